"""How the soak counts what it gets back (issue 23 §4): every answer by route, status and typed code.

Kept apart from the locustfile (which runs under gevent in locust's own process) so that tests can
check it on plain `requests` responses. A streamed answer is read by `read_stream`: a refusal before
the first token is an ordinary JSON error (503 `deadline_unreachable`, 429 `queue_full`, …) whose
body must be read before anything else consumes the stream, and an error after the first chunk is
an SSE event with the same error body, under status 200. Both are counted by their code.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

NO_ERROR_BODY = "no_error_body"  # a non-200 whose body is not the error body: itself a finding


def error_code(body: Any) -> str | None:
    """The typed code of an error body (`{"error": {"code": …}}`), else None."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
        return code if isinstance(code, str) and code else None
    return None


def response_code(response: Any) -> str | None:
    """The code to count a response under: the one a stream carried (`soak_code`), else its error
    body's code for a status of 400 or more (`no_error_body` when it has none)."""
    carried = getattr(response, "soak_code", None)
    if carried:
        return str(carried)
    status = getattr(response, "status_code", None)
    if status is None or status < 400:
        return None
    try:
        return error_code(response.json()) or NO_ERROR_BODY
    except Exception:
        return NO_ERROR_BODY


def count_key(name: str, response: Any, exception: Any) -> str:
    """`<route> <status> <code>`; a request with no status is counted by its exception's type."""
    status = getattr(response, "status_code", None) if response is not None else None
    shown = status if exception is None or status else type(exception).__name__
    return f"{name} {shown} {response_code(response) or ''}".strip()


def failure(status: int, body: Any) -> str | None:
    """Why an answer breaks the soak's target, or None: a 5xx other than a 503/504 whose error is
    retryable."""
    if status < 500:
        return None
    if status not in (503, 504):
        return f"untyped 5xx: {status}"
    retryable = (
        isinstance(body, dict) and isinstance(body.get("error"), dict) and body["error"].get("retryable")
    )
    return None if retryable else f"a {status} that is not retryable"


@dataclass
class StreamRead:
    chunks: int = 0
    largest_gap_seconds: float = 0.0
    error: str | None = None  # the typed code of an error the stream carried (status 200 or not)
    failure: str | None = None  # why it breaks the target (see `failure`)


def read_stream(response: Any, max_chunks: int) -> StreamRead:
    """Read a streamed chat answer as a client that leaves after `max_chunks` chunks does.

    A non-200 is read whole first (so its code is seen, and counted); a 200's SSE events are read
    one by one, the gap between them kept, and an error event's code taken. The code is left on the
    response as `soak_code` for the request counter."""
    read = StreamRead()
    if response.status_code != 200:
        try:
            body = json.loads(response.content)
        except ValueError:
            body = None
        read.error = error_code(body) or NO_ERROR_BODY
        read.failure = failure(response.status_code, body)
        response.soak_code = read.error
        return read
    last = time.perf_counter()
    for line in response.iter_lines():
        if not line:
            continue
        now = time.perf_counter()
        if read.chunks:
            read.largest_gap_seconds = max(read.largest_gap_seconds, now - last)
        last, read.chunks = now, read.chunks + 1
        data = line[len(b"data: ") :] if line.startswith(b"data: ") else line
        if data != b"[DONE]":
            try:
                event = json.loads(data)
            except ValueError:
                event = None
            code = error_code(event)
            if code is not None:  # an error after the first chunk: the same body, in an event
                read.error = code
                response.soak_code = code
                if not event["error"].get("retryable", False):  # a server-side error, not retryable
                    read.failure = f"a stream ended by {code}"
                break
        if read.chunks >= max_chunks:  # the client leaves mid-stream
            break
    return read


def missing_codes(counts: dict[str, int]) -> list[str]:
    """Count keys of a non-200 answer that name no code: the report must show one for every such."""
    missing = []
    for key in counts:
        last = key.rsplit(" ", 1)[-1]
        if last.isdigit() and last != "200":
            missing.append(key)
    return missing
