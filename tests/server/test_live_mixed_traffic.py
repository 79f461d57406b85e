"""Decisions beside running chats, on the real model: admission counts the work ahead as it runs
(beside the request, in the same decodes), chats at the length chats have been generating, and
chats take memory cells as they generate. So a small decision sent while 2, 4 or 8 chats run is
answered, and so is every chat.

The chats ask for up to CHAT_MAX_TOKENS: in the default (throughput) mode a greedy chat's tokens
depend on what shares its decodes, and now and then one rambles on to its max_tokens; at the
default 1,024 that outlasts the 20 s deadline, at 120 it does not (the longest answer here is
about 80 tokens).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from server_helpers import LOCAL_ONLY

from decider_dev.local_server import WITHOUT_LOAD_PROBE, LocalServer, run_local_server

pytestmark = [pytest.mark.server, pytest.mark.model, LOCAL_ONLY]
MIXED_ENV = {"DECIDER_N_THREADS": "1", "DECIDER_DEADLINE_SECONDS": "20", **WITHOUT_LOAD_PROBE}
CHAT_MAX_TOKENS = 120
# Questions the bundled SmolLM2 answers in 4 to 90 tokens at temperature 0, the longest first: it
# is still generating when the decision has been answered.
PROMPTS = [
    "Name a famous painter and one of his paintings.",
    "Say hello to Anna in one short sentence.",
    "Describe the sun in two sentences.",
    "Translate 'good morning' to French.",
    "What is 2+2? Answer in one sentence.",
    "Name three colors.",
    "What is the capital of Italy? Answer briefly.",
    "Give one word that rhymes with cat.",
]
SMALL_DECISION = {
    "state": "I was charged twice for my order and nobody answers my emails.",
    "questions": {
        "billing": {"type": "noul", "instructions": "Is this about billing?"},
        "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    },
}


@pytest.fixture(scope="module")
def mixed_server() -> Iterator[LocalServer]:
    with run_local_server(MIXED_ENV) as server:
        yield server


def _chat(url: str, prompt: str, generating: threading.Barrier) -> tuple[int, list[Any], float]:
    """Stream a chat; wait at `generating` once its first token is there. (status, events, end)."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "stream": True,
        "max_tokens": CHAT_MAX_TOKENS,
    }
    events: list[Any] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        if response.status_code != 200:
            generating.abort()
            return response.status_code, [response.read().decode()], time.monotonic()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if len(events) == 2:  # the role, then the first token
                with contextlib.suppress(threading.BrokenBarrierError):
                    generating.wait(30)
    return response.status_code, events, time.monotonic()


def _finished(events: list[Any]) -> bool:
    last = events[-1] if events else {"error": "no event"}
    return "error" not in last and last["choices"][0]["finish_reason"] is not None


@pytest.mark.parametrize("chats", [2, 4, 8])
def test_a_small_decision_beside_running_chats_is_answered_and_so_is_every_chat(
    mixed_server: LocalServer, chats: int
) -> None:
    url = mixed_server.base_url
    for _ in range(2):  # the server is idle: never a 503 (and the cost model is fitted)
        idle = httpx.post(f"{url}/v1/systemone", json=SMALL_DECISION, timeout=60)
        assert idle.status_code == 200, idle.text
    generating = threading.Barrier(chats + 1)
    with ThreadPoolExecutor(chats) as pool:
        futures = [pool.submit(_chat, url, PROMPTS[i], generating) for i in range(chats)]
        with contextlib.suppress(threading.BrokenBarrierError):  # a chat was refused: asserted below
            generating.wait(30)  # every chat has its first token
        decision = httpx.post(f"{url}/v1/systemone", json=SMALL_DECISION, timeout=60)
        decided_at = time.monotonic()
        results = [future.result() for future in futures]
    assert [status for status, _, _ in results] == [200] * chats, results
    assert decision.status_code == 200, decision.text
    assert all(_finished(events) for _, events, _ in results), [events[-1:] for _, events, _ in results]
    assert max(ended for _, _, ended in results) > decided_at  # a chat was still generating beside it
