"""How long admitted work takes on the batched engine: the estimates admission decides on.

The engine runs every admitted work in the same decode steps (decider.engine.scheduling.loop), so the
work ahead of a request does not run before it: it runs beside it. What a request waits for is
the steps that run until it is done, each carrying its own rows and its neighbours'. `finish_cost`
says what those steps are: a window of S steps, S the steps the request needs itself (more when the
tokens in the window exceed what a step carries), and each piece of work ahead contributing the
share of its tokens that it decodes in S of its steps (all of them when it needs fewer). The cost
model (decider.engine.scheduling.cost) turns that into seconds.

A chat is counted at the length chats have been generating (`ChatLengths`), never more than its
`max_tokens`: a generation usually stops long before it, and a chat that runs longer than the
others is expected to stop soon after. Before any chat has finished, a chat counts at `max_tokens`.

`Admission` decides on those estimates, on the event loop: a request is refused at once with 429
when `queue_size` requests are already waiting to start, with 503 `deadline_unreachable` when,
beside the work admitted before it, it cannot be done before its deadline (only when something is
ahead: a retry can succeed once it is done), and with a 4xx when the request alone could not be
done in time even on an idle server (a retry cannot succeed). A request's deadline runs from its
arrival.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from decider.engine.scheduling.chat_pace import ChatPace
from decider.engine.scheduling.cost import Cost, CostModel
from decider.engine.scheduling.jobs import Job
from decider.errors import OverloadedError, RequestExceedsDeadlineError, UnavailableError

if TYPE_CHECKING:
    from decider.engine.scheduling.jobs import Running

CHAT_LENGTH_WINDOW = 64  # finished chats whose generated lengths the estimate remembers
MIN_CHAT_LENGTHS = 3  # below this many, a chat counts at its max_tokens
WINDOW_ROUNDS = 8  # fixed-point rounds for the window's length (it converges in two or three)
MAX_RETRY_AFTER_SECONDS = 60
# A request is refused as too large for the deadline (a 4xx, never retried) only when the estimate
# exceeds the deadline by this factor: a refusal is final, so it must never hit a request that could
# have been served (an estimate is an estimate); one just above the deadline is tried and may 504.
REFUSE_FACTOR = 1.25
# Beside work ahead, a request is admitted only when its estimate with this margin fits the time it
# has left: the estimates run short of the measured times (`make bench-engine`'s admission_* lines:
# 0.84-0.92 of them, and 0.74 on a slow machine), and a request admitted on a bare estimate near the
# limit held every neighbour's steps until its 504. Refused, it gets a 503 a retry can pass.
ESTIMATE_MARGIN = 1.2
DEFAULT_STEP_TOKENS = 2048  # tokens a decode carries, for estimates before a model is attached


@dataclass(frozen=True)
class Ahead:
    """A piece of admitted work not done yet: what is left of it, and the seconds it may still run
    (a job is stopped at its deadline)."""

    cost: Cost
    seconds_left: float


class ChatLengths:
    """Generated tokens of the chats that finished recently: stopped by the model, or cut off at
    their max_tokens (which says only that the chat would have run at least that long)."""

    def __init__(self, window: int = CHAT_LENGTH_WINDOW) -> None:
        self._ends: deque[tuple[int, bool]] = deque(maxlen=window)  # (generated, stopped by itself)

    def record(self, generated: int, *, stopped: bool = True) -> None:
        self._ends.append((max(0, generated), stopped))

    def expected_total(self, max_tokens: int, produced: int = 0) -> int:
        """Tokens a chat that has produced `produced` so far is expected to generate in all.

        The mean length, at most `max_tokens`, of the recent chats that ran longer than `produced`
        (a chat that is still going is one of those); a chat cut off at a max_tokens smaller than
        this one's says nothing of how long it would have run, and is left out. A chat that has
        outlived them all is expected to run as long again. Never more than `max_tokens`, never
        less than one more token; `max_tokens` itself until three chats tell."""
        ceiling = max(max_tokens, produced)
        lengths = [min(n, ceiling) for n, stopped in self._ends if stopped or n >= ceiling]
        if len(lengths) < MIN_CHAT_LENGTHS:
            return ceiling
        longer = [length for length in lengths if length > produced]
        expected = sum(longer) / len(longer) if longer else 2 * produced
        return min(ceiling, max(produced + 1, math.ceil(expected)))


def effective_steps(cost: Cost, step_tokens: int) -> int:
    """Decodes a piece of work needs: its own count, or more when its tokens exceed what steps carry."""
    if cost.tokens <= 0:
        return cost.steps
    return max(cost.steps, math.ceil(cost.tokens / max(1, step_tokens)))


def finish_cost(new: Cost | None, ahead: Sequence[Ahead], costs: CostModel, step_tokens: int) -> Cost:
    """The decode steps that run until `new` is done, beside the work `ahead` (its rows share them).

    With `new` None: the steps until everything ahead is done (how long the engine stays busy).
    Work ahead counts only up to its deadline."""
    pieces = [_until_deadline(piece, costs) for piece in ahead]
    pieces = [(cost, effective_steps(cost, step_tokens)) for cost in pieces if cost.tokens or cost.steps]
    own = new or Cost()
    own_steps = (
        effective_steps(own, step_tokens) if new is not None else max((s for _, s in pieces), default=0)
    )
    window = own_steps
    total = own
    for _ in range(WINDOW_ROUNDS):
        total = own
        for cost, steps in pieces:
            total = total + (cost if steps <= window else cost.scaled(window / steps))
        needed = max(own_steps, math.ceil(total.tokens / max(1, step_tokens)))
        if needed <= window:
            break
        window = needed
    return Cost(window, total.tokens, total.attended)


def _until_deadline(piece: Ahead, costs: CostModel) -> Cost:
    alone = costs.predict(piece.cost) if piece.cost.tokens else None
    if not alone or alone <= piece.seconds_left:
        return piece.cost
    return piece.cost.scaled(piece.seconds_left / alone)


class Admission:
    """Which requests get in, on the estimates above: the event loop's side of the scheduler.

    Not locked itself: the scheduler calls it under its lock, which the engine thread also holds
    while it changes the running works, the decode in flight, the cost model and the chats' lengths.
    """

    def __init__(
        self,
        *,
        queue_size: int,
        deadline_seconds: float,
        metrics: Any,
        works: Sequence[Running],
        pace: ChatPace | None = None,
    ) -> None:
        self.queue_size = queue_size
        self.pace = pace or ChatPace(0.0)  # chats' decodes of their own (the loop's)
        self.deadline_seconds = deadline_seconds
        self.admitted: set[Job] = set()  # admitted, not yet finished (includes not yet submitted)
        self.costs = CostModel()  # seconds per decode, fitted to the decodes timed so far
        self.chat_lengths = ChatLengths()  # tokens the recent chats generated
        self.step_tokens = DEFAULT_STEP_TOKENS  # the backend's, once attached
        self.in_flight: tuple[float, Cost] | None = None  # the decode running: (started, its cost)
        self._works = works  # the engine's running works, in admission order (read here, never changed)
        self._metrics = metrics

    def admit(
        self,
        kind: str,
        request_id: str,
        cost: Cost | None = None,
        *,
        least: Cost | None = None,
        arrived_at: float | None = None,
    ) -> Job:
        """Admit a request or refuse it at once (429 queue full, 503 deadline unreachable, 422 when
        it cannot finish in time even alone). `cost` is what it may take (what the work behind it
        waits for), `least` what it takes at least (a chat may stop at its first token; default:
        `cost`). Its deadline runs from `arrived_at` (when the server received it; default now)."""
        now = time.monotonic()
        arrived = now if arrived_at is None else min(arrived_at, now)
        cost = cost or Cost()
        least = least or cost
        deadline = arrived + self.deadline_seconds
        ahead = self._ahead(now)
        predicted_wait = self._busy_seconds(ahead, now)
        self.refuse_when_full(predicted_wait)
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
            estimate = self._finish_seconds(least, ahead, now)
            if kind != "chat" and any(job.kind == "chat" for job in self.admitted):
                # the chats beside it may take their share of the decodes it waits on, if those are long
                estimate *= self.pace.stretch(self._longest_decode_seconds(least, ahead))
            # Only work ahead can make a request that fits alone miss its deadline, and then a
            # retry can succeed once that work is done. On an idle engine the request is tried.
            if ahead and estimate * ESTIMATE_MARGIN > deadline - now:
                self._metrics.rejections.labels("deadline_unreachable").inc()
                retry_after = _retry_after(predicted_wait)
                raise UnavailableError(
                    f"beside the requests ahead this one needs about {estimate:.1f} s (about "
                    f"{own:.1f} s alone; {ESTIMATE_MARGIN:g}x that with the estimate's margin), more than "
                    f"the {deadline - now:.1f} s left of its {self.deadline_seconds:g} s deadline "
                    "(DECIDER_DEADLINE_SECONDS)",
                    code="deadline_unreachable",
                    headers={"Retry-After": str(retry_after)},
                )
        job = Job(kind, request_id, deadline, now, cost, estimate)
        self.admitted.add(job)
        self.update_gauges()
        return job

    def refuse_when_full(self, predicted_wait: float | None = None) -> None:
        """429 when `queue_size` admitted requests are waiting to start (the HTTP layer also asks
        this alone, before reading a body)."""
        waiting = sum(1 for job in self.admitted if job.started_at is None)
        if self.admitted and waiting >= self.queue_size:
            self._metrics.rejections.labels("queue_full").inc()
            if predicted_wait is None:
                now = time.monotonic()
                predicted_wait = self._busy_seconds(self._ahead(now), now)
            retry_after = _retry_after(predicted_wait)
            raise OverloadedError(
                f"{self.queue_size} requests are already waiting for the model (DECIDER_QUEUE_SIZE); "
                f"retry after {retry_after} s",
                code="queue_full",
                headers={"Retry-After": str(retry_after)},
            )

    def release(self, job: Job) -> None:
        """The job is done, failed or withdrawn: it no longer counts as admitted."""
        self.admitted.discard(job)

    def update_gauges(self) -> None:
        started = sum(1 for r in self._works if r.started)
        self._metrics.queue_depth.set(len(self.admitted) - started)
        self._metrics.engine_busy.set(started)

    def _ahead(self, now: float) -> list[Ahead]:
        """What is left of the admitted work (a chat at the length chats have been generating).

        A job is stopped at its deadline, so it runs for at most the time it has left, and one
        already past it (answered 504, its decode being aborted) or cancelled runs no more."""
        submitted = {id(r.job): r for r in self._works}
        ahead = []
        for job in self.admitted:
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

    def _in_flight_seconds(self, now: float) -> float:
        """What is left of the decode running now: a new request's rows go into the next one."""
        if self.in_flight is None:
            return 0.0
        started, cost = self.in_flight
        return max(0.0, (self.costs.predict(cost) or 0.0) - (now - started))

    def _finish_seconds(self, new: Cost, ahead: list[Ahead], now: float) -> float:
        """Predicted seconds until `new` is done, run beside the work `ahead` (the model is ready)."""
        seconds = self.costs.predict(finish_cost(new, ahead, self.costs, self.step_tokens)) or 0.0
        return seconds + (self._in_flight_seconds(now) if ahead else 0.0)

    def _longest_decode_seconds(self, new: Cost, ahead: list[Ahead]) -> float:
        """Predicted seconds of the longest decode `new` runs in or waits on: the largest per-step
        share of its own work or of a piece ahead (each one's tokens spread over its steps)."""

        def one_step(cost: Cost) -> float:
            steps = max(1, effective_steps(cost, self.step_tokens))
            return self.costs.predict(Cost(1, math.ceil(cost.tokens / steps), cost.attended / steps)) or 0.0

        return max(one_step(cost) for cost in [new, *(piece.cost for piece in ahead)])

    def _busy_seconds(self, ahead: list[Ahead], now: float) -> float:
        """Predicted seconds until the admitted work is all done (0 until the cost model is ready)."""
        if not ahead:
            return 0.0
        seconds = self.costs.predict(finish_cost(None, ahead, self.costs, self.step_tokens)) or 0.0
        return seconds + self._in_flight_seconds(now)


def _retry_after(predicted_wait: float) -> int:
    return min(MAX_RETRY_AFTER_SECONDS, max(1, math.ceil(predicted_wait)))
