"""`decider-proxy` and its httpx transports, end to end without AWS: the real clients → the proxy
(the console script, and the library in-process) → botocore (SigV4) → a local stand-in of the
SageMaker runtime API (`AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME`) → the real server's `/invocations`.
Each client gets through the proxy what it gets directly."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import jev_lite
import openai
import pytest
import typesafe_sdk
from jevcompat.runner import run as jevcompat_run
from server_helpers import CHAT, DECISION, FORCED_CHAT, FORCED_TEXT, LONG_BODY_STATE, assert_error_body
from typesafe_sdk import Choice, Noul, Score, TypeSafeClient

from decider_cli.proxy import async_sagemaker_http_client, sagemaker_http_client
from decider_cli.proxy.sidecar import STANDIN_CREDENTIALS, RunningProxy, run_proxy
from decider_cli.proxy.standin import MODEL_NOT_READY, THROTTLED, RunningStandin, run_standin
from decider_dev.local_server import LocalServer

pytestmark = [pytest.mark.server, pytest.mark.model]
ENDPOINT = "decider-test"
OPENAI_QUESTIONS = [
    {"type": "predicate", "name": "refund", "instructions": "Does the customer ask for a refund?"},
    {
        "type": "choice",
        "name": "team",
        "instructions": "Which team should handle this?",
        "choices": [{"value": "billing"}, {"value": "technical"}, {"value": "sales"}],
    },
]


@pytest.fixture(scope="module")
def standin(live_server: LocalServer) -> Iterator[RunningStandin]:
    faults = {"throttled": THROTTLED, "warming": MODEL_NOT_READY}
    with run_standin(live_server.base_url, endpoints={ENDPOINT}, faults=faults) as running:
        yield running


@pytest.fixture(scope="module")
def proxy(standin: RunningStandin) -> Iterator[RunningProxy]:
    with run_proxy(ENDPOINT, runtime_url=standin.url) as running:
        yield running


@pytest.fixture
def standin_env(standin: RunningStandin, monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore in this process pointed at the stand-in, as the sidecar is."""
    for key, value in STANDIN_CREDENTIALS.items():
        if value:
            monkeypatch.setenv(key, value)
        else:
            monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME", standin.url)


def _openai(base_url: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60, **kwargs)


def _probabilities(decision: Any) -> list[Any]:
    return [answer.model_dump() for answer in decision.answers]


