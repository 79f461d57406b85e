"""`make bench-server`: the real server under 1, 4 and 8 concurrent clients on JevBench-240 cases.

Three measurements in one run, on one server started as the image starts it (default settings,
all cores), side by side on the same requests:

1. HTTP overhead. Each case is decided by an in-process engine and by `POST /invocations` on the
   server (same model, same settings), one request at a time, alternating which goes first.
   `http_vs_engine` = total HTTP end-to-end time / total in-process time (target: at most 1.10).
2. Concurrency sweep. The same requests (JevBench cases spread over the suite, `extensions: true`)
   go to `/invocations` from 1, 4 and 8 closed-loop clients (each sends its next request when its
   answer arrives). Per level: decisions/s, p50/p95 latency, the queue and engine time the
   responses report, `/ping` latency probed every 100 ms, and from the `/metrics` counters
   (`decider_engine_decodes_total`, `decider_engine_decode_rows`, `decider_engine_decode_tokens`)
   llama_decode calls per request and rows and tokens per decode. Every answer is compared with
   the 1-client answer to the same request.
3. Batch route. N states that share one question set, as one `POST /v1/systemone/batch`, against
   the same N states as N separate `/v1/systemone` requests (one client, and N concurrent clients).
4. The text route (when llama-server is there: `make llama-server`, or `--llama-server PATH`). The
   sweep's questions, one chat request each to llama-server on the same model, threads and context,
   with its prompt cache, from 1 and 4 clients, a fresh llama-server for each (tools/dev/bench/text_route.py).
   `--text-requests` of the sweep's requests (default 8) go through the decision route, then the text
   route, then the decision route again, back to back. `decision_vs_text` = llama-server's wall time
   / the mean of the two decision-route wall times (above 1: we are faster; a drift of the machine's
   speed cancels out); `argmax_agree` = the share of questions where both pick the same option;
   `text_prompt_tokens` / `decision_tokens` = the tokens each evaluated.
5. Mixed traffic. `--mixed-requests` of the sweep's requests (default 8), one at a time, alone and
   then again while `--mixed-chats` clients (default 4) keep streaming chats with the default
   max_tokens beside them; `decision_p50_ratio` / `decision_p95_ratio` = beside / alone (1.0: the
   chats cost the decisions nothing), `chat_tokens_per_second` = every chat's streamed tokens while
   the decisions ran beside them, and how the chats ended (`cut`: closed at the level's end);
   `--levels mixed` runs it alone, on a fresh server.
   A batch beside a chat (`batch_chat`, on a fresh server, caches off as above): one
   `/v1/systemone/batch` of `--batch-chat-states` states (default 16), and a streaming chat sent 1 s
   after it. `chat_ttft_vs_target` = the chat's time to first token beside the batch / issue 34's
   bound, max(5 x the chat's alone, a quarter of the batch's time alone) (at most 1: met);
   `chat_gap_beside` = the median gap between its later tokens;
   `batch_beside_over_alone` = what the chat cost the batch.
6. Multi-turn chat. `--multi-turn-conversations` conversations (default 3) of `--turns` turns
   (default 5, greedy, 64 tokens per answer), each turn carrying the earlier ones, each conversation
   opened by a system message of its own, on a fresh server with the default caches (kept chat
   turns) and then on one without them: the median time to first token of the last turn over the
   first's (`ttft_last_over_first`, target at most 1.5 at turn 5; `uncached_ttft_last_over_first`
   without the caches), and the prompt tokens the last turn copied (`cached_tokens_last`).
7. Real traffic (`traffic_levels`), each level on a fresh server with the default
   settings (states and exact repeats kept across requests) and a fresh llama-server, our side
   first, then llama-server's text route on the same questions, at 1 and 4 clients:
   - `repeat`: `--repeat-cases` cases (default 8) asked `--repeat-rounds` times (default 3), round
     robin, as an agent re-asks its states;
   - `hybrid` and `hybrid_repeat`: the same, once and repeated, on a random-weight qwen35 GGUF of
     realistic proportions (`--hybrid-layers` 16 of `--hybrid-embd` 512, tools/dev/qwen35_gguf.py, written
     once under .bench/), the production model's architecture.
   Each line has both sides' wall seconds and evaluated tokens (ours: the tokens decoded, from
   /metrics; theirs: `timings.prompt_n`) and the tokens our responses report as cached. Without
   llama-server, our side is printed alone (`decision_vs_text=nan`). `--against REV` also runs our
   side on that git revision's container package (a worktree under .bench/trees/, this checkout's
   environment) right after ours, against the same llama-server run (`against_vs_text`): a ratio an
   issue quotes from another machine is checked against the tree it was measured on, here.
   - `host` (the host-memory tier, `DECIDER_STATE_CACHE_HOST_MIB`; not part of `all` or `traffic`):
     `--host-states` cases (default 12: more than the 8 sequences kept in the context) asked twice,
     round robin, the first half of each case's questions and then the second half (new questions,
     so exact repeats answer nothing: each state must be prefilled again or come back), on a fresh
     server with the defaults and then on one with `DECIDER_STATE_CACHE_HOST_MIB=0`, one client;
     `host_vs_device_only` = the second's wall time / the first's (above 1: the tier pays).
   `--levels multi_turn`, `batch_chat`, `mixed`, `repeat`, `hybrid` or `host` runs that level alone.
   Phases 1-5 ask each case once, and the sweep asks the same requests at every level: there the
   server runs with both caches off (DECIDER_STATE_CACHE_SEQS=0, DECIDER_REPEAT_CACHE_ENTRIES=0), so
   that a level is never a replay of the one before.

The last lines are machine-readable (times in seconds; ratios against the 1-client run):
    http_vs_engine=… ping_p99=…
    batch_vs_separate=… batch_vs_concurrent=… batch_max_dp=…
    concurrency=1 decodes_per_request_ratio=… throughput_ratio=… p95_over_p50_1=… max_dp_vs_serial=…
    (one line per concurrency)
    text_route=llama-server concurrency=1 decision_vs_text=… argmax_agree=… text_errors=…
      text_prompt_tokens=… decision_tokens=…   (1 and 4 clients)
    mixed_chats=4 decision_p50_ratio=… decision_p95_ratio=… p50_alone=… p50_beside=… p95_alone=…
      p95_beside=… decision_errors=… chat_ends=…
    multi_turn=5 conversations=3 ttft_first=… ttft_last=… ttft_last_over_first=…
      uncached_ttft_last_over_first=… prompt_tokens_first=… prompt_tokens_last=… cached_tokens_first=…
      cached_tokens_last=… turn_ends=…
    batch_chat_states=16 chat_ttft_vs_target=… chat_ttft_alone=… chat_ttft_beside=… chat_gap_alone=…
      chat_gap_beside=… batch_alone=… batch_beside=… batch_beside_over_alone=… chat_end=… batch_status=…
    level=repeat concurrency=1 decision_vs_text=… decision_seconds=… text_seconds=…
      decision_tokens=… cached_tokens=… text_prompt_tokens=… errors=…   (repeat, hybrid, hybrid_repeat)
    level=host states=… host_vs_device_only=… host_seconds=… device_only_seconds=… cached_tokens=…
      cached_tokens_device_only=… decision_tokens=… decision_tokens_device_only=… errors=…

JevBench data: Apache-2.0, Copyright 2026 Chen Feng (the `jevbench` package's cases:
decider_cli.evaluate.jevbench).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import queue
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from decider_cli.evaluate.jevbench import JEVBENCH_240_CASES
from decider_cli.evaluate.metrics import percentile
from decider_dev import REPO_ROOT
from decider_dev.bench.common import (
    NO_CACHES,
    Distributions,
    distributions,
    key_values,
    load_cases,
    max_abs_delta,
    model_settings,
    ratio,
    request_body,
    run_clients_in_parallel,
    same_questions_group,
    server_environment,
    spread,
    unlabelled_metrics,
)
from decider_dev.bench.text_route import find_llama_server, run_llama_server, run_text_route, text_questions
from decider_dev.local_server import run_local_server

DEFAULT_CASES = JEVBENCH_240_CASES
TEXT_ROUTE_CLIENTS = (1, 4)
# The once-asked phases and the sweep (which asks the same requests at every level) run without
# the caches: a level must not replay the one before. The traffic levels run with the defaults.
BENCH_DIR = REPO_ROOT / ".bench"
CLIENT_TIMEOUT_SECONDS = 120  # above the server's 55 s deadline: the server, not the client, gives up
# The /metrics series the sweep reads (counter and histogram sums/counts, cumulative since start).
ENGINE_SERIES = (
    "decider_engine_decodes_total",
    "decider_engine_decode_rows_sum",
    "decider_engine_decode_rows_count",
    "decider_engine_decode_tokens_sum",
    "decider_engine_decode_tokens_count",
)


def engine_counters(metrics_text: str) -> dict[str, float]:
    """The engine's decode counters from a Prometheus text exposition (missing series read as 0)."""
    return unlabelled_metrics(metrics_text, ENGINE_SERIES)


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in ENGINE_SERIES}


