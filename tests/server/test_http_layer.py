"""The HTTP layer on a fake engine: routing, body handling, limits, error shapes, streaming format.

These run in-process in milliseconds. The same behaviours on the real model and the real process
are covered by the test_live_* modules.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from openai.types import Decision
from server_fakes import FakeEngine
from server_helpers import assert_error_body
from starlette.testclient import TestClient

from decider.engine.model.native import NativeError
from decider.engine.works.decisions import DecisionOutcome
from decider.server import handlers
from decider.server.app import create_app
from decider.settings import Settings

DECISION = {
    "state": "I was charged twice for one order.",
    "questions": {
        "billing": {"type": "noul", "instructions": "Is this about billing?"},
        "tone": {"type": "choice", "instructions": "Tone?", "criteria": {"calm": None, "angry": "Upset"}},
        "anger": {"type": "score", "instructions": "How angry?", "criteria": ["calm", "annoyed", "furious"]},
    },
}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
OPENAI_DECISION = {
    "model": "gpt-6-luna",
    "input": [{"role": "user", "content": "I was charged twice for one order."}],
    "questions": [
        {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"},
        {"type": "choice", "instructions": "Tone?", "choices": [{"value": True}, {"value": "true"}]},
        {
            "type": "score",
            "name": "anger",
            "instructions": "How angry?",
            "levels": [{"label": "calm"}, {"label": "mad"}],
        },
    ],
}
API_KEY = "test-key-0123456789abcdef"


def _settings(**overrides: Any) -> Settings:
    return Settings(model_path="/nonexistent/model.gguf", **overrides)


def _wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 5
    while client.get("/ping").status_code != 200:
        assert time.monotonic() < deadline, "fake engine never became ready"
        time.sleep(0.01)


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(fake_engine: FakeEngine) -> Iterator[TestClient]:
    settings = _settings(max_body_bytes=4096, max_questions=4, max_options=8, max_chat_tokens=16)
    with TestClient(create_app(settings, loader=lambda _: fake_engine)) as test_client:
        _wait_ready(test_client)
        yield test_client


def _error(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert_error_body(body, code, status=status)
    retryable = body["error"]["retryable"]
    assert response.headers["x-should-retry"] == ("true" if retryable else "false")
    return body["error"]


# --- readiness -----------------------------------------------------------------------------------


def test_ping_is_503_until_the_model_has_loaded() -> None:
    release = threading.Event()
    engine = FakeEngine()

    def slow_loader(_: Settings) -> FakeEngine:
        release.wait(5)
        return engine

    with TestClient(create_app(_settings(), loader=slow_loader)) as client:
        loading = client.get("/ping")
        assert loading.status_code == 503
        assert loading.json()["status"] == "loading"
        _error(client.post("/v1/systemone", json=DECISION), 503, "model_unavailable")
        release.set()
        _wait_ready(client)
        assert client.get("/ping").json() == {"status": "ready", "model": engine.model_info.id}


def test_failed_load_is_reported_once_and_never_healthy() -> None:
    failures: list[str] = []

    def broken_loader(_: Settings) -> FakeEngine:
        raise FileNotFoundError("model path /nonexistent does not exist")

    app = create_app(_settings(), loader=broken_loader, on_fatal=failures.append)
    with TestClient(app) as client:
        deadline = time.monotonic() + 5
        while not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failures == ["model path /nonexistent does not exist"]
        response = client.get("/ping")
        assert response.status_code == 503
        assert response.json()["status"] == "failed"


def test_a_failure_decoding_the_prompt_head_is_fatal_too() -> None:
    """The head is decoded after the load, before /ping turns 200: its failure is a start-up failure."""
    failures: list[str] = []
    engine = FakeEngine()
    engine.head_tokens = [1, 2, 3]

    def failing(*_: object, **__: object) -> None:
        raise NativeError("llama_decode returned -1")

    engine.runtime.decode = failing  # type: ignore[method-assign]
    app = create_app(_settings(), loader=lambda _: engine, on_fatal=failures.append)
    with TestClient(app) as client:
        deadline = time.monotonic() + 5
        while not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(failures) == 1 and "llama_decode returned -1" in failures[0]
        assert client.get("/ping").json()["status"] == "failed"


# --- routing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attributes", "body", "route"),
    [
        (None, DECISION, "/v1/systemone"),
        (None, OPENAI_DECISION, "/v1/decisions"),
        (None, CHAT, "/v1/chat/completions"),
        ("route=/v1/systemone", DECISION, "/v1/systemone"),
        ("route=/v1/decisions", OPENAI_DECISION, "/v1/decisions"),
        ("route=/v1/chat/completions", CHAT, "/v1/chat/completions"),
        ("trace=abc, route=/v1/chat/completions/", CHAT, "/v1/chat/completions"),
        ("trace=abc", DECISION, "/v1/systemone"),
    ],
)
def test_invocations_dispatch(client: TestClient, attributes: str | None, body: Any, route: str) -> None:
    headers = {"X-Amzn-SageMaker-Custom-Attributes": attributes} if attributes else {}
    response = client.post("/invocations", json=body, headers=headers)
    assert response.status_code == 200, response.text
    returned = dict(
        item.split("=", 1) for item in response.headers["X-Amzn-SageMaker-Custom-Attributes"].split(",")
    )
    assert returned["request_id"] == response.headers["x-request-id"]
    assert int(returned["duration_ms"]) >= 0
    assert returned["route"] == route
    if route == "/v1/systemone":
        assert set(response.json()["answers"]) == set(DECISION["questions"])
    elif route == "/v1/decisions":
        assert Decision.model_validate(response.json()).answers[1].choice is True
    else:
        assert response.json()["object"] == "chat.completion"


def test_invocations_refuses_routes_outside_the_allow_list(client: TestClient) -> None:
    for route in ("/v1/completions", "/../metrics", "http://evil/", "/v1/systemone?x=1"):
        response = client.post(
            "/invocations", json=DECISION, headers={"X-Amzn-SageMaker-Custom-Attributes": f"route={route}"}
        )
        error = _error(response, 404, "unknown_route")
        assert error["param"] == "X-Amzn-SageMaker-Custom-Attributes"
        assert "request_id=" in response.headers["X-Amzn-SageMaker-Custom-Attributes"]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"state": "x"}, "unroutable_body"),
        ({**DECISION, **CHAT}, "ambiguous_body"),
        ([1, 2], "invalid_body"),
        ("text", "invalid_body"),
    ],
)
def test_invocations_refuses_unroutable_bodies(client: TestClient, body: Any, code: str) -> None:
    _error(client.post("/invocations", json=body), 422, code)


def test_unknown_paths_and_methods_get_json_errors(client: TestClient) -> None:
    _error(client.get("/nope"), 404, "unknown_endpoint")
    error = _error(client.get("/invocations"), 405, "method_not_allowed")
    assert error["type"] == "invalid_request_error"


# --- bodies and limits ---------------------------------------------------------------------------


def test_declared_body_size_over_the_cap_is_413(client: TestClient) -> None:
    payload = json.dumps({**DECISION, "state": "x" * 5000})
    _error(client.post("/v1/systemone", content=payload), 413, "body_too_large")


def test_streamed_body_over_the_cap_is_413_without_content_length(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"state": "'
        for _ in range(100):
            yield b"x" * 100
        yield b'"}'

    _error(client.post("/invocations", content=chunks()), 413, "body_too_large")


def test_gzip_bomb_is_413(client: TestClient) -> None:
    bomb = gzip.compress(json.dumps({**DECISION, "state": "x" * 100_000}).encode())
    assert len(bomb) < 4096
    response = client.post("/v1/systemone", content=bomb, headers={"Content-Encoding": "gzip"})
    _error(response, 413, "body_too_large")


def test_gzip_body_is_accepted(client: TestClient) -> None:
    response = client.post(
        "/v1/systemone",
        content=gzip.compress(json.dumps(DECISION).encode()),
        headers={"Content-Encoding": "gzip"},
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("content", "headers", "status", "code"),
    [
        (b"{not json", {}, 422, "invalid_json"),
        (b"", {}, 422, "invalid_json"),
        (b'{"state": NaN, "questions": {}}', {}, 422, "invalid_json"),
        (b"\xff\xfe\x00garbage", {}, 422, "invalid_json"),
        (b"[" * 200 + b"]" * 200, {}, 422, "json_too_deep"),
        (b"[" * 100_000, {}, 413, "body_too_large"),
        (
            json.dumps(DECISION).encode(),
            {"Content-Type": "multipart/form-data; boundary=x"},
            415,
            "unsupported_media_type",
        ),
        (json.dumps(DECISION).encode(), {"Content-Encoding": "br"}, 415, "unsupported_content_encoding"),
        (b"not gzip", {"Content-Encoding": "gzip"}, 422, "invalid_encoding"),
    ],
)
def test_bad_bodies_get_clear_4xx(
    client: TestClient, content: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    for path in ("/invocations", "/v1/systemone", "/v1/chat/completions"):
        _error(client.post(path, content=content, headers=headers), status, code)


def test_duplicate_keys_are_refused_over_http(client: TestClient) -> None:
    raw = b'{"state": "s", "questions": {"q": {"type": "noul"}, "q": {"type": "noul"}}}'
    for path in ("/invocations", "/v1/systemone"):
        error = _error(client.post(path, content=raw), 422, "duplicate_question")
        assert error["param"] == "questions.q"


def test_decision_limits_are_422_with_the_parameter(client: TestClient) -> None:
    many = {f"q{i}": {"type": "noul", "instructions": "?"} for i in range(5)}
    error = _error(
        client.post("/v1/systemone", json={"state": "s", "questions": many}), 422, "too_many_questions"
    )
    assert error["param"] == "questions"
    options = {f"o{i}": None for i in range(9)}
    body = {"state": "s", "questions": {"team": {"type": "choice", "instructions": "?", "criteria": options}}}
    error = _error(client.post("/v1/systemone", json=body), 422, "option_count_unsupported")
    assert error["param"] == "questions.team.criteria"


def test_chat_limits_and_unsupported_parameters(client: TestClient) -> None:
    error = _error(
        client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 17}), 422, "max_tokens_too_large"
    )
    assert error["param"] == "max_tokens"
    error = _error(
        client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 99}),
        422,
        "max_tokens_too_large",
    )
    assert error["param"] == "max_completion_tokens"
    _error(client.post("/v1/chat/completions", json={**CHAT, "n": 2}), 422, "unsupported_parameter")
    _error(client.post("/v1/chat/completions", json={"messages": []}), 422, "invalid_parameter")
    _error(client.post("/v1/chat/completions", json={"max_tokens": 3}), 422, "missing_field")
    _error(client.post("/v1/chat/completions", json={**CHAT, "temperature": 9}), 422, "invalid_parameter")


def test_decision_answers_are_made_off_the_engine_thread(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine thread hands back the readouts (a `DecisionOutcome`, no wire model); the response
    is made from them on a worker thread."""
    made_on: list[tuple[str, bool]] = []
    make = handlers.decision_response

    def recorded(outcome: Any) -> Any:
        made_on.append((threading.current_thread().name, isinstance(outcome, DecisionOutcome)))
        return make(outcome)

    monkeypatch.setattr(handlers, "decision_response", recorded)
    response = client.post("/v1/systemone", json=DECISION)
    assert response.status_code == 200 and set(response.json()["answers"]) == set(DECISION["questions"])
    assert len(made_on) == 1 and made_on[0][1] and made_on[0][0] != "engine"


