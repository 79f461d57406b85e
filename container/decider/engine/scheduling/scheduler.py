"""Who runs when: the one engine thread, and how requests get onto it and wait for their answer.

The engine is not thread-safe, so ONE engine thread owns the llama context (the model load
included). The scheduler puts three pieces together under one lock:
- admission (decider.engine.scheduling.admission): on the event loop, a request is admitted or refused at once
  on estimates of the work running beside it;
- the engine loop (decider.engine.scheduling.loop): on the engine thread, one decode step at a time from every
  running work, deadlines, cancellation and failures;
- memory epochs (decider.engine.scheduling.epochs), batch-invariant mode only: when dead cells are freed.
Requests are submitted as `Job`s (decider.engine.scheduling.jobs) whose futures the engine thread settles.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from decider.engine.model.native import NativeError
from decider.engine.scheduling.admission import Admission
from decider.engine.scheduling.chat_pace import ChatPace
from decider.engine.scheduling.cost import Cost
from decider.engine.scheduling.epochs import MemoryEpochs
from decider.engine.scheduling.jobs import Job, Running, deadline_error, resolve, shutting_down
from decider.engine.scheduling.loop import Backend, EngineLoop
from decider.engine.scheduling.work import Work
from decider.errors import UnavailableError
from decider.settings import CacheBudget

log = logging.getLogger("decider.server")
T = TypeVar("T")
# How much lower the engine thread's CPU priority is than the HTTP loop's: below the loop (so /ping
# answers at once), above the threads that parse and plan request bodies (decider.server.intake,
# PARSE_NICENESS = 15), so a flood of bodies to refuse never slows the model's work down.
ENGINE_NICENESS = 5


class _Null:
    """A metric that records nothing (a scheduler without a server: `DecisionEngine.decide`)."""

    def labels(self, *_: str) -> _Null:
        return self

    def inc(self, *_: float) -> None: ...

    def set(self, *_: float) -> None: ...

    def observe(self, *_: float) -> None: ...


class NoMetrics:
    """The metrics the scheduler reports, all discarded (`decider.server.metrics.ServerMetrics`
    is the real one)."""

    def __getattr__(self, _name: str) -> _Null:
        return _Null()


def lower_engine_thread_priority() -> None:
    """Run inference at a lower CPU priority than the HTTP event loop.

    On Linux a thread's nice value is its own and is inherited by threads it starts, so this also
    covers llama.cpp's compute threads (created from the engine thread on first use). When the
    cores are saturated by inference, `/ping` and admission still get the CPU at once.
    """
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: keep going
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + ENGINE_NICENESS))


class Scheduler:
    """Owns the engine thread, the admission queue and the batching of every decode."""

    def __init__(
        self,
        *,
        queue_size: int,
        deadline_seconds: float,
        metrics: Any = None,
        epoch_cells: int | None = None,
        chat_share: float = 0.0,
        cache_budget: CacheBudget | None = None,
    ) -> None:
        self.cache_budget = cache_budget or CacheBudget()  # default: nothing kept across requests
        metrics = metrics if metrics is not None else NoMetrics()
        self._cond = threading.Condition()
        self._works: list[Running] = []  # in admission order; changed only under _cond
        pace = ChatPace(chat_share)
        self.admission = Admission(
            queue_size=queue_size,
            deadline_seconds=deadline_seconds,
            metrics=metrics,
            works=self._works,
            pace=pace,
        )
        self.loop = EngineLoop(
            self._cond,
            self._works,
            self.admission,
            metrics=metrics,
            epochs=MemoryEpochs(epoch_cells),
            pace=pace,
        )
        self._control: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._closed = False
        self.failure: str | None = None  # why the engine thread died (it never should)
        self._thread = threading.Thread(target=self._guarded_loop, name="engine", daemon=True)
        self._thread.start()

    @property
    def engine_alive(self) -> bool:
        """False once the engine thread has died: nothing admitted can ever finish (the server
        reports unhealthy and exits)."""
        return self._thread.is_alive() and self.failure is None

    # --- engine thread setup -------------------------------------------------------------------
    def submit_unscheduled(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread outside admission control (the model load)."""
        future: Future[T] = Future()
        with self._cond:
            self._control.append((fn, future))
            self._cond.notify()
        return future

    def attach(
        self,
        backend: Backend,
        head_tokens: list[int],
        *,
        namespace: str = "",
        budget: CacheBudget | None = None,
    ) -> None:
        """Start batching on a loaded model, after the load (on the engine thread in the server).

        The batch policy says which sequences are reserved, and whether memory epochs keep cells in
        place (batch invariance: decider.invariance). `namespace` names the model file and
        prompt version the repeat cache keys its entries under.

        Kept states need cells that stay where they are across requests; memory epochs free every
        dead cell below them at once, and new tokens would land there, out of position order. So
        with batch invariance only exact repeats are kept (their readouts are bitwise those of a new
        decode in that mode), never states.
        """
        if budget is not None:  # sized once the model was loaded (DecisionEngine.cache_budget)
            self.cache_budget = budget
        self.admission.step_tokens = backend.policy.step_tokens
        self.loop.attach(backend, head_tokens, self.cache_budget, namespace)

    # --- admission (event loop) ----------------------------------------------------------------
    def admit(
        self,
        kind: str,
        request_id: str,
        cost: Cost | None = None,
        *,
        least: Cost | None = None,
        arrived_at: float | None = None,
    ) -> Job:
        """Admit a request or refuse it at once (`Admission.admit`; 503 when stopping)."""
        with self._cond:
            if self._closed:
                raise shutting_down()
            return self.admission.admit(kind, request_id, cost, least=least, arrived_at=arrived_at)

    def refuse_when_full(self) -> None:
        """The queue-full test of `admit`, alone: the HTTP layer asks it before reading a body."""
        with self._cond:
            if self._closed:
                raise shutting_down()
            self.admission.refuse_when_full()

    def price(self, work: Work) -> tuple[Cost, Cost | None]:
        """The work's costs less what the caches hold now (`Work.costs_given`: a peek, an estimate).
        A peek scans every kept key (the host tier's too), so callers on the event loop price on a
        worker thread first (decider.server.handlers.admit) and pass the result to `enqueue`."""
        return work.costs_given(self.loop.caches)

    def enqueue(
        self,
        kind: str,
        request_id: str,
        work: Work,
        *,
        arrived_at: float | None = None,
        priced: tuple[Cost, Cost | None] | None = None,
    ) -> Job:
        """Admit and submit in one call, so no cancellation can fall between the two (a job admitted
        and never submitted would count as waiting forever). The job's `future` is the outcome.
        `priced`: the costs `price` gave (priced here when None)."""
        cost, least = priced if priced is not None else self.price(work)
        job = self.admit(kind, request_id, cost, least=least, arrived_at=arrived_at)
        job.future = self.submit(job, work)
        return job

    # --- execution (event loop) ----------------------------------------------------------------
    def submit(self, job: Job, work: Work) -> Future[Any]:
        """Hand an admitted job's work to the engine thread; the future resolves with its outcome.
        Callers in the event loop use `enqueue` (admission and submission in one call)."""
        future: Future[Any] = Future()
        with self._cond:
            if self._closed:
                self.admission.release(job)
                resolve(future, error=shutting_down())
                return future
            self._works.append(Running(job, work, future))
            self._cond.notify()
        return future

    async def run(self, job: Job, work: Work) -> Any:
        """Run `work` and wait for it, at most until the job's deadline.

        The engine decides whether the work finished in time; this side only stops waiting. So a
        result that the engine completed in time is answered even when this loop is late to see it.
        """
        return await self.wait(job, self.submit(job, work))

    async def wait(self, job: Job, future: Future[Any]) -> Any:
        """Wait for a submitted job's outcome, at most until its deadline (see `run`)."""
        waiter = asyncio.wrap_future(future)
        try:
            done, _ = await asyncio.wait({waiter}, timeout=job.remaining() + 0.05)  # never cancels it
        except asyncio.CancelledError:
            job.cancel()
            _ignore_outcome(waiter)
            raise
        if not done:
            job.cancel()
            _ignore_outcome(waiter)
            if not (future.done() and future.exception() is None):
                raise deadline_error(job, self.admission.deadline_seconds)
            return future.result()
        # The outcome as the asyncio copy holds it: reading an error there is what tells asyncio it
        # was seen (read from `future` instead, every failed job logged "Future exception was never
        # retrieved" with a traceback when the copy was collected).
        return waiter.result()

    def withdraw(self, job: Job) -> None:
        """Forget an admitted job that will never be submitted (its request failed before)."""
        with self._cond:
            if not any(r.job is job for r in self._works):
                self.admission.release(job)
                self.admission.update_gauges()

    def close(self) -> None:
        """Refuse new work, stop what is left (abort the decode in flight) and end the engine thread."""
        with self._cond:
            self._closed = True
            self.loop.hard_stop = True
            for running in self._works:
                running.job.cancel()
            self._cond.notify()

    # --- the engine thread ---------------------------------------------------------------------
    def _guarded_loop(self) -> None:
        """The engine loop; if it ever dies, say why, refuse new work and fail what waits (503)."""
        try:
            self._loop()
        except BaseException as exc:
            self.failure = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
            log.debug("the engine thread died", exc_info=True)  # the server logs the one line
            error = UnavailableError(
                f"the engine stopped ({self.failure}); the server is exiting",
                code="engine_failed",
                headers={"Retry-After": "1"},
            )
            with self._cond:
                self._closed = True
                works = list(self._works)
                self._works.clear()
                control, self._control = self._control, []
                self.admission.admitted.clear()
            for running in works:
                resolve(running.future, error=error)
            for _, future in control:
                resolve(future, error=error)

    def _loop(self) -> None:
        lower_engine_thread_priority()
        while True:
            with self._cond:
                while not self._control and not (self._works and self.loop.backend) and not self._closed:
                    self._cond.wait()
                control, self._control = self._control, []
                if self._closed and not control:
                    self._drain_locked()
                    return
            for fn, future in control:
                _run_into(fn, future)
            if self.loop.backend is not None and self._works:
                try:
                    self.loop.iterate()
                except Exception as exc:  # a bug must fail the requests in flight, never the thread
                    log.exception("the engine loop failed; every running request fails")
                    self.loop.reset(self.loop.backend, NativeError(f"{type(exc).__name__}: {exc}"))

    def _drain_locked(self) -> None:
        for running in self._works:
            self.loop.abandon(running, shutting_down())
        self._works.clear()


def _ignore_outcome(waiter: asyncio.Future[Any]) -> None:
    """No one awaits `waiter` any more: retrieve its eventual error, so asyncio logs nothing."""
    waiter.add_done_callback(lambda done: done.cancelled() or done.exception())


def _run_into(fn: Callable[[], Any], future: Future[Any]) -> None:
    try:
        result = fn()
    except BaseException as exc:
        resolve(future, error=exc)
    else:
        resolve(future, result)