def test_openai_chat_and_stream_through_the_proxy_equal_direct(
    live_server: LocalServer, proxy: RunningProxy, standin: RunningStandin
) -> None:
    direct = _openai(live_server.base_url).chat.completions.create(model="", **FORCED_CHAT)
    proxied = _openai(proxy.base_url).chat.completions.create(model="", **FORCED_CHAT)
    assert proxied.choices[0].message.content == direct.choices[0].message.content == FORCED_TEXT
    assert proxied.model == direct.model and proxied.usage.prompt_tokens == direct.usage.prompt_tokens
    assert proxied.usage.total_tokens == proxied.usage.prompt_tokens + proxied.usage.completion_tokens
    stream = _openai(proxy.base_url).chat.completions.create(
        model="", stream=True, stream_options={"include_usage": True}, **FORCED_CHAT
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == FORCED_TEXT
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == direct.usage.prompt_tokens
    streamed = [call for call in standin.state.calls if call["path"].endswith("/invocations-response-stream")]
    assert streamed and streamed[-1]["custom_attributes"] == "route=/v1/chat/completions"
    assert all(
        call["authorization"].startswith("AWS4-HMAC-SHA256 Credential=") for call in standin.state.calls
    )


def test_openai_decisions_and_models_through_the_proxy_equal_direct(
    live_server: LocalServer, proxy: RunningProxy
) -> None:
    direct = _openai(live_server.base_url).decisions.create(
        model="m", input=DECISION["state"], questions=OPENAI_QUESTIONS
    )
    proxied = _openai(proxy.base_url).decisions.create(
        model="m", input=DECISION["state"], questions=OPENAI_QUESTIONS
    )
    assert _probabilities(proxied) == _probabilities(direct)  # the second is an exact repeat: same bits
    same = {"input_tokens_details": {"cached_tokens"}}  # it reports what it read back instead
    assert proxied.usage.model_dump(exclude=same) == direct.usage.model_dump(exclude=same)
    assert proxied.usage.input_tokens_details.cached_tokens >= direct.usage.input_tokens_details.cached_tokens
    assert [m.id for m in _openai(proxy.base_url).models.list().data] == [direct.model]


def test_typesafe_sdk_through_the_proxy_equals_direct(live_server: LocalServer, proxy: RunningProxy) -> None:
    questions = {
        "refund": Noul(instructions="Does the customer ask for a refund?"),
        "team": Choice(instructions="Which team?", criteria={"billing": "Payments", "technical": None}),
        "anger": Score(instructions="How upset?", criteria=["calm", "annoyed", "furious"]),
    }
    results = []
    for base_url in (live_server.base_url, proxy.base_url):
        with TypeSafeClient(api_key="unused", base_url=base_url, timeout=60) as client:
            results.append(client.system_one(state=DECISION["state"], questions=questions))
            listed = client.models.list()
    direct, proxied = results
    assert proxied.model_dump(exclude={"request_id"}) == direct.model_dump(exclude={"request_id"})
    assert proxied.request_id and proxied.request_id != direct.request_id  # from CustomAttributes
    assert [m.name for m in listed.models] == [direct.model]
    with (
        TypeSafeClient(api_key="unused", base_url=proxy.base_url, timeout=60) as client,
        pytest.raises(typesafe_sdk.TypeSafeUnprocessableEntityError),
    ):
        too_many = {f"option {i}": None for i in range(256)}  # Jev allows 2-255
        client.system_one(state="s", questions={"q": Choice(instructions="?", criteria=too_many)})


def test_typesafe_sdk_zstd_bodies_through_the_proxy(live_server: LocalServer, proxy: RunningProxy) -> None:
    # the SDK's default: zstd for bodies of 1 KiB or more (InvokeEndpoint carries no Content-Encoding,
    # so the proxy undoes it); the same answer as an uncompressed body sent direct
    state = LONG_BODY_STATE
    questions = {"refund": Noul(instructions="Does the customer ask for a refund?")}
    answers = []
    for base_url, compression in ((proxy.base_url, None), (live_server.base_url, False)):
        with TypeSafeClient(
            api_key="unused", base_url=base_url, timeout=60, compression=compression
        ) as client:
            answers.append(client.system_one(state=state, questions=questions).nouls["refund"].noul)
    assert answers[0] == pytest.approx(answers[1], abs=0.05)


def test_jev_lite_through_the_proxy_equals_direct(live_server: LocalServer, proxy: RunningProxy) -> None:
    answers = []
    for base_url in (live_server.base_url, proxy.base_url):
        with jev_lite.TypeSafe(api_key="unused", base_url=base_url, max_retries=0) as client:
            answers.append(client.system_one.create(state=DECISION["state"], questions=DECISION["questions"]))
            models = client.models.list()
    direct, proxied = answers
    assert proxied.answers == direct.answers and proxied.usage == direct.usage
    assert proxied.model == direct.model == models.models[0].name


def test_batch_route_and_raw_invocations_through_the_proxy(
    live_server: LocalServer, proxy: RunningProxy
) -> None:
    refund = {"refund": DECISION["questions"]["refund"]}
    body = {"states": ["charged twice", "app crashes on start"], "questions": refund}
    direct = httpx.post(f"{live_server.base_url}/v1/systemone/batch", json=body, timeout=60)
    proxied = httpx.post(f"{proxy.base_url}/v1/systemone/batch", json=body, timeout=60)
    assert proxied.status_code == 200 and proxied.json() == direct.json()
    raw = httpx.post(
        f"{proxy.base_url}/invocations",
        json=DECISION,
        headers={"X-Amzn-SageMaker-Custom-Attributes": "route=/v1/systemone"},
        timeout=60,
    )
    assert raw.status_code == 200 and set(raw.json()["answers"]) == set(DECISION["questions"])
    assert "route=/v1/systemone" in raw.headers["x-amzn-sagemaker-custom-attributes"]


def test_errors_through_the_proxy_are_the_containers(live_server: LocalServer, proxy: RunningProxy) -> None:
    for path, body in (
        ("/v1/systemone", {"state": "x"}),
        ("/v1/decisions", {"input": "x", "questions": []}),
        ("/v1/chat/completions", {"messages": [], "stream": True}),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 100_000}),
    ):
        direct = httpx.post(f"{live_server.base_url}{path}", json=body, timeout=60)
        proxied = httpx.post(f"{proxy.base_url}{path}", json=body, timeout=60)
        assert (proxied.status_code, proxied.json()) == (direct.status_code, direct.json()), path
        assert proxied.headers["x-should-retry"] == "false"
        assert_error_body(proxied.json())
    bad_json = httpx.post(f"{proxy.base_url}/v1/systemone", content=b"{not json", timeout=60)
    assert bad_json.status_code == 422
    assert_error_body(bad_json.json(), "invalid_json")
    unknown = httpx.get(f"{proxy.base_url}/v1/embeddings", timeout=10)
    assert unknown.status_code == 404
    assert_error_body(unknown.json(), "unknown_endpoint")
    wrong_method = httpx.get(f"{proxy.base_url}/v1/systemone", timeout=10)
    assert wrong_method.status_code == 405
    assert_error_body(wrong_method.json(), "method_not_allowed")
    too_large = httpx.post(f"{proxy.base_url}/v1/systemone", content=b" " * 6_291_457, timeout=60)
    assert too_large.status_code == 413
    assert_error_body(too_large.json(), "body_too_large")