def test_invalid_requests_never_reach_the_engine(client: TestClient, fake_engine: FakeEngine) -> None:
    client.post("/v1/systemone", json={"state": "", "questions": {}})
    client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10_000})
    assert fake_engine.calls == []


# --- answers ---------------------------------------------------------------------------------------


def test_chat_answer_shape(client: TestClient, fake_engine: FakeEngine) -> None:
    body = client.post("/v1/chat/completions", json={**CHAT, "model": "anything-at-all"}).json()
    assert body["model"] == fake_engine.model_info.id
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "t0 t1 t2 t3 "}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_chat_stream_is_sse_ending_with_done(client: TestClient) -> None:
    request = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "t0 t1 t2 t3 "
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4


def test_models_lists_the_served_model_in_openai_and_jev_shapes(
    client: TestClient, fake_engine: FakeEngine
) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (entry,) = body["data"]
    assert entry["id"] == fake_engine.model_info.id
    assert entry["object"] == "model"
    assert entry["quantization"] == "Q4_1"
    assert entry["sha256"] == fake_engine.model_info.sha256
    assert entry["markers"] == fake_engine.model_info.markers
    assert body["models"][0]["name"] == fake_engine.model_info.id


def test_metrics_count_requests_by_route_and_status(client: TestClient) -> None:
    client.post("/v1/systemone", json=DECISION)
    client.post("/v1/systemone", content=b"{")
    client.get("/some/scanner/path")
    text = client.get("/metrics").text
    assert 'decider_http_requests_total{route="/v1/systemone",status="200"} 1.0' in text
    assert 'decider_http_requests_total{route="/v1/systemone",status="422"} 1.0' in text
    assert 'decider_http_requests_total{route="other",status="404"} 1.0' in text
    assert "decider_http_request_duration_seconds_bucket" in text
    tokens = client.post("/v1/systemone", json=DECISION).json()["usage"]["input_tokens"]
    assert f'decider_tokens_total{{kind="decision_input"}} {2 * tokens}.0' in client.get("/metrics").text
    after = client.get("/metrics").text
    # The state's prefill stops at its boundary (where it is kept: the fake cannot cut a copy), then
    # the rest of the prefix, then the branches; the repeat decodes nothing.
    assert "decider_engine_decodes_total 3.0" in after
    questions = len(DECISION["questions"])
    assert f'decider_cache_lookups_total{{cache="repeat",outcome="hit"}} {questions}.0' in after
    assert 'decider_cache_lookups_total{cache="state",outcome="miss"} 1.0' in after
    assert "decider_queue_depth 0.0" in text
    assert "decider_model_ready 1.0" in text


