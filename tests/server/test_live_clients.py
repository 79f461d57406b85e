"""Real clients against the real server on the real model: openai SDK, typesafe-sdk, raw SageMaker
calls, and several clients at once."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import httpx2
import openai
import pytest
import typesafe_sdk
from server_helpers import CHAT, DECISION, FORCED_CHAT, FORCED_TEXT, LONG_BODY_STATE, assert_error_body
from typesafe_sdk import Choice, Noul, Score, TypeSafeClient

from decider_dev.local_server import LocalServer

pytestmark = [pytest.mark.server, pytest.mark.model]
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"


def _openai(server: LocalServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused-locally", max_retries=0, timeout=60
    )


def _served_id(server: LocalServer) -> str:
    return httpx.get(f"{server.base_url}/ping").json()["model"]


def test_openai_sdk_chat(live_server: LocalServer) -> None:
    completion = _openai(live_server).chat.completions.create(
        model="whatever-the-caller-likes",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        temperature=0.7,
        top_p=0.9,
        seed=42,
        stop=["\n\n"],
    )
    assert completion.model == _served_id(live_server)
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in {"stop", "length"}
    assert completion.usage is not None
    assert 0 < completion.usage.completion_tokens <= 8
    assert (
        completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    )


def test_openai_sdk_streaming(live_server: LocalServer) -> None:
    """A streamed chat spells out its own tokens, and streamed and plain give the same text. The
    comparison is on FORCED_CHAT: a default server's two answers to a seeded chat may differ
    (server_helpers.FORCED_CHAT; the bitwise check is test_live_chat_parity's invariant server)."""
    stream = _openai(live_server).chat.completions.create(
        model="",
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        **CHAT,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert b"".join(bytes(e.bytes) for e in entries).decode() == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    usage = chunks[-1].usage
    assert usage is not None and 0 < usage.completion_tokens <= CHAT["max_tokens"]
    assert len(entries) == usage.completion_tokens
    plain = _openai(live_server).chat.completions.create(model="", **FORCED_CHAT)
    streamed = _openai(live_server).chat.completions.create(model="", stream=True, **FORCED_CHAT)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == FORCED_TEXT
    assert plain.choices[0].message.content == FORCED_TEXT and plain.choices[0].finish_reason == "stop"


def test_openai_sdk_models_and_errors(live_server: LocalServer) -> None:
    client = _openai(live_server)
    (model,) = client.models.list().data
    assert model.id == _served_id(live_server)
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=100_000)
    assert refused.value.code == "max_tokens_too_large"


def test_typesafe_sdk_noul_choice_score(live_server: LocalServer) -> None:
    with TypeSafeClient(api_key="local-test", base_url=live_server.base_url, timeout=60) as client:
        result = client.system_one(
            state=DECISION["state"],
            questions={
                "refund": Noul(instructions="Does the customer ask for a refund?"),
                "team": Choice(
                    instructions="Which team should handle this?",
                    criteria={
                        "billing": "Payments and refunds",
                        "technical": "Bugs and outages",
                        "sales": None,
                    },
                ),
                "anger": Score(
                    instructions="How upset is the customer?", criteria=["calm", "annoyed", "furious"]
                ),
            },
        )
        listed = client.models.list()
    served = _served_id(live_server)
    assert result.model == served
    assert 0.0 <= result.nouls["refund"].noul <= 1.0
    team = result.choices["team"]
    assert team.choice in {"billing", "technical", "sales"}
    assert sum(team.probabilities.values()) == pytest.approx(1.0)
    anger = result.scores["anger"]
    assert 0.0 <= anger.score <= 2.0
    assert set(anger.probabilities) == {0, 1, 2}
    assert result.usage.output_tokens == 0
    assert result.request_id
    assert [m.name for m in listed.models] == [served]


@pytest.mark.parametrize("compression", [None, False])
def test_typesafe_sdk_zstd_bodies_answer_as_plain_ones(
    live_server: LocalServer, compression: bool | None
) -> None:
    # typesafe-sdk 0.7.5 compresses bodies of 1 KiB or more with zstd whenever a zstd module is
    # importable (its default, None); the image ships one (backports-zstd), so neither mode gets a 415.
    sent: list[str | None] = []

    def record(request: httpx2.Request) -> None:
        sent.append(request.headers.get("content-encoding"))

    state = LONG_BODY_STATE
    questions = {"refund": Noul(instructions="Does the customer ask for a refund?")}
    with (
        httpx2.Client(timeout=60, event_hooks={"request": [record]}) as http,
        TypeSafeClient(
            api_key="t", base_url=live_server.base_url, http_client=http, compression=compression
        ) as c,
    ):
        result = c.system_one(state=state, questions=questions)
    assert sent == (["zstd"] if compression is None else [None])
    with TypeSafeClient(api_key="t", base_url=live_server.base_url, timeout=60, compression=False) as plain:
        reference = plain.system_one(state=state, questions=questions)
    assert result.nouls["refund"].noul == pytest.approx(reference.nouls["refund"].noul, abs=0.05)


def test_zstd_bodies_are_bounded_and_checked(live_server: LocalServer) -> None:
    from backports import zstd

    url = f"{live_server.base_url}/invocations"
    headers = {"Content-Type": "application/json", "Content-Encoding": "zstd"}
    bomb = zstd.compress(b'{"state": "' + b"a" * (7 * 2**20) + b'"}')  # 7 MiB inflated, ~1 KiB sent
    too_large = httpx.post(url, content=bomb, headers=headers, timeout=60)
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "body_too_large"
    garbage = httpx.post(url, content=b"not zstd at all", headers=headers, timeout=60)
    assert garbage.status_code == 422 and garbage.json()["error"]["code"] == "invalid_encoding"  # as gzip's


@pytest.mark.parametrize(
    ("what", "body", "status", "code"),
    [
        (
            "image assets (images in states and criteria)",
            {**DECISION, "assets": {"img1": {"type": "image", "url": "data:image/png;base64,iVBORw0KGgo="}}},
            422,
            "unsupported_field",
        ),
        (
            "a box question",
            {**DECISION, "questions": {"q": {"type": "box", "instructions": "Where?"}}},
            422,
            "invalid_question_type",
        ),
    ],
)
def test_jev_1_14_parts_this_text_model_cannot_answer_get_a_typed_4xx(
    live_server: LocalServer, what: str, body: dict, status: int, code: str
) -> None:
    response = httpx.post(f"{live_server.base_url}/v1/systemone", json=body, timeout=60)
    assert response.status_code == status and response.json()["error"]["code"] == code, what


def test_a_multipart_body_gets_415(live_server: LocalServer) -> None:
    parts = {
        "state": (None, "hi"),
        "questions": (None, json.dumps({"q": {"type": "noul", "instructions": "?"}})),
    }
    response = httpx.post(f"{live_server.base_url}/v1/systemone", files=parts, timeout=60)
    assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"


def test_typesafe_sdk_sees_typed_errors(live_server: LocalServer) -> None:
    with (
        TypeSafeClient(api_key="local-test", base_url=live_server.base_url, timeout=60) as client,
        pytest.raises(typesafe_sdk.TypeSafeUnprocessableEntityError) as refused,
    ):
        too_many = {f"option {i}": None for i in range(256)}  # Jev allows 2-255
        client.system_one(state="s", questions={"q": Choice(instructions="?", criteria=too_many)})
    assert "256" in str(refused.value)


def test_invocations_without_custom_attributes(live_server: LocalServer) -> None:
    decision = httpx.post(f"{live_server.base_url}/invocations", json=DECISION, timeout=60)
    assert decision.status_code == 200, decision.text
    assert set(decision.json()["answers"]) == set(DECISION["questions"])
    chat = httpx.post(f"{live_server.base_url}/invocations", json=CHAT, timeout=60)
    assert chat.status_code == 200, chat.text
    assert chat.json()["object"] == "chat.completion"
    for response, route in ((decision, "/v1/systemone"), (chat, "/v1/chat/completions")):
        attributes = dict(item.split("=", 1) for item in response.headers[CUSTOM_ATTRIBUTES].split(","))
        assert attributes["route"] == route
        assert len(attributes["request_id"]) == 32
        assert 0 <= int(attributes["duration_ms"]) < 60_000


def test_invocations_with_custom_attributes(live_server: LocalServer) -> None:
    url = f"{live_server.base_url}/invocations"
    body = json.dumps(DECISION).encode()  # as boto3 sends it: bytes, no content type of its own
    decision = httpx.post(url, content=body, headers={CUSTOM_ATTRIBUTES: "route=/v1/systemone"}, timeout=60)
    assert decision.status_code == 200, decision.text
    assert decision.json()["model"] == _served_id(live_server)
    streamed = httpx.post(
        url,
        json={**CHAT, "stream": True},
        headers={CUSTOM_ATTRIBUTES: "route=/v1/chat/completions"},
        timeout=60,
    )
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.rstrip().endswith("data: [DONE]")
    wrong = httpx.post(url, json=DECISION, headers={CUSTOM_ATTRIBUTES: "route=/v1/embeddings"}, timeout=60)
    assert wrong.status_code == 404
    assert_error_body(wrong.json(), "unknown_route")
    mismatched = httpx.post(
        url, json=DECISION, headers={CUSTOM_ATTRIBUTES: "route=/v1/chat/completions"}, timeout=60
    )
    assert mismatched.status_code == 422  # a decision body sent to the chat route
    assert_error_body(mismatched.json())


def test_decision_extensions_are_opt_in(live_server: LocalServer) -> None:
    plain = httpx.post(f"{live_server.base_url}/v1/systemone", json=DECISION, timeout=60).json()
    assert "extensions" not in plain
    assert all("extensions" not in answer for answer in plain["answers"].values())
    extended = httpx.post(
        f"{live_server.base_url}/v1/systemone", json={**DECISION, "extensions": True}, timeout=60
    ).json()
    assert "option_logits" in extended["answers"]["team"]["extensions"]


def test_several_concurrent_clients_without_errors(live_server: LocalServer) -> None:
    def decision_client(i: int) -> list[int]:
        with httpx.Client(base_url=live_server.base_url, timeout=120) as client:
            body = {**DECISION, "state": f"{DECISION['state']} (ticket {i})"}
            return [client.post("/invocations", json=body).status_code]

    def chat_client(i: int) -> list[int]:
        client = _openai(live_server)
        for _ in range(2):
            client.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=4, seed=i)
        return [200, 200]

    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(decision_client, i) for i in range(4)] + [
            pool.submit(chat_client, i) for i in range(2)
        ]
        statuses = [status for future in futures for status in future.result()]
    assert statuses == [200] * 8
    assert httpx.get(f"{live_server.base_url}/ping").status_code == 200


def test_openai_sdk_chat_as_sagemakers_openai_path_sends_it(live_server: LocalServer) -> None:
    """SageMaker's OpenAI-compatible path (`…/endpoints/<ep>/openai/v1/chat/completions`) reaches the
    container's `/v1/chat/completions` by path: `model=""` as its examples send, a bearer token that may
    or may not be forwarded (ignored without DECIDER_API_KEY), plain and streamed."""
    token = "sagemaker-api-key-" + "QUJD" * 40  # the shape of generate_token()'s token
    client = openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key=token, max_retries=0, timeout=60)
    plain = client.chat.completions.create(model="", **FORCED_CHAT)
    assert plain.model == _served_id(live_server) and plain.choices[0].message.content == FORCED_TEXT
    chunks = list(client.chat.completions.create(model="", stream=True, **FORCED_CHAT))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == FORCED_TEXT
    assert chunks[-1].choices[0].finish_reason == "stop"
