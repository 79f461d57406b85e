"""Compare two runs of the same items (e.g. the CPU and the GPU endpoint): speed ratios and argmax flips."""

from __future__ import annotations

import html
import math
from pathlib import Path

from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from decider_cli.evaluate.metrics import mean
from decider_cli.evaluate.report import _html_table, _img, latency_png
from decider_cli.evaluate.results import ResultRow, RunMeta
from decider_cli.evaluate.summary import Summary, fmt, summarize


class Flip(BaseModel):
    case_id: str
    key: str
    type: str
    gold: str | None
    argmax_a: str
    argmax_b: str
    probs_a: dict[str, float]
    probs_b: dict[str, float]
    max_abs_diff: float


class Comparison(BaseModel):
    run_a: str
    run_b: str
    model_a: str | None
    model_b: str | None
    p50_a: float
    p50_b: float
    p95_a: float
    p95_b: float
    p50_ratio: float  # A / B: how many times faster B is than A
    p95_ratio: float
    decisions_per_s_a: float
    decisions_per_s_b: float
    same_order: bool
    common_questions: int
    agreeing: int
    agreement_rate: float
    max_abs_prob_diff: float
    mean_abs_prob_diff: float
    accuracy_a: float
    accuracy_b: float
    scored_common: int
    only_in_one: int
    flips: list[Flip]


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(a) and not math.isnan(b) else math.nan


def compare_runs(
    name_a: str, run_a: tuple[RunMeta, list[ResultRow]], name_b: str, run_b: tuple[RunMeta, list[ResultRow]]
) -> Comparison:
    (meta_a, rows_a), (meta_b, rows_b) = run_a, run_b
    sum_a: Summary = summarize(meta_a, rows_a)
    sum_b: Summary = summarize(meta_b, rows_b)
    by_key_a = {(r.case_id, r.key): r for r in rows_a if r.status == "ok"}
    by_key_b = {(r.case_id, r.key): r for r in rows_b if r.status == "ok"}
    common = [k for k in by_key_a if k in by_key_b]
    flips: list[Flip] = []
    diffs: list[float] = []
    correct_a = correct_b = scored = 0
    for k in common:
        a, b = by_key_a[k], by_key_b[k]
        diff = max(abs(a.probs[label] - b.probs.get(label, math.nan)) for label in a.probs)
        diffs.append(diff)
        if a.scored:
            scored += 1
            correct_a += bool(a.correct)
            correct_b += bool(b.correct)
        if a.predicted != b.predicted:
            flips.append(
                Flip(
                    case_id=k[0],
                    key=k[1],
                    type=a.type,
                    gold=a.gold,
                    argmax_a=a.predicted,
                    argmax_b=b.predicted,
                    probs_a=a.probs,
                    probs_b=b.probs,
                    max_abs_diff=diff,
                )
            )
    order_a = [r.case_id for r in meta_a.requests]
    order_b = [r.case_id for r in meta_b.requests]
    return Comparison(
        run_a=name_a,
        run_b=name_b,
        model_a=meta_a.model,
        model_b=meta_b.model,
        p50_a=sum_a.latency.p50,
        p50_b=sum_b.latency.p50,
        p95_a=sum_a.latency.p95,
        p95_b=sum_b.latency.p95,
        p50_ratio=_ratio(sum_a.latency.p50, sum_b.latency.p50),
        p95_ratio=_ratio(sum_a.latency.p95, sum_b.latency.p95),
        decisions_per_s_a=sum_a.decisions_per_s,
        decisions_per_s_b=sum_b.decisions_per_s,
        same_order=order_a == order_b,
        common_questions=len(common),
        agreeing=len(common) - len(flips),
        agreement_rate=(len(common) - len(flips)) / len(common) if common else math.nan,
        max_abs_prob_diff=max(diffs) if diffs else math.nan,
        mean_abs_prob_diff=mean(diffs),
        accuracy_a=correct_a / scored if scored else math.nan,
        accuracy_b=correct_b / scored if scored else math.nan,
        scored_common=scored,
        only_in_one=len(set(by_key_a) ^ set(by_key_b)),
        flips=sorted(flips, key=lambda f: (-f.max_abs_diff, f.case_id, f.key)),
    )


def _probs_text(probs: dict[str, float]) -> str:
    return " ".join(f"{label}:{p:.3f}" for label, p in probs.items())


