"""A quality gate: did accuracy, ECE or p95 latency move past the bounds the user set, beyond noise?

`decide-eval check RUN --baseline RUN_OR_FILE` compares a run with an accepted one (a run directory, or the
baseline file `--accept` writes). For accuracy and ECE (overall, by question type and by domain) and for p95
request latency (overall), it bootstraps each run independently (the two runs are separate samples) and
takes the percentile interval of the difference run − baseline (of the ratio, for p95 latency).

A comparison fails only when the whole interval lies past the bound: accuracy fell by more than
`--max-accuracy-drop`, ECE rose by more than `--max-ece-rise`, p95 latency grew by more than
`--max-p95-increase` (relative). The intervals are two-sided at `--confidence` divided among the comparisons
gated (Bonferroni), so noise alone fails a check with probability at most 1 − confidence, however many
types and domains the set has. Groups with fewer than `--min-group` scored answers in either run are shown,
not gated.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from decider_cli.evaluate.metrics import N_BINS, expected_calibration_error, percentile
from decider_cli.evaluate.results import ResultRow, RunDirError, RunMeta, load_run
from decider_cli.evaluate.summary import fmt

BASELINE_FORMAT = "decide-eval-baseline-v1"
CHECK_FILE = "check.json"


class Bounds(BaseModel):
    max_accuracy_drop: float = 0.02  # absolute (0.02 = two points of accuracy)
    max_ece_rise: float = 0.03  # absolute
    max_p95_increase: float = 0.25  # relative (0.25 = 25 % slower at p95)
    confidence: float = 0.95
    min_group: int = 20
    bootstrap: int = 4000
    seed: int = 0


class Comparison(BaseModel):
    metric: str  # accuracy | ece | p95_latency
    group: str  # all | type | domain
    name: str
    n_baseline: int
    n_run: int
    baseline: float
    run: float
    delta: float  # run - baseline (p95_latency: run / baseline - 1)
    interval: tuple[float, float]  # of delta, at the per-comparison level
    bound: float
    gated: bool
    verdict: str  # fail | worse (within noise) | better | same | not gated


class CheckResult(BaseModel):
    run: str
    baseline: str
    model_run: str | None
    model_baseline: str | None
    same_cases: bool
    bounds: Bounds
    gated: int
    per_comparison_level: float
    comparisons: list[Comparison]
    failed: bool


def save_baseline(path: Path, meta: RunMeta, rows: Sequence[ResultRow]) -> Path:
    """One JSON file holding a run (what `check` needs of it), for a pipeline to keep as its baseline."""
    slim = [r.model_dump(exclude={"answer", "logits"}) for r in rows]
    payload = {"format": BASELINE_FORMAT, "meta": meta.model_dump(), "rows": slim}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def load_run_or_baseline(path: Path) -> tuple[RunMeta, list[ResultRow]]:
    if path.is_dir():
        return load_run(path)
    if not path.is_file():
        raise RunDirError(f"{path}: no such run directory or baseline file")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        if payload.get("format") != BASELINE_FORMAT:
            raise ValueError(f"not a {BASELINE_FORMAT} file")
        return RunMeta.model_validate(payload["meta"]), [ResultRow.model_validate(r) for r in payload["rows"]]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RunDirError(f"{path}: cannot read the baseline ({exc})") from exc


CHUNK = 2_000_000  # resampled values held at once


def _bootstrap(
    n: int, b: int, rng: np.random.Generator, statistic: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """statistic(picks) over b resamples of n indices, in chunks of about CHUNK values."""
    step = max(1, CHUNK // max(1, n))
    return np.concatenate(
        [statistic(rng.integers(0, n, (min(step, b - start), n))) for start in range(0, b, step)]
    )


def _boot_accuracy(correct: np.ndarray, rng: np.random.Generator, b: int) -> np.ndarray:
    return _bootstrap(correct.size, b, rng, lambda picks: correct[picks].mean(axis=1))


def _boot_ece(conf: np.ndarray, correct: np.ndarray, rng: np.random.Generator, b: int) -> np.ndarray:
    """ECE (10 equal-width bins, as metrics.expected_calibration_error) of b resamples, vectorized."""
    n = conf.size
    bin_of = np.minimum((conf * N_BINS).astype(int), N_BINS - 1)

    def ece(picks: np.ndarray) -> np.ndarray:
        rows = picks.shape[0]
        flat = (bin_of[picks] + np.arange(rows)[:, None] * N_BINS).ravel()
        size = rows * N_BINS
        conf_sum = np.bincount(flat, weights=conf[picks].ravel(), minlength=size).reshape(rows, N_BINS)
        right = np.bincount(flat, weights=correct[picks].ravel(), minlength=size).reshape(rows, N_BINS)
        return np.abs(right - conf_sum).sum(axis=1) / n  # sum over bins of n_b/N |acc_b - conf_b|

    return _bootstrap(n, b, rng, ece)


def _boot_p95(latencies: np.ndarray, rng: np.random.Generator, b: int) -> np.ndarray:
    return _bootstrap(
        latencies.size, b, rng, lambda picks: np.percentile(latencies[picks], 95, axis=1, method="linear")
    )


def _verdict(lo: float, hi: float, bound: float, worse_is_up: bool, gated: bool, delta: float) -> str:
    if not gated:
        return "not gated"
    if worse_is_up:
        if lo > bound:
            return "fail"
        if delta > bound:
            return "worse (within noise)"
        if hi < 0:
            return "better"
    else:
        if hi < -bound:
            return "fail"
        if delta < -bound:
            return "worse (within noise)"
        if lo > 0:
            return "better"
    return "same"


def _scored(rows: Sequence[ResultRow]) -> list[ResultRow]:
    return [r for r in rows if r.scored]


def check_runs(
    run_name: str,
    run: tuple[RunMeta, list[ResultRow]],
    baseline_name: str,
    baseline: tuple[RunMeta, list[ResultRow]],
    bounds: Bounds,
) -> CheckResult:
    (meta_r, rows_r), (meta_b, rows_b) = run, baseline
    scored_r, scored_b = _scored(rows_r), _scored(rows_b)
    groups: list[tuple[str, str, Callable[[ResultRow], bool]]] = [("all", "all", lambda r: True)]
    for qtype in sorted({r.type for r in scored_r} | {r.type for r in scored_b}):
        groups.append(("type", qtype, lambda r, t=qtype: r.type == t))
    for domain in sorted({r.domain for r in scored_r} | {r.domain for r in scored_b}):
        groups.append(("domain", domain, lambda r, d=domain: r.domain == d))
    plan = []  # (metric, group, name, rows of run, rows of baseline, gated)
    for group, name, member in groups:
        a, b = [r for r in scored_r if member(r)], [r for r in scored_b if member(r)]
        if not a or not b:
            continue
        gated = min(len(a), len(b)) >= bounds.min_group
        plan.append(("accuracy", group, name, a, b, gated))
        plan.append(("ece", group, name, a, b, gated))
    lat_r = np.array([r.latency_s for r in meta_r.requests], dtype=float)
    lat_b = np.array([r.latency_s for r in meta_b.requests], dtype=float)
    latency_gated = min(lat_r.size, lat_b.size) >= bounds.min_group
    gated = sum(1 for p in plan if p[5]) + (1 if latency_gated else 0)
    level = 1 - (1 - bounds.confidence) / max(1, gated)  # Bonferroni over the gated comparisons
    tail = (1 - level) / 2 * 100
    rng = np.random.default_rng(bounds.seed)
    comparisons: list[Comparison] = []
    for metric, group, name, a, b, is_gated in plan:
        ok_a = np.array([bool(r.correct) for r in a], dtype=float)
        ok_b = np.array([bool(r.correct) for r in b], dtype=float)
        if metric == "accuracy":
            run_value, base_value = float(ok_a.mean()), float(ok_b.mean())
            diffs = _boot_accuracy(ok_a, rng, bounds.bootstrap) - _boot_accuracy(ok_b, rng, bounds.bootstrap)
            bound, worse_is_up = bounds.max_accuracy_drop, False
        else:
            conf_a = np.array([r.confidence for r in a], dtype=float)
            conf_b = np.array([r.confidence for r in b], dtype=float)
            run_value = expected_calibration_error(conf_a.tolist(), ok_a.astype(bool).tolist())
            base_value = expected_calibration_error(conf_b.tolist(), ok_b.astype(bool).tolist())
            diffs = _boot_ece(conf_a, ok_a, rng, bounds.bootstrap) - _boot_ece(
                conf_b, ok_b, rng, bounds.bootstrap
            )
            bound, worse_is_up = bounds.max_ece_rise, True
        lo, hi = (float(v) for v in np.percentile(diffs, [tail, 100 - tail]))
        delta = run_value - base_value
        comparisons.append(
            Comparison(
                metric=metric,
                group=group,
                name=name,
                n_baseline=len(b),
                n_run=len(a),
                baseline=base_value,
                run=run_value,
                delta=delta,
                interval=(lo, hi),
                bound=bound,
                gated=is_gated,
                verdict=_verdict(lo, hi, bound, worse_is_up, is_gated, delta),
            )
        )
    if lat_r.size and lat_b.size:
        p95_r, p95_b = percentile(lat_r.tolist(), 95), percentile(lat_b.tolist(), 95)
        ratios = _boot_p95(lat_r, rng, bounds.bootstrap) / np.maximum(
            _boot_p95(lat_b, rng, bounds.bootstrap), 1e-12
        )
        lo, hi = (float(v) - 1 for v in np.percentile(ratios, [tail, 100 - tail]))
        delta = p95_r / p95_b - 1 if p95_b > 0 else math.inf
        comparisons.append(
            Comparison(
                metric="p95_latency",
                group="all",
                name="all",
                n_baseline=int(lat_b.size),
                n_run=int(lat_r.size),
                baseline=p95_b,
                run=p95_r,
                delta=delta,
                interval=(lo, hi),
                bound=bounds.max_p95_increase,
                gated=latency_gated,
                verdict=_verdict(lo, hi, bounds.max_p95_increase, True, latency_gated, delta),
            )
        )
    return CheckResult(
        run=run_name,
        baseline=baseline_name,
        model_run=meta_r.model,
        model_baseline=meta_b.model,
        same_cases=meta_r.cases_sha256 == meta_b.cases_sha256,
        bounds=bounds,
        gated=gated,
        per_comparison_level=level,
        comparisons=comparisons,
        failed=any(c.verdict == "fail" for c in comparisons),
    )


def _number(metric: str, value: float) -> str:
    return f"{fmt(value, 3)} s" if metric == "p95_latency" else fmt(value, 3)


def _delta(metric: str, value: float) -> str:
    return f"{value:+.1%}" if metric == "p95_latency" else f"{value:+.3f}"


def _bound(c: Comparison) -> str:
    if c.metric == "accuracy":
        return f"drop > {c.bound:g}"
    if c.metric == "ece":
        return f"rise > {c.bound:g}"
    return f"+{c.bound:.0%}"


CHECK_COLUMNS = (
    "metric",
    "group",
    "n base/run",
    "baseline",
    "run",
    "Δ",
    "interval of Δ",
    "fails if",
    "verdict",
)
STYLE = {"fail": "bold red", "worse (within noise)": "yellow", "better": "green"}


def print_check(result: CheckResult, console: Console, *, all_rows: bool = False) -> None:
    console.rule("decide-eval check")
    console.print(f"run:      {result.run}  (model {result.model_run or 'n/a'})")
    console.print(f"baseline: {result.baseline}  (model {result.model_baseline or 'n/a'})")
    if not result.same_cases:
        console.print("[yellow]warning:[/] the runs used different case files (cases_sha256 differs)")
    b = result.bounds
    console.print(
        f"bounds: accuracy drop > {b.max_accuracy_drop:g}, ECE rise > {b.max_ece_rise:g}, "
        f"p95 latency +{b.max_p95_increase:.0%}; a check fails only when its whole interval is past "
        "its bound "
        f"({result.gated} gated comparisons, {b.confidence:.0%} overall: "
        f"{result.per_comparison_level:.2%} intervals each, {b.bootstrap} bootstrap resamples per run)",
        soft_wrap=True,
    )
    table = Table(title="What moved (run − baseline)", title_justify="left")
    for column in CHECK_COLUMNS:
        table.add_column(column, justify="right")
    shown = 0
    for c in result.comparisons:
        if not all_rows and c.group == "domain" and c.verdict in ("same", "not gated"):
            continue
        shown += 1
        style = STYLE.get(c.verdict, "")
        table.add_row(
            c.metric,
            c.name if c.group != "domain" else f"domain {c.name}",
            f"{c.n_baseline}/{c.n_run}",
            _number(c.metric, c.baseline),
            _number(c.metric, c.run),
            _delta(c.metric, c.delta),
            f"{_delta(c.metric, c.interval[0])} … {_delta(c.metric, c.interval[1])}",
            _bound(c),
            f"[{style}]{c.verdict}[/]" if style else c.verdict,
        )
    console.print(table)
    hidden = len(result.comparisons) - shown
    if hidden:
        console.print(f"({hidden} domain rows unchanged or too small to gate not shown; --all shows them)")
    failed = [c for c in result.comparisons if c.verdict == "fail"]
    if failed:
        names = ", ".join(f"{c.metric} {c.name}" for c in failed)
        console.print(f"[bold red]FAIL[/]: moved past its bound beyond noise: {names}", soft_wrap=True)
    else:
        console.print("[green]PASS[/]: nothing moved past its bound beyond noise")


def write_check(run_dir: Path, result: CheckResult) -> Path | None:
    if not run_dir.is_dir():
        return None
    path = run_dir / CHECK_FILE
    path.write_text(result.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return path
