"""Admission control in isolation: bounded queue, deadlines, one engine thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from decider.errors import DeadlineExceededError, OverloadedError, UnavailableError
from decider.server.admission import Job, Scheduler
from decider.server.metrics import ServerMetrics


def _scheduler(queue_size: int = 1, deadline: float = 5.0) -> Scheduler:
    return Scheduler(queue_size=queue_size, deadline_seconds=deadline, metrics=ServerMetrics())


def _hold(gate: threading.Event):
    def work(job: Job) -> str:
        gate.wait(5)
        return job.request_id

    return work


def test_queue_full_is_refused_at_once_with_retry_after() -> None:
    async def scenario() -> None:
        scheduler = _scheduler(queue_size=1)
        gate = threading.Event()
        running = scheduler.start(scheduler.admit("decision", "a"), _hold(gate))
        queued = scheduler.start(scheduler.admit("decision", "b"), _hold(gate))
        started = time.monotonic()
        with pytest.raises(OverloadedError) as refused:
            scheduler.admit("decision", "c")
        assert time.monotonic() - started < 0.1
        assert refused.value.status == 429
        assert refused.value.code == "queue_full"
        assert int(refused.value.headers["Retry-After"]) >= 1
        gate.set()
        assert await running == "a"
        assert await queued == "b"
        await asyncio.sleep(0.05)  # the done callbacks free the places
        assert scheduler.waiting == 0
        scheduler.admit("decision", "d")  # room again
        scheduler.close()

    asyncio.run(scenario())


def test_queue_size_zero_allows_only_the_running_request() -> None:
    async def scenario() -> None:
        scheduler = _scheduler(queue_size=0)
        gate = threading.Event()
        running = scheduler.start(scheduler.admit("chat", "a"), _hold(gate))
        with pytest.raises(OverloadedError):
            scheduler.admit("chat", "b")
        gate.set()
        await running
        scheduler.close()

    asyncio.run(scenario())


def test_running_work_past_its_deadline_is_told_to_stop_and_answers_504() -> None:
    seen_stop = threading.Event()

    def slow(job: Job) -> str:
        while not job.should_stop():
            time.sleep(0.01)
        seen_stop.set()
        return "late"

    async def scenario() -> None:
        scheduler = _scheduler(deadline=0.3)
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError) as late:
            await scheduler.run(scheduler.admit("chat", "a"), slow)
        assert late.value.status == 504
        assert late.value.code == "deadline_exceeded"
        assert time.monotonic() - started < 1.0
        assert seen_stop.wait(1.0)
        scheduler.close()

    asyncio.run(scenario())


def test_queued_work_past_its_deadline_never_runs() -> None:
    ran: list[str] = []

    async def scenario() -> None:
        scheduler = _scheduler(queue_size=4, deadline=0.3)
        gate = threading.Event()
        first = scheduler.start(scheduler.admit("decision", "a"), _hold(gate))
        queued = scheduler.admit("decision", "b")
        with pytest.raises(DeadlineExceededError) as late:
            await scheduler.run(queued, lambda job: ran.append(job.request_id))
        assert "waiting for the model" in late.value.message
        gate.set()
        await first
        await asyncio.sleep(0.1)
        scheduler.close()

    asyncio.run(scenario())
    assert ran == []


def test_every_job_runs_on_the_one_engine_thread() -> None:
    async def scenario() -> set[str]:
        scheduler = _scheduler(queue_size=8)
        jobs = [scheduler.admit("decision", str(i)) for i in range(6)]
        names = await asyncio.gather(
            *(scheduler.run(job, lambda job: threading.current_thread().name) for job in jobs)
        )
        scheduler.close()
        return set(names)

    names = asyncio.run(scenario())
    assert len(names) == 1
    assert next(iter(names)).startswith("engine")


def test_request_predicted_to_miss_the_deadline_is_refused_with_503() -> None:
    async def scenario() -> None:
        scheduler = _scheduler(queue_size=8, deadline=1.0)
        await scheduler.run(scheduler.admit("decision", "warm"), lambda job: time.sleep(0.6))
        gate = threading.Event()
        ahead = scheduler.start(scheduler.admit("decision", "a"), _hold(gate))
        with pytest.raises(UnavailableError) as refused:
            scheduler.admit("decision", "b")  # ~0.6 s ahead + ~0.6 s own > 1 s
        assert refused.value.status == 503
        assert refused.value.code == "deadline_unreachable"
        gate.set()
        await ahead
        scheduler.close()

    asyncio.run(scenario())


def test_closed_scheduler_refuses_new_work() -> None:
    scheduler = _scheduler()
    scheduler.close()
    with pytest.raises(UnavailableError) as refused:
        scheduler.admit("decision", "a")
    assert refused.value.code == "shutting_down"
