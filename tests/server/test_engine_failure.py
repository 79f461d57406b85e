"""If the engine thread dies, the instance says so and goes (issue 23 §3): `/ping` turns 503, what
waits is answered 503 `engine_failed` at once (retryable: another instance can serve it), and the
process exits non-zero with one line saying why, so SageMaker replaces it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
from server_fakes import FakeEngine
from server_helpers import assert_error_body
from starlette.testclient import TestClient

from decider.server.app import create_app
from decider.settings import Settings
from decider_dev.local_server import free_port

DECISION = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}
CHILD = Path(__file__).with_name("engine_crash_child.py")


class EngineCrash(BaseException):
    """Escapes the engine loop's `except Exception`, as an unforeseen fault would."""


def _crashing_engine() -> FakeEngine:
    engine = FakeEngine()

    def crash(*_: object, **__: object) -> None:
        raise EngineCrash("simulated fault")

    engine.runtime.decode = crash  # type: ignore[method-assign]
    return engine


def test_a_dead_engine_thread_fails_what_waits_turns_ping_503_and_is_fatal() -> None:
    failures: list[str] = []
    settings = Settings(model_path="/nonexistent/model.gguf")
    app = create_app(settings, loader=lambda _: _crashing_engine(), on_fatal=failures.append)
    with TestClient(app) as client:
        deadline = time.monotonic() + 5
        while client.get("/ping").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        started = time.monotonic()
        response = client.post("/v1/systemone", json=DECISION)
        assert time.monotonic() - started < 5, "the request waited for its deadline"
        assert response.status_code == 503, response.text
        assert_error_body(response.json(), "engine_failed", status=503)
        assert response.json()["error"]["retryable"] is True
        ping = client.get("/ping")
        assert ping.status_code == 503 and ping.json()["status"] in ("ready", "failed")
        assert_error_body({k: ping.json()[k] for k in ("error", "detail")}, "engine_failed")
        while not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failures == ["the engine thread died: EngineCrash: simulated fault"]
        assert client.get("/ping").json()["status"] == "failed"
        response = client.post("/v1/systemone", json=DECISION)
        assert response.status_code == 503, response.text


def test_the_process_exits_non_zero_with_one_line() -> None:
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline and child.poll() is None, "the server never became ready"
            try:
                if httpx.get(f"{base}/ping", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        response = httpx.post(f"{base}/v1/systemone", json=DECISION, timeout=30)
        assert response.status_code == 503, response.text
        assert child.wait(timeout=30) == 1
    finally:
        if child.poll() is None:
            child.kill()
    output = child.stdout.read() if child.stdout else ""
    lines = [line for line in output.splitlines() if "engine failed:" in line]
    assert lines == [
        "ERROR decider.server engine failed: the engine thread died: EngineCrash: simulated fault in the "
        "engine loop; exiting"
    ], output
    assert "Traceback" not in output
