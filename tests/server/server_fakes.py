"""A scriptable stand-in for the model, for unit tests of scheduling, routing and limits only.

The planning, the work state machines and the scheduler are the real ones; only llama.cpp is
faked: `FakeRuntime` "decodes" by sleeping (and honours the abort callback like llama.cpp does),
reads flat logits, and samples a scripted chat answer. The issue's behaviour tests
(tests/server/test_live_*.py) run the real server on the real model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from decider.engine.model.labels import build_label_table
from decider.engine.model.native import DecodeAbortedError, Row, RowOutput
from decider.engine.model.prompt import (
    FALLBACK_TEMPLATES,
    PROMPT_FORMATS,
    ChatTemplate,
    PromptBuilder,
    PromptFrame,
)
from decider.engine.scheduling.cost import span_attended
from decider.engine.works.chat import ChatPlan, ChatWork
from decider.engine.works.decision_work import DecisionWork
from decider.engine.works.decisions import DecisionPlan, DecisionPlanner
from decider.errors import RequestError
from decider.invariance import BatchPolicy
from decider.settings import Settings

EOS = 2
FIRST_TEXT_TOKEN = 100  # token 100 + i reads "t{i} "


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


@dataclass
class FakeModelInfo:
    id: str = "fake-model@0123456789ab+Q4_1"
    name: str = "fake-model"
    file: str = "fake.gguf"
    sha256: str = "0123456789ab" + "0" * 52
    quantization: str = "Q4_1"
    architecture: str = "llama"
    n_ctx: int = 65536
    chat_template_source: str = "fallback:chatml"
    max_options: int = 64
    markers: dict[str, list[str]] = field(
        default_factory=lambda: {"control": ["<|im_end|>"], "template": [], "setting": []}
    )

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class FakeRuntime:
    """Each decode sleeps `decode_seconds`, plus `token_seconds` per token and `attention_seconds` per
    attended position, checking `should_abort`."""

    decode_seconds: float = 0.0
    token_seconds: float = 0.0
    attention_seconds: float = 0.0  # per attended position (each token attends every one before it)
    chat_tokens: int = 5
    gate: threading.Event | None = None  # when set, every decode first waits for it
    n_ctx: int = 65536
    n_seq_max: int = 64
    n_batch: int = 4096
    invariant: bool = False  # batch-invariant memory (pad, graveyards, epochs), as the real policy has it
    calls: list[int] = field(default_factory=list)  # tokens per decode
    threads: set[str] = field(default_factory=set)
    _produced: dict[int, int] = field(default_factory=dict)

    def decode(self, rows: Sequence[Row], *, should_abort: Callable[[], bool] | None = None) -> None:
        tokens = sum(len(row.tokens) for row in rows)
        self.calls.append(tokens)
        self.threads.add(threading.current_thread().name)
        abort = should_abort or (lambda: False)
        if self.gate is not None:
            while not self.gate.wait(0.005):
                if abort():
                    raise DecodeAbortedError("aborted while held")
        attended = sum(span_attended(row.start_pos, len(row.tokens)) for row in rows)
        work = self.decode_seconds + self.token_seconds * tokens + self.attention_seconds * attended
        end = time.monotonic() + work
        while time.monotonic() < end:
            if abort():
                raise DecodeAbortedError("aborted")
            time.sleep(min(0.005, max(0.0, end - time.monotonic())))
        for index, row in enumerate(rows):
            if row.output is not None:
                spec = row.output
                row.result = RowOutput(
                    logits=np.zeros(len(spec.token_ids)),
                    logsumexp=0.0 if spec.logsumexp else None,
                    argmax=0 if spec.argmax else None,
                    batch_index=index,
                )

    @property
    def policy(self) -> BatchPolicy:
        ubatch = min(BatchPolicy.default_ubatch(self.invariant), self.n_batch)
        return BatchPolicy(self.invariant, self.n_batch, ubatch, self.n_seq_max)

    def seq_copy(self, src: int, dst: int) -> None:
        pass

    def seq_remove(self, seq_id: int) -> None:
        pass

    def seq_save(self, seq_id: int) -> bytes:
        return bytes(64)

    def seq_restore(self, seq_id: int, data: bytes) -> bool:
        return True

    def clear(self) -> None:
        pass

    def sample(self, sampler: Any, batch_index: int) -> int:
        key = id(sampler)
        produced = self._produced.get(key, 0)
        self._produced[key] = produced + 1
        return EOS if produced >= self.chat_tokens else FIRST_TEXT_TOKEN + produced

    def piece(self, token: int, *, special: bool = False) -> bytes:
        return f"t{token - FIRST_TEXT_TOKEN} ".encode() if token >= FIRST_TEXT_TOKEN else b""

    def is_eog(self, token: int) -> bool:
        return token == EOS


class FakeEngine:
    """The real planner (a character tokenizer, the ChatML fallback template) over a FakeRuntime."""

    def __init__(self, settings: Settings | None = None, **runtime: Any) -> None:
        self.settings = settings or Settings(model_path="/nonexistent/model.gguf")
        self.runtime = FakeRuntime(**runtime)
        self.model_info = FakeModelInfo()
        template = ChatTemplate(
            source="fallback:chatml", text=FALLBACK_TEMPLATES["chatml"], bos_token="", eos_token=""
        )
        builder = PromptBuilder(
            PromptFrame.from_template(template),
            PROMPT_FORMATS["decider-options-v1"],
            chars,
            chars,
            None,
            False,
        )
        labels = build_label_table(builder, chars, lambda t: chr(t).encode(), self.settings.max_options)
        self.planner = DecisionPlanner(
            self.settings,
            builder,
            labels,
            n_ctx=self.runtime.n_ctx,
            max_token_bytes=4,
            piece=self.runtime.piece,
            model_id=self.model_info.id,
        )
        self.head_tokens: list[int] = []  # no cached head: its decode would cost decode_seconds

    @property
    def calls(self) -> list[int]:
        return self.runtime.calls

    def plan_decision(self, request: Any) -> DecisionPlan:
        return self.planner.plan(request)

    def plan_batch(self, request: Any) -> DecisionPlan:
        return self.planner.plan_batch(request)

    def decision_work(self, plan: DecisionPlan) -> DecisionWork:
        return DecisionWork(plan, self.planner)

    def chat_plan(
        self, messages: list[dict[str, Any]], *, max_tokens: int | None, max_tokens_cap: int, **params: Any
    ) -> ChatPlan:
        prompt = [0, 0, 0]
        max_tokens = max_tokens_cap if max_tokens is None else max_tokens
        if len(prompt) + max_tokens > self.runtime.n_ctx:
            raise RequestError("too long", code="context_length_exceeded", param="messages")
        return ChatPlan(
            prompt,
            max_tokens,
            params.get("temperature", 0.0),
            params.get("top_p", 1.0),
            tuple(params.get("stop") or ()),
            params.get("seed"),
        )

    def chat_work(self, plan: ChatPlan, emit: Callable[[Any], None] | None = None) -> ChatWork:
        return ChatWork(plan, emit)
