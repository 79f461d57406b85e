"""Property-based fuzzing of request bodies and headers against the real server: whatever is
sent, the answer is never a 5xx, every error has the error body, and the server keeps serving. What the
server does with a body is under test, not the answer: it runs the tiny random model (`tiny_server`)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import CHAT, DECISION, assert_error_body, assert_survived

from decider_dev.local_server import LocalServer

pytestmark = [pytest.mark.server, pytest.mark.model]

PATHS = ("/invocations", "/v1/systemone", "/v1/decisions", "/v1/chat/completions")
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)
question_types = st.sampled_from(["noul", "choice", "score", "box", "", "NOUL"]) | json_scalars
questions = st.dictionaries(
    st.text(max_size=10),
    st.fixed_dictionaries(
        {},
        optional={
            "type": question_types,
            "instructions": json_values,
            "criteria": json_values | st.lists(st.text(max_size=8), max_size=5),
        },
    )
    | json_values,
    max_size=3,
)
decisions = st.fixed_dictionaries(
    {},
    optional={
        "state": json_values,
        "questions": questions | json_values,
        "model": json_values,
        "extensions": json_values,
        "permutations": st.integers(-3, 40) | json_values,
        "mode": st.sampled_from(["shared", "fresh", "other"]) | json_values,
    },
)
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "robot"])
            | json_scalars,
            "content": st.text(max_size=30) | json_values,
        },
    )
    | json_values,
    max_size=3,
)
chats = st.fixed_dictionaries(
    {},
    optional={
        "messages": messages | json_values,
        "max_tokens": st.integers(-5, 3) | st.integers(2000, 2**40) | json_scalars,
        "temperature": st.floats(-1, 3) | json_scalars,
        "top_p": st.floats(-1, 2) | json_scalars,
        "stop": st.lists(st.text(max_size=4), max_size=6) | json_scalars,
        "seed": st.integers(-(2**70), 2**70) | json_scalars,
        "stream": st.booleans() | json_scalars,
        "n": st.integers(-1, 3) | json_scalars,
    },
)
parts = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["input_text", "input_json", "input_image", "output_text", "refusal", "x"])
        | json_values,
        "text": json_values,
        "data": json_values,
        "refusal": json_values,
    },
)
input_items = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "custom_tool_call", "x"])
        | json_values,
        "role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]) | json_values,
        "content": st.text(max_size=20) | st.lists(parts, max_size=3) | json_values,
        "call_id": st.sampled_from(["c1", "c2"]) | json_scalars,
        "name": json_values,
        "arguments": json_values,
        "output": json_values,
    },
)
choice_entries = st.fixed_dictionaries(
    {}, optional={"value": st.booleans() | st.text(max_size=6) | json_scalars, "description": json_values}
)
openai_questions = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["predicate", "choice", "score", "noul"]) | json_values,
        "name": json_values,
        "instructions": st.text(max_size=20) | st.lists(parts, max_size=2) | json_values,
        "choices": st.lists(choice_entries, max_size=4) | json_values,
        "levels": st.lists(st.fixed_dictionaries({}, optional={"label": json_values}), max_size=4),
    },
)
openai_decisions = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values,
        "input": st.text(max_size=30) | st.lists(input_items, max_size=3) | json_values,
        "questions": st.lists(openai_questions, max_size=3) | json_values,
        "prompt_cache_key": json_scalars,
        "safety_identifier": json_scalars,
    },
)
raw_bodies = st.binary(max_size=300) | st.text(max_size=200).map(str.encode)
bodies = (
    decisions.map(json.dumps).map(str.encode)
    | openai_decisions.map(json.dumps).map(str.encode)
    | chats.map(json.dumps).map(str.encode)
    | raw_bodies
)
content_types = st.sampled_from(
    [None, "application/json", "text/plain", "application/xml", "multipart/form-data", ";;"]
)
attributes = st.sampled_from(
    [
        None,
        "route=/v1/systemone",
        "route=/v1/decisions",
        "route=/v1/chat/completions",
        "route=/v1/embeddings",
        "route=",
        "=,=,",
        "route=/ping",
    ]
) | st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=40)


def _short(body: bytes) -> bytes:
    """Keep real generations short: a valid chat body gets max_tokens at most 3."""
    try:
        value: Any = json.loads(body)
    except ValueError:
        return body
    if isinstance(value, dict) and "messages" in value and not isinstance(value.get("max_tokens"), int):
        value["max_tokens"] = 2
    return json.dumps(value).encode()


@settings(
    max_examples=160,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
@given(
    path=st.sampled_from(PATHS),
    body=bodies,
    content_type=content_types,
    custom_attributes=attributes,
)
def test_bad_bodies_never_get_a_5xx(
    tiny_server: LocalServer, path: str, body: bytes, content_type: str | None, custom_attributes: str | None
) -> None:
    headers = {}
    if content_type is not None:
        headers["Content-Type"] = content_type
    if custom_attributes is not None:
        headers["X-Amzn-SageMaker-Custom-Attributes"] = custom_attributes
    response = httpx.post(f"{tiny_server.base_url}{path}", content=_short(body), headers=headers, timeout=60)
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code >= 400:
        assert_error_body(response.json())
    elif "text/event-stream" in response.headers.get("content-type", ""):
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert isinstance(response.json(), dict)


def test_server_still_serves_after_fuzzing(tiny_server: LocalServer) -> None:
    assert tiny_server.ping() == 200
    assert httpx.post(f"{tiny_server.base_url}/invocations", json=DECISION, timeout=60).status_code == 200
    openai_body = {"input": "x", "questions": [{"type": "predicate", "instructions": "?"}]}
    assert httpx.post(f"{tiny_server.base_url}/invocations", json=openai_body, timeout=60).status_code == 200
    assert httpx.post(f"{tiny_server.base_url}/invocations", json=CHAT, timeout=60).status_code == 200
    assert_survived(tiny_server)
