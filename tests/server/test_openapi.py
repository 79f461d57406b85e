"""The OpenAPI 3.1 document (issue 23 §4): built from the pydantic models, served at /openapi.json,
kept in docs/openapi.json, and the live server fuzzed from it with schemathesis.

Every response must match its documented status, content type and schema; no request may get a
5xx other than a typed, retryable 503/504; the process lives through all of them. `make fuzz`
runs the same with DECIDER_FUZZ_EXAMPLES=200 per operation (a few examples each in `make test`).
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance
from server_fakes import FakeEngine
from server_helpers import assert_survived
from starlette.testclient import TestClient

from decider.errors import RequestError
from decider.schemas.decision import loads_strict, parse_batch_request, parse_decision_request
from decider.schemas.openai_decisions import MESSAGE_ROLES, PART_TYPES, parse_openai_decision_request
from decider.schemas.openapi import WHITESPACE, openapi_document, render
from decider.server.app import create_app
from decider.settings import Settings
from decider_dev.local_server import LocalServer, RemoteServer

DOCUMENT = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
EXAMPLES = int(os.environ.get("DECIDER_FUZZ_EXAMPLES", "4"))
SUMMARY = os.environ.get("DECIDER_FUZZ_SUMMARY")  # `make fuzz`: answers by operation, status and code
ANSWERS: collections.Counter[str] = collections.Counter()
schema = schemathesis.openapi.from_dict(openapi_document())


def test_the_document_in_docs_is_up_to_date() -> None:
    assert DOCUMENT.read_text() == render(), (
        "run: .venv/bin/python -m decider.schemas.openapi > docs/openapi.json"
    )


def test_every_schema_keeps_its_own_name() -> None:
    """Two models of one name make pydantic rename both (`Choice-Input`, `Choice-Output`): a client
    generated from the document would see the chat's `Choice` disappear."""
    names = set(openapi_document()["components"]["schemas"])
    assert not [name for name in names if name.endswith(("-Input", "-Output"))], sorted(names)
    assert {"Choice", "AssistantMessage", "ChatMessage", "JevDecisionBody", "OpenAIDecisionBody"} <= names


def test_the_input_messages_cover_the_parser_s_roles_and_parts() -> None:
    """One message model per set of parts the parser takes (decider.schemas.openai_decisions)."""
    roles = {"InputUserMessage": ("user",), "InputInstructionMessage": ("developer", "system")}
    roles["InputAssistantMessage"] = ("assistant",)
    schemas = openapi_document()["components"]["schemas"]
    assert sorted(r for group in roles.values() for r in group) == sorted(MESSAGE_ROLES)
    for name, group in roles.items():
        role = schemas[name]["properties"]["role"]
        assert set(role.get("enum", [role.get("const")])) == set(group), name
        parts = schemas[name]["properties"]["content"]["anyOf"][1]["items"]
        refs = [parts["$ref"]] if "$ref" in parts else [one["$ref"] for one in parts["oneOf"]]
        documented = {schemas[ref.rsplit("/", 1)[1]]["properties"]["type"]["const"] for ref in refs}
        for member in group:
            assert documented == PART_TYPES[member] - {"input_image"}, (name, member)


def test_the_document_s_blank_is_the_parsers_blank() -> None:
    """The document's "not blank" pattern excludes exactly what `str.strip()` strips."""
    spelled = re.compile(f"[{WHITESPACE}]")
    every = [chr(point) for point in range(sys.maxunicode + 1)]
    assert [c for c in every if spelled.fullmatch(c)] == [c for c in every if c.isspace()]


def test_the_server_publishes_it() -> None:
    engine = FakeEngine()
    with TestClient(
        create_app(Settings(model_path="/nonexistent/model.gguf"), loader=lambda _: engine)
    ) as client:
        response = client.get("/openapi.json")
    assert response.status_code == 200
    document = response.json()
    assert document == json.loads(render()) and document["openapi"].startswith("3.1")
    served = {"/ping", "/invocations", "/v1/systemone", "/v1/systemone/batch", "/v1/decisions"}
    served |= {"/v1/chat/completions", "/v1/models", "/metrics", "/execution-parameters", "/openapi.json"}
    assert set(document["paths"]) == served


