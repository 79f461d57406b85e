"""The engine thread's loop: plan one decode step from every running work, execute it, complete.

Admitted work is a `Work` state machine (decision or chat); every pass (`EngineLoop.iterate`)
builds ONE decode step from every running work, up to `n_batch` tokens, the free sequences and the
free memory cells: the next token of each chat first (a generation interleaves with decisions token
by token), then the rows of the decisions and chat prefills in the order they were admitted. Each
work keeps its own deadline, cancellation and errors: one bad work never fails its neighbours. A
chat takes a memory cell per generated token as it goes, leaving free what the first unit waiting
for cells needs; when a step has no free cell for every chat's next token beyond that, the chats
pause while a decision holds cells (they come back when it ends), and otherwise the youngest chats
stop with finish_reason "length" until the others fit (`_make_room_for_chats`).

Deadlines are decided here, on the engine thread: work that completes after its deadline is a 504,
work that completes before it is answered, whatever the event loop's timing. A step whose works
have all been told to stop (deadline, client gone, shutdown) is aborted inside `llama_decode`
through llama.cpp's abort callback, which it checks between graph nodes; a cancelled work that
shares a step with live ones stops at the end of that step. A llama.cpp failure fails every running
work and resets the memory (`reset`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from decider.engine.memory.host_cache import HostCache
from decider.engine.memory.prefix_cache import Caches, RepeatCache, StateCache
from decider.engine.memory.sequences import SeqPool
from decider.engine.model.native import DecodeAbortedError, KvCacheFullError, NativeError, Row
from decider.engine.scheduling.admission import Admission
from decider.engine.scheduling.chat_pace import ChatPace
from decider.engine.scheduling.cost import Cost, span_attended
from decider.engine.scheduling.epochs import MemoryEpochs
from decider.engine.scheduling.jobs import (
    ClientGoneError,
    Job,
    Running,
    deadline_error,
    resolve,
    shutting_down,
)
from decider.engine.scheduling.steps import PlannedRow, Step
from decider.engine.scheduling.work import Work
from decider.errors import DeciderError, RequestError, UnavailableError, internal_error
from decider.invariance import HEAD_SEQ, BatchPolicy
from decider.settings import CacheBudget

log = logging.getLogger("decider.server")
STALL_SECONDS = 5.0


class Backend(Protocol):
    """What the engine loop needs of the loaded model (LlamaRuntime, or a fake in tests)."""

    n_ctx: int
    n_seq_max: int
    policy: BatchPolicy

    def decode(self, rows: list[Row], *, should_abort: Callable[[], bool] | None = None) -> None: ...

    def seq_copy(self, src: int, dst: int) -> None: ...

    def seq_remove(self, seq_id: int) -> None: ...

    def clear(self) -> None: ...


class EngineLoop:
    """The running works' side of the scheduler: everything here runs on the engine thread.

    `works` is the scheduler's list (in admission order); the loop changes it, and the admission
    state, only under `cond`, the lock the event loop admits and submits under."""

    def __init__(
        self,
        cond: threading.Condition,
        works: list[Running],
        admission: Admission,
        *,
        metrics: Any,
        epochs: MemoryEpochs,
        pace: ChatPace | None = None,
    ) -> None:
        self.cond = cond
        self.pace = pace or ChatPace(0.0)
        self.works = works
        self.admission = admission
        self.epochs = epochs
        self._metrics = metrics
        self.backend: Backend | None = None
        self.seqs: SeqPool | None = None
        self.caches = Caches(None, None)
        # Rows of one length per decode (steps.Step.take); None: on recurrent and hybrid backends.
        self.equal_rows: bool | None = None
        self.hard_stop = False  # the server is stopping: abort the decode in flight, fail the rest
        self._head: list[int] = []
        self._head_ready = False
        self._stalled_since: float | None = None
        self._last_start: Running | None = None  # whose unit started last (per-unit fairness, `_plan`)
        self._cells_claimed = 0  # what the first unit waiting for cells needs (chats leave it free)

    def attach(self, backend: Backend, head_tokens: list[int], budget: CacheBudget, namespace: str) -> None:
        """Batch on a loaded model: its sequences, its caches, its prompt head (see `Scheduler.attach`)."""
        policy = backend.policy
        self.seqs = SeqPool(backend, backend.n_seq_max, policy.reserved_seqs, graveyards=policy.graveyards)
        self._head = list(head_tokens)
        states = None
        if budget.states and not policy.epochs:
            states = StateCache(
                self.seqs,
                head=len(self._head),
                max_cells=budget.state_cells,
                max_seqs=budget.state_seqs,
                partial=budget.partial_hits and bool(getattr(backend, "partial_reuse", False)),
                metrics=self._metrics,
                host=HostCache(budget.host_bytes, metrics=self._metrics) if budget.host else None,
            )
            self.seqs.reclaimer = states
        repeats = RepeatCache(budget.repeat_entries, metrics=self._metrics) if budget.repeat_entries else None
        self.caches = Caches(states, repeats, namespace)
        self.backend = backend
        self.decode_head(backend)  # before /ping turns 200: the first request does not pay for it

    # --- one pass --------------------------------------------------------------------------------
    def iterate(self) -> None:
        self._reap()
        self._complete()  # work with nothing to decode (single-candidate questions) is done at once
        if not self.works:
            return
        backend = self.backend
        assert backend is not None and self.seqs is not None
        try:
            if not self._head_ready:
                self.decode_head(backend)
            self.epochs.maybe_compact(self.seqs, self.works)
            began = time.monotonic()  # the pace counts a step's planning and reading, not only its decode
            alone = self.pace.chats_alone(self._chats_waiting())
            step = self._plan(backend, chats_alone=alone)
            if alone and not step.rows:  # no chat could plan a row: the shared decode runs
                alone = self.pace.chats_alone(False)
                step = self._plan(backend)
            if step.rows:
                self._stalled_since = None
            elif any(r.work.finished for r in self.works):  # answered from the caches, no decode
                self._complete()
                return
            else:
                self._unblock()
                with self.cond:  # nothing can move until a deadline passes or new work arrives
                    self.cond.wait(timeout=0.01)
                return
            self._execute(backend, step)
            others = any(planned.work.kind != "chat" for planned in step.rows)
            waited = others and self._chats_waiting()
            self.pace.decoded(time.monotonic() - began, chats_alone=alone, chats_waited=waited)
        except NativeError as exc:  # not a full cache, not an abort: the context itself failed
            log.exception("llama.cpp failed; every running request fails and the memory is reset")
            self.reset(backend, exc)
            return
        self._complete()

    def decode_head(self, backend: Backend) -> None:
        assert self.seqs is not None
        size = backend.policy.step_tokens
        for start in range(0, len(self._head), size):
            backend.decode([Row(HEAD_SEQ, self._head[start : start + size], start)])
        if self._head:
            self.seqs.keep(HEAD_SEQ)
        self._head_ready = True

    # --- planning --------------------------------------------------------------------------------
    def _free_cells(self, backend: Backend) -> int:
        """Cells no work holds; kept states' cells count as held (a step evicts them on demand)."""
        held = sum(r.work.footprint().held for r in self.works) + self.epochs.dead_cells(self.works)
        if self.caches.states is not None:
            held += self.caches.states.cells
        return backend.n_ctx - len(self._head) - backend.policy.reserved_cells - held

    def _evict_states_for(self, cells: int, backend: Backend) -> None:
        """Evict unpinned kept states until `cells` are free beyond what waiting work claims."""
        states = self.caches.states
        if states is not None:
            states.reclaim(cells - (self._free_cells(backend) - self._cells_claimed), whole=False)

    def _make_room_for_chats(self, backend: Backend) -> None:
        """Every generating chat takes one cell in each step, and leaves free the cells that the
        first unit waiting for cells needs to start (first come, first served: chats growing into
        freed cells must not starve it). When the free cells are fewer: while a decision holds
        cells and the engine moves, the chats without one pause (the decision ends, and its cells
        come back); otherwise, and as soon as a step came out with no row (the cell holders cannot
        plan one: a chat must never wait on a holder that does not move), the youngest chats stop
        with finish_reason "length" until the rest fit."""
        assert self.seqs is not None
        chats = [r for r in self.works if r.work.kind == "chat" and r.work.cells_wanted]  # type: ignore[attr-defined]
        need, free = len(chats), self._free_cells(backend) - self._cells_claimed
        if not chats or need <= free:
            return
        self._evict_states_for(need, backend)  # a kept state never stops a chat
        free = self._free_cells(backend) - self._cells_claimed
        if need <= free:
            return
        holders = any(r.work.kind != "chat" and r.work.footprint().held for r in self.works)
        if holders and self._stalled_since is None:
            return
        for running in reversed(chats):  # admission order: the youngest last
            if need <= free:
                break
            running.work.stop_for_cells(self.seqs)  # type: ignore[attr-defined]
            log.info(
                "request %s: no memory cell for its next token; stopped (length)", running.job.request_id
            )
            need -= 1
            free = self._free_cells(backend) - self._cells_claimed

    def _chats_waiting(self) -> bool:
        return any(r.work.kind == "chat" and not r.work.finished for r in self.works)

    def _plan(self, backend: Backend, *, chats_alone: bool = False) -> Step:
        """The next decode's rows. `chats_alone` (ChatPace): the chats' rows only, those of started
        chats and of the oldest work that has not run yet if it is a chat."""
        assert self.seqs is not None
        self._make_room_for_chats(backend)
        policy = backend.policy
        equal_rows = (
            self.equal_rows if self.equal_rows is not None else bool(getattr(backend, "recurrent", False))
        )
        step = Step(
            self.seqs,
            policy.step_tokens,
            self._free_cells(backend),
            runtime=backend,
            running=[r.work for r in self.works],
            growth_floor=self._cells_claimed,
            caches=self.caches,
            equal_rows=equal_rows,
            long_row=policy.n_ubatch // 2,
            # The start rule keeps shared decodes full without holding idle cells; a chats-only
            # decode is short by design, and a chat started there has its first token at once.
            start_below_tokens=0 if chats_alone else policy.n_ubatch,
        )
        step.branch_reserve = sum(r.work.footprint().prefix_seqs for r in self.works)
        epoch_full = self.epochs.full(self.seqs, self.works)
        now = time.monotonic()
        order = [r for r in self.works if r.work.kind == "chat" and r.started] + [
            r for r in self.works if not (r.work.kind == "chat" and r.started)
        ]
        if chats_alone:  # the started chats, and the oldest work that never ran if it is a chat
            first = next((r for r in self.works if not r.started), None)
            order = [r for r in order if r.work.kind == "chat" and (r.work.started or r is first)]
        # Starts are first come, first served, per unit: a unit refused for want of cells or
        # sequences closes the gate behind it (a large request is never starved). A unit held back
        # by the start rule alone does not. And a work that has started units (a batch's states)
        # lets a work waiting for its first unit take the next start after each of its own: a chat
        # sent after a 16-state batch gets its first token within a few steps, not after the batch.
        first_waits = any(not r.started and r.work.wants_start for r in self.works)
        waiting_ahead = False
        for running in order:
            if step.tokens_left <= 0:
                break
            yields = first_waits and running.started and self._last_start is running
            step.starts_allowed = not (waiting_ahead or epoch_full or yields)
            step.refused_for_memory = False
            units_before = running.work.started_units
            before = len(step.rows)
            try:
                running.work.plan_step(step)
            except Exception as exc:  # one work's bug fails that work alone
                log.exception("request %s: planning its next rows failed", running.job.request_id)
                step.rows = [planned for planned in step.rows if planned.work is not running.work]
                self._remove(running, internal_error(exc))
                continue
            waiting_ahead = waiting_ahead or step.refused_for_memory
            if running.work.started_units > units_before:
                self._last_start = running
            if len(step.rows) > before or running.work.finished:
                self._mark_started(running.job, now)
        self._cells_claimed = step.waiting_for_cells
        with self.cond:
            self.admission.update_gauges()
        return step

    # --- execution -------------------------------------------------------------------------------
    def _execute(self, backend: Backend, step: Step) -> None:
        jobs = [self._job_of(work) for work in step.works]

        def should_abort() -> bool:
            return self.hard_stop or all(job.should_stop() for job in jobs)

        tokens = step.token_count
        attended = sum(span_attended(p.row.start_pos, len(p.row.tokens)) for p in step.rows)
        cost = Cost(1, tokens, attended)
        started = time.monotonic()
        with self.cond:  # admission reads the model, and the decode in flight, on the event loop
            self.admission.in_flight = (started, cost)
        try:
            completed = self._decode_split(backend, step.rows, should_abort)
        finally:
            elapsed = time.monotonic() - started
            with self.cond:
                self.admission.in_flight = None
        self._metrics.decodes.inc()
        self._metrics.decode_rows.observe(len(step.rows))
        self._metrics.decode_tokens.observe(tokens)
        if completed:  # an aborted or split decode says nothing of the cost
            with self.cond:
                self.admission.costs.observe(cost, elapsed)

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
        seqs = self.seqs
        assert seqs is not None
        if seqs.epochs:  # before any on_done can remove a sequence
            for seq in {planned.row.seq_id for planned in rows if planned.keep}:
                seqs.keep(seq)
        for planned in rows:
            running = self._running_of(planned.work)
            if running is None:  # failed earlier in this step
                continue
            running.decoded += len(planned.row.tokens)
            try:
                planned.on_done(planned.row)
            except DeciderError as exc:  # a typed end of that work alone (a chat's response_format)
                log.info("request %s: %s (%s)", running.job.request_id, exc.code, exc.message)
                self._remove(running, exc)
            except Exception as exc:  # one work's bug fails that work alone, never its neighbours
                log.exception("request %s: reading its rows failed", running.job.request_id)
                self._remove(running, internal_error(exc))
        return True

    def _job_of(self, work: Work) -> Job:
        running = self._running_of(work)
        assert running is not None
        return running.job

    def _running_of(self, work: Work) -> Running | None:
        return next((r for r in self.works if r.work is work), None)

    # --- ends ------------------------------------------------------------------------------------
    def _reap(self) -> None:
        """Release the works whose caller can no longer use an answer."""
        now = time.monotonic()
        for running in list(self.works):
            job = running.job
            if self.hard_stop:
                self._remove(running, shutting_down())
            elif job.expired(now):
                self._remove(running, deadline_error(job, self.admission.deadline_seconds))
            elif job.cancelled:
                self._remove(running, ClientGoneError())

    def _complete(self) -> None:
        now = time.monotonic()
        for running in list(self.works):
            if not running.work.finished:
                continue
            job = running.job
            self._mark_started(job, now)  # finished without a row of its own: answered by another's
            with self.cond:
                if running.work.kind == "chat":
                    end = running.work.natural_end  # type: ignore[attr-defined]
                    if end is not None:
                        self.admission.chat_lengths.record(end[0], stopped=end[1])
                self.works.remove(running)
                self.epochs.leave(running)
                self.admission.release(job)
                self.admission.update_gauges()
            assert job.started_at is not None
            self._metrics.engine_seconds.labels(job.kind).observe(now - job.started_at)
            running.work.timing = {
                "queue_seconds": job.started_at - job.admitted_at,
                "engine_seconds": now - job.started_at,
                "total_seconds": now - job.admitted_at,
            }
            if now > job.deadline:  # decided here, on the engine's clock: late is late
                resolve(running.future, error=deadline_error(job, self.admission.deadline_seconds))
                continue
            try:
                outcome = running.work.outcome()
            except Exception as exc:  # an answer that cannot be assembled fails alone
                log.exception("request %s: assembling the answer failed", job.request_id)
                resolve(running.future, error=exc)
            else:
                resolve(running.future, outcome)

    def _mark_started(self, job: Job, now: float) -> None:
        """The job's first row was planned (or it finished without one): its queue wait ends."""
        if job.started_at is None:
            job.started_at = now
            self._metrics.queue_wait.labels(job.kind).observe(now - job.admitted_at)

    def _unblock(self) -> None:
        """No row fits although works are waiting: if nothing holds memory, the first can never run.

        Started works have their memory reserved (a chat short of cells for its next token pauses
        only beside a decision that has rows: after a step with none it is stopped), so they stall
        only through a bug: after STALL_SECONDS without a row they fail (500) rather than hang until
        their deadline."""
        if any(r.started for r in self.works):
            now = time.monotonic()
            self._stalled_since = self._stalled_since or now
            if now - self._stalled_since > STALL_SECONDS:
                log.error("no running request could make progress for %.0f s; failing them", STALL_SECONDS)
                for running in [r for r in self.works if r.started]:
                    self._remove(running, DeciderError("the engine could not schedule this request"))
                self._stalled_since = None
            return
        first = self.works[0]
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

    def _remove(self, running: Running, error: BaseException) -> None:
        self.abandon(running, error)
        with self.cond:
            if running in self.works:
                self.works.remove(running)
                self.epochs.leave(running)
            self.admission.release(running.job)
            self.admission.update_gauges()

    def abandon(self, running: Running, error: BaseException) -> None:
        """Free what the work holds and fail its future with `error` (the work stays listed)."""
        if self.backend is not None and self.seqs is not None:
            try:
                running.work.abandon(self.seqs)
            except NativeError:
                log.exception("releasing request %s's sequences failed", running.job.request_id)
        resolve(running.future, error=error)

    def reset(self, backend: Backend, exc: NativeError) -> None:
        """The context failed: fail every running work, clear the memory, decode the head again."""
        error = DeciderError(f"the model failed to evaluate the prompt: {exc}", code="backend_failed")
        with self.cond:
            failed = list(self.works)
            self.works.clear()
            for running in failed:
                self.admission.release(running.job)
            self.admission.update_gauges()
        for running in failed:
            running.job.cancel()
            self.abandon(running, error)  # frees a chat's sampler; the sequences go with the clear
        backend.clear()
        assert self.seqs is not None
        self.seqs.reset()
        if self.caches.states is not None:
            self.caches.states.clear()  # their sequences went with the clear
        self.epochs.reset()
        self._head_ready = False
