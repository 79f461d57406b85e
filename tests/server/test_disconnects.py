"""A client that leaves stops its work (issue 23 §3): on every route and through `/invocations`,
streaming or not, while its request is still queued behind another. The real uvicorn server runs
in this process on a fake engine whose decodes are held by a gate, so what the scheduler still
holds can be read directly."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_fakes import FakeEngine
from server_helpers import serve_in_thread

from decider.server.app import create_app
from decider.settings import Settings

DECISION = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
OPENAI_DECISION = {"input": "s", "questions": [{"type": "predicate", "instructions": "?"}]}
BATCH = {"states": ["a", "b"], "questions": DECISION["questions"]}
CASES = [
    ("/v1/systemone", DECISION, None),
    ("/v1/systemone/batch", BATCH, None),
    ("/v1/decisions", OPENAI_DECISION, None),
    ("/v1/chat/completions", CHAT, None),
    ("/v1/chat/completions", {**CHAT, "stream": True}, None),
    ("/invocations", DECISION, None),
    ("/invocations", {**CHAT, "stream": True}, "route=/v1/chat/completions"),
]


@pytest.fixture(scope="module")
def held_server() -> Iterator[tuple[str, Any, threading.Event]]:
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    app = create_app(Settings(model_path="/nonexistent/model.gguf"), loader=lambda _: engine)
    with serve_in_thread(app) as base:
        try:
            yield base, app.state.runtime, gate
        finally:
            gate.set()


def _live_jobs(runtime: Any, kind: str | None = None) -> list[Any]:
    admitted = list(runtime.scheduler.admission.admitted)
    return [job for job in admitted if not job.cancelled and kind in (None, job.kind)]


def _hang_up_after(seconds: float, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    """Send the request, wait `seconds` for its answer, then close the connection."""
    client = httpx.Client(timeout=httpx.Timeout(30, read=seconds))
    with (
        client,
        contextlib.suppress(httpx.ReadTimeout),
        client.stream("POST", url, json=body, headers=headers) as r,
    ):
        r.read()


@pytest.mark.parametrize(("path", "body", "attributes"), CASES)
def test_a_queued_request_whose_client_leaves_is_cancelled(
    held_server: tuple[str, Any, threading.Event], path: str, body: dict[str, Any], attributes: str | None
) -> None:
    base, runtime, gate = held_server
    gate.clear()
    # a state of its own: an exact repeat of an earlier case's would be answered from the repeat cache
    blocking = {**DECISION, "state": f"blocker for {path} {sorted(body)} {attributes}"}
    blocker = threading.Thread(target=lambda: httpx.post(f"{base}/v1/systemone", json=blocking, timeout=30))
    blocker.start()  # its decode waits at the gate: whatever comes next is queued behind it
    deadline = time.monotonic() + 5
    while not _live_jobs(runtime):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (ahead,) = _live_jobs(runtime)
    headers = {"X-Amzn-SageMaker-Custom-Attributes": attributes} if attributes else {}
    _hang_up_after(0.5, f"{base}{path}", body, headers)
    # the client has hung up before any byte of its answer: its job goes, the one ahead stays
    deadline = time.monotonic() + 3
    while [job for job in _live_jobs(runtime) if job is not ahead]:
        assert time.monotonic() < deadline, f"{path}: the abandoned request is still admitted"
        time.sleep(0.02)
    assert _live_jobs(runtime) == [ahead]
    gate.set()
    blocker.join(10)
