"""Who runs when: admission, continuous batching across requests, deadlines and cancellation.

The engine is not thread-safe, so ONE engine thread owns the llama context (the model load
included). Requests are admitted on the event loop: refused at once with 429 when `queue_size`
requests are already waiting to start, with 503 `deadline_unreachable` when, beside the work
admitted before it, it cannot be done before its deadline (only when something is ahead: a retry
can succeed once it is done), and with a 4xx when the request alone could not be done in time even
on an idle server (a retry cannot succeed). The estimates count the work ahead as running beside
the request, sharing its decode steps (decider.engine.admission), chats at the length chats have
been generating, and come from a cost model fitted to the decodes the engine has timed, attention
included (decider.engine.cost). A request's deadline runs from its arrival.

Admitted work is a `Work` state machine (decision or chat); every loop of the engine thread builds
ONE decode step from every
running work, up to `n_batch` tokens, the free sequences and the free memory cells: the next token
of each chat first (a generation interleaves with decisions token by token), then the rows of the
decisions and chat prefills in the order they were admitted. Each work keeps its own deadline,
cancellation and errors: one bad work never fails its neighbours. A chat takes a memory cell per
generated token as it goes, leaving free what the first unit waiting for cells needs; when a step
has no free cell for every chat's next token beyond that, the chats pause while a decision holds
cells (they come back when it ends), and otherwise the youngest chats stop with finish_reason
"length" until the others fit (`_make_room_for_chats`).

Deadlines are decided on the engine thread: work that completes after its deadline is a 504, work
that completes before it is answered, whatever the event loop's timing. A step whose works have all
been told to stop (deadline, client gone, shutdown) is aborted inside `llama_decode` through
llama.cpp's abort callback, which it checks between graph nodes; a cancelled work that shares a step
with live ones stops at the end of that step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from decider.engine.admission import Ahead, ChatLengths, finish_cost
from decider.engine.cost import Cost, CostModel, span_attended
from decider.engine.invariance import HEAD_SEQ, BatchPolicy
from decider.engine.native import DecodeAbortedError, KvCacheFullError, NativeError, Row
from decider.engine.prefix_cache import CacheBudget, Caches, RepeatCache, StateCache
from decider.engine.steps import PlannedRow, SeqPool, Step
from decider.engine.work import Work
from decider.errors import (
    DeadlineExceededError,
    DeciderError,
    OverloadedError,
    RequestError,
    RequestExceedsDeadlineError,
    UnavailableError,
    internal_error,
)

log = logging.getLogger("decider.server")
T = TypeVar("T")
# How much lower the engine thread's CPU priority is than the HTTP loop's: below the loop (so /ping
# answers at once), above the threads that parse and plan request bodies (decider.server.intake,
# PARSE_NICENESS = 15), so a flood of bodies to refuse never slows the model's work down.
ENGINE_NICENESS = 5
MAX_RETRY_AFTER_SECONDS = 60
# A 504 after waiting at least this share of the deadline in the queue may succeed on a retry; one
# whose work had the model nearly all along would only time out again.
RETRYABLE_WAIT_FRACTION = 0.1
# A request is refused as too large for the deadline (a 4xx, never retried) only when the estimate
# exceeds the deadline by this factor: a refusal is final, so it must never hit a request that could
# have been served (an estimate is an estimate); one just above the deadline is tried and may 504.
REFUSE_FACTOR = 1.25
STALL_SECONDS = 5.0
DEFAULT_STEP_TOKENS = 2048  # tokens a decode carries, for estimates before a model is attached


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


class Backend(Protocol):
    """What the scheduler needs of the loaded model (LlamaRuntime, or a fake in tests)."""

    n_ctx: int
    n_seq_max: int
    policy: BatchPolicy

    def decode(self, rows: list[Row], *, should_abort: Callable[[], bool] | None = None) -> None: ...

    def seq_copy(self, src: int, dst: int) -> None: ...

    def seq_remove(self, seq_id: int) -> None: ...

    def clear(self) -> None: ...


@dataclass(eq=False)
class Job:
    """One admitted request: its deadline and its cancellation flag, shared with the engine thread."""

    kind: str
    request_id: str
    deadline: float  # time.monotonic(): the request's arrival plus the deadline
    admitted_at: float
    cost: Cost = field(default_factory=Cost)
    estimate: float | None = None  # seconds to its answer, predicted at admission (None: no model yet)
    started_at: float | None = None
    future: Future[Any] | None = None  # set by `Scheduler.enqueue`
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def expired(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.deadline

    def should_stop(self) -> bool:
        """True once the caller has gone, the deadline has passed, or the server is stopping."""
        return self.cancelled or self.expired()

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


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


def deadline_error(job: Job, deadline_seconds: float) -> DeadlineExceededError:
    where = "waiting for the model" if job.started_at is None else "while the model was working"
    waited = (job.started_at or time.monotonic()) - job.admitted_at
    return DeadlineExceededError(
        f"the request passed its {deadline_seconds:g} s deadline {where} "
        f"(DECIDER_DEADLINE_SECONDS); retry later or send less work per request",
        code="deadline_exceeded",
        retryable=waited >= RETRYABLE_WAIT_FRACTION * deadline_seconds,
    )


def shutting_down() -> UnavailableError:
    return UnavailableError("the server is shutting down", code="shutting_down", headers={"Retry-After": "1"})


class ClientGoneError(Exception):
    """The caller went away; nobody reads this work's answer."""


