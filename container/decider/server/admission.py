"""Admission control: one engine, one worker thread, a bounded queue and a deadline per request.

The engine is not thread-safe, so every engine call (the model load included) runs on a single
worker thread. Requests are admitted while fewer than `queue_size` are waiting (plus the one being
worked on); beyond that they get 429 with `Retry-After` at once. Each admitted request carries a
deadline (`deadline_seconds` from arrival): work that has not started by then is dropped, work in
progress is told to stop through `Job.should_stop` (checked by the engine between tokens), and the
caller gets 504 `deadline_exceeded` without waiting any longer. A request that is predicted to
miss its deadline, from the recent service times of the requests ahead of it, is refused at once
with 503 `deadline_unreachable` instead of queueing for nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from decider.errors import DeadlineExceededError, OverloadedError, UnavailableError
from decider.server.metrics import ServerMetrics

T = TypeVar("T")
EWMA_WEIGHT = 0.3  # weight of the newest service time in the running estimate
ENGINE_NICENESS = 10  # how much lower the engine thread's CPU priority is than the HTTP loop's
MAX_RETRY_AFTER_SECONDS = 60
# A 504 is retryable when queueing took at least this share of the deadline: a retry on a quieter
# server gets that much more time. Less than that, and the work alone is too large (split it).
RETRYABLE_WAIT_FRACTION = 0.1


@dataclass(eq=False)
class Job:
    """One admitted request: its deadline and its cancellation flag, shared with the worker thread."""

    kind: str
    request_id: str
    deadline: float  # time.monotonic()
    admitted_at: float
    expected_seconds: float
    started_at: float | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def should_stop(self) -> bool:
        """True once the caller has gone, the deadline has passed, or the server is stopping."""
        return self.cancelled or self.expired()

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


def lower_engine_thread_priority() -> None:
    """Run inference at a lower CPU priority than the HTTP event loop.

    On Linux a thread's nice value is its own and is inherited by threads it starts, so this also
    covers llama.cpp's compute threads (created from the engine thread on first use). When the
    cores are saturated by inference, `/ping` and admission still get the CPU at once; when the
    loop is idle, inference loses nothing.
    """
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: keep going
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + ENGINE_NICENESS))


def deadline_error(job: Job, deadline_seconds: float) -> DeadlineExceededError:
    where = "waiting for the model" if job.started_at is None else "while the model was working"
    waited = (job.started_at or time.monotonic()) - job.admitted_at
    return DeadlineExceededError(
        f"the request passed its {deadline_seconds:g} s deadline {where} "
        f"(DECIDER_DEADLINE_SECONDS); retry later or send less work per request",
        code="deadline_exceeded",
        retryable=waited >= RETRYABLE_WAIT_FRACTION * deadline_seconds,
    )


class Scheduler:
    """Owns the single engine worker thread and the bounded queue in front of it."""

    def __init__(self, *, queue_size: int, deadline_seconds: float, metrics: ServerMetrics) -> None:
        self.queue_size = queue_size
        self.deadline_seconds = deadline_seconds
        self._metrics = metrics
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine", initializer=lower_engine_thread_priority
        )
        self._lock = threading.Lock()
        self._pending: set[Job] = set()
        self._running: Job | None = None
        self._service_estimate: dict[str, float] = {}
        self._closed = False

    # --- unscheduled work (model load) -------------------------------------------------------
    def submit_unscheduled(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread outside admission control (used for the model load)."""
        return self._executor.submit(fn)

    # --- admission -----------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._pending) - (1 if self._running is not None else 0)

    def admit(self, kind: str, request_id: str) -> Job:
        """Admit a request or refuse it at once (429 queue full, 503 deadline unreachable/stopping)."""
        now = time.monotonic()
        with self._lock:
            if self._closed:
                raise UnavailableError(
                    "the server is shutting down", code="shutting_down", headers={"Retry-After": "1"}
                )
            predicted_wait = self._predicted_wait_locked(now)
            if len(self._pending) >= self.queue_size + 1:
                self._metrics.rejections.labels("queue_full").inc()
                retry_after = min(MAX_RETRY_AFTER_SECONDS, max(1, math.ceil(predicted_wait)))
                raise OverloadedError(
                    f"{self.queue_size} requests are already waiting for the model (DECIDER_QUEUE_SIZE); "
                    f"retry after {retry_after} s",
                    code="queue_full",
                    headers={"Retry-After": str(retry_after)},
                )
            expected = self._service_estimate.get(kind, 0.0)
            if expected and predicted_wait + expected > self.deadline_seconds:
                self._metrics.rejections.labels("deadline_unreachable").inc()
                retry_after = min(MAX_RETRY_AFTER_SECONDS, max(1, math.ceil(predicted_wait)))
                raise UnavailableError(
                    f"the requests ahead need about {predicted_wait:.1f} s and this one about "
                    f"{expected:.1f} s, "
                    f"more than the {self.deadline_seconds:g} s deadline (DECIDER_DEADLINE_SECONDS)",
                    code="deadline_unreachable",
                    headers={"Retry-After": str(retry_after)},
                )
            job = Job(kind, request_id, now + self.deadline_seconds, now, expected)
            self._pending.add(job)
            self._update_gauges_locked()
        return job

    def _predicted_wait_locked(self, now: float) -> float:
        total = 0.0
        for job in self._pending:
            if job is self._running and job.started_at is not None:
                total += max(0.0, job.expected_seconds - (now - job.started_at))
            else:
                total += job.expected_seconds
        return total

    def _update_gauges_locked(self) -> None:
        running = 1 if self._running is not None else 0
        self._metrics.queue_depth.set(len(self._pending) - running)
        self._metrics.engine_busy.set(running)

    # --- execution -----------------------------------------------------------------------------
    def start(self, job: Job, fn: Callable[[Job], T]) -> asyncio.Future[T]:
        """Queue `fn(job)` on the engine thread; the returned future resolves with its result."""
        future = self._executor.submit(self._execute, job, fn)
        future.add_done_callback(lambda _: self._finish(job))
        return asyncio.wrap_future(future)

    async def run(self, job: Job, fn: Callable[[Job], T]) -> T:
        """Run `fn(job)` on the engine thread and wait for it, at most until the job's deadline."""
        future = self.start(job, fn)
        try:
            return await asyncio.wait_for(future, timeout=job.remaining())
        except TimeoutError:
            job.cancel()
            if future.done() and not future.cancelled() and future.exception() is None:
                return future.result()
            raise deadline_error(job, self.deadline_seconds) from None
        except asyncio.CancelledError:
            job.cancel()
            task = asyncio.current_task()
            if future.cancelled() and task is not None and not task.cancelling():
                # The queued work was dropped (server stopping), not this request: answer it.
                raise UnavailableError(
                    "the server is shutting down", code="shutting_down", headers={"Retry-After": "1"}
                ) from None
            raise

    def _execute(self, job: Job, fn: Callable[[Job], T]) -> T:
        job.started_at = time.monotonic()
        with self._lock:
            self._running = job
            self._update_gauges_locked()
        self._metrics.queue_wait.labels(job.kind).observe(job.started_at - job.admitted_at)
        completed = False
        try:
            if job.should_stop():
                raise deadline_error(job, self.deadline_seconds)
            result = fn(job)
            completed = True
            return result
        finally:
            elapsed = time.monotonic() - job.started_at
            self._metrics.engine_seconds.labels(job.kind).observe(elapsed)
            with self._lock:
                if completed and not job.should_stop():
                    previous = self._service_estimate.get(job.kind)
                    self._service_estimate[job.kind] = (
                        elapsed if previous is None else (1 - EWMA_WEIGHT) * previous + EWMA_WEIGHT * elapsed
                    )
                self._running = None
                self._update_gauges_locked()

    def _finish(self, job: Job) -> None:
        with self._lock:
            self._pending.discard(job)
            self._update_gauges_locked()

    # --- shutdown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Refuse new work, stop what is left (queued jobs are dropped, the running one is told to
        stop) and release the worker thread. Called after the HTTP server has drained."""
        with self._lock:
            self._closed = True
            jobs = list(self._pending)
        for job in jobs:
            job.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