def scrape(client: httpx.Client) -> dict[str, float]:
    response = client.get("/metrics")
    response.raise_for_status()
    return engine_counters(response.text)


@dataclass
class Outcome:
    index: int
    seconds: float
    status: int | str  # 200, "<status> <error code>", or the exception's name
    body: dict[str, Any] | None = None


@dataclass
class Level:
    """One concurrency level of the sweep."""

    clients: int
    outcomes: list[Outcome] = field(default_factory=list)
    wall_seconds: float = 0.0
    pings: list[float] = field(default_factory=list)
    ping_failures: int = 0
    counters: dict[str, float] = field(default_factory=dict)  # deltas over the level

    @property
    def ok(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200]

    @property
    def errors(self) -> dict[int | str, int]:
        counts: dict[int | str, int] = {}
        for outcome in self.outcomes:
            if outcome.status != 200:
                counts[outcome.status] = counts.get(outcome.status, 0) + 1
        return counts

    @property
    def latencies(self) -> list[float]:
        return [o.seconds for o in self.ok]

    @property
    def decisions(self) -> int:
        return sum(len(o.body["answers"]) for o in self.ok if o.body)

    @property
    def decisions_per_second(self) -> float:
        return ratio(self.decisions, self.wall_seconds)

    @property
    def decodes_per_request(self) -> float:
        """llama_decode calls per answered request (a refused request costs none)."""
        return ratio(self.counters.get("decider_engine_decodes_total", math.nan), len(self.ok))

    def per_decode(self, what: str) -> float:
        return ratio(
            self.counters.get(f"decider_engine_decode_{what}_sum", math.nan),
            self.counters.get(f"decider_engine_decode_{what}_count", math.nan),
        )

    def timing(self, key: str) -> list[float]:
        """`timing.<key>` of every answered request, as its extensions report it."""
        return [o.body["extensions"]["timing"][key] for o in self.ok if o.body and o.body.get("extensions")]

    def answers(self) -> dict[int, Distributions]:
        return {o.index: distributions(o.body) for o in self.ok if o.body}

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the answered decisions report as read from the caches (`extensions`)."""
        return sum(int((o.body or {}).get("extensions", {}).get("cached_tokens", 0)) for o in self.ok)

    @property
    def decoded_tokens(self) -> float:
        return self.counters.get("decider_engine_decode_tokens_sum", math.nan)


# --- clients -----------------------------------------------------------------------------------------
def _probe_ping(base_url: str, stop: threading.Event, level: Level, interval: float) -> None:
    with httpx.Client(base_url=base_url, timeout=5) as client:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                ok = client.get("/ping").status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                level.pings.append(time.perf_counter() - started)
            else:
                level.ping_failures += 1
            stop.wait(interval)


def post(client: httpx.Client, path: str, body: dict[str, Any], index: int) -> Outcome:
    started = time.perf_counter()
    try:
        response = client.post(path, json=body)
    except httpx.HTTPError as exc:  # recorded like an error status; the client goes on
        return Outcome(index, time.perf_counter() - started, type(exc).__name__)
    elapsed = time.perf_counter() - started
    if response.is_success:
        return Outcome(index, elapsed, response.status_code, response.json())
    return Outcome(index, elapsed, f"{response.status_code} {error_code(response)}")


def error_code(response: httpx.Response) -> str:
    """The machine-readable code of an error body (`{"error": {"code"}}`), else its reason phrase."""
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return response.reason_phrase


def run_clients(
    base_url: str, path: str, bodies: list[dict[str, Any]], clients: int, ping_interval: float | None
) -> Level:
    """`clients` closed-loop clients share the bodies in order; every outcome is kept by body index."""
    level = Level(clients)
    work: queue.Queue[int] = queue.Queue()
    for index in range(len(bodies)):
        work.put(index)
    lock = threading.Lock()

    def client_loop() -> None:
        with httpx.Client(base_url=base_url, timeout=CLIENT_TIMEOUT_SECONDS) as client:
            while True:
                try:
                    index = work.get_nowait()
                except queue.Empty:
                    return
                outcome = post(client, path, bodies[index], index)
                with lock:
                    level.outcomes.append(outcome)

    stop = threading.Event()
    prober = None
    if ping_interval:
        prober = threading.Thread(
            target=_probe_ping, args=(base_url, stop, level, ping_interval), daemon=True
        )
        prober.start()
    level.wall_seconds = run_clients_in_parallel(clients, client_loop)
    stop.set()
    if prober is not None:
        prober.join()
    level.outcomes.sort(key=lambda outcome: outcome.index)
    return level


def measured_level(
    base_url: str, path: str, bodies: list[dict[str, Any]], clients: int, ping_interval: float | None
) -> Level:
    """One run of `run_clients` with the engine's counter deltas over it."""
    with httpx.Client(base_url=base_url, timeout=10) as client:
        before = scrape(client)
        level = run_clients(base_url, path, bodies, clients, ping_interval)
        level.counters = counter_delta(before, scrape(client))
    return level


def fresh_server_level(
    env: dict[str, str], bodies: list[dict[str, Any]], clients: int, warm_up: dict[str, Any]
) -> Level:
    """`bodies` to `/invocations` from `clients` clients on a fresh server with `env`, measured after
    one request of its own (`warm_up`, a case outside the measured ones)."""
    with run_local_server(env) as server:
        run_clients(server.base_url, "/invocations", [warm_up], 1, None)
        return measured_level(server.base_url, "/invocations", bodies, clients, None)


