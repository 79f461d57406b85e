"""The engine under real traffic, on the live server: the batch route, answers that do not depend on
what runs beside them, and cancellation that stops the model's work (deadline, client gone).

Mechanics only: equal distributions between routes and under concurrency, timings of stops.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psutil
import pytest
from server_helpers import DECISION, LOCAL_ONLY, assert_error_body

from decider_dev.local_server import WITHOUT_LOAD_PROBE, LocalServer, run_local_server

pytestmark = [pytest.mark.server, pytest.mark.model]
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
IDLE_CPU_SECONDS = 0.25  # of one second: an idle server uses a few hundredths
STATES = [
    DECISION["state"],
    "My parcel arrived broken and support has not answered in a week.",
    {"ticket": 4711, "text": "The invoice shows the wrong VAT number.", "tier": "gold"},
]


def _answers(body: dict[str, Any]) -> dict[str, Any]:
    return {key: answer.get("probabilities", answer.get("noul")) for key, answer in body["answers"].items()}


def test_the_batch_route_answers_each_state_as_its_own_request(invariant_server: LocalServer) -> None:
    url = invariant_server.base_url
    questions = DECISION["questions"]
    singles = [
        httpx.post(f"{url}/v1/systemone", json={"state": s, "questions": questions}, timeout=120).json()
        for s in STATES
    ]
    batch = httpx.post(
        f"{url}/v1/systemone/batch", json={"states": STATES, "questions": questions}, timeout=120
    )
    assert batch.status_code == 200, batch.text
    body = batch.json()
    assert set(body) == {"results", "usage"} and len(body["results"]) == len(STATES)
    for single, result in zip(singles, body["results"], strict=True):
        assert _answers(result) == _answers(single)  # bitwise: the same answers, in order
        assert result["usage"] == single["usage"]
    assert body["usage"]["input_tokens"] == sum(single["usage"]["input_tokens"] for single in singles)
    assert body["usage"]["output_tokens"] == 0
    by_shape = httpx.post(
        f"{url}/invocations", json={"states": STATES[:1], "questions": questions}, timeout=120
    )
    named = httpx.post(
        f"{url}/invocations",
        json={"states": STATES[:1], "questions": questions},
        headers={CUSTOM_ATTRIBUTES: "route=/v1/systemone/batch"},
        timeout=120,
    )
    for response in (by_shape, named):
        assert response.status_code == 200, response.text
        assert "route=/v1/systemone/batch" in response.headers[CUSTOM_ATTRIBUTES]
        assert _answers(response.json()["results"][0]) == _answers(singles[0])


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"states": [], "questions": DECISION["questions"]}, "invalid_states", "states"),
        ({"states": "one", "questions": DECISION["questions"]}, "invalid_states", "states"),
        ({"states": ["ok", ""], "questions": DECISION["questions"]}, "invalid_state", "states.1"),
        ({"states": ["ok", {"x": 1}, 7], "questions": DECISION["questions"]}, "invalid_state", "states.2"),
        ({"states": ["ok"] * 65, "questions": DECISION["questions"]}, "too_many_states", "states"),
        (
            {"states": ["ok", "word " * 7000], "questions": DECISION["questions"]},
            "context_length_exceeded",
            "states.1",
        ),
        (
            {"states": ["ok"], "questions": {"q": {"type": "box"}}},
            "invalid_question_type",
            "questions.q.type",
        ),
    ],
)
def test_the_whole_batch_is_validated_before_the_model_runs(
    live_server: LocalServer, body: dict[str, Any], code: str, param: str
) -> None:
    response = httpx.post(f"{live_server.base_url}/v1/systemone/batch", json=body, timeout=60)
    assert response.status_code == 422, response.text
    assert_error_body(response.json(), code, status=422)
    assert response.json()["error"]["param"] == param


def test_answers_under_concurrent_load_equal_the_serial_answers(invariant_server: LocalServer) -> None:
    """With DECIDER_BATCH_INVARIANT=true: the same bits alone and beside other requests and a chat."""
    url = invariant_server.base_url
    bodies = [{"state": state, "questions": DECISION["questions"]} for state in STATES]
    serial = [_answers(httpx.post(f"{url}/v1/systemone", json=b, timeout=120).json()) for b in bodies]
    barrier = threading.Barrier(len(bodies) + 1)

    def call(body: dict[str, Any]) -> dict[str, Any]:
        barrier.wait()
        return httpx.post(f"{url}/v1/systemone", json=body, timeout=300).json()

    def chat() -> int:
        barrier.wait()
        message = {"role": "user", "content": "Tell me about the sea."}
        return httpx.post(
            f"{url}/v1/chat/completions", json={"messages": [message], "max_tokens": 24}, timeout=300
        ).status_code

    with ThreadPoolExecutor(max_workers=len(bodies) + 1) as pool:
        chatting = pool.submit(chat)
        together = list(pool.map(call, bodies))
        assert chatting.result() == 200
    assert [_answers(body) for body in together] == serial


def _slow_decision() -> dict[str, Any]:
    """About 5,000 tokens of state and eight option orders: many seconds of work on one thread."""
    state = " ".join(
        f"Line {i}: the customer wrote again about order {i} and the refund." for i in range(250)
    )
    return {"state": state, "questions": DECISION["questions"], "permutations": 8}


def _quick_call(url: str) -> None:
    response = httpx.post(
        f"{url}/v1/systemone",
        json={"state": "Short.", "questions": {"q": {"type": "noul", "instructions": "Is it short?"}}},
        timeout=60,
    )
    assert response.status_code == 200, response.text


def _cpu_seconds(server: LocalServer) -> float:
    """CPU time the server's processes have used so far (user and system, children included)."""
    root = psutil.Process(server.process.pid)
    return sum(sum(process.cpu_times()[:2]) for process in [root, *root.children(recursive=True)])


