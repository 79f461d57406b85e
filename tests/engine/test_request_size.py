"""The prompt tokens a decision request may have planned (issue 23 §2, decider.engine.works.request_size), on
the real SmolLM2 tokenizer: refused before a tokenizer call where the bytes tell, counted while
tokenizing where they cannot, and never in the way of a request JevBench or the demo sends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from decider.engine.works.decisions import DecisionPlanner
from decider.errors import RequestError
from decider.schemas.decision import parse_batch_request, parse_decision_request
from decider.settings import Settings
from decider_dev.demo import SAMPLE_REQUEST

pytestmark = pytest.mark.model
WORDS = "the customer says the payment failed again and asks what to do next "  # ~4.5 bytes a token


@dataclass
class Spy:
    calls: int = 0
    tokens: int = 0


@pytest.fixture
def spy(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Spy]:
    """Counts every tokenizer call planning makes on the shared engine (restored afterwards)."""
    seen = Spy()
    builder = engine.planner.builder
    for name in ("_tokenize_text", "_tokenize_template"):
        inner: Callable[[str], list[int]] = getattr(builder, name)

        def counted(text: str, inner: Callable[[str], list[int]] = inner) -> list[int]:
            tokens = inner(text)
            seen.calls += 1
            seen.tokens += len(tokens)
            return tokens

        monkeypatch.setattr(builder, name, counted)
    yield seen


def _planner(engine: Any, **settings: Any) -> DecisionPlanner:
    """The engine's planner (its tokenizer, labels, context) under other settings."""
    base = engine.planner
    return DecisionPlanner(
        Settings(model_path=engine.settings.model_path, **settings),
        base.builder,
        base.labels,
        n_ctx=base.n_ctx,
        max_token_bytes=base.max_token_bytes,
        piece=base._piece,
        model_id=base.model_id,
    )


def _request(body: dict[str, Any], settings: Settings) -> Any:
    limits = {
        "max_questions": settings.max_questions,
        "max_options": settings.max_options,
        "max_permutations": settings.max_permutations,
    }
    if "states" in body:
        return parse_batch_request(body, max_states=settings.max_batch_states, **limits)
    return parse_decision_request(body, **limits)


def _choices(count: int, instructions: str) -> dict[str, Any]:
    criteria = {"a": "first", "b": "second", "c": "third", "d": "fourth"}
    return {
        f"q{i}": {"type": "choice", "instructions": instructions, "criteria": criteria} for i in range(count)
    }


def test_the_default_refuses_the_issues_body_before_tokenizing(engine: Any, spy: Spy) -> None:
    """64 questions of ~84 KB at 8 permutations: a 5.4 MB body (under the 6 MiB cap) asking for ~43 MB
    of text to tokenize. Refused at once, from the bytes alone."""
    settings = engine.settings
    instructions = WORDS * (84_000 // len(WORDS))
    body = {"state": "I was charged twice.", "questions": _choices(64, instructions), "permutations": 8}
    request = _request(body, settings)
    floor = sum(engine.planner.text_bytes(request).least_tokens(engine.planner.max_token_bytes))
    assert floor > settings.request_token_limit == settings.max_batch_states * settings.n_ctx
    with pytest.raises(RequestError) as refused:
        engine.plan_decision(request)
    assert refused.value.code == "request_too_large" and refused.value.param == "questions"
    assert not refused.value.retryable and refused.value.status == 422
    assert "DECIDER_MAX_REQUEST_TOKENS" in refused.value.message
    assert spy.calls == 0, "the request was tokenized before it was refused"


def test_where_the_bytes_cannot_tell_the_tokens_are_counted_as_they_come(engine: Any, spy: Spy) -> None:
    """A floor under the limit, tokens over it: refused once the count passes, the rest never tokenized."""
    planner = _planner(engine, max_request_tokens=2000)
    body = {"state": "I was charged twice.", "questions": _choices(12, WORDS * 3), "permutations": 8}
    request = _request(body, planner.settings)
    text = planner.text_bytes(request)
    assert sum(text.least_tokens(planner.max_token_bytes)) <= 2000 < text.most_tokens(planner.tokens_per_text)
    full = engine.plan_decision(request)  # under the default limit: every item tokenized
    calls_in_full, spy.calls = spy.calls, 0
    assert full.planned_tokens > 2 * 2000
    with pytest.raises(RequestError) as refused:
        planner.plan(request)
    assert refused.value.code == "request_too_large" and refused.value.param == "questions"
    assert "more than 2000" in refused.value.message and not refused.value.retryable
    assert spy.calls < calls_in_full / 2, (spy.calls, calls_in_full)  # stopped at the limit
    assert planner.plan(_request({**body, "permutations": 1}, planner.settings)).planned_tokens <= 2000


def test_a_question_that_cannot_fit_the_context_is_refused_before_tokenizing(engine: Any, spy: Spy) -> None:
    instructions = WORDS * (700_000 // len(WORDS))  # > n_ctx tokens even at the longest piece per token
    request = _request({"state": "s", "questions": _choices(1, instructions)}, engine.settings)
    with pytest.raises(RequestError) as refused:
        engine.plan_decision(request)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "questions.q0"
    assert spy.calls == 0


def test_no_jevbench_case_nor_the_demo_request_comes_near_the_default(
    engine: Any, jevbench_cases: list[dict[str, Any]]
) -> None:
    """At the most permutations allowed, every case (and the demo request) holds fewer bytes than the
    default limit has tokens: at one token per byte at most, the limit can never refuse one. The batch
    route's worst JevBench request (the largest state with the largest question set, as many states
    as allowed) is planned for real, within the limit too."""
    settings = engine.settings
    limit = settings.request_token_limit
    planner = engine.planner
    most = settings.max_permutations
    bodies = [{"state": case["state"], "questions": case["questions"]} for case in jevbench_cases]
    ceilings = [
        planner.text_bytes(_request({**body, "permutations": most}, settings)).most_tokens(
            planner.tokens_per_text
        )
        for body in [*bodies, SAMPLE_REQUEST]
    ]
    assert max(ceilings) < limit / 2, (max(ceilings), limit)
    state = max((body["state"] for body in bodies), key=lambda s: len(str(s)))
    questions = max(
        (body["questions"] for body in bodies),
        key=lambda q: planner.text_bytes(_request({"state": "s", "questions": q}, settings)).most_tokens(),
    )
    batch = {"states": [state] * settings.max_batch_states, "questions": questions, "permutations": most}
    plan = engine.plan_batch(_request(batch, settings))
    assert 0 < plan.planned_tokens < limit, (plan.planned_tokens, limit)


def test_a_chat_that_cannot_fit_the_context_is_refused_before_tokenizing(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    for owner in (engine.runtime, engine.caller_text):
        inner = owner.tokenize
        monkeypatch.setattr(
            owner, "tokenize", lambda text, *a, inner=inner, **k: calls.append(text) or inner(text, *a, **k)
        )
    messages = [{"role": "user", "content": WORDS * (700_000 // len(WORDS))}]
    with pytest.raises(RequestError) as refused:
        engine.chat_plan(messages, max_tokens=None, max_tokens_cap=16)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "messages"
    assert calls == []
    short = engine.chat_plan([{"role": "user", "content": "Say hello."}], max_tokens=8, max_tokens_cap=16)
    assert short.prompt and calls  # an ordinary chat is tokenized as before