# --- phases ------------------------------------------------------------------------------------------
def measure_overhead(
    client: httpx.Client, engine: Any, cases: list[dict[str, Any]]
) -> tuple[list[float], list[float]]:
    """Per-case seconds in-process and over HTTP, alternating the order to cancel drift."""
    from decider.schemas.decision import parse_decision_request
    from decider.server.answers import decide

    engine_times: list[float] = []
    http_times: list[float] = []

    def in_process(case: dict[str, Any]) -> None:
        started = time.perf_counter()
        decide(engine, parse_decision_request(request_body(case))).to_wire()
        engine_times.append(time.perf_counter() - started)

    def over_http(case: dict[str, Any]) -> None:
        started = time.perf_counter()
        response = client.post("/invocations", json=request_body(case))
        response.raise_for_status()
        response.json()
        http_times.append(time.perf_counter() - started)

    for i, case in enumerate(cases):
        first, second = (in_process, over_http) if i % 2 == 0 else (over_http, in_process)
        first(case)
        second(case)
    return engine_times, http_times


def sweep_dp(level: Level, serial: dict[int, Distributions]) -> float:
    """Largest |Δp| between this level's answers and the 1-client answers to the same requests."""
    worst = 0.0
    for index, probs in level.answers().items():
        if index in serial:
            worst = max(worst, max_abs_delta(probs, serial[index]))
    return worst


@dataclass
class BatchResult:
    states: int
    questions: int
    batch: Level
    sequential: Level
    concurrent: Level

    def max_dp(self, against: Level) -> float:
        outcome = self.batch.ok[0] if self.batch.ok else None
        if outcome is None or outcome.body is None:
            return math.nan
        separate = against.answers()
        worst = 0.0
        for index, result in enumerate(outcome.body["results"]):
            if index in separate:
                worst = max(worst, max_abs_delta(distributions(result), separate[index]))
        return worst


def measure_batch(base_url: str, group: list[dict[str, Any]]) -> BatchResult:
    """N states with one question set: one batch request, N sequential and N concurrent requests."""
    questions = group[0]["questions"]
    singles = [{"state": case["state"], "questions": questions} for case in group]
    batch = {"states": [case["state"] for case in group], "questions": questions}
    return BatchResult(
        states=len(group),
        questions=len(questions),
        batch=measured_level(base_url, "/v1/systemone/batch", [batch], 1, None),
        sequential=measured_level(base_url, "/v1/systemone", singles, 1, None),
        concurrent=measured_level(base_url, "/v1/systemone", singles, len(singles), None),
    )


# --- output ------------------------------------------------------------------------------------------
def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def concurrency_line(level: Level, serial: Level, serial_answers: dict[int, Distributions]) -> str:
    return key_values(
        (
            ("concurrency", str(level.clients)),
            ("decodes_per_request_ratio", ratio(level.decodes_per_request, serial.decodes_per_request)),
            ("throughput_ratio", ratio(level.decisions_per_second, serial.decisions_per_second)),
            ("p95_over_p50_1", ratio(percentile(level.latencies, 95), percentile(serial.latencies, 50))),
            ("max_dp_vs_serial", f"{sweep_dp(level, serial_answers):.4f}"),
        )
    )


def print_overhead(console: Console, engine_times: list[float], http_times: list[float]) -> float:
    total = ratio(sum(http_times), sum(engine_times))
    per_request = statistics.median(h / e for h, e in zip(http_times, engine_times, strict=True))
    table = Table(title="HTTP /invocations vs in-process engine (same requests, sequential)")
    for column in ("path", "total s", "mean s", "p50 s", "p95 s"):
        table.add_column(column, justify="right")
    for name, times in (("in-process engine", engine_times), ("HTTP /invocations", http_times)):
        table.add_row(
            name,
            f"{sum(times):.3f}",
            f"{statistics.fmean(times):.4f}",
            f"{percentile(times, 50):.4f}",
            f"{percentile(times, 95):.4f}",
        )
    table.caption = f"ratio of totals {total:.3f} (target ≤ 1.10); median per-request ratio {per_request:.3f}"
    console.print(table)
    return total


