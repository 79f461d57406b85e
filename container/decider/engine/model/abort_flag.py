"""Stopping a `llama_decode` without taking the interpreter lock in it.

llama.cpp calls its abort callback after every node of the compute graph, from the compute
threads. A Python callback there takes the GIL each time, so decoding stalls whenever another
thread holds it (parsing a large body, planning a request): measured in docs/server.md. Here the
callback is native: libc's `strlen` on a two-byte buffer `[flag, 0]` returns 0 while the flag is
clear and 1 once it is set, exactly the `bool (*)(void *)` llama.cpp expects, and reading it needs
nothing from Python. One watcher thread per context evaluates the scheduler's `should_abort`
every `POLL_SECONDS` while a decode runs and sets the flag when it turns true.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import llama_cpp

POLL_SECONDS = 0.005  # how often `should_abort` is asked during a decode (the abort's added latency)
_strlen = ctypes.CDLL(None).strlen


class AbortFlag:
    """The native abort callback of one llama context and the watcher that raises its flag."""

    def __init__(self, poll_seconds: float = POLL_SECONDS) -> None:
        self._buffer = ctypes.create_string_buffer(2)  # [flag, NUL]
        self.callback = ctypes.cast(_strlen, llama_cpp.ggml_abort_callback)
        self.data = ctypes.cast(self._buffer, ctypes.c_void_p)
        self._poll = poll_seconds
        self._check: Callable[[], bool] | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._watcher = threading.Thread(target=self._watch, name="decode-abort", daemon=True)
        self._watcher.start()

    @property
    def raised(self) -> bool:
        return self._buffer.raw[0] != 0

    def arm(self, should_abort: Callable[[], bool] | None) -> None:
        """Before a decode: clear the flag and watch `should_abort` (None: nothing can stop it)."""
        with self._cond:
            self._buffer[0] = b"\x00"
            self._check = should_abort
            self._cond.notify()

    def disarm(self) -> None:
        """After the decode: stop watching."""
        with self._cond:
            self._check = None

    def close(self) -> None:
        """End the watcher thread (the context is freed)."""
        with self._cond:
            self._closed = True
            self._check = None
            self._cond.notify()

    def _watch(self) -> None:
        while True:
            with self._cond:
                while self._check is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                check = self._check
            assert check is not None
            stop = bool(check())
            with self._cond:
                if stop and self._check is check:
                    self._buffer[0] = b"\x01"
                    self._check = None  # raised: nothing more to watch until the next arm
                    continue
                if self._check is not check:
                    continue
                self._cond.wait(self._poll)  # an arm or disarm wakes it early
