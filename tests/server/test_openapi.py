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
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance
from server_fakes import FakeEngine
from starlette.testclient import TestClient

from decider.schemas.openapi import openapi_document, render
from decider.server.app import create_app
from decider.settings import Settings
from decider_dev.local_server import LocalServer

DOCUMENT = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
EXAMPLES = int(os.environ.get("DECIDER_FUZZ_EXAMPLES", "4"))
SUMMARY = os.environ.get("DECIDER_FUZZ_SUMMARY")  # `make fuzz`: answers by operation, status and code
ANSWERS: collections.Counter[str] = collections.Counter()
schema = schemathesis.openapi.from_dict(openapi_document())


def test_the_document_in_docs_is_up_to_date() -> None:
    assert DOCUMENT.read_text() == render(), (
        "run: .venv/bin/python -m decider.schemas.openapi > docs/openapi.json"
    )


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
def test_schemathesis(case: Any, live_server: LocalServer) -> None:
    _short(case)
    # Valid by the document is not always valid by the server (limits, option counts, context): a
    # typed 4xx then, which the response checks hold to the documented error body.
    response = case.call_and_validate(
        base_url=live_server.base_url, timeout=60, excluded_checks=[positive_data_acceptance]
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
def test_the_server_lives_through_the_fuzzing(live_server: LocalServer) -> None:
    assert httpx.get(f"{live_server.base_url}/ping", timeout=10).status_code == 200
    if isinstance(live_server, LocalServer):
        assert live_server.process.poll() is None
        assert "Traceback" not in live_server.logs()
    if SUMMARY:
        lines = [f"{count:6d}  {key}" for key, count in sorted(ANSWERS.items())]
        Path(SUMMARY).write_text(
            f"{sum(ANSWERS.values())} requests, {EXAMPLES} examples per operation\n" + "\n".join(lines) + "\n"
        )
