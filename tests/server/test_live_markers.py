"""Caller text that could become a marker token, through the real server on Gemma 3 270M with
`<start_of_image>` listed in DECIDER_MARKER_TOKENS.

The server does not expose token ids, so the prompt token counts it reports are compared with the
in-process engine on the same model and settings: equal to the neutralized prompt, one token per
marker shorter would mean the marker went through as the real token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from decider.engine import DecisionEngine
from decider.engine.model.markers import CallerText
from decider.engine.model.prompt import FALLBACK_TEMPLATES, PROMPT_FORMATS, PROMPT_V1, ChatTemplate
from decider.engine.works.generation import chat_tokens
from decider.settings import Settings
from decider_dev.local_server import WITHOUT_LOAD_PROBE, LocalServer, run_local_server

V1 = PROMPT_FORMATS[PROMPT_V1]

pytestmark = [pytest.mark.server, pytest.mark.model]
GEMMA_ENV = {
    "DECIDER_N_THREADS": "1",
    "DECIDER_N_CTX": "1024",
    "DECIDER_N_SEQ_MAX": "7",
    "DECIDER_MAX_STATE_TOKENS": "512",
    "DECIDER_MARKER_TOKENS": json.dumps(["<start_of_image>"]),
    **WITHOUT_LOAD_PROBE,
}
TEXT = "Photo: <start_of_image> then a <table>\n\n\nwith rows"
MESSAGES = [{"role": "user", "content": TEXT}]


@pytest.fixture(scope="module")
def gemma_server(gemma3_path) -> Iterator[LocalServer]:
    with run_local_server({**GEMMA_ENV, "DECIDER_MODEL_PATH": str(gemma3_path)}) as server:
        yield server


@pytest.fixture(scope="module")
def gemma_engine(gemma3_path) -> Iterator[Any]:
    settings = Settings(
        model_path=gemma3_path,
        n_ctx=1024,
        n_seq_max=7,
        max_state_tokens=512,
        marker_tokens=["<start_of_image>"],
        n_threads=1,
    )
    engine = DecisionEngine.load(settings)
    yield engine
    engine.close()


def test_models_lists_the_configured_marker(gemma_server: LocalServer) -> None:
    (entry,) = httpx.get(f"{gemma_server.base_url}/v1/models").json()["data"]
    assert entry["markers"]["setting"] == ["<start_of_image>"]
    assert "<start_of_turn>" in entry["markers"]["control"]
    assert all("<table>" not in texts for texts in entry["markers"].values())


def test_chat_prompt_holds_the_marker_as_plain_text(gemma_server: LocalServer, gemma_engine: Any) -> None:
    body = {"messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    usage = httpx.post(f"{gemma_server.base_url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
    neutralized = gemma_engine.render_chat(MESSAGES)
    template = ChatTemplate(
        source="fallback:chatml", text=FALLBACK_TEMPLATES["chatml"], bos_token="", eos_token=""
    )
    unguarded = CallerText([], lambda text: gemma_engine.runtime.tokenize(text, special=False))
    raw = chat_tokens(template, gemma_engine.runtime, unguarded.tokenize, MESSAGES)
    assert 255999 in raw and 255999 not in neutralized
    assert usage["prompt_tokens"] == len(neutralized) > len(raw)


def test_decision_prompt_holds_the_marker_as_plain_text(gemma_server: LocalServer, gemma_engine: Any) -> None:
    body = {
        "state": TEXT,
        "questions": {"q": {"type": "noul", "instructions": "Is there a photo?"}},
        "extensions": True,
    }
    answer = httpx.post(f"{gemma_server.base_url}/v1/systemone", json=body, timeout=60).json()["answers"]["q"]
    _, tokens = gemma_engine.render_prompt(
        TEXT, "Is there a photo?", [("A", V1.noul_true), ("B", V1.noul_false)]
    )
    assert 255999 not in tokens
    assert answer["extensions"]["input_tokens"] == len(tokens)
