"""A scriptable stand-in for the engine, for unit tests of queueing, routing and limits only.

The issue's behaviour tests (tests/server/test_live_*.py) run the real server on the real model;
this fake exists so admission control can be tested with precise, controllable timing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from decider.engine import GenerationEvent, GenerationUsage
from decider.schemas.decision import ChoiceAnswer, DecisionResponse, NoulAnswer, ScoreAnswer, Usage


@dataclass
class FakeModelInfo:
    id: str = "fake-model@0123456789ab+Q4_1"
    name: str = "fake-model"
    file: str = "fake.gguf"
    sha256: str = "0123456789ab" + "0" * 52
    quantization: str = "Q4_1"
    architecture: str = "llama"
    n_ctx: int = 2048
    chat_template_source: str = "gguf"
    max_options: int = 64
    markers: dict[str, list[str]] = field(
        default_factory=lambda: {"control": ["<|im_end|>"], "template": ["<think>"], "setting": []}
    )

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class FakeEngine:
    """`decide` sleeps `decide_seconds`; `generate` yields `tokens` deltas `token_seconds` apart."""

    decide_seconds: float = 0.0
    token_seconds: float = 0.0
    tokens: int = 5
    model_info: FakeModelInfo = field(default_factory=FakeModelInfo)
    calls: list[str] = field(default_factory=list)
    threads: set[str] = field(default_factory=set)
    gate: threading.Event | None = None  # when set, decide waits for it (tests hold the worker busy)

    def _note(self, name: str) -> None:
        self.calls.append(name)
        self.threads.add(threading.current_thread().name)

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return [0] * (3 + sum(len(m["content"].split()) for m in messages))

    def decide(self, request: Any, should_stop: Callable[[], bool] | None = None) -> DecisionResponse:
        self._note("decide")
        if self.gate is not None:
            self.gate.wait(10)
        end = time.monotonic() + self.decide_seconds
        while time.monotonic() < end:
            if should_stop is not None and should_stop():
                break
            time.sleep(0.005)
        answers: dict[str, Any] = {}
        for question in request.questions:
            keys = [option.key for option in question.options]
            if question.type == "noul":
                answers[question.key] = NoulAnswer(noul=0.5)
            elif question.type == "choice":
                probs = {key: 1.0 / len(keys) for key in keys}
                answers[question.key] = ChoiceAnswer(choice=keys[0], probabilities=probs, confidence=0.0)
            else:
                probs = {key: 1.0 / len(keys) for key in keys}
                legend = {option.key: option.description for option in question.options}
                answers[question.key] = ScoreAnswer(
                    score=(len(keys) - 1) / 2, legend=legend, probabilities=probs, confidence=0.0
                )
        return DecisionResponse(model=self.model_info.id, answers=answers, usage=Usage(input_tokens=7))

    def generate(self, messages: list[dict[str, str]], **kwargs: Any) -> Iterator[GenerationEvent]:
        self._note("generate")
        should_stop = kwargs["should_stop"]
        produced = 0
        for i in range(min(self.tokens, kwargs["max_tokens"])):
            if should_stop():
                yield GenerationEvent(
                    finish_reason="cancelled",
                    usage=GenerationUsage(prompt_tokens=3, completion_tokens=produced),
                )
                return
            time.sleep(self.token_seconds)
            produced += 1
            yield GenerationEvent(text=f"t{i} ")
        reason = "length" if kwargs["max_tokens"] <= self.tokens else "stop"
        yield GenerationEvent(
            finish_reason=reason, usage=GenerationUsage(prompt_tokens=3, completion_tokens=produced)
        )
