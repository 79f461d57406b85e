"""The container's Batch Transform contract on the fake engine, in-process: `/execution-parameters`,
JSON Lines in and out (one line per record, in order, a bad record failing alone), the deadline
under `SAGEMAKER_BATCH=true`, and `route=/v1/models` on `/invocations`."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from server_fakes import FakeEngine
from server_helpers import assert_error_body
from starlette.testclient import TestClient

from decider.server.app import create_app
from decider.server.batch_transform import (
    batch_settings,
    execution_parameters,
    payload_limit,
    records_in_flight,
    split_records,
)
from decider.settings import Settings

JSONL = {"Content-Type": "application/jsonlines"}
GOOD = {
    "state": "I was charged twice.",
    "questions": {
        "billing": {"type": "noul", "instructions": "Is this about billing?"},
        "tone": {"type": "choice", "instructions": "Tone?", "criteria": {"calm": None, "angry": "Upset"}},
    },
}
OPENAI = {
    "input": "I was charged twice.",
    "questions": [{"type": "predicate", "name": "billing", "instructions": "Is this about billing?"}],
}


def _settings(**overrides: Any) -> Settings:
    return Settings(model_path="/nonexistent/model.gguf", **overrides)


@pytest.fixture
def client() -> Iterator[TestClient]:
    engine = FakeEngine()
    with TestClient(create_app(_settings(queue_size=4), loader=lambda _: engine)) as test_client:
        deadline = time.monotonic() + 5
        while test_client.get("/ping").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield test_client


def _lines(response: Any) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/jsonlines")
    assert response.text.endswith("\n")
    return [json.loads(line) for line in response.text.splitlines()]


def test_execution_parameters(client: TestClient) -> None:
    response = client.get("/execution-parameters")
    assert response.status_code == 200
    assert response.json() == {
        "MaxConcurrentTransforms": 2,
        "BatchStrategy": "MULTI_RECORD",
        "MaxPayloadInMB": 1,
    }
    gpu = execution_parameters(_settings(n_gpu_layers=-1, batch_invariant=False))
    assert gpu["MaxPayloadInMB"] == 6
    single = execution_parameters(_settings(queue_size=1))
    assert single["MaxConcurrentTransforms"] == 1
    for params in (gpu, single):
        assert params["MaxConcurrentTransforms"] * params["MaxPayloadInMB"] <= 100


def test_one_line_per_record_in_order_and_bad_records_fail_alone(client: TestClient) -> None:
    records = [
        json.dumps(GOOD),
        "{not json",
        json.dumps({**GOOD, "state": "The app crashes."}),
        json.dumps({"state": "no questions"}),
        "",
        json.dumps(OPENAI),
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"states": ["a", "b"], "questions": GOOD["questions"]}),
        json.dumps(
            {
                **GOOD,
                "questions": {
                    "q": {
                        "type": "choice",
                        "instructions": "?",
                        "criteria": dict.fromkeys(map(str, range(256))),
                    }
                },
            }
        ),
    ]
    lines = _lines(client.post("/invocations", content="\r\n".join(records) + "\n", headers=JSONL))
    assert len(lines) == len(records)
    assert set(lines[0]["answers"]) == {"billing", "tone"} and set(lines[2]["answers"]) == {"billing", "tone"}
    for index, code in (
        (1, "invalid_json"),
        (3, "missing_field"),
        (4, "empty_record"),
        (6, "unsupported_record"),
    ):
        assert_error_body(lines[index], code)
    assert lines[5]["answers"][0]["name"] == "billing"  # the OpenAI shape, by the record's shape
    assert len(lines[7]["results"]) == 2
    assert_error_body(lines[8])
    assert all(line["error"]["retryable"] is False for line in lines if "error" in line)


def test_the_same_answers_as_single_requests(client: TestClient) -> None:
    single = client.post("/v1/systemone", json=GOOD).json()
    (line,) = _lines(client.post("/invocations", content=json.dumps(GOOD), headers=JSONL))
    assert line == single


def test_more_records_than_the_queue_holds(client: TestClient) -> None:
    records = [json.dumps({**GOOD, "state": f"ticket {i}"}) for i in range(20)]  # queue_size 4
    lines = _lines(client.post("/invocations", content="\n".join(records), headers=JSONL))
    assert len(lines) == 20 and all("answers" in line for line in lines)


def test_whole_payload_refusals(client: TestClient) -> None:
    gz = client.post(
        "/invocations",
        content=gzip.compress(json.dumps(GOOD).encode()),
        headers={**JSONL, "Content-Encoding": "gzip"},
    )
    assert len(_lines(gz)) == 1
    empty = client.post("/invocations", content=b"", headers=JSONL)
    assert empty.status_code == 200 and empty.text == ""
    too_large = client.post("/invocations", content=b"x" * (6 * 1024 * 1024 + 1), headers=JSONL)
    assert too_large.status_code == 413
    assert_error_body(too_large.json(), "body_too_large")


def test_models_through_invocations(client: TestClient) -> None:
    listed = client.post(
        "/invocations", json={}, headers={"X-Amzn-SageMaker-Custom-Attributes": "route=/v1/models"}
    )
    assert listed.status_code == 200 and listed.json() == client.get("/v1/models").json()


def test_batch_deadline_follows_the_invocation_timeout() -> None:
    settings = _settings()
    assert batch_settings(settings, {}).deadline_seconds == 55.0
    assert batch_settings(settings, {"SAGEMAKER_BATCH": "true"}).deadline_seconds == 595.0
    env = {"SAGEMAKER_BATCH": "true", "DECIDER_BATCH_INVOCATION_TIMEOUT_SECONDS": "3600"}
    assert batch_settings(settings, env).deadline_seconds == 3595.0
    explicit = _settings(deadline_seconds=100)
    assert batch_settings(explicit, env).deadline_seconds == 100.0
    for bad in ("0", "3601", "soon"):
        with pytest.raises(ValueError, match="DECIDER_BATCH_INVOCATION_TIMEOUT_SECONDS"):
            batch_settings(settings, {**env, "DECIDER_BATCH_INVOCATION_TIMEOUT_SECONDS": bad})


def test_helpers() -> None:
    assert split_records(b"a\nb\r\n\nc\n") == [b"a", b"b", b"", b"c"]
    assert split_records(b"") == [] and split_records(b"\n") == [b""]
    settings = _settings()
    assert payload_limit(settings, {}) == 6 * 1024 * 1024
    assert payload_limit(settings, {"SAGEMAKER_MAX_PAYLOAD_IN_MB": "20"}) == 20 * 1024 * 1024
    assert records_in_flight(settings) == 8 and records_in_flight(_settings(queue_size=0)) == 1


def test_a_record_larger_than_one_request_fails_alone_before_it_is_parsed() -> None:
    """A payload may be up to MaxPayloadInMB (100 MB), but each record is one request: one past the
    real-time body cap gets its own 413 line, unparsed, and the records beside it are answered."""
    engine = FakeEngine()
    settings = _settings(queue_size=4, max_body_bytes=4096)
    with TestClient(create_app(settings, loader=lambda _: engine)) as client:
        deadline = time.monotonic() + 5
        while client.get("/ping").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        huge = json.dumps({**GOOD, "state": "x" * 8192}).encode()  # valid JSON, one request too large
        payload = b"\n".join([json.dumps(GOOD).encode(), huge, b"{not json" + b" " * 8192])
        assert len(payload) < payload_limit(settings, {})  # the payload as a whole is accepted
        lines = _lines(client.post("/invocations", content=payload, headers=JSONL))
    assert len(lines) == 3
    assert "billing" in json.dumps(lines[0]) and "error" not in lines[0]
    for line in lines[1:]:  # refused by size, before parsing: even the malformed one says so
        assert_error_body(line, "record_too_large")
