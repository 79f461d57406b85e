"""The soak's judgement (tools/dev/soak/run.py) and what it measures with: the server's memory is the
front's and its engine child's together (it was the front's alone, about 50 MB, since the front came
in), and a verdict that misses no target it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from decider_dev.local_server import LocalServer
from decider_dev.soak.run import MEMORY_GROWTH_MIB, Outcome, failure_count, verdict

MIB = 1024

# A front that runs a child holding 96 MiB, as the real front runs the engine that holds the model.
TREE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import time; block = bytearray(96 * 2**20); print('held', flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE)
child.stdout.readline()
print("ready", flush=True)
time.sleep(60)
"""


def _own_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_the_server_memory_counts_the_engine_child(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stdout.readline() == b"ready\n"
        server = LocalServer(process=process, port=0, host="127.0.0.1", log_path=tmp_path / "log")
        front = _own_kib(process.pid, "VmRSS")
        assert front < 64 * MIB
        assert server.memory_kib() >= front + 96 * MIB
        assert server.memory_kib("VmHWM") >= server.memory_kib() - 4 * MIB  # each process's peak
    finally:
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
        process.kill()
        process.wait()
    assert server.memory_kib() == 0  # the front has ended


def _outcome(**changes: object) -> Outcome:
    fields: dict[str, object] = {
        "alive": True,
        "engine_restarts": 0.0,
        "traceback": False,
        "counts": {"decision 200": 40, "invalid: json 422 invalid_json": 10},
        "failures": 0,
        "samples": [(0.0, 500.0, 0.0), (60.0, 560.0, 20.0), (300.0, 900.0, 360.0), (600.0, 580.0, 30.0)],
    }
    return Outcome(**{**fields, **changes})  # type: ignore[arg-type]


def test_a_soak_that_meets_every_target_passes() -> None:
    outcome = _outcome()
    assert outcome.memory() == (500.0, 540.0, 550.0, 550.0)  # the host tier taken off every sample
    assert outcome.per_minute() == [(500.0, 0.0), (540.0, 20.0), (540.0, 360.0), (550.0, 30.0)]
    assert verdict(outcome) == []


@pytest.mark.parametrize(
    ("changes", "missed"),
    [
        ({"alive": False}, "the server process died"),
        ({"engine_restarts": 2.0}, "the engine died and was started again 2 time(s)"),
        ({"traceback": True}, "a traceback in the server log"),
        ({"failures": 3}, "3 answer(s) broke the target"),
        ({"counts": {"decision 500": 1}}, "non-200 answers counted without a code: decision 500"),
        ({"samples": []}, "no memory sample"),
        (
            {"samples": [(0.0, 500.0, 0.0), (60.0, 540.0, 0.0), (400.0, 540.0 + MEMORY_GROWTH_MIB + 1, 0.0)]},
            f"memory grew {MEMORY_GROWTH_MIB + 1} MB after the first minute",
        ),
    ],
)
def test_each_missed_target_fails_the_soak(changes: dict[str, object], missed: str) -> None:
    reasons = verdict(_outcome(**changes))
    assert len(reasons) == 1 and reasons[0].startswith(missed), reasons


def test_growth_within_the_bound_after_the_first_minute_passes() -> None:
    samples = [(0.0, 300.0, 0.0), (60.0, 540.0, 0.0), (400.0, 540.0 + MEMORY_GROWTH_MIB, 0.0)]
    assert verdict(_outcome(samples=samples)) == []  # the first minute's warm-up is not growth


def test_failures_are_read_from_the_aggregated_row(tmp_path: Path) -> None:
    stats = tmp_path / "soak_stats.csv"
    stats.write_text("Type,Name,Request Count,Failure Count\nPOST,decision,10,2\n,Aggregated,30,5\n")
    assert failure_count(stats) == 5
    assert failure_count(tmp_path / "absent.csv") == 0
