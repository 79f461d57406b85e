"""A server that outlives its engine (issue 31 §2, decider.server.supervisor): the front keeps the
port, the engine runs in a child it restarts.

First the crash ledger on its own, then the real front over a stand-in child that aborts on demand
(tests/server/fake_engine_child.py: restarts, poisoned requests, a stream cut, the crash budget, a
child that cannot start), then the real `serve` on the bundled model: the engine killed with
SIGKILL and with SIGABRT during traffic, answered 503 retryable, back within 10 s, answering the
same as before.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from conftest import LIVE_ENV
from server_helpers import DECISION, LONG_ANSWER, assert_error_body

from decider.errors import EXIT_ENGINE_CRASHING, OverloadedError
from decider.server.supervisor import CRASH_BUDGET, CrashLedger, HeldBodies, Running, fingerprint
from decider_dev.local_server import LocalServer, engine_restarts, free_port, run_local_server

FRONT = Path(__file__).with_name("fake_engine_front.py")
RECOVERY_S = 10.0  # issue 31: the engine serving again within 10 s of its death, on the bundled model


# --- the ledger --------------------------------------------------------------------------------------
def test_a_request_running_at_two_crashes_in_a_row_is_refused() -> None:
    ledger = CrashLedger()
    bad, good = Running("POST", "/v1/chat/completions", b'{"a": 1, "b": [2]}'), Running("POST", "/ping", b"")
    assert ledger.crashed([bad, good]) == []
    assert ledger.crashed([bad]) == [fingerprint(bad.path, bad.body)]
    assert ledger.is_refused(bad.path, b'{"b":[2],"a":1}')  # the same JSON, reordered and respaced
    assert not ledger.is_refused(good.path, good.body) and not ledger.is_refused("/v1/decisions", bad.body)


def test_only_crashes_in_a_row_count() -> None:
    ledger = CrashLedger()
    one, other = Running("POST", "/x", b"1"), Running("POST", "/x", b"2")
    ledger.crashed([one])
    ledger.crashed([other])  # `one` was not running: it starts again from zero
    assert ledger.crashed([one]) == [] and not ledger.is_refused("/x", b"1")
    ledger.answered("/x", b"1")  # answered since: not a suspect any more
    assert ledger.crashed([one]) == []


def test_the_bodies_the_front_holds_are_bounded_in_bytes() -> None:
    bodies = HeldBodies(10)
    bodies.take(6)
    with pytest.raises(OverloadedError) as refused:
        bodies.take(5)
    assert refused.value.code == "queue_full" and refused.value.retryable and bodies.held == 6
    bodies.take(4)  # up to the bound exactly
    bodies.give_back(6)
    bodies.take(5)
    assert bodies.held == 9


def test_the_front_never_loads_the_engine() -> None:
    """llama.cpp stays out of the front: a native fault there would end the port too."""
    code = (
        "import sys, decider.cli, decider.server.supervisor; "
        "print(sorted(m for m in sys.modules if m.startswith(('llama_cpp', 'decider.engine'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


# --- the front over a stand-in child -----------------------------------------------------------------
class Front:
    def __init__(self, **env: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, str(FRONT), str(self.port)],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(f"{self.base}/ping", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"the front never became ready: {self.output()}")

    def echo(self, body: Any) -> httpx.Response:
        return httpx.post(f"{self.base}/echo", json=body, timeout=30)

    def output(self) -> str:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)
        return self.process.stdout.read() if self.process.stdout else ""


@pytest.fixture
def front() -> Iterator[Front]:
    running = Front()
    running.wait_ready()
    yield running
    if running.process.poll() is None:
        running.process.kill()
        running.process.wait()


def test_a_crash_answers_what_ran_503_and_the_next_request_is_served(front: Front) -> None:
    ok = front.echo({"n": 1})
    assert ok.status_code == 200 and ok.json()["id"] == ok.headers["x-request-id"]  # one id, both logs
    crashed = front.echo({"crash": 1})
    assert crashed.status_code == 503 and crashed.headers["x-should-retry"] == "true"
    assert_error_body(crashed.json(), "engine_restarted", status=503)
    assert crashed.json()["error"]["retryable"] is True
    after = front.echo({"n": 2})  # waits for the new child, within its deadline
    assert after.status_code == 200 and after.json()["echo"] == {"n": 2}
    metrics = httpx.get(f"{front.base}/metrics").text
    assert "decider_engine_restarts_total 1.0" in metrics
    assert engine_restarts(front.base) == 1  # what the soak and the schema corpus read
    log = front.output()
    request_id = crashed.headers["x-request-id"]
    assert f"engine process died (signal SIGABRT) while running 1 request(s): {request_id} POST /echo" in log
    assert front.process.returncode == 0  # drained and stopped on SIGTERM


def test_a_request_that_crashes_the_engine_twice_in_a_row_is_refused(front: Front) -> None:
    for _ in range(2):
        assert front.echo({"crash": "x", "n": 1}).status_code == 503
    refused = front.echo({"n": 1, "crash": "x"})  # the same request, its keys reordered
    assert refused.status_code == 422
    assert_error_body(refused.json(), "request_crashes_engine")
    assert refused.json()["error"]["retryable"] is False and refused.headers["x-should-retry"] == "false"
    assert front.echo({"n": 1}).status_code == 200
    assert "decider_requests_refused_as_crashing_total 1.0" in httpx.get(f"{front.base}/metrics").text


def test_a_stream_cut_by_a_crash_ends_with_an_error_event(front: Front) -> None:
    with httpx.stream("POST", f"{front.base}/stream", content=b"{}", timeout=30) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[:2] == ["data: 0", "data: 1"] and len(events) == 3, events
    error = json.loads(events[2].removeprefix("data: "))
    assert_error_body(error, "engine_restarted", status=503)
    assert front.echo({"n": 3}).status_code == 200


def test_an_engine_that_keeps_dying_ends_the_front(front: Front) -> None:
    """More than CRASH_BUDGET crashes in the window: the front stops, so SageMaker replaces it."""
    for n in range(CRASH_BUDGET + 1):
        assert front.echo({"crash": n}).status_code == 503  # each a new request: none is refused
    assert front.process.wait(timeout=30) == EXIT_ENGINE_CRASHING
    assert "giving up, so the instance is replaced" in front.output()


def test_a_body_past_the_front_s_bound_is_refused_while_read_and_the_bound_comes_back() -> None:
    """The front holds each body until its answer: with room for one body at the cap (6 MiB), a
    second large one beside a running first is refused 429 while it is read, a small one still
    passes, and once the first is answered the large one is served. Before the bound, the front
    read every body whole, however many came."""
    settings = {"parse_concurrency": 1, "queue_size": 0}
    front = Front(FAKE_FRONT_SETTINGS=json.dumps(settings), FAKE_ENGINE_HOLD_S="2")
    try:
        front.wait_ready()
        large = {"pad": "x" * 3_500_000}
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(front.echo, {**large, "hold": True})
            time.sleep(0.7)  # its body is read and held: the child holds the request for 2 s
            refused = front.echo(large)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text[:200]
            assert_error_body(refused.json(), "queue_full", status=429)
            assert refused.json()["error"]["retryable"] is True
            assert front.echo({"n": 1}).status_code == 200  # small bodies pass beside
            assert first.result().status_code == 200
        assert front.echo(large).status_code == 200  # what the first and the refused one held came back
    finally:
        front.output()


def test_an_engine_that_cannot_start_ends_the_front_with_its_status() -> None:
    failing = Front(FAKE_ENGINE_FAIL_START="1")
    assert failing.process.wait(timeout=30) == 1
    assert "engine process died" not in failing.output()  # the child's own line says why


def test_ping_says_loading_until_the_first_engine_serves() -> None:
    slow = Front(FAKE_ENGINE_START_S="1.5")
    try:
        deadline = time.monotonic() + 10
        statuses = set()
        while time.monotonic() < deadline:
            try:
                ping = httpx.get(f"{slow.base}/ping", timeout=1)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            statuses.add(ping.status_code)
            if ping.status_code == 200:
                break
            time.sleep(0.05)
        assert statuses == {503, 200}
    finally:
        slow.output()


# --- the real server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def own_server() -> Iterator[LocalServer]:
    """Its own server: the shared one's kept states and timings stay as other tests left them."""
    with run_local_server(LIVE_ENV) as server:
        yield server