# What a body the document allows may still be refused for: the limits that are settings (the document
# names them, with their defaults, in descriptions).
SETTING_LIMITS = {"too_many_questions", "too_many_states", "option_count_unsupported", "invalid_permutations"}


# ... and on /v1/decisions, what its schema cannot say (docs/openapi.json's OpenAIDecisionBody): a choice
# without text, duplicate choices, an output before its call.
LOOSE_ON_OPENAI = {"empty_text", "duplicate_option", "unmatched_call_id"}


LIMITS = ("max_questions", "max_options", "max_permutations")


def _openai(body: Any) -> None:
    parse_openai_decision_request(body, **{name: Settings.model_fields[name].default for name in LIMITS})


@pytest.mark.parametrize(
    ("path", "parse", "loose"),
    [
        ("/v1/systemone", parse_decision_request, set()),
        ("/v1/systemone/batch", parse_batch_request, set()),
        ("/v1/decisions", _openai, LOOSE_ON_OPENAI),
    ],
)
def test_what_the_document_allows_on_the_decision_routes_the_server_parses(
    path: str, parse: Any, loose: set[str]
) -> None:
    """The decision bodies are parsed by hand (typed codes): bodies generated from the document, as a
    client or the fuzz below writes them, must pass those parsers but for a setting's limit (or a
    float `permutations` such as `2.0`: integers are strict, as on the chat route) and what the
    schema leaves loose. With `state` and `input` documented as any JSON value, no generated decision
    body was valid (`make fuzz` answered none)."""

    @given(schema[path]["POST"].as_strategy())
    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def parsed(case: Any) -> None:
        try:
            text = json.dumps(case.body, allow_nan=False)
        except ValueError:
            return  # NaN or Infinity: no JSON body carries them
        try:
            parse(loads_strict(text))
        except RequestError as error:
            assert error.code in SETTING_LIMITS | loose, (error.code, error.message, text[:500])

    parsed()


def _short(case: Any) -> None:
    """Keep generations short: a chat body generates 2 tokens at most. Only values the document allows
    are changed (to values it allows): a body made to break the document must stay broken, or the
    server's 200 would read as an invalid body accepted."""
    body = case.body
    if not isinstance(body, dict) or "messages" not in body:
        return
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 2:
            body[field] = 2
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 2  # absent or null (the default: up to DECIDER_MAX_CHAT_TOKENS)


@pytest.mark.server
@pytest.mark.model
@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_schemathesis(case: Any, tiny_server: LocalServer | RemoteServer) -> None:
    _short(case)
    # Valid by the document is not always valid by the server (limits, option counts, context): a
    # typed 4xx then, which the response checks hold to the documented error body.
    response = case.call_and_validate(
        base_url=tiny_server.base_url, timeout=60, excluded_checks=[positive_data_acceptance]
    )
    code = ""
    if response.status_code >= 400:
        try:
            code = response.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = "no_error_body"
    ANSWERS[f"{case.operation.label} {response.status_code} {code}".strip()] += 1
    if response.status_code >= 500:
        body = response.json()
        assert response.status_code in (503, 504) and body["error"]["retryable"], response.text


@pytest.mark.server
@pytest.mark.model
def test_the_server_lives_through_the_fuzzing(tiny_server: LocalServer | RemoteServer) -> None:
    assert httpx.get(f"{tiny_server.base_url}/ping", timeout=10).status_code == 200
    assert_survived(tiny_server)
    if SUMMARY:
        lines = [f"{count:6d}  {key}" for key, count in sorted(ANSWERS.items())]
        Path(SUMMARY).write_text(
            f"{sum(ANSWERS.values())} requests, {EXAMPLES} examples per operation\n" + "\n".join(lines) + "\n"
        )
