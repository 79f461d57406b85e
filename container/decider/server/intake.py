"""Bounded work before admission: how many request bodies are read, parsed and planned at once,
on which threads, and at what CPU priority.

Every body is read, parsed (strict JSON), validated and tokenized before the scheduler can admit
or refuse it by its cost. Unbounded, a flood of large bodies would hold one body's bytes and its
parsed objects per connection (over 100 MB for a few 4 MB bodies) and take the CPU from the model.
So:

- before a byte of the body is read, a full queue is 429 `queue_full` with `Retry-After` at once
  (`Scheduler.refuse_when_full`), and so is a request that finds `DECIDER_PARSE_CONCURRENCY` bodies in
  intake and `DECIDER_QUEUE_SIZE` more waiting for a place (waiting costs no memory: the body is unread);
- at most `DECIDER_PARSE_CONCURRENCY` requests are between the first byte of their body and the end of
  their planning at once; the others wait before reading (TCP holds their bytes, not this process);
- Batch Transform's JSON Lines take the same places: the payload while it is read, then each record
  from its parse to the end of its planning (they wait for a place instead of being refused);
- parsing and planning run on this module's own threads, at `PARSE_NICENESS` below the HTTP loop
  and below the engine thread (`decider.engine.scheduling.scheduler.ENGINE_NICENESS`): the model's work gets
  the cores first, and the event loop (`/ping`) before either.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from decider.errors import OverloadedError

T = TypeVar("T")
PARSE_NICENESS = 15  # below the engine thread's +5: see the module docstring


def lower_parse_thread_priority() -> None:
    """Run this (parsing) thread at PARSE_NICENESS (Linux: a thread's nice value is its own)."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + PARSE_NICENESS))


class Intake:
    """The request bodies in intake (read, parsed, planned) and the threads that parse them."""

    def __init__(self, concurrency: int, max_waiting: int) -> None:
        self.concurrency = concurrency
        self.max_waiting = max(1, max_waiting)
        self._slots = asyncio.Semaphore(concurrency)
        self._waiting = 0
        self._pool = ThreadPoolExecutor(
            max_workers=concurrency, thread_name_prefix="intake", initializer=lower_parse_thread_priority
        )

    @contextlib.asynccontextmanager
    async def slot(self, *, refuse: bool = True) -> AsyncIterator[Callable[[], None]]:
        """A place in intake, for reading the body up to the end of planning; yields `release`,
        which the handler calls once its work is planned (the slot is released on exit anyway).

        `refuse=False` waits however many wait, uncounted: Batch Transform's payloads and records,
        whose bytes are already bounded by the invocation (decider.server.batch_transform)."""
        if refuse and self._slots.locked() and self._waiting >= self.max_waiting:
            raise OverloadedError(
                f"{self.concurrency} request bodies are being parsed (DECIDER_PARSE_CONCURRENCY) and "
                f"{self._waiting} more wait for their turn (DECIDER_QUEUE_SIZE); retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        waiting = 1 if refuse else 0
        self._waiting += waiting
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= waiting
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._slots.release()

        try:
            yield release
        finally:
            release()

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` (parse, validate, tokenize) on an intake thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def release_intake(request: Any) -> None:
    """Release the request's intake slot, once its work is planned (no-op without one)."""
    release = getattr(request.state, "release_intake", None)
    if release is not None:
        release()
