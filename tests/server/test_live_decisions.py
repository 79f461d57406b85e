"""OpenAI's Decisions API, errors every client reads, the API key and the marker list, against the
real `serve` process on the bundled models, with the real openai SDK and typesafe-sdk."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
import typesafe_sdk
from openai.types import Decision
from server_helpers import DECISION, assert_error_body
from typesafe_sdk import Noul, TypeSafeClient

from decider_dev.local_server import WITHOUT_LOAD_PROBE, LocalServer, remote_server, run_local_server

pytestmark = [pytest.mark.server, pytest.mark.model]
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
API_KEY = "live-test-key-0123456789"
STATE = DECISION["state"]
QUESTIONS = [
    {"type": "predicate", "name": "refund", "instructions": "Does the customer ask for a refund?"},
    {
        "type": "choice",
        "name": "team",
        "instructions": "Which team should handle this?",
        "choices": [
            {"value": "billing", "description": "Payments and refunds"},
            {"value": "technical", "description": "Bugs and outages"},
            {"value": "sales"},
        ],
    },
    {
        "type": "score",
        "name": "anger",
        "instructions": "How upset is the customer?",
        "levels": [{"label": "calm"}, {"label": "annoyed"}, {"label": "furious"}],
    },
    {
        "type": "choice",
        "instructions": "Is a refund requested?",
        "choices": [
            {"value": True},
            {"value": "true", "description": "The customer says so"},
            {"value": False},
        ],
    },
]


def _openai(server: LocalServer, api_key: str = "unused-locally") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=api_key, max_retries=0, timeout=60)


def test_openai_sdk_decisions_create_parses_every_answer_type(live_server: LocalServer) -> None:
    decision = _openai(live_server).decisions.create(model="gpt-6-luna", input=STATE, questions=QUESTIONS)
    assert isinstance(decision, Decision)
    assert decision.model == httpx.get(f"{live_server.base_url}/ping").json()["model"]
    refund, team, anger, typed = decision.answers
    assert (refund.type, refund.name) == ("predicate", "refund") and 0.0 <= refund.probability <= 1.0
    assert team.type == "choice" and team.choice in {"billing", "technical", "sales"}
    assert [p.value for p in team.probabilities] == ["billing", "technical", "sales"]
    assert sum(p.probability for p in team.probabilities) == pytest.approx(1.0)
    assert team.choice == max(team.probabilities, key=lambda p: p.probability).value
    assert anger.type == "score" and 0.0 <= anger.score <= 2.0
    assert [(p.value, p.label) for p in anger.probabilities] == [(0, "calm"), (1, "annoyed"), (2, "furious")]
    assert anger.score == pytest.approx(sum(p.value * p.probability for p in anger.probabilities))
    assert typed.name is None and [p.value for p in typed.probabilities] == [True, "true", False]
    assert type(typed.choice) is type(max(typed.probabilities, key=lambda p: p.probability).value)
    usage = decision.usage
    assert usage.input_tokens > 0 and usage.output_tokens == 0 and usage.total_tokens == usage.input_tokens
    # Other tests may have asked about this state already: what was kept is reported, never more than
    # the prompt (test_live_cache.py pins the counts down on states of its own).
    assert 0 <= usage.input_tokens_details.cached_tokens < usage.input_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_the_same_question_gives_the_same_probabilities_on_both_routes(live_server: LocalServer) -> None:
    openai_body = {"model": "m", "input": STATE, "questions": QUESTIONS[:3]}
    jev_body = {
        "state": STATE,
        "questions": {
            "refund": {"type": "noul", "instructions": QUESTIONS[0]["instructions"]},
            "team": {
                "type": "choice",
                "instructions": QUESTIONS[1]["instructions"],
                "criteria": {
                    "billing": "Payments and refunds",
                    "technical": "Bugs and outages",
                    "sales": None,
                },
            },
            "anger": {
                "type": "score",
                "instructions": QUESTIONS[2]["instructions"],
                "criteria": ["calm", "annoyed", "furious"],
            },
        },
    }
    url = live_server.base_url
    jev = httpx.post(f"{url}/v1/systemone", json=jev_body, timeout=60).json()
    answers = {
        "direct": httpx.post(f"{url}/v1/decisions", json=openai_body, timeout=60).json(),
        "by shape": httpx.post(f"{url}/invocations", json=openai_body, timeout=60).json(),
        "by route": httpx.post(
            f"{url}/invocations",
            content=json.dumps(openai_body).encode(),
            headers={CUSTOM_ATTRIBUTES: "route=/v1/decisions"},
            timeout=60,
        ).json(),
    }
    for how, body in answers.items():
        refund, team, anger = body["answers"]
        assert refund["probability"] == pytest.approx(jev["answers"]["refund"]["noul"], abs=1e-6), how
        assert [p["probability"] for p in team["probabilities"]] == pytest.approx(
            list(jev["answers"]["team"]["probabilities"].values()), abs=1e-6
        ), how
        assert [p["probability"] for p in anger["probabilities"]] == pytest.approx(
            list(jev["answers"]["anger"]["probabilities"].values()), abs=1e-6
        ), how
        assert anger["score"] == pytest.approx(jev["answers"]["anger"]["score"], abs=1e-6), how
        assert body["usage"]["input_tokens"] == jev["usage"]["input_tokens"], how


def test_messages_and_tool_calls_as_input(live_server: LocalServer) -> None:
    decision = _openai(live_server).decisions.create(
        model="m",
        input=[
            {"role": "developer", "content": "Route support tickets."},
            {"role": "user", "content": [{"type": "input_text", "text": STATE}]},
            {"type": "function_call", "call_id": "c1", "name": "lookup_order", "arguments": '{"id": 1182}'},
            {"type": "function_call_output", "call_id": "c1", "output": "charged twice, 2 x 49.00"},
        ],
        questions=QUESTIONS[:1],
    )
    assert decision.answers[0].type == "predicate"


def test_openai_sdk_sees_typed_errors_it_does_not_retry(live_server: LocalServer) -> None:
    client = _openai(live_server)
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.decisions.create(
            model="m", input=[{"role": "user", "content": [image]}], questions=QUESTIONS[:1]
        )
    assert refused.value.code == "image_not_supported" and refused.value.param == "input.0.content.0"
    assert refused.value.response.headers["x-should-retry"] == "false"
    many = [{"value": f"option {i}"} for i in range(256)]  # OpenAI and Jev allow 2-255
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.decisions.create(
            model="m", input=STATE, questions=[{"type": "choice", "instructions": "?", "choices": many}]
        )
    assert refused.value.code == "option_count_unsupported" and refused.value.param == "questions.0.choices"


def test_errors_carry_both_shapes_on_every_route(live_server: LocalServer) -> None:
    url = live_server.base_url
    for path, body in (
        ("/v1/systemone", {"state": "s", "questions": {"q": {"type": "box"}}}),
        ("/v1/decisions", {"input": "s", "questions": [{"type": "box"}]}),
        ("/v1/chat/completions", {"messages": []}),
    ):
        response = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert response.status_code == 422
        assert_error_body(response.json(), status=422)
        assert response.json()["detail"][0]["loc"][0] == "body"
    missing = httpx.get(f"{url}/nope", timeout=10)
    assert_error_body(missing.json(), "unknown_endpoint", status=404)
    assert missing.json()["detail"] == {
        "error_type": "unknown_endpoint",
        "message": missing.json()["error"]["message"],
    }


def test_a_body_that_asks_for_too_many_tokens_is_refused_before_tokenizing(live_server: LocalServer) -> None:
    """64 questions of ~84 KB at 8 permutations: 5.4 MB, under the body cap, ~43 MB of text to tokenize
    (the old planner tokenized all of it, then refused it as `context_length_exceeded`). Now a typed
    422 from the bytes, as a request and as a Batch Transform record."""
    words = "the customer says the payment failed again and asks what to do next "
    criteria = {"a": "first", "b": "second", "c": "third", "d": "fourth"}
    question = {"type": "choice", "instructions": words * (84_000 // len(words)), "criteria": criteria}
    body = {"state": STATE, "questions": {f"q{i}": question for i in range(64)}, "permutations": 8}
    data = json.dumps(body)
    response = httpx.post(f"{live_server.base_url}/v1/systemone", content=data, timeout=20)
    assert response.status_code == 422, response.text[:300]
    assert_error_body(response.json(), "request_too_large", status=422)
    assert response.json()["error"]["param"] == "questions"
    record = httpx.post(
        f"{live_server.base_url}/invocations",
        content=data + "\n" + json.dumps(DECISION),
        headers={"Content-Type": "application/jsonlines"},
        timeout=60,
    )
    refused, answered = (json.loads(line) for line in record.text.splitlines())
    assert_error_body(refused, "request_too_large")
    assert set(answered["answers"]) == set(DECISION["questions"])


def test_models_reports_the_marker_list(live_server: LocalServer) -> None:
    (model,) = _openai(live_server).models.list().data
    markers = model.model_extra["markers"]
    assert "<|im_end|>" in markers["control"] and markers["setting"] == []


# --- API key ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[LocalServer]:
    if remote_server() is not None:
        pytest.skip("needs a server with DECIDER_API_KEY set of its own")
    with run_local_server(
        {"DECIDER_N_THREADS": "1", "DECIDER_API_KEY": API_KEY, **WITHOUT_LOAD_PROBE}
    ) as server:
        yield server


def test_a_configured_key_gates_every_client_but_ping(keyed_server: LocalServer) -> None:
    assert httpx.get(f"{keyed_server.base_url}/ping").status_code == 200
    assert (
        _openai(keyed_server, API_KEY)
        .decisions.create(model="m", input=STATE, questions=QUESTIONS[:1])
        .answers
    )
    with pytest.raises(openai.AuthenticationError) as refused:
        _openai(keyed_server, "wrong-key").models.list()
    assert refused.value.code == "invalid_api_key"
    with TypeSafeClient(api_key=API_KEY, base_url=keyed_server.base_url, timeout=60) as client:
        assert (
            0.0
            <= client.system_one(state=STATE, questions={"q": Noul(instructions="Refund?")}).nouls["q"].noul
            <= 1.0
        )
    with (
        TypeSafeClient(api_key="wrong-key", base_url=keyed_server.base_url, timeout=60) as client,
        pytest.raises(typesafe_sdk.TypeSafeAuthenticationError) as refused_ts,
    ):
        client.system_one(state=STATE, questions={"q": Noul(instructions="Refund?")})
    assert "API key is not valid" in str(refused_ts.value)
    assert API_KEY not in keyed_server.logs()