def _assert_the_model_stopped(server: LocalServer) -> None:
    """A second after the stop, the server idles: a model still at work would burn about a core
    (one thread) through the next second. CPU time, unlike a timed request, does not grow when other
    processes crowd the machine, so a busy test run cannot make this fail."""
    time.sleep(1.0)
    before = _cpu_seconds(server)
    time.sleep(1.0)
    used = _cpu_seconds(server) - before
    assert used < IDLE_CPU_SECONDS, f"{used:.2f} s of CPU in the second after the stop: the work still runs"
    _quick_call(server.base_url)  # and the next request is answered


@LOCAL_ONLY
def test_a_deadline_stops_the_model_within_about_a_second() -> None:
    # A fresh server has no decode rate yet, so nothing is refused up front: the work starts.
    with run_local_server(
        {"DECIDER_N_THREADS": "1", "DECIDER_DEADLINE_SECONDS": "2", **WITHOUT_LOAD_PROBE}
    ) as server:
        started = time.perf_counter()
        response = httpx.post(f"{server.base_url}/v1/systemone", json=_slow_decision(), timeout=60)
        elapsed = time.perf_counter() - started
        assert response.status_code == 504, response.text
        assert_error_body(response.json(), "deadline_exceeded")
        assert elapsed < 2 + 1.0
        _assert_the_model_stopped(server)


@LOCAL_ONLY
def test_a_client_that_leaves_stops_the_model_within_about_a_second() -> None:
    with run_local_server(
        {"DECIDER_N_THREADS": "1", **WITHOUT_LOAD_PROBE}
    ) as server:  # a 55 s deadline: the work is admitted
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{server.base_url}/v1/systemone", json=_slow_decision(), timeout=0.7)  # it hangs up
        _assert_the_model_stopped(server)


def test_a_large_body_does_not_hold_up_ping(live_server: LocalServer) -> None:
    """The body is refused (it is past the context), so the shared server is left as it was."""
    # 250k small objects: about 0.75 s of parsing and validation on a quiet machine (flat strings of
    # the same size take 0.15 s, within the noise of a ping on a busy one). Work that held the event
    # loop would hold the ping pending when it starts for most of the request's time; work off the
    # loop holds none. A busy machine stretches both alike, so each ping is bounded by its request.
    rows = [{"a": 1, "b": "x"} for _ in range(250_000)]
    text = json.dumps({"state": {"rows": rows}, "questions": DECISION["questions"]})
    assert len(text) > 5_000_000
    pings: list[tuple[float, float]] = []  # (start, seconds)
    done = threading.Event()

    def ping() -> None:
        while not done.is_set():
            started = time.perf_counter()
            assert live_server.ping(timeout=30) == 200
            pings.append((started, time.perf_counter() - started))

    pinger = threading.Thread(target=ping)
    pinger.start()
    windows: list[tuple[float, float]] = []
    try:
        for _ in range(2):  # pings must overlap a request (each takes most of a second)
            started = time.perf_counter()
            response = httpx.post(
                f"{live_server.base_url}/v1/systemone",
                content=text,
                headers={"Content-Type": "application/json"},
                timeout=60,
            )
            windows.append((started, time.perf_counter()))
            assert response.status_code == 422
            assert response.json()["error"]["code"] == "context_length_exceeded"
            assert response.json()["error"]["param"] == "state"
    finally:
        done.set()
        pinger.join()
    # (ping seconds, its request's seconds) for every ping sent while a request was in flight
    during = [(seconds, b - a) for start, seconds in pings for a, b in windows if a <= start <= b]
    assert during and all(seconds < 0.5 * request for seconds, request in during), (
        len(during),
        max(during),
    )