def test_sagemaker_refusals_map_to_the_error_shape_with_truthful_retryable(standin: RunningStandin) -> None:
    for endpoint, status, code, retryable in (
        ("throttled", 429, "sagemaker_throttled", True),
        ("warming", 503, "model_not_ready", True),
        ("no-such-endpoint", 404, "endpoint_not_found", False),
    ):
        with run_proxy(endpoint, runtime_url=standin.url) as proxy:
            response = httpx.post(f"{proxy.base_url}/v1/systemone", json=DECISION, timeout=60)
            assert response.status_code == status, response.text
            assert_error_body(response.json(), code, status=status)
            assert response.json()["error"]["retryable"] is retryable
            assert response.headers["x-should-retry"] == str(retryable).lower()
            if endpoint == "throttled":
                with pytest.raises(openai.RateLimitError) as refused:
                    _openai(proxy.base_url).chat.completions.create(model="", **CHAT)
                assert refused.value.code == "sagemaker_throttled"


@pytest.mark.usefixtures("standin_env")
def test_transport_library_in_process(live_server: LocalServer) -> None:
    """The same without the sidecar: `http_client=` for the openai SDK (httpx2) and jev-lite (httpx)."""
    client = _openai("http://ignored", http_client=sagemaker_http_client(ENDPOINT, http=httpx2))
    direct = _openai(live_server.base_url)
    assert client.chat.completions.create(model="", **FORCED_CHAT).choices[0].message.content == FORCED_TEXT
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="", stream=True, **FORCED_CHAT)
        if c.choices
    )
    assert streamed == FORCED_TEXT
    proxied = client.decisions.create(model="m", input=DECISION["state"], questions=OPENAI_QUESTIONS)
    expected = direct.decisions.create(model="m", input=DECISION["state"], questions=OPENAI_QUESTIONS)
    assert _probabilities(proxied) == _probabilities(expected)
    with jev_lite.TypeSafe(api_key="unused", http_client=sagemaker_http_client(ENDPOINT)) as jev:
        assert set(jev.system_one.create(state="s", questions=DECISION["questions"]).answers) == set(
            DECISION["questions"]
        )
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.chat.completions.create(model="", messages=[], max_tokens=4)
    assert refused.value.status_code == 422


@pytest.mark.usefixtures("standin_env")
def test_async_transport_streams_without_blocking(live_server: LocalServer) -> None:
    async def run() -> tuple[str, list[str]]:
        client = openai.AsyncOpenAI(
            base_url="http://ignored/v1",
            api_key="unused",
            max_retries=0,
            http_client=async_sagemaker_http_client(ENDPOINT, http=httpx2),
        )
        pieces: list[str] = []
        stream = await client.chat.completions.create(model="", stream=True, **FORCED_CHAT)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        models = await client.models.list()
        return "".join(pieces), [m.id for m in models.data]

    text, models = asyncio.run(run())
    direct = _openai(live_server.base_url).chat.completions.create(model="", **FORCED_CHAT)
    assert text == direct.choices[0].message.content == FORCED_TEXT and models == [direct.model]
    assert os.environ["AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME"].startswith("http://127.0.0.1:")


JEVCOMPAT_CASES = {
    "models-endpoint",
    "model-alias",
    "noul-basic",
    "noul-criteria",
    "choice-basic",
    "choice-null-description",
    "state-types",
    "structured-text",
    "question-ids",
    "invalid",
    "out-of-range",
    "unknown-fields",
    "sdk-python",
}


def test_jev_conformance_suite_through_the_proxy(proxy: RunningProxy) -> None:
    """jevcompat (the public Jev conformance suite) through the proxy, on its quick cases; the whole
    suite through the proxy gives what it gives directly (docs/clients.md, run once by hand)."""
    report = jevcompat_run(proxy.base_url, timeout=120, only=JEVCOMPAT_CASES)
    summary = report.summary()
    assert report.aborted is None, report.aborted
    assert summary["MUST"]["failed"] == 0 and summary["SHOULD"]["failed"] == 0, [
        result for result in report.results if result.status == "fail"
    ]
    assert summary["MUST"]["passed"] >= 20