def print_sweep(console: Console, levels: list[Level], serial_answers: dict[int, Distributions]) -> None:
    table = Table(title="Concurrency sweep: the same JevBench requests on /invocations")
    for column in (
        "clients", "requests", "errors", "wall s", "decisions/s", "p50 s", "p95 s", "queue p50 s",
        "engine p50 s", "decodes/request", "rows/decode", "tokens/decode", "/ping p99 s", "max |Δp| vs 1",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for level in levels:
        errors = level.errors
        table.add_row(
            str(level.clients),
            str(len(level.outcomes)),
            str(sum(errors.values())) + (f" {errors}" if errors else ""),
            f"{level.wall_seconds:.2f}",
            f"{level.decisions_per_second:.3f}",
            f"{percentile(level.latencies, 50):.3f}",
            f"{percentile(level.latencies, 95):.3f}",
            f"{median(level.timing('queue_seconds')):.3f}",
            f"{median(level.timing('engine_seconds')):.3f}",
            f"{level.decodes_per_request:.2f}",
            f"{level.per_decode('rows'):.2f}",
            f"{level.per_decode('tokens'):.1f}",
            f"{percentile(level.pings, 99):.4f}" if level.pings else "-",
            f"{sweep_dp(level, serial_answers):.4f}",
        )
    table.caption = (
        "Targets: at 8 clients decodes/request ≤ 0.5× and p95 ≤ 8× the 1-client p50; "
        "decisions/s at 4 and 8 ≥ 0.95×; |Δp| ≤ 0.01"
    )
    console.print(table)


def print_batch(console: Console, result: BatchResult) -> None:
    table = Table(
        title=f"/v1/systemone/batch: {result.states} states × {result.questions} questions "
        "against the same states as separate /v1/systemone requests"
    )
    for column in (
        "how",
        "requests",
        "errors",
        "wall s",
        "decisions/s",
        "decodes",
        "rows/decode",
        "max |Δp|",
    ):
        table.add_column(column, justify="right")
    decisions = result.states * result.questions
    for name, level, delta in (
        ("one batch request", result.batch, "-"),
        ("separate, 1 client", result.sequential, f"{result.max_dp(result.sequential):.4f}"),
        (f"separate, {result.states} clients", result.concurrent, f"{result.max_dp(result.concurrent):.4f}"),
    ):
        table.add_row(
            name,
            str(len(level.outcomes)),
            str(sum(level.errors.values())) + (f" {level.errors}" if level.errors else ""),
            f"{level.wall_seconds:.2f}",
            f"{ratio(decisions, level.wall_seconds):.3f}",
            f"{level.counters.get('decider_engine_decodes_total', math.nan):.0f}",
            f"{level.per_decode('rows'):.2f}",
            delta,
        )
    table.caption = "max |Δp|: each state's batch answers against its separate answers"
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES, help="JevBench-style cases.jsonl")
    parser.add_argument(
        "--requests", type=int, default=16, help="requests per concurrency level (default 16)"
    )
    parser.add_argument(
        "--concurrency",
        default="1,4,8",
        help="client counts of the sweep, comma-separated; 1 is always run first (default 1,4,8)",
    )
    parser.add_argument("--overhead-cases", type=int, default=4, help="cases of the HTTP-overhead phase")
    parser.add_argument(
        "--text-requests",
        type=int,
        default=8,
        help="requests of the sweep asked again through both routes for the text-route lines (default 8)",
    )
    parser.add_argument(
        "--batch-states",
        type=int,
        default=6,
        help="states of the batch-route comparison (default 6: all of them fit one memory epoch)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 8 requests, 2 overhead cases, 3 states (in the batch route and beside a chat)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="DECIDER_N_THREADS for both (default: physical cores)"
    )
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the bundled SmolLM2)")
    parser.add_argument(
        "--n-gpu-layers", type=int, default=0, help="DECIDER_N_GPU_LAYERS for both (-1: all; a CUDA build)"
    )
    parser.add_argument("--ping-interval", type=float, default=0.1)
    parser.add_argument(
        "--mixed-chats",
        default="4",
        help="chats generating beside the mixed level's decisions, comma-separated (default 4; 0: skip)",
    )
    parser.add_argument(
        "--batch-chat-states",
        type=int,
        default=16,
        help="states of the batch a chat is sent beside (default 16, as in issue 34; 0: skip)",
    )
    parser.add_argument(
        "--turns", type=int, default=5, help="turns of the multi-turn chat line (default 5; 0: skip)"
    )
    parser.add_argument(
        "--mixed-requests", type=int, default=8, help="decisions of the mixed level, alone and beside chats"
    )
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        help="llama-server binary for the text route (default: the "
        "one `make llama-server` built, else PATH; none: the text route is skipped)",
    )
    parser.add_argument("--repeat-cases", type=int, default=8, help="cases of the repeat levels (default 8)")
    parser.add_argument("--repeat-rounds", type=int, default=3, help="times each is asked (default 3)")
    parser.add_argument(
        "--hybrid-layers", type=int, default=16, help="layers of the hybrid GGUF (default 16)"
    )
    parser.add_argument("--hybrid-embd", type=int, default=512, help="its width (default 512)")
    parser.add_argument(
        "--multi-turn-conversations",
        type=int,
        default=3,
        help="conversations of the multi-turn level, on each server (default 3; the median per turn)",
    )
    parser.add_argument(
        "--host-states",
        type=int,
        default=12,
        help="cases of the host level, each asked twice (default 12: more than the 8 kept sequences)",
    )
    parser.add_argument(
        "--against",
        default=None,
        help="with the traffic levels: also run our side on this git revision's container package "
        "(e.g. the tree an issue was filed on), against the same llama-server runs (against_vs_text=)",
    )
    parser.add_argument(
        "--levels",
        default="all",
        choices=("all", "traffic", "repeat", "hybrid", "multi_turn", "batch_chat", "mixed", "host"),
        help="'all'; 'traffic' for the repeat and hybrid levels alone, 'repeat' or 'hybrid' for one of "
        "them, 'multi_turn' for the multi-turn chat alone, 'batch_chat' for a chat beside a batch alone, "
        "'mixed' for decisions beside chats alone, 'host' for the host-memory tier's level alone "
        "(default all; it has no 'host')",
    )
    args = parser.parse_args(argv)
    if args.levels in ("traffic", "repeat", "hybrid"):
        return traffic_main(args, args.levels)
    if args.levels == "multi_turn":
        return multi_turn_main(args)
    if args.levels == "batch_chat":
        return batch_chat_main(args)
    if args.levels == "mixed":
        return mixed_main(args)
    if args.levels == "host":
        return host_main(args)
    if args.quick:
        args.requests, args.overhead_cases, args.batch_states, args.text_requests = 8, 2, 3, 4
        args.batch_chat_states = min(args.batch_chat_states, 3)
    levels_wanted = sorted({1, *(int(n) for n in args.concurrency.split(",") if n.strip())})
    console = Console(width=200)

    from decider.engine import DecisionEngine
    from decider.engine.model.bundled import smollm2_path
    from decider.settings import Settings

    cases = load_cases(args.cases)
    sweep_cases = spread(cases, args.requests)
    bodies = [request_body(case, extensions=True) for case in sweep_cases]
    questions = sum(len(case["questions"]) for case in sweep_cases)
    fields = model_settings(args, smollm2_path())
    # The engine timed beside the server runs without caches too: a kept answer would make the
    # in-process side free (the overhead phase's warm-up case is measured again).
    settings = Settings(**fields, **NO_CACHES)
    env = server_environment({**fields, **NO_CACHES})
    console.print(
        f"[bold]bench-server[/]: {Path(settings.model_path).name}, threads={settings.threads()}, "
        f"n_gpu_layers={settings.n_gpu_layers}, batch_invariant={settings.batch_invariant}; "
        f"sweep: {len(bodies)} JevBench-240 requests ({questions} questions) at {levels_wanted} clients; "
        f"overhead: {args.overhead_cases} cases; batch: {args.batch_states} states"
    )
    with (
        run_local_server(env) as server,
        httpx.Client(base_url=server.base_url, timeout=CLIENT_TIMEOUT_SECONDS) as client,
    ):
        engine = DecisionEngine.load(settings)
        overhead_cases = spread(cases, args.overhead_cases)
        measure_overhead(client, engine, overhead_cases[:1])  # warm-up, both paths
        engine_times, http_times = measure_overhead(client, engine, overhead_cases)
        text_bodies = spread(bodies, args.text_requests)
        asked = text_questions(engine, text_bodies)
        # The text route's warm-up: a case the sweep does not ask, so no measured state is cached.
        warm_up = text_questions(engine, [request_body(next(c for c in cases if c not in sweep_cases))])
        engine.close()

        levels: list[Level] = []
        for clients in levels_wanted:
            console.print(f"[dim]{clients} client(s)…[/]")
            levels.append(
                measured_level(server.base_url, "/invocations", bodies, clients, args.ping_interval)
            )
        console.print("[dim]batch route…[/]")
        batch = measure_batch(server.base_url, same_questions_group(cases, args.batch_states))
        mixed = [
            measure_mixed(server.base_url, spread(bodies, args.mixed_requests), chats)
            for chats in (int(n) for n in args.mixed_chats.split(",") if n.strip())
            if chats > 0
        ]
        comparisons = compare_text_route(
            console,
            server.base_url,
            find_llama_server(args.llama_server),
            settings,
            text_bodies,
            asked,
            warm_up,
        )

    multi_turn = (
        measure_multi_turn_levels(console, fields, args.turns, args.multi_turn_conversations)
        if args.turns > 1
        else None
    )
    http_vs_engine = print_overhead(console, engine_times, http_times)
    serial = levels[0]
    serial_answers = serial.answers()
    print_sweep(console, levels, serial_answers)
    print_batch(console, batch)
    pings = [p for level in levels for p in level.pings]
    ping_failures = sum(level.ping_failures for level in levels)
    if ping_failures:
        console.print(f"[red]{ping_failures} /ping probes failed[/]")
    compared = [level for comparison in comparisons for level in (comparison.before, comparison.after)]
    failed = any(
        level.errors for level in (*levels, batch.batch, batch.sequential, batch.concurrent, *compared)
    )
    if failed:
        console.print("[red]some requests failed (see the errors columns)[/]")

    print(
        key_values(
            (
                ("http_vs_engine", f"{http_vs_engine:.3f}"),
                ("ping_p99", f"{percentile(pings, 99):.4f}"),
            )
        )
    )
    print(
        key_values(
            (
                ("batch_vs_separate", ratio(batch.sequential.wall_seconds, batch.batch.wall_seconds)),
                ("batch_vs_concurrent", ratio(batch.concurrent.wall_seconds, batch.batch.wall_seconds)),
                ("batch_max_dp", f"{batch.max_dp(batch.sequential):.4f}"),
            )
        )
    )
    for level in levels:
        print(concurrency_line(level, serial, serial_answers))
    for comparison in comparisons:
        print(text_route_line(comparison))
    for result in mixed:
        print(result.line())
    if multi_turn is not None:
        print(multi_turn.line())
    failed = failed or any(result.beside.errors or result.alone.errors for result in mixed)
    batch_chat_failed = batch_chat_main(args) if args.batch_chat_states > 0 else 0
    traffic_failed = traffic_main(args)
    return 1 if failed or ping_failures or batch_chat_failed or traffic_failed else 0