@dataclass(eq=False)
class _Running:
    job: Job
    work: Work
    future: Future[Any]
    decoded: int = 0  # tokens decoded so far (for the wait estimate)
    dead_at_epoch_start: int = 0  # the work's dead cells when the current memory epoch began

    @property
    def started(self) -> bool:
        return self.job.started_at is not None


class Scheduler:
    """Owns the engine thread, the admission queue and the batching of every decode."""

    def __init__(
        self,
        *,
        queue_size: int,
        deadline_seconds: float,
        metrics: Any = None,
        epoch_cells: int | None = None,
        cache_budget: CacheBudget | None = None,
    ) -> None:
        self.queue_size = queue_size
        self.cache_budget = cache_budget or CacheBudget()  # default: nothing kept across requests
        # Rows of one length per decode (steps.Step.take); None: on recurrent and hybrid backends.
        self.equal_rows: bool | None = None
        self.caches = Caches(None, None)
        self.epoch_cells = epoch_cells  # None: no cap on the decision starts of a memory epoch
        self.deadline_seconds = deadline_seconds
        self._metrics = metrics if metrics is not None else NoMetrics()
        self._cond = threading.Condition()
        self._control: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._works: list[_Running] = []  # in admission order
        self._admitted: set[Job] = set()  # admitted, not yet finished (includes not yet submitted)
        self._closed = False
        self._hard_stop = False
        self._backend: Backend | None = None
        self._seqs: SeqPool | None = None
        self._dead_removed = 0  # dead cells of works already gone, since the last compaction
        self._stalled_since: float | None = None
        self._head: list[int] = []
        self._head_ready = False
        self.costs = CostModel()  # seconds per decode, fitted to the decodes timed so far (under _cond)
        self.chat_lengths = ChatLengths()  # tokens the recent chats generated (under _cond)
        self._step_tokens = DEFAULT_STEP_TOKENS  # the backend's, once attached
        self._in_flight: tuple[float, Cost] | None = None  # the decode running: (started, its cost)
        self._cells_claimed = 0  # what the first unit waiting for cells needs (chats leave it free)
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

    def attach(self, backend: Backend, head_tokens: list[int], *, namespace: str = "") -> None:
        """Start batching on a loaded model, after the load (on the engine thread in the server).

        The batch policy says which sequences are reserved, and whether memory epochs keep cells in
        place (batch invariance: decider.engine.invariance). `namespace` names the model file and
        prompt version the repeat cache keys its entries under.

        Kept states need cells that stay where they are across requests; memory epochs free every
        dead cell below them at once, and new tokens would land there, out of position order. So
        with batch invariance only exact repeats are kept (their readouts are bitwise those of a new
        decode in that mode), never states.
        """
        policy = backend.policy
        self._seqs = SeqPool(backend.n_seq_max, policy.reserved_seqs, graveyards=policy.graveyards)
        self._head = list(head_tokens)
        self._step_tokens = policy.step_tokens
        self._backend = backend
        budget = self.cache_budget
        states = None
        if budget.states and not policy.epochs:
            states = StateCache(
                backend,  # type: ignore[arg-type]
                self._seqs,
                head=len(self._head),
                max_cells=budget.state_cells,
                max_seqs=budget.state_seqs,
                partial=bool(getattr(backend, "partial_reuse", False)),
                metrics=self._metrics,
            )
            self._seqs.reclaimer = states
        repeats = RepeatCache(budget.repeat_entries, metrics=self._metrics) if budget.repeat_entries else None
        self.caches = Caches(states, repeats, namespace)
        self._decode_head(backend)  # before /ping turns 200: the first request does not pay for it

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
        """Admit a request or refuse it at once (429 queue full, 503 deadline unreachable or stopping,
        422 when it cannot finish in time even alone). `cost` is what it may take (what the work
        behind it waits for), `least` what it takes at least (a chat may stop at its first token;
        default: `cost`). Its deadline runs from `arrived_at` (when the server received it; default now)."""
        now = time.monotonic()
        arrived = now if arrived_at is None else min(arrived_at, now)
        cost = cost or Cost()
        least = least or cost
        deadline = arrived + self.deadline_seconds
        with self._cond:
            if self._closed:
                raise shutting_down()
            ahead = self._ahead_locked(now)
            predicted_wait = self._busy_seconds_locked(ahead, now)
            self._refuse_when_full_locked(predicted_wait)
            own = self.costs.predict(least) if least.tokens else None
            estimate = None
            if own is not None:
                if own > REFUSE_FACTOR * self.deadline_seconds:
                    self._metrics.rejections.labels("request_exceeds_deadline").inc()
                    raise RequestExceedsDeadlineError(
                        f"this request is {least.tokens} tokens of work, about {own:.0f} s on this endpoint, "
                        f"more than the {self.deadline_seconds:g} s deadline (DECIDER_DEADLINE_SECONDS) even "
                        "with nothing else running; send fewer questions or states per request"
                    )
                estimate = self._finish_seconds_locked(least, ahead, now)
                # Only work ahead can make a request that fits alone miss its deadline, and then a
                # retry can succeed once that work is done. On an idle engine the request is tried.
                if ahead and estimate > deadline - now:
                    self._metrics.rejections.labels("deadline_unreachable").inc()
                    retry_after = _retry_after(predicted_wait)
                    raise UnavailableError(
                        f"beside the requests ahead this one needs about {estimate:.1f} s (about "
                        f"{own:.1f} s alone), more than the {deadline - now:.1f} s left of its "
                        f"{self.deadline_seconds:g} s deadline (DECIDER_DEADLINE_SECONDS)",
                        code="deadline_unreachable",
                        headers={"Retry-After": str(retry_after)},
                    )
            job = Job(kind, request_id, deadline, now, cost, estimate)
            self._admitted.add(job)
            self._update_gauges_locked()
        return job

    def refuse_when_full(self) -> None:
        """The queue-full test of `admit`, alone: the HTTP layer asks it before reading a body."""
        with self._cond:
            if self._closed:
                raise shutting_down()
            self._refuse_when_full_locked(None)

    def _refuse_when_full_locked(self, predicted_wait: float | None) -> None:
        waiting = sum(1 for job in self._admitted if job.started_at is None)
        if self._admitted and waiting >= self.queue_size:
            self._metrics.rejections.labels("queue_full").inc()
            if predicted_wait is None:
                now = time.monotonic()
                predicted_wait = self._busy_seconds_locked(self._ahead_locked(now), now)
            retry_after = _retry_after(predicted_wait)
            raise OverloadedError(
                f"{self.queue_size} requests are already waiting for the model (DECIDER_QUEUE_SIZE); "
                f"retry after {retry_after} s",
                code="queue_full",
                headers={"Retry-After": str(retry_after)},
            )

    def enqueue(self, kind: str, request_id: str, work: Work, *, arrived_at: float | None = None) -> Job:
        """Admit and submit in one call, so no cancellation can fall between the two (a job admitted
        and never submitted would count as waiting forever). The job's `future` is the outcome. Its
        costs leave out what the caches hold now (`Work.costs_given`: a peek, an estimate)."""
        cost, least = work.costs_given(self.caches)
        job = self.admit(kind, request_id, cost, least=least, arrived_at=arrived_at)
        job.future = self.submit(job, work)
        return job

    def _ahead_locked(self, now: float) -> list[Ahead]:
        """What is left of the admitted work (a chat at the length chats have been generating).

        A job is stopped at its deadline, so it runs for at most the time it has left, and one
        already past it (answered 504, its decode being aborted) or cancelled runs no more."""
        submitted = {id(r.job): r for r in self._works}
        ahead = []
        for job in self._admitted:
            if job.cancelled or job.expired(now):
                continue
            running = submitted.get(id(job))
            if running is None:
                pieces = [job.cost]
            elif running.work.kind == "chat":
                pieces = running.work.cost_left(self.chat_lengths)  # type: ignore[attr-defined]
            else:
                pieces = [job.cost.remaining(running.decoded)]
            ahead += [Ahead(piece, job.deadline - now) for piece in pieces if piece.tokens]
        return ahead

    def _in_flight_seconds_locked(self, now: float) -> float:
        """What is left of the decode running now: a new request's rows go into the next one."""
        if self._in_flight is None:
            return 0.0
        started, cost = self._in_flight
        return max(0.0, (self.costs.predict(cost) or 0.0) - (now - started))

    def _finish_seconds_locked(self, new: Cost, ahead: list[Ahead], now: float) -> float:
        """Predicted seconds until `new` is done, run beside the work `ahead` (the model is ready)."""
        seconds = self.costs.predict(finish_cost(new, ahead, self.costs, self._step_tokens)) or 0.0
        return seconds + (self._in_flight_seconds_locked(now) if ahead else 0.0)

    def _busy_seconds_locked(self, ahead: list[Ahead], now: float) -> float:
        """Predicted seconds until the admitted work is all done (0 until the cost model is ready)."""
        if not ahead:
            return 0.0
        seconds = self.costs.predict(finish_cost(None, ahead, self.costs, self._step_tokens)) or 0.0
        return seconds + self._in_flight_seconds_locked(now)

    def _update_gauges_locked(self) -> None:
        started = sum(1 for r in self._works if r.started)
        self._metrics.queue_depth.set(len(self._admitted) - started)
        self._metrics.engine_busy.set(started)

    # --- execution (event loop) ----------------------------------------------------------------
    def submit(self, job: Job, work: Work) -> Future[Any]:
        """Hand an admitted job's work to the engine thread; the future resolves with its outcome.
        Callers in the event loop use `enqueue` (admission and submission in one call)."""
        future: Future[Any] = Future()
        with self._cond:
            if self._closed:
                self._admitted.discard(job)
                _resolve(future, error=shutting_down())
                return future
            self._works.append(_Running(job, work, future))
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
                raise deadline_error(job, self.deadline_seconds)
        return future.result()

    def withdraw(self, job: Job) -> None:
        """Forget an admitted job that will never be submitted (its request failed before)."""
        with self._cond:
            if not any(r.job is job for r in self._works):
                self._admitted.discard(job)
                self._update_gauges_locked()

    def close(self) -> None:
        """Refuse new work, stop what is left (abort the decode in flight) and end the engine thread."""
        with self._cond:
            self._closed = True
            self._hard_stop = True
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
                works, self._works = self._works, []
                control, self._control = self._control, []
                self._admitted.clear()
            for running in works:
                _resolve(running.future, error=error)
            for _, future in control:
                _resolve(future, error=error)

    def _loop(self) -> None:
        lower_engine_thread_priority()
        while True:
            with self._cond:
                while not self._control and not (self._works and self._backend) and not self._closed:
                    self._cond.wait()
                control, self._control = self._control, []
                if self._closed and not control:
                    self._drain_locked()
                    return
            for fn, future in control:
                _run_into(fn, future)
            if self._backend is not None and self._works:
                try:
                    self._iterate()
                except Exception as exc:  # a bug must fail the requests in flight, never the thread
                    log.exception("the engine loop failed; every running request fails")
                    self._reset(self._backend, NativeError(f"{type(exc).__name__}: {exc}"))

    def _drain_locked(self) -> None:
        for running in self._works:
            self._abandon(running, shutting_down())
        self._works.clear()

    def _iterate(self) -> None:
        self._reap()
        self._complete()  # work with nothing to decode (single-candidate questions) is done at once
        if not self._works:
            return
        backend = self._backend
        assert backend is not None and self._seqs is not None
        try:
            if not self._head_ready:
                self._decode_head(backend)
            self._maybe_compact(backend)
            step = self._plan(backend)
            if step.rows:
                self._stalled_since = None
            elif any(r.work.finished for r in self._works):  # answered from the caches, no decode
                self._complete()
                return
            else:
                self._unblock()
                with self._cond:  # nothing can move until a deadline passes or new work arrives
                    self._cond.wait(timeout=0.01)
                return
            self._execute(backend, step)
        except NativeError as exc:  # not a full cache, not an abort: the context itself failed
            log.exception("llama.cpp failed; every running request fails and the memory is reset")
            self._reset(backend, exc)
            return
        self._complete()

    def _decode_head(self, backend: Backend) -> None:
        assert self._seqs is not None
        size = backend.policy.step_tokens
        for start in range(0, len(self._head), size):
            backend.decode([Row(HEAD_SEQ, self._head[start : start + size], start)])
        if self._head:
            self._seqs.keep(backend, HEAD_SEQ)
        self._head_ready = True

    def _dead_cells(self) -> int:
        """Cells released into the graveyards since the last compaction (works count theirs
        cumulatively; `dead_at_epoch_start` is what a work had released before the epoch began)."""
        return self._dead_removed + sum(r.work.footprint().dead - r.dead_at_epoch_start for r in self._works)

    def _maybe_compact(self, backend: Backend) -> None:
        """End the memory epoch when no decision state is live: free every dead cell at once."""
        assert self._seqs is not None
        if not self._seqs.epochs or not self._dead_cells():
            return
        if any(r.work.footprint().holds_epoch_cells for r in self._works):  # a started state keeps its cells
            return
        live = [HEAD_SEQ, *(seq for r in self._works for seq in r.work.footprint().seqs)]
        self._seqs.compact(backend, live)
        self._dead_removed = 0
        for running in self._works:
            running.dead_at_epoch_start = running.work.footprint().dead

    def _epoch_full(self) -> bool:
        """The memory epoch has grown to `epoch_cells`: let its decisions finish, start nothing new.

        Counted: the decisions' cells and every released cell not yet freed. Not counted: a running
        chat's own cells, so a long generation never holds decisions back."""
        if self.epoch_cells is None or not self._seqs or not self._seqs.epochs:
            return False
        decisions = (r.work for r in self._works if r.work.kind == "decision")
        used = sum(work.footprint().held for work in decisions) + self._dead_cells()
        return used >= self.epoch_cells

    def _free_cells(self, backend: Backend) -> int:
        """Cells no work holds; kept states' cells count as held (a step evicts them on demand)."""
        held = sum(r.work.footprint().held for r in self._works) + self._dead_cells()
        if self.caches.states is not None:
            held += self.caches.states.cells
        return backend.n_ctx - len(self._head) - backend.policy.reserved_cells - held

    def _evict_states_for(self, cells: int, backend: Backend) -> None:
        """Evict unpinned kept states until `cells` are free beyond what waiting work claims."""
        states = self.caches.states
        while states is not None and self._free_cells(backend) - self._cells_claimed < cells:
            if states.evict_one() is None:
                return

    def _make_room_for_chats(self, backend: Backend) -> None:
        """Every generating chat takes one cell in each step, and leaves free the cells that the
        first unit waiting for cells needs to start (first come, first served: chats growing into
        freed cells must not starve it). When the free cells are fewer: while a decision holds
        cells, the chats without one pause (the decision ends, and its cells come back); otherwise
        the youngest chats stop with finish_reason "length" until the rest fit."""
        assert self._seqs is not None
        chats = [r for r in self._works if r.work.kind == "chat" and r.work.cells_wanted]  # type: ignore[attr-defined]
        need, free = len(chats), self._free_cells(backend) - self._cells_claimed
        if not chats or need <= free:
            return
        self._evict_states_for(need, backend)  # a kept state never stops a chat
        free = self._free_cells(backend) - self._cells_claimed
        if need <= free:
            return
        if any(r.work.kind != "chat" and r.work.footprint().held for r in self._works):
            return
        for running in reversed(chats):  # admission order: the youngest last
            if need <= free:
                break
            running.work.stop_for_cells(backend, self._seqs)  # type: ignore[attr-defined]
            log.info(
                "request %s: no memory cell for its next token; stopped (length)", running.job.request_id
            )
            need -= 1
            free = self._free_cells(backend) - self._cells_claimed

    def _plan(self, backend: Backend) -> Step:
        assert self._seqs is not None
        self._make_room_for_chats(backend)
        policy = backend.policy
        equal_rows = (
            self.equal_rows if self.equal_rows is not None else bool(getattr(backend, "recurrent", False))
        )
        step = Step(
            backend,
            self._seqs,
            policy.step_tokens,
            self._free_cells(backend),
            running=[r.work for r in self._works],
            growth_floor=self._cells_claimed,
            caches=self.caches,
            equal_rows=equal_rows,
            long_row=policy.n_ubatch // 2,
        )
        step.prefix_holders = sum(r.work.footprint().prefix_seqs for r in self._works)
        epoch_full = self._epoch_full()
        now = time.monotonic()
        order = [r for r in self._works if r.work.kind == "chat" and r.started] + [
            r for r in self._works if not (r.work.kind == "chat" and r.started)
        ]
        waiting_ahead = False  # starts are first come, first served: a large request is never starved
        for running in order:
            if step.tokens_left <= 0:
                break
            step.starts_allowed = not (waiting_ahead or epoch_full)
            before = len(step.rows)
            try:
                running.work.plan_step(step)
            except Exception as exc:  # one work's bug fails that work alone
                log.exception("request %s: planning its next rows failed", running.job.request_id)
                step.rows = [planned for planned in step.rows if planned.work is not running.work]
                self._remove(running, internal_error(exc))
                continue
            waiting_ahead = waiting_ahead or running.work.wants_start
            progressed = len(step.rows) > before or running.work.finished
            if progressed and running.job.started_at is None:
                running.job.started_at = now
                self._metrics.queue_wait.labels(running.job.kind).observe(now - running.job.admitted_at)
        self._cells_claimed = step.waiting_for_cells
        with self._cond:
            self._update_gauges_locked()
        return step

    def _execute(self, backend: Backend, step: Step) -> None:
        jobs = [self._job_of(work) for work in step.works]

        def should_abort() -> bool:
            return self._hard_stop or all(job.should_stop() for job in jobs)

        tokens = step.token_count
        attended = sum(span_attended(p.row.start_pos, len(p.row.tokens)) for p in step.rows)
        cost = Cost(1, tokens, attended)
        started = time.monotonic()
        with self._cond:  # admission reads the model, and the decode in flight, on the event loop
            self._in_flight = (started, cost)
        try:
            completed = self._decode_split(backend, step.rows, should_abort)
        finally:
            elapsed = time.monotonic() - started
            with self._cond:
                self._in_flight = None
        self._metrics.decodes.inc()
        self._metrics.decode_rows.observe(len(step.rows))
        self._metrics.decode_tokens.observe(tokens)
        if completed:  # an aborted or split decode says nothing of the cost
            with self._cond:
                self.costs.observe(cost, elapsed)

    def _decode_split(
        self, backend: Backend, rows: list[PlannedRow], should_abort: Callable[[], bool]
    ) -> bool:
        """Decode `rows`; when no memory slot is free for all of them, halve and retry each half.
        False when a decode was aborted or a row could not be placed."""
        rows = [planned for planned in rows if self._running_of(planned.work) is not None]
        if not rows:  # every row belonged to a work that failed in an earlier half: its sequences are free
            return False
        try:
            backend.decode([planned.row for planned in rows], should_abort=should_abort)
        except KvCacheFullError:
            if len(rows) == 1:
                self._fail(
                    rows[0].work,
                    UnavailableError(
                        "the model's memory is full for this request right now; retry shortly",
                        code="kv_cache_full",
                        headers={"Retry-After": "1"},
                    ),
                )
                return False
            half = len(rows) // 2
            first = self._decode_split(backend, rows[:half], should_abort)
            return self._decode_split(backend, rows[half:], should_abort) and first
        except DecodeAbortedError:
            return False  # every work in it is stopping; `_reap` releases them
        seqs = self._seqs
        assert seqs is not None
        if seqs.epochs:  # before any on_done can remove a sequence
            for seq in {planned.row.seq_id for planned in rows if planned.keep}:
                seqs.keep(backend, seq)
        for planned in rows:
            running = self._running_of(planned.work)
            if running is None:  # failed earlier in this step
                continue
            running.decoded += len(planned.row.tokens)
            try:
                planned.on_done(planned.row)
            except Exception as exc:  # one work's bug fails that work alone, never its neighbours
                log.exception("request %s: reading its rows failed", running.job.request_id)
                self._remove(running, internal_error(exc))
        return True

    def _job_of(self, work: Work) -> Job:
        running = self._running_of(work)
        assert running is not None
        return running.job

    def _running_of(self, work: Work) -> _Running | None:
        return next((r for r in self._works if r.work is work), None)

    def _reap(self) -> None:
        """Release the works whose caller can no longer use an answer."""
        now = time.monotonic()
        for running in list(self._works):
            job = running.job
            if self._hard_stop:
                self._remove(running, shutting_down())
            elif job.expired(now):
                self._remove(running, deadline_error(job, self.deadline_seconds))
            elif job.cancelled:
                self._remove(running, ClientGoneError())

    def _complete(self) -> None:
        now = time.monotonic()
        for running in list(self._works):
            if not running.work.finished:
                continue
            job = running.job
            with self._cond:
                if running.work.kind == "chat":
                    end = running.work.natural_end  # type: ignore[attr-defined]
                    if end is not None:
                        self.chat_lengths.record(end[0], stopped=end[1])
                self._works.remove(running)
                self._dead_removed += running.work.footprint().dead - running.dead_at_epoch_start
                self._admitted.discard(job)
                self._update_gauges_locked()
            if job.started_at is not None:
                self._metrics.engine_seconds.labels(job.kind).observe(now - job.started_at)
                running.work.timing = {
                    "queue_seconds": job.started_at - job.admitted_at,
                    "engine_seconds": now - job.started_at,
                    "total_seconds": now - job.admitted_at,
                }
            if now > job.deadline:  # decided here, on the engine's clock: late is late
                _resolve(running.future, error=deadline_error(job, self.deadline_seconds))
                continue
            try:
                outcome = running.work.outcome()
            except Exception as exc:  # an answer that cannot be assembled fails alone
                log.exception("request %s: assembling the answer failed", job.request_id)
                _resolve(running.future, error=exc)
            else:
                _resolve(running.future, outcome)

    def _unblock(self) -> None:
        """No row fits although works are waiting: if nothing holds memory, the first can never run.

        Started works have their memory reserved (a chat short of cells for its next token pauses
        only beside a decision, which has rows, else it is stopped), so they stall only through a bug: after
        STALL_SECONDS without a row they fail (500) rather than hang until their deadline."""
        if any(r.started for r in self._works):
            now = time.monotonic()
            self._stalled_since = self._stalled_since or now
            if now - self._stalled_since > STALL_SECONDS:
                log.error("no running request could make progress for %.0f s; failing them", STALL_SECONDS)
                for running in [r for r in self._works if r.started]:
                    self._remove(running, DeciderError("the engine could not schedule this request"))
                self._stalled_since = None
            return
        first = self._works[0]
        self._remove(
            first,
            RequestError(
                "this request does not fit the model's context even alone (DECIDER_N_CTX, DECIDER_N_SEQ_MAX)",
                code="context_length_exceeded",
            ),
        )

    def _fail(self, work: Work, error: BaseException) -> None:
        running = self._running_of(work)
        if running is not None:
            self._remove(running, error)

    def _remove(self, running: _Running, error: BaseException) -> None:
        self._abandon(running, error)
        with self._cond:
            if running in self._works:
                self._works.remove(running)
                self._dead_removed += running.work.footprint().dead - running.dead_at_epoch_start
            self._admitted.discard(running.job)
            self._update_gauges_locked()

    def _abandon(self, running: _Running, error: BaseException) -> None:
        if self._backend is not None and self._seqs is not None:
            try:
                running.work.abandon(self._backend, self._seqs)
            except NativeError:
                log.exception("releasing request %s's sequences failed", running.job.request_id)
        _resolve(running.future, error=error)

    def _reset(self, backend: Backend, exc: NativeError) -> None:
        error = DeciderError(f"the model failed to evaluate the prompt: {exc}", code="backend_failed")
        with self._cond:
            failed, self._works = self._works, []
            for running in failed:
                self._admitted.discard(running.job)
            self._update_gauges_locked()
        for running in failed:
            running.job.cancel()
            self._abandon(running, error)  # frees a chat's sampler; the sequences go with the clear
        backend.clear()
        assert self._seqs is not None
        self._seqs.reset()
        if self.caches.states is not None:
            self.caches.states.clear()  # their sequences went with the clear
        self._dead_removed = 0
        self._head_ready = False


def _ignore_outcome(waiter: asyncio.Future[Any]) -> None:
    """No one awaits `waiter` any more: retrieve its eventual error, so asyncio logs nothing."""
    waiter.add_done_callback(lambda done: done.cancelled() or done.exception())


def _retry_after(predicted_wait: float) -> int:
    return min(MAX_RETRY_AFTER_SECONDS, max(1, math.ceil(predicted_wait)))


def _run_into(fn: Callable[[], Any], future: Future[Any]) -> None:
    try:
        result = fn()
    except BaseException as exc:
        _resolve(future, error=exc)
    else:
        _resolve(future, result)


def _resolve(future: Future[Any], result: Any = None, *, error: BaseException | None = None) -> None:
    """Settle a future once; one already settled (or cancelled by its waiter) is left alone."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
