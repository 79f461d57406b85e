"""A stand-in engine child for tests/server/test_supervisor.py: serves HTTP on the front's Unix socket
like `serve engine`, and dies natively (os.abort) on what a test asks for.

    python fake_engine_child.py SOCKET

- `/ping`: 200 once started (after `$FAKE_ENGINE_START_S` seconds; `$FAKE_ENGINE_FAIL_START`: exit 1
  before that, as a model that cannot load);
- `POST /echo`: the body back; `{"crash": ...}` anywhere in it aborts the process first, and a body
  that holds `"hold"` is answered after `$FAKE_ENGINE_HOLD_S` seconds (a request still running);
- `POST /stream`: two server-sent events, then an abort;
- `GET /metrics`: empty (the front adds its own).

Like the real child (decider.cli), it dies with its front, however the front went: a test that kills
the front leaves no process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import uvicorn

from decider.cli import die_with_parent

STARTED = time.monotonic() + float(os.environ.get("FAKE_ENGINE_START_S", "0"))


async def app(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    path = scope["path"]
    if path == "/ping":
        status = 200 if time.monotonic() >= STARTED else 503
        await _json(send, status, {"status": "ready" if status == 200 else "loading"})
    elif path == "/echo":
        if b'"crash"' in body:
            os.abort()
        if b'"hold"' in body:
            await asyncio.sleep(float(os.environ.get("FAKE_ENGINE_HOLD_S", "1")))
        request_id = dict(scope["headers"]).get(b"x-decider-request-id", b"").decode()
        await _json(send, 200, {"echo": json.loads(body or b"null"), "id": request_id}, request_id)
    elif path == "/metrics":  # the child's own counters: none here
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        await send({"type": "http.response.body", "body": b""})
    elif path == "/stream":
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for i in range(2):
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
            await asyncio.sleep(0.05)
        os.abort()
    else:
        await _json(send, 404, {"error": "no such path"})


async def _json(send, status, body, request_id=""):  # type: ignore[no-untyped-def]
    headers = [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


if __name__ == "__main__":
    die_with_parent()
    if os.environ.get("FAKE_ENGINE_FAIL_START"):
        time.sleep(0.2)
        sys.exit(1)
    uvicorn.run(app, uds=sys.argv[1], log_level="warning", lifespan="off")