# --- real traffic: repeats, and the hybrid model ---------------------------------------------------
@dataclass
class TrafficLevel:
    """Our server and llama-server's text route on the same questions, each fresh (`traffic_levels`)."""

    name: str
    clients: int
    ours: Level
    text: Any = None  # TextRun, or None without llama-server
    against: Level | None = None  # the same on another tree's server (`--against`)

    def line(self) -> str:
        text_seconds = self.text.wall_seconds if self.text is not None else math.nan
        levels = [self.ours] if self.against is None else [self.ours, self.against]
        errors = sum(sum(level.errors.values()) for level in levels) + (self.text.errors if self.text else 0)
        against: tuple[tuple[str, float | str], ...] = ()
        if self.against is not None:
            against = (
                ("against_vs_text", ratio(text_seconds, self.against.wall_seconds)),
                ("against_seconds", f"{self.against.wall_seconds:.2f}"),
                ("against_tokens", f"{self.against.decoded_tokens:.0f}"),
            )
        return key_values(
            (
                ("level", self.name),
                ("concurrency", str(self.clients)),
                ("decision_vs_text", ratio(text_seconds, self.ours.wall_seconds)),
                ("decision_seconds", f"{self.ours.wall_seconds:.2f}"),
                ("text_seconds", f"{text_seconds:.2f}"),
                ("decision_tokens", f"{self.ours.decoded_tokens:.0f}"),
                ("cached_tokens", str(self.ours.cached_tokens)),
                ("text_prompt_tokens", str(self.text.prompt_tokens) if self.text is not None else "-"),
                *against,
                ("errors", str(errors)),
                ("error_codes", ",".join(f"{code}:{n}" for code, n in self.ours.errors.items()) or "-"),
            )
        )


def round_robin(bodies: list[dict[str, Any]], rounds: int) -> list[dict[str, Any]]:
    """The same cases asked `rounds` times, one round after the other (an agent re-asking its states)."""
    return [body for _ in range(rounds) for body in bodies]


