"""The decode abort check without the interpreter lock (issue 23 §2): llama.cpp's callback is libc's
`strlen` on `[flag, NUL]`, and a watcher thread raises the flag when `should_abort` turns true."""

from __future__ import annotations

import threading
import time

from decider.engine.model.abort_flag import AbortFlag


def test_the_native_callback_reads_the_flag() -> None:
    flag = AbortFlag()
    assert flag.callback(flag.data) is False
    flag.arm(lambda: True)
    deadline = time.monotonic() + 2
    while not flag.raised:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert flag.callback(flag.data) is True
    flag.arm(None)  # the next decode starts clear
    assert flag.callback(flag.data) is False and not flag.raised


def test_the_watcher_raises_the_flag_soon_after_should_abort_turns_true() -> None:
    flag = AbortFlag(poll_seconds=0.005)
    stop = threading.Event()
    flag.arm(stop.is_set)
    time.sleep(0.05)
    assert not flag.raised
    stopped_at = time.monotonic()
    stop.set()
    while not flag.raised:
        assert time.monotonic() - stopped_at < 1.0
        time.sleep(0.001)
    assert time.monotonic() - stopped_at < 0.5


def test_a_disarmed_flag_stays_down() -> None:
    flag = AbortFlag(poll_seconds=0.005)
    calls: list[int] = []

    def check() -> bool:
        calls.append(1)
        return len(calls) > 3

    flag.arm(check)
    flag.disarm()
    time.sleep(0.05)
    assert not flag.raised and len(calls) <= 2


def test_closing_ends_the_watcher() -> None:
    flag = AbortFlag()
    flag.arm(lambda: False)
    flag.close()
    flag._watcher.join(1.0)
    assert not flag._watcher.is_alive()