FLIP_COLUMNS = ("case", "key", "type", "gold", "A", "B", "A probabilities", "B probabilities", "max |Δp|")


def _flip_cells(f: Flip) -> list[str]:
    return [
        f.case_id,
        f.key,
        f.type,
        f.gold or "-",
        f.argmax_a,
        f.argmax_b,
        _probs_text(f.probs_a),
        _probs_text(f.probs_b),
        fmt(f.max_abs_diff, 4),
    ]


def print_comparison(c: Comparison, console: Console, *, max_rows: int = 50) -> None:
    console.rule("decide-eval compare")
    console.print(f"A: {c.run_a}  model {c.model_a or 'n/a'}")
    console.print(f"B: {c.run_b}  model {c.model_b or 'n/a'}")
    if not c.same_order:
        console.print("[yellow]warning:[/] the runs did not send the same items in the same order")
    speed = Table(
        title="Speed (request latency, seconds; ratio = A / B, >1 means B is faster)", title_justify="left"
    )
    for column in ("", "A", "B", "A / B"):
        speed.add_column(column, justify="right")
    speed.add_row("p50", fmt(c.p50_a), fmt(c.p50_b), fmt(c.p50_ratio, 2) + "×")
    speed.add_row("p95", fmt(c.p95_a), fmt(c.p95_b), fmt(c.p95_ratio, 2) + "×")
    speed.add_row(
        "decisions/s",
        fmt(c.decisions_per_s_a, 2),
        fmt(c.decisions_per_s_b, 2),
        fmt(_ratio(c.decisions_per_s_b, c.decisions_per_s_a), 2) + "× (B / A)",
    )
    console.print(speed)
    console.print(
        f"argmax agreement: {c.agreeing}/{c.common_questions} = {fmt(c.agreement_rate, 4)}  "
        f"(max |Δp| {fmt(c.max_abs_prob_diff, 4)}, mean {fmt(c.mean_abs_prob_diff, 4)}; "
        f"{c.only_in_one} questions answered in only one run)"
    )
    console.print(
        f"accuracy on the {c.scored_common} common scored questions: "
        f"A {fmt(c.accuracy_a)}, B {fmt(c.accuracy_b)}"
    )
    if c.flips:
        flips = Table(
            title=f"Questions where the argmax differs ({len(c.flips)}, largest |Δp| first)",
            title_justify="left",
        )
        for column in FLIP_COLUMNS:
            flips.add_column(column)
        for f in c.flips[:max_rows]:
            flips.add_row(*_flip_cells(f))
        console.print(flips)
        if len(c.flips) > max_rows:
            console.print(f"… {len(c.flips) - max_rows} more (see --out for all)")


def write_comparison(out_dir: Path, c: Comparison, latencies: dict[str, list[float]]) -> Path:
    """compare.json (all flips) and compare.html (overlaid latency CDF, flips side by side)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.json").write_text(c.model_dump_json(indent=2) + "\n", encoding="utf-8")
    png = latency_png(latencies)
    (out_dir / "compare_latency.png").write_bytes(png)
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>decide-eval compare</title><style>"
        "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto}"
        "table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:.2em .5em}img{max-width:100%}</style></head><body>"
        f"<h1>decide-eval compare</h1><p>A: <code>{html.escape(c.run_a)}</code> "
        f"({html.escape(c.model_a or 'n/a')})"
        f"<br>B: <code>{html.escape(c.run_b)}</code> ({html.escape(c.model_b or 'n/a')})</p>"
        + _html_table(
            ["", "A", "B", "A / B"],
            [
                ["p50 s", fmt(c.p50_a), fmt(c.p50_b), fmt(c.p50_ratio, 2)],
                ["p95 s", fmt(c.p95_a), fmt(c.p95_b), fmt(c.p95_ratio, 2)],
            ],
        )
        + _img(png, "latency CDF of both runs")
        + f"<p>argmax agreement {c.agreeing}/{c.common_questions} = {fmt(c.agreement_rate, 4)}</p>"
        + _html_table(list(FLIP_COLUMNS), [_flip_cells(f) for f in c.flips])
        + "</body></html>\n"
    )
    path = out_dir / "compare.html"
    path.write_text(page, encoding="utf-8")
    return path
