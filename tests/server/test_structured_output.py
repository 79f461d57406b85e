"""Structured output on llguidance (issue 31 §1), against the live server.

- The classes of schema that killed or held the GBNF path (docs/structured-output.md): impossible
  code points (U+0000 in enum, const and pattern), lone surrogates anywhere, deep `maxLength`, an
  ambiguous `$ref`/`anyOf` chain. Each is a 200 or a typed 4xx, within the deadline, and the
  server answers a plain chat afterwards; a 200 that ends with `stop` validates with `jsonschema`.
  What matters there is what the server does with the schema, not the answer: the tiny random model
  (`tiny_server`, SmolLM2's tokenizer) runs them.
- Greedy answers to simple schemas are the ones the GBNF path gave, on the bundled model: recorded
  on the tree before the change (data/greedy_structured_output.json: content, finish_reason and token count).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from server_helpers import assert_error_body, assert_survived

from decider_dev.bench.constraint_engines import anyof_ref_chain
from decider_dev.local_server import WITHOUT_LOAD_PROBE, LocalServer, remote_server, run_local_server

pytestmark = [pytest.mark.server, pytest.mark.model]
RECORDED = json.loads((Path(__file__).parent / "data" / "greedy_structured_output.json").read_text())


def _chat(server: LocalServer, schema: Any, *, max_tokens: int = 24, **fields: Any) -> httpx.Response:
    response_format = (
        {"type": "json_object"}
        if schema is None
        else {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    )
    body = {
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_format": response_format,
        **fields,
    }
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def _raw_chat(server: LocalServer, schema_text: str) -> httpx.Response:
    """A body written by hand: JSON escapes Python's json.dumps would not produce (lone surrogates)."""
    body = (
        '{"messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 8, '
        '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
        + schema_text
        + "}}}"
    )
    return httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=body.encode(),
        headers={"Content-Type": "application/json"},
        timeout=120,
    )


def _check_answer(response: httpx.Response, schema: Any) -> None:
    """200 with output that validates when it ended by itself, or a typed 4xx."""
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text
    if response.status_code != 200:
        assert_error_body(response.json())
        return
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def _still_serving(server: LocalServer) -> None:
    assert server.ping() == 200
    plain = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert plain.status_code == 200, plain.text


HOSTILE = {
    "nul_in_enum": {"type": "object", "properties": {"k": {"enum": ["a\u0000b", "c"]}}, "required": ["k"]},
    "nul_in_const": {"type": "object", "properties": {"k": {"const": {"x": "\u0000"}}}, "required": ["k"]},
    "nul_in_pattern": {"type": "string", "pattern": "^\\x00+$"},
    "nul_class_in_pattern": {"type": "string", "pattern": "^[\\u0000-\\u0001]{2}$"},
    "min_above_max": {"type": "array", "minItems": 6, "maxItems": 1, "items": {"enum": ["a", "b"]}},
    "deep_max_length": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 200_000}}},
    "deep_max_items": {"type": "array", "items": {"type": "integer"}, "maxItems": 200_000},
    "nested_quantifiers": {"type": "string", "pattern": "^((a{1000}){1000}){1000}$"},
    "anyof_ref_chain": anyof_ref_chain(40),
    "unsupported_keyword": {"type": "object", "if": {"required": ["a"]}, "then": {}},
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_schemas_get_200_or_a_typed_4xx_and_the_server_stays(
    tiny_server: LocalServer, name: str
) -> None:
    schema = HOSTILE[name]
    start = time.monotonic()
    response = _chat(tiny_server, schema)
    assert time.monotonic() - start < 55
    _check_answer(response, schema)
    if name == "unsupported_keyword":
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["code"] == "invalid_response_format" and "if" in error["message"]
        assert error["param"] == "response_format.json_schema.schema.if"
    if name == "min_above_max":
        assert response.status_code == 422
    _still_serving(tiny_server)


@pytest.mark.parametrize(
    ("schema_text", "param"),
    [
        ('{"type": "string", "pattern": "^\\ud800$"}', "response_format.json_schema.schema.pattern"),
        ('{"enum": ["ok", "\\udfff"]}', "response_format.json_schema.schema.enum.1"),
        ('{"properties": {"\\ud800": {}}}', "response_format.json_schema.schema.properties.\\ud800"),
        ('{"description": "\\udc00 anywhere"}', "response_format.json_schema.schema.description"),
    ],
)
def test_a_lone_surrogate_anywhere_is_a_422_naming_it(
    tiny_server: LocalServer, schema_text: str, param: str
) -> None:
    response = _raw_chat(tiny_server, schema_text)
    assert response.status_code == 422, response.text
    body = response.json()
    assert_error_body(body, "invalid_response_format", status=422)
    assert body["error"]["param"] == param
    _still_serving(tiny_server)


