"""The mixed-traffic soak (issue 23 §4): the real server, locust's users, a report.

    python -m decider_dev.soak.run [--minutes 10] [--users 8]

Starts `serve` on the bundled model, runs tools/dev/soak/locustfile.py headless against it for
`--minutes`, samples the server's resident memory every 5 s, and prints: requests by route, status
and error code; p50/p95 per route (locust's CSV); the largest gap between a stream's chunks; the
memory after the first minute and at the end. Targets: no crash, no 5xx except typed 503/504 whose
`retryable` is true, memory flat after the first minute. `make soak` runs it for 10 minutes; never
part of `make test`.

Memory is sampled as RSS less what the host-memory tier of kept states holds (the
`decider_cache_host_bytes` gauge): that tier grows by design, up to DECIDER_STATE_CACHE_HOST_MIB
(2 GiB by default), as evicted states and chat turns are saved, so the raw RSS of a soak whose
users send new states keeps rising for as long as the budget is not full. Both are printed.
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
from pathlib import Path

import httpx

from decider_dev.bench.common import unlabelled_metrics
from decider_dev.local_server import run_local_server
from decider_dev.soak.accounting import missing_codes

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


HOST_BYTES = "decider_cache_host_bytes"


def host_tier_mib(base_url: str) -> float:
    """What the host-memory tier of kept states holds now (the decider_cache_host_bytes gauge)."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return unlabelled_metrics(text, [HOST_BYTES])[HOST_BYTES] / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--users", type=int, default=8)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="decider-soak-"))
    results = workdir / "results.json"
    samples: list[tuple[float, float, float]] = []  # (seconds, RSS, of which the host tier), MiB
    with run_local_server() as server:
        pid, stop = server.process.pid, threading.Event()
        started = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic() - started, rss_mib(pid), host_tier_mib(server.base_url)))
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
        traceback = "Traceback" in server.logs()
    report = json.loads(results.read_text()) if results.exists() else {"counts": {}}
    print(f"\nsoak: {args.minutes:g} min, {args.users} users; server alive at the end: {alive}")
    print(f"a traceback in the server log: {traceback}")
    print("\nrequests by route, status and code:")
    for key, count in sorted(report["counts"].items()):
        print(f"  {count:7d}  {key}")
    print("\nlatency per route (ms):")
    with (workdir / "soak_stats.csv").open() as stats:
        for row in csv.DictReader(stats):
            name, count, p50, p95 = row["Name"], row["Request Count"], row["50%"], row["95%"]
            print(f"  {name:28s} n={count:>6s}  p50={p50:>6s}  p95={p95:>6s}")
    missing = missing_codes(report["counts"])
    if missing:
        print(f"non-200 answers counted without a code (a finding): {', '.join(missing)}")
    print(f"\nlargest gap between a stream's chunks: {report.get('largest_gap_seconds', 0):.2f} s")
    less_host = [(t, rss - host) for t, rss, host in samples]
    after_first = [rss for t, rss in less_host if t >= 60] or [rss for _, rss in less_host]
    if after_first:
        start, minute, end = less_host[0][1], after_first[0], less_host[-1][1]
        print(f"server RSS less the host tier: {start:.0f} MB at the start, {minute:.0f} MB after the")
        print(f"  first minute, {max(after_first):.0f} MB peak after it, {end:.0f} MB at the end")
        _t, rss, host = samples[-1]
        print(f"  (at the end: RSS {rss:.0f} MB, of which the host tier of kept states {host:.0f} MB)")
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