# --- deadlines through HTTP ---------------------------------------------------------------------


@pytest.fixture
def slow_client() -> Iterator[TestClient]:
    engine = FakeEngine(token_seconds=0.1, chat_tokens=100)
    settings = _settings(deadline_seconds=0.6, max_chat_tokens=200)
    with TestClient(create_app(settings, loader=lambda _: engine)) as test_client:
        _wait_ready(test_client)
        yield test_client


def test_generation_past_the_deadline_is_504_not_a_hang(slow_client: TestClient) -> None:
    started = time.monotonic()
    response = slow_client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100})
    _error(response, 504, "deadline_exceeded")
    assert time.monotonic() - started < 2.0


def test_stream_past_the_deadline_ends_with_an_error_event_and_done(slow_client: TestClient) -> None:
    started = time.monotonic()
    with slow_client.stream(
        "POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 100, "stream": True}
    ) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert time.monotonic() - started < 2.0
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "deadline_exceeded"
    assert 1 < len(lines) - 2 < 100  # some tokens arrived before the cut


def test_decision_past_the_deadline_is_504_and_the_engine_is_told_to_stop() -> None:
    engine = FakeEngine(decode_seconds=30)
    with TestClient(create_app(_settings(deadline_seconds=0.5), loader=lambda _: engine)) as client:
        _wait_ready(client)
        started = time.monotonic()
        _error(client.post("/v1/systemone", json=DECISION), 504, "deadline_exceeded")
        assert time.monotonic() - started < 2.0
        engine.runtime.decode_seconds = 0
        assert client.post("/v1/systemone", json=DECISION).status_code == 200  # the worker is free again


