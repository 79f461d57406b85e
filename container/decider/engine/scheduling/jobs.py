"""One admitted request as both threads see it: its deadline, its cancellation, how it ends.

The event loop admits a `Job` (decider.engine.scheduling.admission) and waits for its future; the
engine thread runs its work as a `Running` (decider.engine.scheduling.loop) and settles the future.
The errors here are the ways a job ends without an answer.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from decider.engine.scheduling.cost import Cost
from decider.engine.scheduling.work import Work
from decider.errors import DeadlineExceededError, UnavailableError, shutting_down  # noqa: F401 - re-exported

# A 504 after waiting at least this share of the deadline in the queue may succeed on a retry; one
# whose work had the model nearly all along would only time out again.
RETRYABLE_WAIT_FRACTION = 0.1


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


@dataclass(eq=False)
class Running:
    """A submitted job and its work, on the engine thread's list (in admission order)."""

    job: Job
    work: Work
    future: Future[Any]
    decoded: int = 0  # tokens decoded so far (for the wait estimate)
    dead_at_epoch_start: int = 0  # the work's dead cells when the current memory epoch began

    @property
    def started(self) -> bool:
        return self.job.started_at is not None


class ClientGoneError(Exception):
    """The caller went away; nobody reads this work's answer."""


def deadline_error(job: Job, deadline_seconds: float) -> DeadlineExceededError:
    where = "waiting for the model" if job.started_at is None else "while the model was working"
    waited = (job.started_at or time.monotonic()) - job.admitted_at
    return DeadlineExceededError(
        f"the request passed its {deadline_seconds:g} s deadline {where} "
        f"(DECIDER_DEADLINE_SECONDS); retry later or send less work per request",
        code="deadline_exceeded",
        retryable=waited >= RETRYABLE_WAIT_FRACTION * deadline_seconds,
    )


def resolve(future: Future[Any], result: Any = None, *, error: BaseException | None = None) -> None:
    """Settle a future once; one already settled (or cancelled by its waiter) is left alone."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