def hybrid_model(layers: int, embd: int, tokenizer: Path) -> Path:
    """A random-weight qwen35 GGUF of `layers` x `embd` (written once under .bench/): the production
    model's architecture at a size this machine runs; the proportions of tools/dev/qwen35_gguf.py's."""
    from decider_dev.qwen35_gguf import HybridShape, write_qwen35

    path = BENCH_DIR / f"qwen35-{layers}x{embd}-random-Q4_1.gguf"
    if not path.is_file():
        heads = max(2, embd // 64)
        shape = HybridShape(
            n_embd=embd, n_layer=layers, n_head=heads, n_head_kv=max(1, heads // 4), head_dim=64,
            rope_dim=16, rope_sections=(3, 3, 2, 0), n_ff=3 * embd, ssm_state=64,
            ssm_groups=max(1, heads // 2), ssm_v_heads=heads,
        )  # fmt: skip
        BENCH_DIR.mkdir(exist_ok=True)
        partial = path.with_suffix(".partial")
        write_qwen35(partial, tokenizer, shape=shape)
        partial.rename(path)
    return path


def traffic_levels(
    console: Console,
    name: str,
    env: dict[str, str],
    settings: Any,
    bodies: list[dict[str, Any]],
    asked: list[Any],
    warm_up: tuple[dict[str, Any], list[Any]],
    binary: Path | None,
    against: Path | None = None,
) -> list[TrafficLevel]:
    """`bodies` on a fresh server with `env` (and on one running the `against` tree's container
    package, if given), then their questions (`asked`) on a fresh llama-server, at each of
    TEXT_ROUTE_CLIENTS; each warmed up on a case outside the measured ones."""
    levels = []
    for clients in TEXT_ROUTE_CLIENTS:
        console.print(f"[dim]{name}: {clients} client(s), {len(bodies)} requests…[/]")
        ours = fresh_server_level(env, bodies, clients, warm_up[0])
        other = None
        if against is not None:
            other = fresh_server_level({**env, "PYTHONPATH": str(against)}, bodies, clients, warm_up[0])
        text = None
        if binary is not None:
            try:
                with run_llama_server(
                    binary,
                    Path(settings.model_path),
                    settings.threads(),
                    max(TEXT_ROUTE_CLIENTS),
                    settings.n_ctx,
                ) as llama:
                    run_text_route(llama.base_url, warm_up[1], 1)
                    text = run_text_route(llama.base_url, asked, clients)
            except RuntimeError as exc:
                console.print(f"[red]{name}: text route skipped: {exc}[/]")
        levels.append(TrafficLevel(name, clients, ours, text, other))
    return levels


def traffic_main(args: Any, which: str = "traffic") -> int:
    """The repeat and hybrid levels (see the module docstring; `which`: 'repeat' or 'hybrid' alone,
    'traffic' both); 1 if a request failed."""
    from decider.engine import DecisionEngine
    from decider.engine.model.bundled import smollm2_path
    from decider.settings import Settings

    console = Console(width=200)
    cases = load_cases(args.cases)
    chosen = spread(cases, args.repeat_cases)
    once = [request_body(case, extensions=True) for case in chosen]
    repeated = round_robin(once, args.repeat_rounds)
    outside = next(case for case in cases if case not in chosen)
    binary = find_llama_server(args.llama_server)
    if binary is None:
        console.print("[yellow]traffic levels: no llama-server, our side only (`make llama-server`)[/]")
    fields = model_settings(args, smollm2_path())
    settings = Settings(**fields)
    engine = DecisionEngine.load(settings)  # the text route's prompts: same tokenizer on both models
    warm_up = (request_body(outside, extensions=True), text_questions(engine, [request_body(outside)]))
    asked_once, asked_repeated = text_questions(engine, once), text_questions(engine, repeated)
    engine.close()
    env = server_environment(fields)
    against = against_tree(args.against) if args.against else None
    levels = []
    if which in ("traffic", "repeat"):
        levels += traffic_levels(
            console, "repeat", env, settings, repeated, asked_repeated, warm_up, binary, against
        )
    if which in ("traffic", "hybrid"):
        hybrid = hybrid_model(args.hybrid_layers, args.hybrid_embd, smollm2_path())
        hybrid_fields = {**fields, "model_path": hybrid}
        hybrid_settings = Settings(**hybrid_fields)
        hybrid_env = server_environment(hybrid_fields)
        for name, bodies, asked in (
            ("hybrid", once, asked_once),
            ("hybrid_repeat", repeated, asked_repeated),
        ):
            levels += traffic_levels(
                console, name, hybrid_env, hybrid_settings, bodies, asked, warm_up, binary, against
            )
    for level in levels:
        print(level.line())
    failed = any(
        level.ours.errors or (level.against and level.against.errors) or (level.text and level.text.errors)
        for level in levels
    )
    return 1 if failed else 0


def against_tree(revision: str) -> Path:
    """The container package of `revision`, checked out once under .bench/trees/ (a git worktree):
    its server runs with this checkout's environment, so only the engine and server code differ."""
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{revision}^{{commit}}"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    tree = BENCH_DIR / "trees" / commit[:12]
    if not (tree / "container" / "decider").is_dir():
        subprocess.run(["git", "worktree", "prune"], cwd=REPO_ROOT, check=True)
        subprocess.run(
            ["git", "worktree", "add", "--force", "--detach", str(tree), commit],
            cwd=REPO_ROOT, check=True, capture_output=True,
        )  # fmt: skip
    return tree / "container"


def halves(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same state asked twice: the first half of its questions, then the second."""
    questions = list(body["questions"].items())
    middle = len(questions) // 2
    return {**body, "questions": dict(questions[:middle])}, {**body, "questions": dict(questions[middle:])}


@dataclass
class HostLevel:
    """The host-memory tier on traffic that comes back to its states with new questions."""

    states: int
    host: Level  # the defaults: kept states saved to host memory when evicted
    device_only: Level  # DECIDER_STATE_CACHE_HOST_MIB=0

    def line(self) -> str:
        levels = (self.host, self.device_only)
        return key_values(
            (
                ("level", "host"),
                ("states", str(self.states)),
                ("host_vs_device_only", ratio(self.device_only.wall_seconds, self.host.wall_seconds)),
                ("host_seconds", self.host.wall_seconds),
                ("device_only_seconds", self.device_only.wall_seconds),
                ("cached_tokens", str(self.host.cached_tokens)),
                ("cached_tokens_device_only", str(self.device_only.cached_tokens)),
                ("decision_tokens", f"{self.host.decoded_tokens:.0f}"),
                ("decision_tokens_device_only", f"{self.device_only.decoded_tokens:.0f}"),
                ("errors", str(sum(sum(level.errors.values()) for level in levels))),
            )
        )


def host_main(args: Any) -> int:
    """The host level alone (`--levels host`, see the module docstring); 1 if a request failed."""
    from decider.engine.model.bundled import smollm2_path
    from decider.settings import Settings

    console = Console(width=200)
    cases = [case for case in load_cases(args.cases) if len(case["questions"]) >= 2]
    chosen = spread(cases, args.host_states)
    asked = [halves(request_body(case, extensions=True)) for case in chosen]
    bodies = [first for first, _second in asked] + [second for _first, second in asked]
    warm_up = request_body(next(case for case in cases if case not in chosen), extensions=True)
    fields = model_settings(args, smollm2_path())
    runs = []
    for name, extra in (("host tier", {}), ("device only", {"state_cache_host_mib": 0})):
        console.print(f"[dim]host level, {name}: {len(chosen)} states, each asked twice…[/]")
        env = {Settings.env_name(key): str(value) for key, value in {**fields, **extra}.items()}
        runs.append(fresh_server_level(env, bodies, 1, warm_up))
    result = HostLevel(len(chosen), *runs)
    print(result.line())
    return 1 if any(level.errors for level in runs) else 0


@dataclass
class TextComparison:
    """One concurrency level of the text route, timed between two runs of the decision route on the
    same cases (decision, text, decision), so a drift of the machine's speed cancels out."""

    clients: int
    before: Level
    text: Any  # TextRun
    after: Level

    @property
    def decision_seconds(self) -> float:
        return (self.before.wall_seconds + self.after.wall_seconds) / 2


def compare_text_route(
    console: Console,
    base_url: str,
    binary: Path | None,
    settings: Any,
    bodies: list[dict[str, Any]],
    asked: list[Any],
    warm_up: list[Any],
    levels: tuple[int, ...] = TEXT_ROUTE_CLIENTS,
) -> list[TextComparison]:
    """The decision route (our server at `base_url`) against llama-server's text route on `bodies`,
    a fresh llama-server for each level so that its prompt cache cannot replay the level before."""
    if binary is None:
        console.print("[yellow]text route skipped: no llama-server (`make llama-server` builds one)[/]")
        return []
    comparisons = []
    try:
        for clients in levels:
            with run_llama_server(
                binary, Path(settings.model_path), settings.threads(), max(levels), settings.n_ctx
            ) as text:
                run_text_route(text.base_url, warm_up, 1)
                console.print(f"[dim]text route against the decision route, {clients} client(s)…[/]")
                before = measured_level(base_url, "/invocations", bodies, clients, None)
                run = run_text_route(text.base_url, asked, clients)
                after = measured_level(base_url, "/invocations", bodies, clients, None)
            comparisons.append(TextComparison(clients, before, run, after))
    except RuntimeError as exc:  # the rest of the run stands; say why these lines are missing
        console.print(f"[red]text route skipped: {exc}[/]")
    return comparisons


def text_route_line(comparison: TextComparison) -> str:
    """The decision route against llama-server's text route at one concurrency."""
    answers = comparison.before.answers()
    same = total = 0
    for (case, key), picked in comparison.text.answers.items():
        probs = answers.get(case, {}).get(key)
        if probs is not None:
            total += 1
            same += picked == probs.index(max(probs))
    tokens = comparison.before.counters.get("decider_engine_decode_tokens_sum", math.nan)
    return key_values(
        (
            ("text_route", "llama-server"),
            ("concurrency", str(comparison.clients)),
            ("decision_vs_text", ratio(comparison.text.wall_seconds, comparison.decision_seconds)),
            ("argmax_agree", ratio(same, total)),
            ("text_errors", str(comparison.text.errors)),
            ("text_prompt_tokens", str(comparison.text.prompt_tokens)),
            ("decision_tokens", f"{tokens:.0f}"),
        )
    )


# --- mixed level: decisions with chats running beside them --------------------------------------------
MIXED_CHAT_PROMPT = "Write a long story about a lighthouse keeper and the ships she saw."


@dataclass
class MixedResult:
    """The same decisions one at a time, alone and with `chats` chats generating beside them."""

    chats: int
    alone: Level
    beside: Level
    chat_ends: dict[str, int] = field(default_factory=dict)  # finish reason or error code -> chats
    chat_tokens_per_second: float = math.nan  # every chat's streamed tokens while the decisions ran

    def line(self) -> str:
        p50 = (percentile(self.alone.latencies, 50), percentile(self.beside.latencies, 50))
        p95 = (percentile(self.alone.latencies, 95), percentile(self.beside.latencies, 95))
        return key_values(
            (
                ("mixed_chats", str(self.chats)),
                ("decision_p50_ratio", ratio(p50[1], p50[0])),
                ("decision_p95_ratio", ratio(p95[1], p95[0])),
                ("p50_alone", p50[0]),
                ("p50_beside", p50[1]),
                ("p95_alone", p95[0]),
                ("p95_beside", p95[1]),
                ("chat_tokens_per_second", self.chat_tokens_per_second),
                ("decision_errors", str(self.beside.errors)),
                ("chat_ends", ",".join(f"{k}:{v}" for k, v in sorted(self.chat_ends.items())) or "none"),
            ),
            digits=3,
        )


def _chat_until(
    base_url: str, seed: int, stop: threading.Event, generating: threading.Barrier, arrivals: list[float]
) -> list[str]:
    """Stream chats (default max_tokens) one after another until `stop`; each one's end: its
    finish_reason, `cut` when `stop` closed it, or its error code. Waits at `generating` once its
    first chat has a token (or has failed); the time of every token it streams goes to `arrivals`."""
    body = {"messages": [{"role": "user", "content": MIXED_CHAT_PROMPT}], "temperature": 1.0, "stream": True}
    ends: list[str] = []
    waited = threading.Event()

    def ready() -> None:
        if not waited.is_set():
            waited.set()
            with contextlib.suppress(threading.BrokenBarrierError):
                generating.wait(120)

    with httpx.Client(base_url=base_url, timeout=CLIENT_TIMEOUT_SECONDS) as client:
        while not stop.is_set():
            end = "cut"
            with client.stream("POST", "/v1/chat/completions", json={**body, "seed": seed}) as response:
                if response.status_code != 200:
                    response.read()
                    end = f"{response.status_code} {error_code(response)}"
                    ready()
                for line in response.iter_lines() if response.status_code == 200 else ():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        end = str(chunk["error"].get("code"))
                    elif chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                        end = chunk["choices"][0]["finish_reason"]
                    elif chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                        arrivals.append(time.perf_counter())
                        ready()
                    if stop.is_set():
                        break
            ends.append(end)
            seed += 1000
    return ends


def measure_mixed(base_url: str, bodies: list[dict[str, Any]], chats: int) -> MixedResult:
    """`bodies` one at a time alone, then again while `chats` clients keep chats generating."""
    alone = measured_level(base_url, "/invocations", bodies, 1, None)
    stop = threading.Event()
    generating = threading.Barrier(chats + 1)
    threads: list[tuple[threading.Thread, list[list[str]]]] = []
    arrivals: list[float] = []  # list.append is atomic: the chat threads share it
    for seed in range(chats):
        out: list[list[str]] = []
        thread = threading.Thread(
            target=lambda seed=seed, out=out: out.append(
                _chat_until(base_url, seed, stop, generating, arrivals)
            ),
            daemon=True,
        )
        thread.start()
        threads.append((thread, out))
    with contextlib.suppress(threading.BrokenBarrierError):
        generating.wait(120)  # every chat is generating
    started = time.perf_counter()
    beside = measured_level(base_url, "/invocations", bodies, 1, None)
    ended = time.perf_counter()
    stop.set()
    ends: dict[str, int] = {}
    for thread, out in threads:
        thread.join(CLIENT_TIMEOUT_SECONDS)
        for end in out[0] if out else ["client_hung"]:
            ends[end] = ends.get(end, 0) + 1
    streamed = sum(1 for at in arrivals if started <= at <= ended)
    return MixedResult(chats, alone, beside, ends, streamed / (ended - started))


def mixed_main(args: Any) -> int:
    """The mixed level alone, on a fresh server with the caches off (as in 'all'); 1 if a request failed."""
    from decider.engine.model.bundled import smollm2_path

    env = server_environment({**model_settings(args, smollm2_path()), **NO_CACHES})
    bodies = [request_body(case, extensions=True) for case in spread(load_cases(args.cases), args.requests)]
    with run_local_server(env) as server:
        run_clients(server.base_url, "/invocations", bodies[-1:], 1, None)  # warm-up
        results = [
            measure_mixed(server.base_url, spread(bodies, args.mixed_requests), chats)
            for chats in (int(n) for n in args.mixed_chats.split(",") if n.strip())
            if chats > 0
        ]
    for result in results:
        print(result.line())
    return 1 if any(result.beside.errors or result.alone.errors for result in results) else 0


# --- a chat beside a batch: issue 34's first-come gate per unit -------------------------------------------
BATCH_CHAT_DELAY_SECONDS = 1.0  # the chat follows the batch by this much (issue 34's scenario)
BATCH_CHAT_ALONE_TRIES = 3  # the chat alone: the median of this many first tokens


@dataclass
class BatchBesideChat:
    """One batch alone and with a chat sent beside it; the chat's tokens alone and beside it."""

    states: int
    ttft_alone: float
    ttft_beside: float
    gap_alone: float  # the median gap between the chat's tokens
    gap_beside: float
    batch_alone: float
    batch_beside: float
    chat_end: str  # its finish_reason, or its error
    batch_status: str  # "200", or the status and error code

    @property
    def target(self) -> float:
        """Issue 34's bound on the chat's first token beside the batch."""
        return max(5 * self.ttft_alone, self.batch_alone / 4)

    @property
    def failed(self) -> bool:
        return self.batch_status != "200" or self.chat_end not in ("stop", "length")

    def line(self) -> str:
        return key_values(
            (
                ("batch_chat_states", str(self.states)),
                ("chat_ttft_vs_target", ratio(self.ttft_beside, self.target)),
                ("chat_ttft_alone", self.ttft_alone),
                ("chat_ttft_beside", self.ttft_beside),
                ("chat_gap_alone", self.gap_alone),
                ("chat_gap_beside", self.gap_beside),
                ("batch_alone", self.batch_alone),
                ("batch_beside", self.batch_beside),
                ("batch_beside_over_alone", ratio(self.batch_beside, self.batch_alone)),
                ("chat_end", self.chat_end),
                ("batch_status", self.batch_status),
            ),
            digits=3,
        )


@dataclass(frozen=True)
class ChatTimes:
    """One short streaming chat: seconds to its first content token, the median gap between its
    tokens after that (nan without them), and how it ended."""

    first: float
    gap: float
    end: str


def short_chat(client: httpx.Client) -> ChatTimes:
    """A 16-token streaming chat, timed token by token."""
    body = {"messages": [{"role": "user", "content": MIXED_CHAT_PROMPT}], "max_tokens": 16, "stream": True}
    started, arrivals, end = time.perf_counter(), [], "no_end"
    with client.stream("POST", "/v1/chat/completions", json={**body, "seed": 7}) as response:
        if response.status_code != 200:
            response.read()
            return ChatTimes(math.nan, math.nan, f"{response.status_code} {error_code(response)}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            choice = (chunk.get("choices") or [{}])[0]
            if "error" in chunk:
                end = str(chunk["error"].get("code"))
            elif choice.get("delta", {}).get("content"):
                arrivals.append(time.perf_counter() - started)
            if choice.get("finish_reason"):
                end = choice["finish_reason"]
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    return ChatTimes(arrivals[0] if arrivals else math.nan, median(gaps), end)


def timed_batch(base_url: str, body: dict[str, Any]) -> tuple[float, str]:
    """One batch request: its seconds, and "200" or its status and error code."""
    with httpx.Client(base_url=base_url, timeout=CLIENT_TIMEOUT_SECONDS) as client:
        started = time.perf_counter()
        response = client.post("/v1/systemone/batch", json=body)
        seconds = time.perf_counter() - started
    status = "200" if response.status_code == 200 else f"{response.status_code} {error_code(response)}"
    return seconds, status


def measure_batch_beside_chat(base_url: str, cases: list[dict[str, Any]], states: int) -> BatchBesideChat:
    """The chat alone, the batch alone, then the batch with the chat sent BATCH_CHAT_DELAY_SECONDS
    after it. The batch's states are `states` distinct cases under the fewest questions among them
    (so that the batch fits its deadline on a slow machine: 16 states of 12 questions take about
    the whole 55 s on SmolLM2 and 2 cores)."""
    chosen = spread(cases, states)
    questions = min((case["questions"] for case in chosen), key=len)
    batch = {"states": [case["state"] for case in chosen], "questions": questions}
    with httpx.Client(base_url=base_url, timeout=CLIENT_TIMEOUT_SECONDS) as client:
        short_chat(client)  # warm-up
        alone = [short_chat(client) for _ in range(BATCH_CHAT_ALONE_TRIES)]
        batch_alone, alone_status = timed_batch(base_url, batch)
        outcome: dict[str, tuple[float, str]] = {}
        thread = threading.Thread(target=lambda: outcome.update(batch=timed_batch(base_url, batch)))
        thread.start()
        time.sleep(BATCH_CHAT_DELAY_SECONDS)
        beside = short_chat(client)
        thread.join(CLIENT_TIMEOUT_SECONDS)
    batch_beside, batch_status = outcome.get("batch", (math.nan, "client_hung"))
    if alone_status != "200":
        batch_status = f"alone {alone_status}"
    return BatchBesideChat(
        states=len(chosen),
        ttft_alone=median([chat.first for chat in alone]),
        ttft_beside=beside.first,
        gap_alone=median([chat.gap for chat in alone]),
        gap_beside=beside.gap,
        batch_alone=batch_alone,
        batch_beside=batch_beside,
        chat_end=beside.end,
        batch_status=batch_status,
    )


def batch_chat_main(args: Any) -> int:
    """The batch-beside-a-chat level on a fresh server, caches off (the batch does the same work
    twice); 1 if it failed."""
    from decider.engine.model.bundled import smollm2_path

    env = server_environment({**model_settings(args, smollm2_path()), **NO_CACHES})
    Console(width=200).print(f"[dim]batch beside a chat: {args.batch_chat_states} states…[/]")
    with run_local_server(env) as server:
        result = measure_batch_beside_chat(server.base_url, load_cases(args.cases), args.batch_chat_states)
    print(result.line())
    return 1 if result.failed else 0


# --- multi-turn chat: time to first token as a conversation grows ---------------------------------------
MULTI_TURN_QUESTIONS = (
    "Tell me about lighthouses.",
    "Who kept them lit?",
    "What did they eat?",
    "How did they spend the winter?",
    "Which one is the most famous?",
    "Why was it built there?",
)


@dataclass
class Turn:
    first_token_seconds: float
    prompt_tokens: int
    status: str  # a finish_reason, or an error
    cached_tokens: int = 0


def _stream_turn(client: httpx.Client, messages: list[dict[str, str]], max_tokens: int) -> tuple[Turn, str]:
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first, text, status, prompt_tokens, cached = math.nan, [], "no_end", 0, 0
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return Turn(math.nan, 0, f"{response.status_code} {error_code(response)}"), ""
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                status = str(chunk["error"].get("code"))
            for choice in chunk.get("choices") or ():
                if choice.get("delta", {}).get("content"):
                    if math.isnan(first):
                        first = time.perf_counter() - started
                    text.append(choice["delta"]["content"])
                if choice.get("finish_reason"):
                    status = choice["finish_reason"]
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Turn(first, prompt_tokens, status, cached), "".join(text)


def measure_multi_turn(base_url: str, turns: int = 5, max_tokens: int = 64, tag: str = "") -> list[Turn]:
    """One conversation of `turns` turns (greedy, `max_tokens` per answer), each turn carrying the
    earlier questions and answers: its time to first token, one client, nothing beside it. `tag`
    opens the conversation with a system message of its own, so that conversations share no
    prefix worth reusing (the default system prompt is about 30 tokens on SmolLM2)."""
    messages: list[dict[str, str]] = [{"role": "system", "content": tag}] if tag else []
    out: list[Turn] = []
    with httpx.Client(base_url=base_url, timeout=CLIENT_TIMEOUT_SECONDS) as client:
        for index in range(turns):
            messages.append(
                {"role": "user", "content": MULTI_TURN_QUESTIONS[index % len(MULTI_TURN_QUESTIONS)]}
            )
            turn, answer = _stream_turn(client, messages, max_tokens)
            out.append(turn)
            messages.append({"role": "assistant", "content": answer})
    return out


@dataclass
class MultiTurn:
    """`conversations` conversations on a server with the default caches, and as many on one without
    (DECIDER_STATE_CACHE_SEQS=0): per turn the median time to first token."""

    kept: list[list[Turn]]
    uncached: list[list[Turn]]

    @staticmethod
    def ttft(conversations: list[list[Turn]], turn: int) -> float:
        times = [
            c[turn].first_token_seconds for c in conversations if not math.isnan(c[turn].first_token_seconds)
        ]
        return statistics.median(times) if times else math.nan

    def line(self) -> str:
        first, last = self.kept[0][0], self.kept[0][-1]
        ttft = (self.ttft(self.kept, 0), self.ttft(self.kept, -1))
        plain = (self.ttft(self.uncached, 0), self.ttft(self.uncached, -1))
        return key_values(
            (
                ("multi_turn", str(len(self.kept[0]))),
                ("conversations", str(len(self.kept))),
                ("ttft_first", ttft[0]),
                ("ttft_last", ttft[1]),
                ("ttft_last_over_first", ratio(ttft[1], ttft[0])),
                ("uncached_ttft_last_over_first", ratio(plain[1], plain[0])),
                ("prompt_tokens_first", str(first.prompt_tokens)),
                ("prompt_tokens_last", str(last.prompt_tokens)),
                ("cached_tokens_first", str(first.cached_tokens)),
                ("cached_tokens_last", str(last.cached_tokens)),
                ("turn_ends", ",".join(turn.status for c in self.kept for turn in c)),
            ),
            digits=3,
        )


def measure_multi_turn_levels(
    console: Console, fields: dict[str, Any], turns: int, conversations: int
) -> MultiTurn:
    """The multi-turn level on a fresh server with the default caches, then on one without them,
    each warmed up by one chat of its own (`conversations` conversations each)."""
    from decider.settings import Settings

    runs: list[list[list[Turn]]] = []
    for name, extra in (("kept turns", {}), ("no caches", NO_CACHES)):
        console.print(f"[dim]multi-turn chat, {name}: {conversations} conversation(s) of {turns} turns…[/]")
        env = {Settings.env_name(key): str(value) for key, value in {**fields, **extra}.items()}
        with run_local_server(env) as server:
            measure_multi_turn(server.base_url, 1, 8, tag="Warm-up.")
            runs.append(
                [
                    measure_multi_turn(server.base_url, turns, tag=f"Conversation {i + 1}.")
                    for i in range(conversations)
                ]
            )
    return MultiTurn(*runs)


def multi_turn_main(args: Any) -> int:
    """The multi-turn level alone (`--levels multi_turn`); 1 if a turn failed."""
    from decider.engine.model.bundled import smollm2_path

    console = Console(width=200)
    result = measure_multi_turn_levels(
        console, model_settings(args, smollm2_path()), args.turns, args.multi_turn_conversations
    )
    print(result.line())
    ends = {turn.status for c in (*result.kept, *result.uncached) for turn in c}
    return 0 if ends <= {"stop", "length"} else 1


if __name__ == "__main__":
    raise SystemExit(main())