def test_decision_past_the_deadline_while_queued_is_retryable_and_at_once_is_not() -> None:
    gate = threading.Event()
    engine = FakeEngine(decode_seconds=30, gate=gate)
    with TestClient(create_app(_settings(deadline_seconds=1.0), loader=lambda _: engine)) as client:
        _wait_ready(client)
        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(client.post, "/v1/systemone", json=DECISION)
            time.sleep(0.3)  # the first request holds the engine; the second waits for it
            second = pool.submit(client.post, "/v1/systemone", json=DECISION)
            ran_out = _error(first.result(), 504, "deadline_exceeded")
            waited = _error(second.result(), 504, "deadline_exceeded")
        gate.set()
    assert ran_out["retryable"] is False  # it had the model from the start: a retry fails again
    assert waited["retryable"] is True  # it lost its time in the queue


# --- OpenAI's /v1/decisions --------------------------------------------------------------------


def test_openai_decisions_route_answers_in_question_order(
    client: TestClient, fake_engine: FakeEngine
) -> None:
    body = client.post("/v1/decisions", json=OPENAI_DECISION).json()
    decision = Decision.model_validate(body)
    assert [a.type for a in decision.answers] == ["predicate", "choice", "score"]
    assert [a.name for a in decision.answers] == ["billing", None, "anger"]
    assert [p.value for p in decision.answers[1].probabilities] == [True, "true"]
    assert [(p.value, p.label) for p in decision.answers[2].probabilities] == [(0, "calm"), (1, "mad")]
    assert decision.model == fake_engine.model_info.id
    assert decision.usage.total_tokens == decision.usage.input_tokens > 0


