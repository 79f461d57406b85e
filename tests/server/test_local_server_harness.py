"""The dev harness (decider_dev.local_server) never leaves a server behind: a SIGTERM to the harness
stops the server it started, as Ctrl-C does, and the harness then dies of that SIGTERM.

The server here is a stand-in for `serve` (a Python child that records the SIGTERM it gets), so the
test is about the harness alone and takes well under a second of CPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# The stand-in `serve`: writes "up <pid>", then waits; on SIGTERM it writes "drained" and exits 0.
STAND_IN = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    record = Path(sys.argv[1])
    def drained(*_):
        record.write_text("drained")
        sys.exit(0)
    signal.signal(signal.SIGTERM, drained)
    record.write_text(f"up {os.getpid()}")
    time.sleep(60)
    """
)
# The harness: a `run_local_server` block (as the benches and the demo use it), or the foreground
# `python -m decider_dev.local_server`, with `serve` replaced by the stand-in.
HARNESS = textwrap.dedent(
    """
    import sys, time
    import decider_dev.local_server as local
    record, kind = sys.argv[1], sys.argv[2]
    local.serve_command = lambda: [sys.executable, "-c", {stand_in!r}, record]
    if kind == "block":
        with local.run_local_server(wait_ready=False):
            time.sleep(60)
    else:
        sys.exit(local.main(["--port", "0"]))
    """
).format(stand_in=STAND_IN)


@pytest.mark.parametrize("kind", ["block", "foreground"])
def test_a_sigterm_to_the_harness_stops_the_server_it_started(tmp_path: Path, kind: str) -> None:
    record, log = tmp_path / "serve-state", tmp_path / "harness.log"
    with log.open("wb") as output:
        harness = subprocess.Popen(
            [sys.executable, "-c", HARNESS, str(record), kind],
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**os.environ, "DECIDER_MODEL_PATH": "/unused"},  # the stand-in loads nothing
        )
    server_pid = None
    try:
        deadline = time.monotonic() + 30
        while server_pid is None:
            state = record.read_text() if record.exists() else ""
            server_pid = int(state.split()[1]) if state.startswith("up ") else None
            assert harness.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the stand-in server never started"
            time.sleep(0.02)
        harness.send_signal(signal.SIGTERM)
        harness.wait(timeout=30)
    finally:
        harness.kill()
        if server_pid is not None and record.read_text() != "drained":
            os.kill(server_pid, signal.SIGKILL)  # left behind: the failure below says so
    assert record.read_text() == "drained", "the server outlived its harness\n" + log.read_text()
    assert harness.returncode == -signal.SIGTERM, (harness.returncode, log.read_text())
    assert "Traceback" not in log.read_text(), log.read_text()