def _engine_child(server: LocalServer) -> psutil.Process:
    [child] = [c for c in psutil.Process(server.process.pid).children() if "engine" in c.cmdline()]
    return child


def _serving_again(server: LocalServer) -> float:
    """When `/ping` is a child's own answer again (the old child is dead): the front's is
    `restarting` until a new child serves."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ping = httpx.get(f"{server.base_url}/ping", timeout=10)
        if ping.status_code == 200 and ping.json()["status"] == "ready":
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError("the engine did not serve again within 60 s")


def _probabilities(response: httpx.Response) -> list[float]:
    answers = response.json()["answers"]
    return [answers["refund"]["noul"], *answers["team"]["probabilities"].values(), answers["anger"]["score"]]


@pytest.mark.server
@pytest.mark.model
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGABRT])
def test_a_killed_engine_is_back_within_ten_seconds_answering_the_same(
    own_server: LocalServer, sig: signal.Signals
) -> None:
    """`back` is the issue's bound, seen from outside: kill to `/ping` being a new child's answer.
    The next decision's own time is not in it. It runs at the engine's nice +5 (ENGINE_NICENESS,
    by design below the HTTP loop), so beside the other test worker's nice-0 work it gets about a
    third of a core: 1.3 s alone became 5.0 s beside two nice-0 busy loops (measured)."""
    url = f"{own_server.base_url}/v1/systemone"
    before = httpx.post(url, json=DECISION, timeout=60)
    assert before.status_code == 200
    chat: dict[str, httpx.Response] = {}

    def long_chat() -> None:
        body = {  # still generating at the kill: it cannot end early
            "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 600,
            "response_format": LONG_ANSWER,
        }
        chat["r"] = httpx.post(f"{own_server.base_url}/v1/chat/completions", json=body, timeout=60)

    running = threading.Thread(target=long_chat)
    running.start()
    time.sleep(0.5)
    child = _engine_child(own_server)
    killed = time.monotonic()
    os.kill(child.pid, sig)
    child.wait(timeout=10)  # a request the dying child still accepted would be one it was running
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, url, json=DECISION, timeout=60)  # at once: waits for the new engine
        back = _serving_again(own_server) - killed
        again = sent.result()
    answered = time.monotonic() - killed
    running.join()
    assert chat["r"].status_code == 503, chat["r"].text
    assert_error_body(chat["r"].json(), "engine_restarted", status=503)
    assert back < RECOVERY_S, (back, answered)
    assert again.status_code == 200, again.text
    # a fresh prefill against (maybe) a kept state's copy: within the cache's agreement (AGREE in
    # tests/engine/test_state_cache.py, measured there)
    assert _probabilities(again) == pytest.approx(_probabilities(before), abs=0.1)
    assert _engine_child(own_server).pid != child.pid
    logs = own_server.logs()
    request_id = chat["r"].headers["x-request-id"]
    assert f"engine process died (signal {sig.name}) while running 1 request(s): {request_id}" in logs
    if sig == signal.SIGABRT:  # the child's faulthandler: every thread's Python stack
        assert "Fatal Python error: Aborted" in logs