def test_openai_decisions_errors_name_the_openai_field(client: TestClient, fake_engine: FakeEngine) -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA"}
    body = {**OPENAI_DECISION, "input": [{"role": "user", "content": [image]}]}
    error = _error(client.post("/v1/decisions", json=body), 422, "image_not_supported")
    assert error["param"] == "input.0.content.0"
    response = client.post("/v1/decisions", json={**OPENAI_DECISION, "questions": [{"type": "predicate"}]})
    assert response.json()["detail"] == [
        {
            "loc": ["body", "questions", 0, "instructions"],
            "msg": "`instructions` is required.",
            "type": "missing_field",
        }
    ]
    options = [{"value": f"o{i}"} for i in range(9)]  # the fixture's max_options is 8
    body = {**OPENAI_DECISION, "questions": [{"type": "choice", "instructions": "?", "choices": options}]}
    error = _error(client.post("/invocations", json=body), 422, "option_count_unsupported")
    assert error["param"] == "questions.0.choices"
    assert fake_engine.calls == []


# --- API key -------------------------------------------------------------------------------------


@pytest.fixture
def keyed_client(fake_engine: FakeEngine) -> Iterator[TestClient]:
    settings = _settings(api_key=API_KEY)
    with TestClient(create_app(settings, loader=lambda _: fake_engine)) as test_client:
        _wait_ready(test_client)
        yield test_client


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/invocations", DECISION),
        ("POST", "/v1/systemone", DECISION),
        ("POST", "/v1/decisions", OPENAI_DECISION),
        ("POST", "/v1/chat/completions", CHAT),
        ("GET", "/v1/models", None),
        ("GET", "/metrics", None),
        ("GET", "/no/such/route", None),
    ],
)
def test_a_configured_key_is_required_on_every_route_but_ping(
    keyed_client: TestClient, fake_engine: FakeEngine, method: str, path: str, body: Any
) -> None:
    def send(**headers: str) -> Any:
        return keyed_client.request(method, path, json=body, headers=headers)

    missing = send()
    error = _error(missing, 401, "missing_api_key")
    assert error["type"] == "authentication_error" and missing.headers["www-authenticate"].startswith(
        "Bearer"
    )
    assert missing.headers["x-request-id"]
    _error(send(Authorization=f"Bearer {API_KEY}x"), 401, "invalid_api_key")
    _error(send(Authorization=f"Basic {API_KEY}"), 401, "invalid_api_key")
    assert fake_engine.calls == []
    allowed = send(Authorization=f"bearer {API_KEY}")
    assert allowed.status_code == (404 if path == "/no/such/route" else 200), allowed.text
    assert keyed_client.get("/ping").status_code == 200


def test_without_a_key_any_authorization_header_is_ignored(client: TestClient) -> None:
    for header in ("Bearer whatever", "Basic abc", ""):
        assert (
            client.post("/v1/systemone", json=DECISION, headers={"Authorization": header}).status_code == 200
        )


def test_the_key_is_never_logged_or_put_into_a_sagemaker_environment(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = _settings(api_key=API_KEY)
    assert API_KEY not in repr(settings) and API_KEY not in str(settings)
    with pytest.raises(ValueError, match="outside SageMaker"):
        settings.to_environment()
    from pydantic import ValidationError

    from decider.cli import describe_settings_error

    with pytest.raises(ValidationError) as bad:
        Settings(model_path="/x", api_key="short-secret")
    assert "short-secret" not in describe_settings_error(bad.value)


# --- admission's cache peek ----------------------------------------------------------------------


def test_the_cache_peek_runs_on_an_intake_thread_and_ping_answers_meanwhile() -> None:
    # Pricing a work scans every kept key (the host tier's too: ~0.1 s per state with 300 kept);
    # on the event loop, a 64-state batch held /ping for seconds. Here one price takes 1 s.
    priced_on: list[str] = []

    class SlowPeekEngine(FakeEngine):
        def decision_work(self, plan: Any) -> Any:
            work = super().decision_work(plan)
            costs_given = work.costs_given

            def slow_costs_given(caches: Any) -> Any:
                priced_on.append(threading.current_thread().name)
                time.sleep(1.0)
                return costs_given(caches)

            work.costs_given = slow_costs_given
            return work

    engine = SlowPeekEngine()
    with TestClient(create_app(_settings(), loader=lambda _: engine)) as client:
        _wait_ready(client)
        body = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}
        with ThreadPoolExecutor(max_workers=1) as pool:
            decision = pool.submit(client.post, "/v1/systemone", json=body)
            time.sleep(0.3)  # the decision is being priced now
            started = time.monotonic()
            assert client.get("/ping").status_code == 200
            ping_seconds = time.monotonic() - started
            assert decision.result().status_code == 200
    assert priced_on and all(name.startswith("intake") for name in priced_on), priced_on
    assert ping_seconds < 0.3, ping_seconds
