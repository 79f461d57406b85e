"""Request bodies and assertions shared by the server tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from decider_dev.local_server import BASE_URL_ENV, LocalServer, RemoteServer, free_port, remote_server

# For tests that start a server with settings of their own (a tiny queue, a broken model, SIGTERM):
# they cannot run against the one server named by DECIDER_TEST_BASE_URL.
LOCAL_ONLY = pytest.mark.skipif(
    remote_server() is not None,
    reason=f"starts its own server with special settings; {BASE_URL_ENV} names a running one "
    "(the image contract checks start-up failures and SIGTERM on the container itself)",
)

DECISION: dict[str, Any] = {
    "state": "Subject: charged twice\n\nI was charged twice for order 1182 and I want my money back today.",
    "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "team": {
            "type": "choice",
            "instructions": "Which team should handle this?",
            "criteria": {"billing": "Payments and refunds", "technical": "Bugs and outages", "sales": None},
        },
        "anger": {
            "type": "score",
            "instructions": "How upset is the customer?",
            "criteria": ["calm", "annoyed", "furious"],
        },
    },
}

# A state over typesafe-sdk's 1 KiB floor for zstd bodies, in few tokens: a run of one character is a
# handful of SmolLM2's (1,100 '=' are 18), where 1 KiB of prose is ~600, seconds of a core each time.
LONG_BODY_STATE = DECISION["state"] + "\n" + "=" * 1100
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "seed": 7}

# A chat whose text its response format fixes: `"Hello, world. Bye!"`, quotes included. A server with
# the default settings does not give the same tokens twice for the same request once other requests
# have come and gone: llama.cpp's CPU attention sums a sequence's cells in cell order and in per-thread
# chunks, so where the cache placed them moves the logits (docs/engine.md, "Answers that do not depend
# on their neighbours"; a seeded chat answered differently 4 times in 5 after the live tests). Tests
# that compare two answers of such a server (plain and streamed, direct and proxied) compare this
# text, which any logits give. The way it is cut into tokens may still differ: compare the text only.
FORCED_TEXT = '"Hello, world. Bye!"'
FORCED_CHAT: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Say hello."}],
    "max_tokens": 32,
    "temperature": 0,
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "greeting",
            "strict": True,
            "schema": {"type": "string", "enum": [FORCED_TEXT.strip('"')]},
        },
    },
}

# A response format that keeps a chat generating: its answer must hold a 1,000-character string, so the
# model cannot end it early (a free greedy chat in the default mode once stopped after 12 tokens). For
# tests that need a chat still running when something happens to it (a kill, a deadline, a shutdown).
LONG_ANSWER: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {
        "name": "story",
        "schema": {
            "type": "object",
            "properties": {"story": {"type": "string", "minLength": 1000}},
            "required": ["story"],
            "additionalProperties": False,
        },
    },
}


def assert_survived(server: LocalServer | RemoteServer) -> None:
    """A local server's process still runs and logged no traceback. A running one's process and logs
    belong to whoever started it: `make image-test` checks that the container still runs and logged
    no traceback."""
    if isinstance(server, LocalServer):
        assert server.process.poll() is None
        assert "Traceback" not in server.logs()


def assert_error_body(body: Any, code: str | None = None, *, status: int | None = None) -> None:
    """The one error body: OpenAI-style `error` plus FastAPI-style `detail` saying the same thing."""
    assert isinstance(body, dict) and set(body) == {"error", "detail"}, body
    error = body["error"]
    assert set(error) == {"type", "code", "message", "param", "retryable"}, body
    assert isinstance(error["code"], str) and error["message"], body
    assert isinstance(error["retryable"], bool), body
    detail = body["detail"]
    if isinstance(detail, list):  # validation error (422)
        assert status in (None, 422), body
        (entry,) = detail
        assert entry["loc"][0] == "body" and entry["msg"] == error["message"], body
        assert entry["type"] == error["code"] and not error["retryable"], body
        param = ".".join(str(part) for part in entry["loc"][1:])
        assert param == (error["param"] or ""), body
    else:
        assert status != 422, body
        assert detail == {"error_type": error["code"], "message": error["message"]}, body
    if code is not None:
        assert error["code"] == code, body


@contextlib.contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """The real uvicorn server on `app` in this process (a fake engine's state stays readable);
    yields its base URL once `/ping` is 200."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/ping", timeout=1).status_code == 200:
                break
        assert time.monotonic() < deadline, "the in-process server never became ready"
        time.sleep(0.02)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(10)
