"""`make bench-server`: the real server under N concurrent clients on JevBench-240 cases.

Two measurements in one run, side by side on the same requests:

1. HTTP overhead. Each case is decided by an in-process engine and by `POST /invocations` on the
   real server (same model, same settings), one request at a time, alternating which goes first.
   `http_vs_engine` = total HTTP end-to-end time / total in-process time (target: at most 1.10).
2. Load. N clients send the cases concurrently; throughput, p50/p95/p99 latency, and `/ping`
   latency (probed every 100 ms during the load) are reported.

The last line is machine-readable:
    http_vs_engine=… rps=… p50=… p95=… p99=… ping_p99=…      (times in seconds)

JevBench data: Apache-2.0, Copyright 2026 Chen Feng (read in place from ../shared; not copied).
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from tools.evaluate.cases import JEVBENCH_240_CASES, load_items
from tools.evaluate.metrics import percentile
from tools.local_server import run_local_server

DEFAULT_CASES = JEVBENCH_240_CASES


def load_cases(path: Path, limit: int) -> list[dict[str, Any]]:
    """The first `limit` cases, as decision requests (state + questions only)."""
    return [item.request for item in load_items(path)[:limit]]


@dataclass
class LoadResult:
    latencies: list[float] = field(default_factory=list)
    errors: dict[int | str, int] = field(default_factory=dict)  # HTTP status or exception name
    wall_seconds: float = 0.0
    pings: list[float] = field(default_factory=list)
    ping_failures: int = 0


def _engine_settings_env(threads: int | None) -> dict[str, str]:
    return {"DECIDER_N_THREADS": str(threads)} if threads else {}


def measure_overhead(
    client: httpx.Client, engine: Any, cases: list[dict[str, Any]]
) -> tuple[list[float], list[float]]:
    """Per-case seconds in-process and over HTTP, alternating the order to cancel drift."""
    from decider.schemas.decision import parse_decision_request

    engine_times: list[float] = []
    http_times: list[float] = []

    def in_process(case: dict[str, Any]) -> None:
        started = time.perf_counter()
        engine.decide(parse_decision_request(case)).to_wire()
        engine_times.append(time.perf_counter() - started)

    def over_http(case: dict[str, Any]) -> None:
        started = time.perf_counter()
        response = client.post("/invocations", json=case)
        response.raise_for_status()
        response.json()
        http_times.append(time.perf_counter() - started)

    for i, case in enumerate(cases):
        first, second = (in_process, over_http) if i % 2 == 0 else (over_http, in_process)
        first(case)
        second(case)
    return engine_times, http_times


def _probe_ping(base_url: str, stop: threading.Event, result: LoadResult, interval: float) -> None:
    with httpx.Client(base_url=base_url, timeout=5) as client:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                ok = client.get("/ping").status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                result.pings.append(time.perf_counter() - started)
            else:
                result.ping_failures += 1
            stop.wait(interval)


def run_load(
    base_url: str, cases: list[dict[str, Any]], concurrency: int, ping_interval: float
) -> LoadResult:
    result = LoadResult()
    work: queue.Queue[dict[str, Any]] = queue.Queue()
    for case in cases:
        work.put(case)
    lock = threading.Lock()

    def client_loop() -> None:
        with httpx.Client(base_url=base_url, timeout=120) as client:
            while True:
                try:
                    case = work.get_nowait()
                except queue.Empty:
                    return
                started = time.perf_counter()
                try:
                    status: int | str = client.post("/invocations", json=case).status_code
                except httpx.HTTPError as exc:  # recorded like an error status; the client goes on
                    status = type(exc).__name__
                elapsed = time.perf_counter() - started
                with lock:
                    if status == 200:
                        result.latencies.append(elapsed)
                    else:
                        result.errors[status] = result.errors.get(status, 0) + 1

    stop = threading.Event()
    prober = threading.Thread(target=_probe_ping, args=(base_url, stop, result, ping_interval), daemon=True)
    prober.start()
    started = time.perf_counter()
    clients = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    result.wall_seconds = time.perf_counter() - started
    stop.set()
    prober.join()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES, help="JevBench-style cases.jsonl")
    parser.add_argument(
        "--limit", type=int, default=12, help="first N cases (default 12: a few minutes on 2 quiet cores)"
    )
    parser.add_argument("--concurrency", type=int, default=4, help="concurrent clients in the load phase")
    parser.add_argument(
        "--threads", type=int, default=None, help="DECIDER_N_THREADS for both (default: all cores)"
    )
    parser.add_argument("--ping-interval", type=float, default=0.1)
    args = parser.parse_args(argv)
    console = Console()

    from decider.engine import DecisionEngine
    from decider.engine.bundled import smollm2_path
    from decider.settings import Settings

    cases = load_cases(args.cases, args.limit)
    questions = sum(len(case["questions"]) for case in cases)
    env = _engine_settings_env(args.threads)
    settings = Settings(model_path=smollm2_path(), **({"n_threads": args.threads} if args.threads else {}))
    console.print(
        f"[bold]bench-server[/]: {len(cases)} JevBench-240 cases ({questions} questions), "
        f"{args.concurrency} clients, threads={settings.threads()}"
    )
    engine = DecisionEngine.load(settings)
    with run_local_server(env) as server, httpx.Client(base_url=server.base_url, timeout=120) as client:
        measure_overhead(client, engine, cases[:2])  # warm-up, both paths
        engine_times, http_times = measure_overhead(client, engine, cases)
        load = run_load(server.base_url, cases, args.concurrency, args.ping_interval)
    engine.close()

    ratio = sum(http_times) / sum(engine_times)
    per_request = statistics.median(h / e for h, e in zip(http_times, engine_times, strict=True))
    overhead = Table(title="HTTP /invocations vs in-process engine (same requests, sequential)")
    for column in ("path", "total s", "mean s", "p50 s", "p95 s"):
        overhead.add_column(column, justify="right")
    for name, times in (("in-process engine", engine_times), ("HTTP /invocations", http_times)):
        overhead.add_row(
            name,
            f"{sum(times):.3f}",
            f"{statistics.fmean(times):.4f}",
            f"{percentile(times, 50):.4f}",
            f"{percentile(times, 95):.4f}",
        )
    overhead.caption = (
        f"ratio of totals {ratio:.3f} (target ≤ 1.10); median per-request ratio {per_request:.3f}"
    )
    console.print(overhead)

    if not load.latencies:
        console.print(f"[red]no request succeeded under load: {load.errors}[/]")
        return 1
    rps = len(load.latencies) / load.wall_seconds
    p50, p95, p99 = (percentile(load.latencies, q) for q in (50, 95, 99))
    ping_p99 = percentile(load.pings, 99) if load.pings else float("nan")
    table = Table(title=f"Load: {args.concurrency} concurrent clients on /invocations")
    for column in (
        "requests",
        "errors",
        "wall s",
        "req/s",
        "p50 s",
        "p95 s",
        "p99 s",
        "/ping p99 s",
        "/ping max s",
    ):
        table.add_column(column, justify="right")
    table.add_row(
        str(len(load.latencies)),
        str(sum(load.errors.values())) + (f" {load.errors}" if load.errors else ""),
        f"{load.wall_seconds:.2f}",
        f"{rps:.3f}",
        f"{p50:.3f}",
        f"{p95:.3f}",
        f"{p99:.3f}",
        f"{ping_p99:.4f}",
        f"{max(load.pings):.4f}" if load.pings else "-",
    )
    console.print(table)
    if load.ping_failures:
        console.print(f"[red]{load.ping_failures} /ping probes failed[/]")
    print(
        f"http_vs_engine={ratio:.3f} rps={rps:.3f} p50={p50:.3f} p95={p95:.3f} p99={p99:.3f} "
        f"ping_p99={ping_p99:.4f}"
    )
    return 0 if not load.errors and not load.ping_failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
