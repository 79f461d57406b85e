"""The soak's accounting (tools/dev/soak/accounting.py) on plain `requests` responses: a streamed answer
refused before its first token is counted by its typed code (it used to be read as a stream first,
and counted as `no_error_body`), an error event inside a 200 stream by its code, and a non-200 key
without a code is reported."""

from __future__ import annotations

import io
import json
from typing import Any

import requests

from decider_dev.soak.accounting import count_key, failure, missing_codes, read_stream


def _streamed(status: int, body: bytes) -> requests.Response:
    """A response as `requests` hands out with `stream=True`: its body not read yet."""
    response = requests.Response()
    response.status_code = status
    response.raw = io.BytesIO(body)
    response.headers["Content-Type"] = "application/json" if status != 200 else "text/event-stream"
    return response


def _error(code: str, *, retryable: bool) -> dict[str, Any]:
    return {
        "error": {"type": "api_error", "code": code, "message": "m", "param": None, "retryable": retryable}
    }


def _sse(*events: Any) -> bytes:
    return b"".join(f"data: {json.dumps(e) if e != '[DONE]' else e}\n\n".encode() for e in events)


def test_a_stream_refused_before_its_first_token_is_counted_by_its_code() -> None:
    response = _streamed(503, json.dumps(_error("deadline_unreachable", retryable=True)).encode())
    read = read_stream(response, max_chunks=6)
    assert read.error == "deadline_unreachable" and read.failure is None
    assert count_key("stream (cancelled)", response, None) == "stream (cancelled) 503 deadline_unreachable"
    refused = _streamed(503, json.dumps(_error("engine_failed", retryable=False)).encode())
    assert read_stream(refused, max_chunks=6).failure == "a 503 that is not retryable"
    assert read_stream(_streamed(500, b"oops"), max_chunks=6).failure == "untyped 5xx: 500"


def test_an_error_event_inside_a_stream_is_counted_by_its_code() -> None:
    chunk = {"choices": [{"delta": {"content": "Once"}}]}
    response = _streamed(200, _sse(chunk, chunk, _error("deadline_exceeded", retryable=False), "[DONE]"))
    read = read_stream(response, max_chunks=6)
    assert read.chunks == 3 and read.error == "deadline_exceeded"
    assert read.failure == "a stream ended by deadline_exceeded"
    assert count_key("stream (cancelled)", response, None) == "stream (cancelled) 200 deadline_exceeded"
    clean = _streamed(200, _sse(*[chunk] * 10, "[DONE]"))
    read = read_stream(clean, max_chunks=6)
    assert read.chunks == 6 and read.error is None and read.failure is None  # left after 6 chunks
    assert count_key("stream (cancelled)", clean, None) == "stream (cancelled) 200"


def test_every_non_200_key_names_a_code() -> None:
    plain = _streamed(429, json.dumps(_error("queue_full", retryable=True)).encode())
    assert count_key("decision", plain, None) == "decision 429 queue_full"
    assert count_key("decision", _streamed(502, b"<html>"), None) == "decision 502 no_error_body"
    counts = {"decision 200": 3, "decision 429 queue_full": 1, "stream (cancelled) 503": 2}
    assert missing_codes(counts) == ["stream (cancelled) 503"]
    assert failure(504, _error("deadline_exceeded", retryable=True)) is None
