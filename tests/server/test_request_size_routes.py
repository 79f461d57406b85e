"""The planned-token bound (DECIDER_MAX_REQUEST_TOKENS, issue 23 §2) on every route that plans
decisions: `/v1/systemone`, `/v1/systemone/batch`, `/v1/decisions`, `/invocations` and each Batch
Transform record, refused with 422 `request_too_large` before a tokenizer call. The real planner
runs on the fake engine's character tokenizer (at most 4 bytes a token), its calls counted."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from server_fakes import FakeEngine
from server_helpers import assert_error_body
from starlette.testclient import TestClient

from decider.server.app import create_app
from decider.settings import Settings

LIMIT = 2000
CRITERIA = {"a": "first", "b": "second", "c": "third", "d": "fourth"}
LONG = "Which team should own this request, given everything the customer wrote? " * 4  # ~300 bytes
JEV = {
    "state": "I was charged twice.",
    "questions": {f"q{i}": {"type": "choice", "instructions": LONG, "criteria": CRITERIA} for i in range(10)},
    "permutations": 8,  # 80 tails of 300+ bytes: at least 6,000 tokens at 4 bytes a token
}
OPENAI = {
    "input": "I was charged twice.",
    "questions": [
        {"type": "choice", "instructions": LONG, "choices": [{"value": key} for key in CRITERIA]}
        for _ in range(10)
    ],
    "permutations": 8,
}
SMALL = {"state": "I was charged twice.", "questions": {"q": {"type": "noul", "instructions": "Billing?"}}}


class Counted:
    def __init__(self) -> None:
        self.calls = 0


@pytest.fixture
def served() -> Iterator[tuple[TestClient, Counted]]:
    settings = Settings(model_path="/nonexistent/model.gguf", max_request_tokens=LIMIT)
    engine = FakeEngine(settings)
    counted = Counted()
    builder = engine.planner.builder
    for name in ("_tokenize_text", "_tokenize_template"):
        inner: Callable[[str], list[int]] = getattr(builder, name)

        def spy(text: str, inner: Callable[[str], list[int]] = inner) -> list[int]:
            counted.calls += 1
            return inner(text)

        setattr(builder, name, spy)
    with TestClient(create_app(settings, loader=lambda _: engine)) as client:
        deadline = time.monotonic() + 5
        while client.get("/ping").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield client, counted


def _refused(response: Any, param: str) -> None:
    assert response.status_code == 422, response.text
    body = response.json()
    assert_error_body(body, "request_too_large", status=422)
    assert body["error"]["param"] == param and body["error"]["retryable"] is False
    assert response.headers["x-should-retry"] == "false"


SMALL_OPENAI = {
    "input": "I was charged twice.",
    "questions": [{"type": "predicate", "instructions": "Billing?"}],
}
SMALL_BATCH = {"states": ["I was charged twice.", "Where is my parcel?"], "questions": SMALL["questions"]}
TO_OPENAI = {"X-Amzn-SageMaker-Custom-Attributes": "route=/v1/decisions"}


@pytest.mark.parametrize(
    ("path", "small", "large", "headers", "param"),
    [
        ("/v1/systemone", SMALL, JEV, {}, "questions"),
        ("/v1/decisions", SMALL_OPENAI, OPENAI, {}, "questions"),
        ("/invocations", SMALL, JEV, {}, "questions"),
        ("/invocations", SMALL_OPENAI, OPENAI, TO_OPENAI, "questions"),
        ("/v1/systemone/batch", SMALL_BATCH, {**SMALL_BATCH, "states": ["x" * 3000] * 3}, {}, "states"),
        ("/invocations", SMALL, {**SMALL, "state": "x" * 9000}, {}, "state"),
    ],
)
def test_every_decision_route_refuses_before_tokenizing(
    served: tuple[TestClient, Counted],
    path: str,
    small: dict[str, Any],
    large: dict[str, Any],
    headers: dict[str, str],
    param: str,
) -> None:
    client, counted = served
    assert client.post(path, json=small, headers=headers).status_code == 200
    assert counted.calls > 0
    counted.calls = 0
    _refused(client.post(path, json=large, headers=headers), param)
    assert counted.calls == 0, "the request was tokenized before it was refused"


def test_each_batch_transform_record_is_held_to_the_bound(served: tuple[TestClient, Counted]) -> None:
    client, counted = served
    assert client.post("/v1/systemone", json=SMALL).status_code == 200
    one_small, counted.calls = counted.calls, 0
    records = [json.dumps(SMALL), json.dumps(JEV), json.dumps(OPENAI), json.dumps(SMALL)]
    response = client.post(
        "/invocations", content="\n".join(records), headers={"Content-Type": "application/jsonlines"}
    )
    assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert "answers" in lines[0] and "answers" in lines[3]
    for line in lines[1:3]:
        assert_error_body(line, "request_too_large")
        assert line["error"]["param"] == "questions" and line["error"]["retryable"] is False
    assert counted.calls == 2 * one_small  # the two small records were tokenized, the large ones never