@pytest.mark.parametrize("name", sorted(RECORDED["cases"]))
def test_greedy_answers_to_simple_schemas_are_the_ones_before(live_server: LocalServer, name: str) -> None:
    text, schema = RECORDED["cases"][name]
    expected = RECORDED["outputs"][name]
    response_format = (
        {"type": "json_object"}
        if schema is None
        else {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    )
    body = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": response_format,
    }
    response = httpx.post(f"{live_server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    got = {
        "status": 200,
        "content": answer["choices"][0]["message"]["content"],
        "finish": answer["choices"][0]["finish_reason"],
        "tokens": answer["usage"]["completion_tokens"],
    }
    assert got == expected
    if schema is not None and got["finish"] == "stop":
        jsonschema.validate(json.loads(got["content"]), schema)


def test_streamed_and_logprobs_answers_agree_with_the_plain_one(live_server: LocalServer) -> None:
    text, schema = RECORDED["cases"]["colour"]
    base = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    }
    url = f"{live_server.base_url}/v1/chat/completions"
    plain = httpx.post(url, json=base, timeout=120).json()["choices"][0]["message"]["content"]
    with_logprobs = httpx.post(url, json={**base, "logprobs": True, "top_logprobs": 2}, timeout=120).json()
    choice = with_logprobs["choices"][0]
    assert choice["message"]["content"] == plain
    entries = choice["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == plain
    # the model's own log-probabilities, before the mask: a constrained token may not be the likeliest
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in entries)
    parts = []
    with httpx.stream("POST", url, json={**base, "stream": True}, timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    parts.append(chunk["choices"][0]["delta"].get("content") or "")
    assert "".join(parts) == plain


def test_the_servers_survived(live_server: LocalServer, tiny_server: LocalServer) -> None:
    assert_survived(live_server)
    assert_survived(tiny_server)


def test_the_vocabulary_is_read_while_the_model_loads(llama_path: Path) -> None:
    """decider.server.runtime reads it before `/ping` turns 200, so the first chat with a
    response_format does not read it (49,152 tokens here, SmolLM2's tokenizer) inside its deadline."""
    if remote_server() is not None:
        pytest.skip("reads a local server's log")
    env = {"DECIDER_N_THREADS": "1", "DECIDER_MODEL_PATH": str(llama_path), **WITHOUT_LOAD_PROBE}
    with run_local_server(env) as server:  # ready
        lines = server.logs().splitlines()
        [read] = [i for i, line in enumerate(lines) if "vocabulary read: 49152 tokens" in line]
        [ready] = [i for i, line in enumerate(lines) if "model ready" in line]
        assert read < ready
        assert _chat(server, {"type": "object"}, max_tokens=4).status_code == 200


WIDE = {
    "type": "object",
    "properties": {"a": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}},
    "required": ["a"],
}


def test_a_bound_hit_mid_answer_ends_that_chat_typed_plain_and_streamed() -> None:
    """With DECIDER_MAX_CONSTRAINT_STEP_ITEMS at its floor, an object of 300 optional properties
    under `a` passes the first steps (`{ "a": `) and then needs more Earley items than allowed: the
    plain chat is a 422 response_format_too_complex, the stream an error event after its first
    tokens, and the server goes on."""
    if remote_server() is not None:
        pytest.skip("needs a server with settings of its own")
    with run_local_server(
        {"DECIDER_N_THREADS": "1", "DECIDER_MAX_CONSTRAINT_STEP_ITEMS": "100", **WITHOUT_LOAD_PROBE}
    ) as server:
        response = _chat(server, WIDE)
        assert response.status_code == 422, response.text
        assert_error_body(response.json(), "response_format_too_complex", status=422)
        assert response.json()["error"]["param"] == "response_format"
        body = {
            "messages": [{"role": "user", "content": "Answer in JSON."}],
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WIDE}},
        }
        events = []
        url = f"{server.base_url}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=120) as stream:
            assert stream.status_code == 200
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        errors = [json.loads(e) for e in events[:-1] if "error" in json.loads(e)]
        assert errors and errors[0]["error"]["code"] == "response_format_too_complex"
        _still_serving(server)
        assert "Traceback" not in server.logs()


def test_without_strict_a_keyword_that_cannot_be_enforced_is_left_out(live_server: LocalServer) -> None:
    """Best effort, as llama-server: `uniqueItems` and `oneOf` over overlapping alternatives compile
    without `strict` (refused by name with it); a `strict` that is no boolean is refused."""
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "id": {"oneOf": [{"type": "string"}, {"type": "string", "minLength": 2}]},
        },
    }
    url = f"{live_server.base_url}/v1/chat/completions"
    base = {"messages": [{"role": "user", "content": "JSON."}], "max_tokens": 16, "temperature": 0}
    for strict, status in ((None, 200), (False, 200), (True, 422), ("yes", 422)):
        spec: dict[str, Any] = {"name": "t", "schema": schema}
        if strict is not None:
            spec["strict"] = strict
        response = httpx.post(
            url, json={**base, "response_format": {"type": "json_schema", "json_schema": spec}}
        )
        assert response.status_code == status, (strict, response.text)
        if status == 422:
            code = "invalid_response_format" if strict is True else "invalid_parameter"
            assert response.json()["error"]["code"] == code, response.text
