"""Send the items to a target (sequentially by default), record every question, write the run directory.

Protocol (JevBench): one request per case, one at a time, no retries, caller wall time; warm-up requests
(copies of the first items) are timed and kept apart; the item order is fixed by (file, seed, limit).
A server error is recorded with its code and the run goes on. Only a dead target stops it: after
`max_transport_errors` network failures in a row, the remaining items are not sent and `aborted` says why.
With `max_seconds`, no new request starts after that much wall time (a time-boxed run, e.g. the demo).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from decider_cli.evaluate.cases import EvalItem, build_request
from decider_cli.evaluate.results import (
    RESULTS_FILE,
    RUN_FILE,
    RequestRecord,
    ResultRow,
    RunMeta,
    rows_from_reply,
    write_rows,
)
from decider_cli.evaluate.targets import Reply, Target

ProgressCallback = Callable[[int, Reply], None]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class _Abort:
    """Counts consecutive transport failures across threads."""

    def __init__(self, limit: int):
        self.limit = limit
        self._streak = 0
        self._lock = threading.Lock()
        self.reason: str | None = None

    def observe(self, reply: Reply) -> None:
        with self._lock:
            self._streak = self._streak + 1 if reply.transport_error else 0
            if self.limit and self._streak >= self.limit and self.reason is None:
                self.reason = (
                    f"{self._streak} transport failures in a row (last: {reply.error_code}: "
                    f"{(reply.error_message or '')[:200]}); remaining items were not sent"
                )

    @property
    def triggered(self) -> bool:
        return self.reason is not None


def run_evaluation(
    target: Target,
    items: list[EvalItem],
    *,
    out_dir: Path,
    meta: RunMeta,
    concurrency: int = 1,
    warmup: int = 1,
    request_options: dict[str, Any] | None = None,
    max_transport_errors: int = 3,
    max_seconds: float | None = None,
    on_reply: ProgressCallback | None = None,
) -> tuple[RunMeta, list[ResultRow]]:
    """Run the items against the target and write `results.jsonl` and `run.json` into `out_dir`.

    A KeyboardInterrupt during the measured phase still writes what was measured, then propagates.
    """
    bodies = [build_request(item, **(request_options or {})) for item in items]
    meta.concurrency = concurrency
    _warm_up(target, items, bodies, warmup, meta)

    abort = _Abort(max_transport_errors)
    replies: dict[int, Reply] = {}
    started = time.perf_counter()

    def send(index: int) -> None:
        out_of_time = max_seconds is not None and time.perf_counter() - started >= max_seconds
        if abort.triggered or out_of_time:
            return
        reply = target.send(bodies[index])
        abort.observe(reply)
        replies[index] = reply
        if on_reply is not None:
            on_reply(index, reply)

    interrupted = False
    try:
        _send_all(send, len(items), concurrency, abort)
    except KeyboardInterrupt:
        interrupted = True
        abort.reason = "interrupted by the user; remaining items were not sent"
    meta.wall_s = time.perf_counter() - started

    rows: list[ResultRow] = []
    for index in sorted(replies):
        reply = replies[index]
        meta.requests.append(_record(index, items[index], reply))
        meta.model = meta.model or _model_of(reply)
        rows.extend(rows_from_reply(items[index], reply, index))
    meta.aborted = abort.reason
    if max_seconds is not None and len(replies) < len(items) and not abort.triggered:
        meta.time_budget = f"--max-seconds {max_seconds:g} reached: {len(replies)} of {len(items)} cases sent"
    meta.finished_at = _now()
    _write_run(out_dir, meta, rows)
    if interrupted:
        raise KeyboardInterrupt
    return meta, rows


def _warm_up(
    target: Target, items: list[EvalItem], bodies: list[dict[str, Any]], count: int, meta: RunMeta
) -> None:
    """Send copies of the first items; their times are kept apart from the measured requests."""
    for n in range(count if items else 0):
        reply = target.send(bodies[n % len(items)])
        meta.warmup.append(_record(n, items[n % len(items)], reply))
        meta.model = meta.model or _model_of(reply)


def _send_all(send: Callable[[int], None], count: int, concurrency: int, abort: _Abort) -> None:
    """Call `send` for every index: in order, or from a pool of `concurrency` threads."""
    if concurrency <= 1:
        for index in range(count):
            send(index)
            if abort.triggered:
                return
        return
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="decide-eval") as pool:
        futures = [pool.submit(send, index) for index in range(count)]
        try:
            for future in futures:
                future.result()
        except KeyboardInterrupt:
            abort.reason = "interrupted"  # queued sends return at once; in-flight ones finish
            for future in futures:
                future.cancel()
            raise


def _write_run(out_dir: Path, meta: RunMeta, rows: list[ResultRow]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_rows(out_dir / RESULTS_FILE, rows)
    (out_dir / RUN_FILE).write_text(meta.model_dump_json(indent=2) + "\n", encoding="utf-8")


def _record(index: int, item: EvalItem, reply: Reply) -> RequestRecord:
    return RequestRecord(
        index=index,
        case_id=item.item_id,
        latency_s=reply.latency_s,
        http_status=reply.status,
        error_code=reply.error_code,
        questions=len(item.questions),
        server_s=_server_seconds(reply),
    )


def _server_seconds(reply: Reply) -> float | None:
    """`extensions.timing.total_seconds` of a decider response (other servers may not report it)."""
    ext = reply.body.get("extensions") if reply.body else None
    timing = ext.get("timing") if isinstance(ext, dict) else None
    value = timing.get("total_seconds") if isinstance(timing, dict) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _model_of(reply: Reply) -> str | None:
    model = reply.body.get("model") if reply.body else None
    return model if isinstance(model, str) else None


def new_meta(
    *, target: str, description: str, cases_path: Path, gold_path: Path | None, args: dict[str, Any]
) -> RunMeta:
    return RunMeta(
        target=target,
        target_description=description,
        cases_path=str(cases_path),
        cases_sha256=sha256_of(cases_path),
        gold_path=str(gold_path) if gold_path else None,
        args=args,
        started_at=_now(),
    )
