"""Chat options that cannot crash the process (issue 23 §1).

A `response_format` schema with a large `maxLength` used to become a GBNF grammar nested as deep
as its bound, and llama.cpp's parser overflowed its stack on it: SIGSEGV, every request lost. The
schema and its grammar are now checked against limits (decider.engine.schema_limits) before
llama.cpp sees them: the crash is reproduced in a child process, the limits are shown to hold on
an eighth of the default stack in a child process, over-limit requests are a 422 of their own
naming the field, and hypothesis-generated schemas never take the live server down.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from decider.engine import chat_options
from decider.engine.schema_limits import (
    GrammarLimitError,
    check_grammar_text,
    check_schema,
    grammar_depth,
    pattern_cost,
)
from decider.settings import GrammarLimits, Settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import assert_error_body

from tools.local_server import LocalServer

CHILD = Path(__file__).with_name("grammar_child.py")
ONE_MIB = 1024 * 1024
SMALL_STACK = ONE_MIB  # an eighth of the usual 8 MiB thread stack


def _object(**field: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"a": field}, "required": ["a"]}


BIG_STRING = _object(type="string", maxLength=200_000)  # the 250-byte request
BIG_ARRAY = _object(type="array", items={"type": "integer"}, maxItems=200_000)


# --- the limits, without a model -------------------------------------------------------------------


def _refusal(schema: Any, limits: GrammarLimits | None = None) -> GrammarLimitError:
    with pytest.raises(GrammarLimitError) as caught:
        chat_options.schema_grammar(schema, limits)
    return caught.value


def test_large_repetition_bounds_are_refused_before_the_converter_runs() -> None:
    assert _refusal(BIG_STRING).path == ("properties", "a", "maxLength")
    assert _refusal(BIG_ARRAY).path == ("properties", "a", "maxItems")
    assert _refusal(_object(type="string", minLength=10**12)).path == ("properties", "a", "minLength")
    # the budget is for the whole schema: many fields within it each, over it together
    many = {
        "type": "object",
        "properties": {f"f{i}": {"type": "string", "maxLength": 1000} for i in range(5)},
    }
    many["required"] = list(many["properties"])
    assert _refusal(many).path == ("properties", "f4", "maxLength")


def test_nested_pattern_quantifiers_multiply() -> None:
    assert pattern_cost("^[A-Z]{2}-\\d{6}$") == 9
    assert pattern_cost("((a{1000}){1000}){1000}") == 10**9
    assert _refusal(_object(type="string", pattern="^((a{100}){100}){100}$")).path == (
        "properties",
        "a",
        "pattern",
    )


def test_optional_properties_per_object_are_bounded() -> None:
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(200)}}
    assert _refusal(wide).path == ("properties",)
    wide["required"] = [f"p{i}" for i in range(100)]
    chat_options.schema_grammar(wide)  # 100 optional: within the default 128


def test_schema_size_grammar_size_and_depth() -> None:
    assert _refusal({"enum": ["x" * 70_000]}).path == ()
    with pytest.raises(GrammarLimitError, match="nests 60 groups"):
        chat_options.schema_grammar(_object(type="string", maxLength=60), GrammarLimits(grammar_depth=50))
    with pytest.raises(GrammarLimitError, match="DECIDER_MAX_GRAMMAR_BYTES"):
        check_grammar_text("root ::= " + '"a" ' * 3000, GrammarLimits(grammar_bytes=10_000))
    assert grammar_depth('root ::= "((" [(] ("a" ("b")?)?') == 2


def test_ordinary_schemas_pass() -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 200},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 10},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        },
        "required": ["name", "tags", "zip"],
    }
    check_schema(schema, GrammarLimits())
    assert "root ::=" in chat_options.schema_grammar(schema)


def test_the_limits_are_settings_with_these_defaults() -> None:
    limits = Settings.from_values({}).grammar_limits
    assert limits == GrammarLimits()
    custom = Settings.from_values({"max_schema_repetition": 100, "max_grammar_depth": 64}).grammar_limits
    assert (custom.repetition, custom.grammar_depth) == (100, 64)


# --- llama.cpp's parser, in a child process ----------------------------------------------------------


def _child(mode: str, source: str, text: str, stack: int = SMALL_STACK) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHILD), mode, source, str(stack), text],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.model
def test_llama_cpp_parser_crashes_on_the_unbounded_grammar() -> None:
    """The bug itself: the converter's grammar for maxLength 200000 kills the process (on a full
    8 MiB stack). If llama.cpp ever bounds its parser, this fails: revisit the limits then."""
    done = _child("raw", json.dumps(BIG_STRING), '{"a": "x', stack=8 * ONE_MIB)
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stdout, done.stderr[-500:])
    limited = _child("schema", json.dumps(BIG_STRING), '{"a": "x', stack=8 * ONE_MIB)
    assert (limited.returncode, limited.stdout.split()) == (0, ["limit"]), limited.stderr[-500:]


@pytest.mark.model
def test_grammars_at_the_limits_parse_on_an_eighth_of_the_stack() -> None:
    depth = GrammarLimits().grammar_depth
    nested = "(" * depth + '"a"?' + ")" * depth  # every level a rule llama.cpp recurses through
    at_limit = _child("gbnf", f'root ::= {nested} "b"', "ab")
    assert (at_limit.returncode, at_limit.stdout.split()) == (0, ["parsed"]), at_limit.stderr[-500:]
    optional = 'root ::= "x" ' + '("a" ' * depth + ")?" * depth  # maxLength's shape, at the depth limit
    done = _child("gbnf", optional, "xaaaa")
    assert done.returncode == 0 and done.stdout.split() in (["parsed"], ["refused"]), done.stderr[-500:]
    over = _child("gbnf", 'root ::= "x" ' + '("a" ' * (depth + 1) + ")?" * (depth + 1), "x")
    assert (over.returncode, over.stdout.split()) == (0, ["limit"])
    # the longest string llama.cpp's own sanity check keeps, parsed and walked
    text = '{"a": "' + "x" * 40
    walked = _child("schema", json.dumps(_object(type="string", maxLength=900)), text)
    assert (walked.returncode, walked.stdout.split()) == (0, ["parsed"]), walked.stderr[-500:]


# --- the live server -----------------------------------------------------------------------------------


def _chat(server: LocalServer, **fields: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 4, **fields}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)


def _schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


@pytest.mark.server
@pytest.mark.model
def test_the_crashing_requests_are_a_422_naming_the_field(live_server: LocalServer) -> None:
    for schema, keyword in ((BIG_STRING, "maxLength"), (BIG_ARRAY, "maxItems")):
        response = _chat(live_server, response_format=_schema_format(schema))
        assert response.status_code == 422, response.text
        body = response.json()
        assert_error_body(body, "response_format_too_complex", status=422)
        assert body["error"]["param"] == f"response_format.json_schema.schema.properties.a.{keyword}"
    assert live_server.ping() == 200


@pytest.mark.server
@pytest.mark.model
def test_stop_strings_and_logit_bias_are_bounded(live_server: LocalServer) -> None:
    response = _chat(live_server, stop=["ok", "x" * 10_000])
    assert response.status_code == 422, response.text
    assert_error_body(response.json(), "stop_too_long", status=422)
    assert response.json()["error"]["param"] == "stop.1"
    response = _chat(live_server, logit_bias={"50256": -100})
    assert response.status_code == 422, response.text
    assert_error_body(response.json(), "unsupported_parameter", status=422)
    assert response.json()["error"]["param"] == "logit_bias"
    assert _chat(live_server, stop=["x" * 256], logit_bias={}).status_code == 200


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
    max_examples=40,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
    database=None,
)
@given(schema=json_schemas)
def test_generated_schemas_never_hurt_the_server(live_server: LocalServer, schema: Any) -> None:
    response = _chat(live_server, response_format=_schema_format(schema))
    assert response.status_code == 200 or 400 <= response.status_code < 500, (
        response.status_code,
        response.text,
    )
    if response.status_code != 200:
        assert_error_body(response.json())
    assert live_server.ping() == 200


@pytest.mark.server
@pytest.mark.model
def test_server_survived_the_schemas(live_server: LocalServer) -> None:
    if isinstance(live_server, LocalServer):
        assert live_server.process.poll() is None
        assert "Traceback" not in live_server.logs()


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "array", "minItems": 6, "maxItems": 1, "items": {"enum": ["a", "b"]}}, ("minItems",)),
        ({"type": "string", "minLength": 3, "maxLength": 2}, ("minLength",)),
        ({"enum": ["a\u0000b"]}, ("enum",)),
        ({"properties": {"k": {"const": {"x": "\u0000"}}}}, ("properties", "k", "enum")),
    ],
)
def test_schemas_that_abort_llama_cpps_sampler_are_refused(schema, where) -> None:
    """Both kinds made the server abort ("Unexpected empty grammar stack after accepting piece"),
    found by the generated-schema fuzz: a minimum above its maximum, and a NUL in an enum/const."""
    with pytest.raises(GrammarLimitError) as refused:
        check_schema(schema, GrammarLimits())
    assert refused.value.path == where
    check_schema({"enum": ["a\\u0000"]}, GrammarLimits())  # the six characters, not a NUL: fine
