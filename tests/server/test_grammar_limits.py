"""Chat options that cannot crash the process (issues 23 and 31).

A `response_format` schema with a large `maxLength` used to become a GBNF grammar nested as deep
as its bound, and llama.cpp's parser overflowed its stack on it: SIGSEGV, every request lost. The
constraint engine is now llguidance (decider.engine.structured.constraints), which builds such bounds lazily
and bounds its own work: those requests are ordinary, the size limit is a 422 of its own naming
the field, and hypothesis-generated schemas never take the live server down.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import assert_error_body, assert_survived

from decider.engine.structured.schema_limits import GrammarLimitError, check_schema
from decider.settings import GrammarLimits
from decider_dev.local_server import LocalServer


def _object(**field: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"a": field}, "required": ["a"]}


BIG_STRING = _object(type="string", maxLength=200_000)  # the 250-byte request
BIG_ARRAY = _object(type="array", items={"type": "integer"}, maxItems=200_000)


# --- the limits, without a model -------------------------------------------------------------------


def test_the_schema_size_is_bounded_before_anything_is_built() -> None:
    with pytest.raises(GrammarLimitError) as refused:
        check_schema({"enum": ["x" * 70_000]}, GrammarLimits())
    assert refused.value.path == ()
    check_schema(_object(type="string", maxLength=200_000), GrammarLimits())  # a bound is no size


# --- the live server -----------------------------------------------------------------------------------


def _chat(server: LocalServer, **fields: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 4, **fields}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)


def _schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


@pytest.mark.server
@pytest.mark.model
def test_the_requests_that_crashed_are_answered(tiny_server: LocalServer) -> None:
    for schema in (BIG_STRING, BIG_ARRAY):
        response = _chat(tiny_server, response_format=_schema_format(schema))
        assert response.status_code == 200, response.text
    response = _chat(tiny_server, response_format=_schema_format({"enum": ["x" * 70_000]}))
    assert response.status_code in (413, 422), response.text
    if response.status_code == 422:
        assert_error_body(response.json(), "response_format_too_complex", status=422)
        assert response.json()["error"]["param"] == "response_format.json_schema.schema"
    assert tiny_server.ping() == 200


@pytest.mark.server
@pytest.mark.model
def test_stop_strings_and_logit_bias_are_bounded(tiny_server: LocalServer) -> None:
    response = _chat(tiny_server, stop=["ok", "x" * 10_000])
    assert response.status_code == 422, response.text
    assert_error_body(response.json(), "stop_too_long", status=422)
    assert response.json()["error"]["param"] == "stop.1"
    response = _chat(tiny_server, logit_bias={"50256": -100})
    assert response.status_code == 422, response.text
    assert_error_body(response.json(), "unsupported_parameter", status=422)
    assert response.json()["error"]["param"] == "logit_bias"
    assert _chat(tiny_server, stop=["x" * 256], logit_bias={}).status_code == 200


bounds = st.integers(0, 8) | st.integers(0, 300_000)
leaf_schemas = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])}),
    st.fixed_dictionaries({"type": st.just("string")}, optional={"minLength": bounds, "maxLength": bounds}),
    st.fixed_dictionaries(
        {
            "type": st.just("string"),
            "pattern": st.from_regex(r"\^(\[a-z\]|\(ab\)|x)\{[0-9]{1,4}\}\$", fullmatch=True),
        }
    ),
    st.fixed_dictionaries({"enum": st.lists(st.text(max_size=8) | st.integers(), min_size=1, max_size=4)}),
    st.fixed_dictionaries(
        {"type": st.just("string"), "format": st.sampled_from(["date", "uuid", "date-time"])}
    ),
    st.fixed_dictionaries({"$ref": st.just("#")}),
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    objects = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), children, max_size=4).flatmap(
        lambda props: st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.just(props)},
            optional={
                "required": st.lists(
                    st.sampled_from(sorted(props) or ["x"]), unique=True, max_size=len(props)
                ),
                "additionalProperties": st.booleans(),
            },
        )
    )
    arrays = st.fixed_dictionaries(
        {"type": st.just("array"), "items": children}, optional={"minItems": bounds, "maxItems": bounds}
    )
    choices = st.fixed_dictionaries({"anyOf": st.lists(children, min_size=1, max_size=3)})
    return objects | arrays | choices


json_schemas = st.recursive(leaf_schemas, _containers, max_leaves=8)


@pytest.mark.server
@pytest.mark.model
@settings(
    max_examples=20,  # `make fuzz` sends ~500 real-world schemas; test_structured_output the hostile classes
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
    database=None,
)
@given(schema=json_schemas)
def test_generated_schemas_never_hurt_the_server(tiny_server: LocalServer, schema: Any) -> None:
    response = _chat(tiny_server, response_format=_schema_format(schema))
    assert response.status_code == 200 or 400 <= response.status_code < 500, (
        response.status_code,
        response.text,
    )
    if response.status_code != 200:
        assert_error_body(response.json())
    assert tiny_server.ping() == 200


@pytest.mark.server
@pytest.mark.model
def test_server_survived_the_schemas(tiny_server: LocalServer) -> None:
    assert_survived(tiny_server)
