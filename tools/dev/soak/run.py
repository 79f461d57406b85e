"""The mixed-traffic soak (issue 23 §4): the real server, locust's users, a report.

    python -m decider_dev.soak.run [--minutes 10] [--users 8]

Starts `serve` on the bundled model, runs tools/dev/soak/locustfile.py headless against it for
`--minutes`, samples the server's resident memory every 5 s, and prints: requests by route, status
and error code; p50/p95 per route (locust's CSV); the largest gap between a stream's chunks; the
memory after the first minute and at the end; then a verdict on the targets, and exits 1 if one is
missed. Targets: the server lives, its engine child too (the front restarts a dead one within
seconds, so only `decider_engine_restarts_total` tells), no traceback in its log, no 5xx except
typed 503/504 whose `retryable` is true, every non-200 with a typed code, and memory flat after the
first minute (its peak at most MEMORY_GROWTH_MIB above the first minute's). `make soak` runs it for
10 minutes; never part of `make test`.

Memory is the RSS of the server's processes (the front and its engine child, which holds the model
and the caches) less what the host-memory tier of kept states holds (the `decider_cache_host_bytes`
gauge): that tier grows by design, up to DECIDER_STATE_CACHE_HOST_MIB (2 GiB by default), as evicted
states and chat turns are saved, so the raw RSS of a soak whose users send new states keeps rising
for as long as the budget is not full. Both are printed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from decider_dev.bench.common import unlabelled_metrics
from decider_dev.local_server import engine_restarts, run_local_server
from decider_dev.soak.accounting import missing_codes

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


HOST_BYTES = "decider_cache_host_bytes"
MEMORY_GROWTH_MIB = 64  # the most the peak after the first minute may stand above the first minute's


def host_tier_mib(base_url: str) -> float:
    """What the host-memory tier of kept states holds now (the decider_cache_host_bytes gauge)."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return unlabelled_metrics(text, [HOST_BYTES])[HOST_BYTES] / 2**20


@dataclass
class Outcome:
    """What a soak saw, as `verdict` judges it."""

    alive: bool
    engine_restarts: float
    traceback: bool
    counts: dict[str, int]
    failures: int  # answers locust marked failed: an untyped 5xx, a 503/504 that is not retryable, …
    samples: list[tuple[float, float, float]] = field(default_factory=list)  # (s, RSS, host tier) MiB

    def memory(self) -> tuple[float, float, float, float] | None:
        """RSS less the host tier: at the start, after the first minute, its peak after it, at the end."""
        less_host = [(t, rss - host) for t, rss, host in self.samples]
        if not less_host:
            return None
        after_first = [rss for t, rss in less_host if t >= 60] or [rss for _, rss in less_host]
        return less_host[0][1], after_first[0], max(after_first), less_host[-1][1]

    def per_minute(self) -> list[tuple[float, float]]:
        """(RSS less the host tier, the host tier) at the last sample of each minute: whether memory
        levels off or keeps climbing, and whether the host tier reached its budget (evictions ran)."""
        last: dict[int, tuple[float, float]] = {}
        for t, rss, host in self.samples:
            last[int(t // 60)] = (rss - host, host)
        return [last[minute] for minute in sorted(last)]


def verdict(outcome: Outcome) -> list[str]:
    """The targets the soak missed (none: it passed)."""
    missed = []
    if not outcome.alive:
        missed.append("the server process died")
    if outcome.engine_restarts:
        missed.append(f"the engine died and was started again {outcome.engine_restarts:g} time(s)")
    if outcome.traceback:
        missed.append("a traceback in the server log")
    if outcome.failures:
        missed.append(f"{outcome.failures} answer(s) broke the target (locust's failures: see above)")
    missing = missing_codes(outcome.counts)
    if missing:
        missed.append(f"non-200 answers counted without a code: {', '.join(missing)}")
    memory = outcome.memory()
    if memory is None:
        missed.append("no memory sample")
    else:
        _start, minute, peak, _end = memory
        if peak - minute > MEMORY_GROWTH_MIB:
            missed.append(
                f"memory grew {peak - minute:.0f} MB after the first minute (at most {MEMORY_GROWTH_MIB})"
            )
    return missed


def failure_count(stats_csv: Path) -> int:
    """The failures of locust's aggregated row (0 when it wrote none)."""
    if not stats_csv.exists():
        return 0
    with stats_csv.open() as stats:
        rows = [row for row in csv.DictReader(stats) if row["Name"] == "Aggregated"]
    return int(rows[0]["Failure Count"]) if rows else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--users", type=int, default=8)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="decider-soak-"))
    results = workdir / "results.json"
    samples: list[tuple[float, float, float]] = []  # (seconds, RSS, of which the host tier), MiB
    with run_local_server() as server:
        stop = threading.Event()
        started = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                rss = server.memory_kib() / 1024
                samples.append((time.monotonic() - started, rss, host_tier_mib(server.base_url)))
                stop.wait(5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        locust = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary"]
        locust += ["-u", str(args.users), "-r", str(args.users), "-t", f"{int(args.minutes * 60)}s"]
        locust += ["--host", server.base_url, "--csv", str(workdir / "soak"), "--exit-code-on-error", "0"]
        subprocess.run(locust, env={**os.environ, "SOAK_RESULTS": str(results)}, check=False)
        stop.set()
        sampler.join()
        alive = server.process.poll() is None
        restarts = engine_restarts(server.base_url) if alive else 0.0
        traceback = "Traceback" in server.logs()
    report = json.loads(results.read_text()) if results.exists() else {"counts": {}}
    outcome = Outcome(
        alive, restarts, traceback, report["counts"], failure_count(workdir / "soak_stats.csv"), samples
    )
    print(f"\nsoak: {args.minutes:g} min, {args.users} users; server alive at the end: {alive}")
    print(f"engine restarts: {restarts:g}; a traceback in the server log: {traceback}")
    print("\nrequests by route, status and code:")
    for key, count in sorted(outcome.counts.items()):
        print(f"  {count:7d}  {key}")
    print("\nlatency per route (ms):")
    with (workdir / "soak_stats.csv").open() as stats:
        for row in csv.DictReader(stats):
            name, count, p50, p95 = row["Name"], row["Request Count"], row["50%"], row["95%"]
            print(f"  {name:28s} n={count:>6s}  p50={p50:>6s}  p95={p95:>6s}")
    print(f"\nlargest gap between a stream's chunks: {report.get('largest_gap_seconds', 0):.2f} s")
    memory = outcome.memory()
    if memory is not None:
        start, minute, peak, end = memory
        print(f"server RSS (front + engine) less the host tier: {start:.0f} MB at the start, {minute:.0f} MB")
        print(f"  after the first minute, {peak:.0f} MB peak after it, {end:.0f} MB at the end")
        _t, rss, host = samples[-1]
        print(f"  (at the end: RSS {rss:.0f} MB, of which the host tier of kept states {host:.0f} MB)")
        minutes = ", ".join(f"{less:.0f}+{host:.0f}" for less, host in outcome.per_minute())
        print(f"  each minute, RSS less the host tier + the host tier (MB): {minutes}")
    missed = verdict(outcome)
    print("\nsoak: " + ("passed" if not missed else "FAILED: " + "; ".join(missed)))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
