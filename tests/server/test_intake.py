"""Bounded work before admission (issue 23 §2): a full queue is a 429 before the body is read, the
bodies in intake are bounded, and parsing runs below the engine's CPU priority, which runs below
the HTTP loop's. The real uvicorn server runs in this process on a fake engine held by a gate."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_fakes import FakeEngine
from server_helpers import assert_error_body, serve_in_thread

from decider.engine.scheduling.scheduler import ENGINE_NICENESS
from decider.server.app import create_app
from decider.server.intake import PARSE_NICENESS
from decider.settings import Settings

DECISION = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}


@contextlib.contextmanager
def _server(**settings: Any) -> Iterator[tuple[str, Any, threading.Event]]:
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    app = create_app(Settings(model_path="/nonexistent/model.gguf", **settings), loader=lambda _: engine)
    with serve_in_thread(app) as base:
        try:
            yield base, app.state.runtime, gate
        finally:
            gate.set()


def _open_body(base: str, path: str = "/v1/systemone", declared: int = 4_000_000) -> socket.socket:
    """A request whose headers are sent and whose body is not (a slow or hostile client)."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n{{".encode()
    )
    return sock


def _status_within(sock: socket.socket, seconds: float) -> tuple[int | None, str]:
    sock.settimeout(seconds)
    head = ""
    with contextlib.suppress(TimeoutError):
        while chunk := sock.recv(65536).decode(errors="replace"):
            head += chunk
            if '"detail"' in head:
                break
            sock.settimeout(0.5)
    status = int(head.split()[1]) if head.startswith("HTTP/1.1") else None
    return status, head


def _wait_until(predicate: Any, seconds: float = 5) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _background_post(base: str, body: Any = DECISION) -> threading.Thread:
    thread = threading.Thread(target=lambda: httpx.post(f"{base}/v1/systemone", json=body, timeout=30))
    thread.start()
    return thread


def test_a_full_queue_is_429_before_the_body_is_read() -> None:
    with _server(queue_size=1) as (base, runtime, gate):
        running, queued = _background_post(base), None
        _wait_until(lambda: len(runtime.scheduler.admission.admitted) == 1)
        queued = _background_post(base)
        _wait_until(lambda: len(runtime.scheduler.admission.admitted) == 2)
        sock = _open_body(base)  # 4 MB declared, one byte sent
        try:
            status, head = _status_within(sock, 2.0)
        finally:
            sock.close()
        assert status == 429, head or "no answer: the server waited for the body"
        assert "retry-after:" in head.lower() and "queue_full" in head
        gate.set()
        running.join(10)
        queued.join(10)


def test_bodies_in_intake_are_bounded() -> None:
    with _server(parse_concurrency=1, queue_size=1) as (base, _runtime, gate):
        gate.set()
        first = _open_body(base)  # holds the one intake place while its body trickles in
        second = _open_body(base)  # waits for that place, its body unread
        try:
            time.sleep(0.3)
            response = httpx.post(f"{base}/v1/systemone", json=DECISION, timeout=5)
            assert response.status_code == 429, response.text
            assert_error_body(response.json(), "queue_full", status=429)
            assert response.headers["retry-after"] == "1"
        finally:
            first.close()
            second.close()
        _wait_until(lambda: httpx.post(f"{base}/v1/systemone", json=DECISION, timeout=5).status_code == 200)


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="thread priorities are a POSIX feature")
def test_parsing_runs_below_the_engine_which_runs_below_the_http_loop() -> None:
    with _server() as (base, _runtime, gate):
        gate.set()
        assert httpx.post(f"{base}/v1/systemone", json=DECISION, timeout=10).status_code == 200
        base_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        threads = {thread.name: thread.native_id for thread in threading.enumerate()}
        intake = [tid for name, tid in threads.items() if name.startswith("intake")]
        assert intake and "engine" in threads

        def nice(tid: int | None) -> int:
            assert tid is not None
            return os.getpriority(os.PRIO_PROCESS, tid)

        assert nice(threads["engine"]) == min(19, base_nice + ENGINE_NICENESS)
        assert all(nice(tid) == min(19, base_nice + PARSE_NICENESS) for tid in intake)
        assert base_nice < nice(threads["engine"]) < nice(intake[0]) or base_nice + ENGINE_NICENESS >= 19


def test_a_client_that_leaves_while_its_body_is_read_is_no_server_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with _server() as (base, runtime, gate):
        gate.set()
        sock = _open_body(base, declared=1000)
        time.sleep(0.2)
        sock.close()  # gone with 999 bytes of its body unsent
        _wait_until(lambda: runtime.metrics.requests.labels("/v1/systemone", "499")._value.get() == 1)
        assert httpx.post(f"{base}/v1/systemone", json=DECISION, timeout=10).status_code == 200
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


class _PlanWatch(FakeEngine):
    """Records, for every plan, the thread it ran on and how many plans ran at once."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []
        self.most_at_once = 0
        self._at_once = 0
        self._lock = threading.Lock()

    def plan_decision(self, request: Any) -> Any:
        with self._lock:
            self._at_once += 1
            self.most_at_once = max(self.most_at_once, self._at_once)
            self.threads.append(threading.current_thread().name)
        try:
            time.sleep(0.03)  # long enough for overlapping plans to overlap
            return super().plan_decision(request)
        finally:
            with self._lock:
                self._at_once -= 1


def test_batch_transform_records_are_parsed_and_planned_in_intake() -> None:
    """JSON Lines records take intake places like any body: with DECIDER_PARSE_CONCURRENCY=1 no two
    plans overlap, a real-time request's included, and every one runs on a low-priority intake thread."""
    engine = _PlanWatch()
    app = create_app(
        Settings(model_path="/nonexistent/model.gguf", parse_concurrency=1), loader=lambda _: engine
    )
    records = "\n".join(json.dumps({**DECISION, "state": f"ticket {i}"}) for i in range(6))
    with serve_in_thread(app) as base:
        single = _background_post(base)
        response = httpx.post(
            f"{base}/invocations",
            content=records,
            headers={"Content-Type": "application/jsonlines"},
            timeout=30,
        )
        single.join(10)
    assert response.status_code == 200, response.text
    assert all("answers" in json.loads(line) for line in response.text.splitlines())
    assert len(engine.threads) == 7
    assert all(name.startswith("intake") for name in engine.threads), engine.threads
    assert engine.most_at_once == 1
