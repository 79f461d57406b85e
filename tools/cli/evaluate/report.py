"""Show a run: rich tables in the terminal, and a self-contained HTML report with PNG plots."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from rich.console import Console
from rich.table import Table

from decider_cli.evaluate.results import RunMeta
from decider_cli.evaluate.summary import GroupScore, Summary, fmt
from decider_cli.evaluate.thresholds import THRESHOLD_COLUMNS, Thresholds, threshold_cells

SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.html"
LATENCY_PNG = "latency.png"
RELIABILITY_PNG = "reliability.png"
COVERAGE_PNG = "coverage.png"
JEVBENCH_NOTICE = (
    "JevBench data: Apache-2.0, Copyright 2026 Chen Feng (JevBench/jevbench); "
    "not affiliated with or endorsed by TypeSafe AI."
)


SCORE_COLUMNS = ("scored", "correct", "accuracy", "chance", "Brier", "ECE")
LATENCY_COLUMNS = (
    "requests",
    "p50",
    "p95",
    "p99",
    "mean",
    "max",
    "server p50",
    "first request",
    "decisions/s",
)


def _score_cells(name: str, g: GroupScore) -> list[str]:
    return [name, str(g.scored), str(g.correct), fmt(g.accuracy), fmt(g.chance), fmt(g.brier), fmt(g.ece)]


def _latency_cells(summary: Summary) -> list[str]:
    lat = summary.latency
    return [
        str(lat.requests),
        fmt(lat.p50),
        fmt(lat.p95),
        fmt(lat.p99),
        fmt(lat.mean),
        fmt(lat.max),
        fmt(lat.server_p50),
        f"{fmt(lat.first_request_s)} ({lat.first_request_kind or 'none'})",
        fmt(summary.decisions_per_s, 2),
    ]


def _error_rows(summary: Summary) -> list[list[str]]:
    """[code, requests, questions] per error code seen on requests or questions."""
    return [
        [
            code,
            str(summary.error_requests_by_code.get(code, 0)),
            str(summary.error_questions_by_code.get(code, 0)),
        ]
        for code in dict.fromkeys([*summary.error_requests_by_code, *summary.error_questions_by_code])
    ]


def _score_table(title: str, groups: dict[str, GroupScore], first: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column(first)
    for column in SCORE_COLUMNS:
        table.add_column(column, justify="right")
    for name, g in groups.items():
        table.add_row(*_score_cells(name, g))
    return table


def print_summary(summary: Summary, console: Console) -> None:
    console.rule("decide-eval summary")
    console.print(f"target: {summary.target}")
    console.print(f"model:  {summary.model or 'n/a'}")
    if summary.aborted:
        console.print(f"[bold red]run stopped early:[/] {summary.aborted}")
    if summary.time_budget:
        console.print(f"[yellow]time-boxed:[/] {summary.time_budget}")
    speed = Table(
        title="Latency per request (caller wall time, seconds)",
        title_justify="left",
        caption="warm-up requests are timed apart and left out of the percentiles",
        caption_justify="left",
    )
    for column in LATENCY_COLUMNS:
        speed.add_column(column, justify="right")
    speed.add_row(*_latency_cells(summary))
    console.print(speed)
    console.print(
        f"questions {summary.questions}: answered {summary.answered}, errors {summary.errors}; "
        f"gold 'unknown' {summary.unknown_gold} (not scored), unlabelled {summary.unlabelled}"
    )
    console.print(
        _score_table("Accuracy by question type", {**summary.by_type, "all": summary.overall}, "type")
    )
    console.print(_score_table("Accuracy by domain", summary.by_domain, "domain"))
    console.print(
        f"ordinal MAE (score, expected level vs gold, n={summary.score_questions}): "
        f"{fmt(summary.ordinal_mae)}   "
        f"noul abstentions (0.2<p<0.8): {fmt(summary.noul_abstention_rate)}"
    )
    if summary.unknown_gold:
        console.print(
            f"gold 'unknown' by type {summary.unknown_by_type}: mean top confidence "
            f"{fmt(summary.unknown_mean_confidence)}, "
            f"noul abstention rate {fmt(summary.unknown_noul_abstention_rate)}"
        )
    if summary.error_requests_by_code or summary.error_questions_by_code:
        errors = Table(title="Errors by code (recorded, not counted as wrong)", title_justify="left")
        errors.add_column("code")
        errors.add_column("requests", justify="right")
        errors.add_column("questions", justify="right")
        for row in _error_rows(summary):
            errors.add_row(*row)
        console.print(errors)


def _figure_png(draw) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=(9, 3.6), dpi=100)
    try:
        draw(figure)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        return buffer.getvalue()
    finally:
        plt.close(figure)


def latency_png(series: dict[str, list[float]]) -> bytes:
    """Latency CDF (all targets on one axis) and a histogram per target."""

    def draw(figure) -> None:
        cdf, hist = figure.subplots(1, 2)
        for name, values in series.items():
            ordered = sorted(values)
            if not ordered:
                continue
            fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
            cdf.step(ordered, fractions, where="post", label=name)
            hist.hist(ordered, bins=min(30, max(5, len(ordered) // 3)), alpha=0.6, label=name)
        cdf.set(title="Request latency CDF", xlabel="seconds", ylabel="fraction of requests", ylim=(0, 1.02))
        hist.set(title="Request latency histogram", xlabel="seconds", ylabel="requests")
        for axis in (cdf, hist):
            axis.grid(alpha=0.3)
            if axis.get_legend_handles_labels()[0]:
                axis.legend(fontsize="small")

    return _figure_png(draw)


def reliability_png(bins: list[dict], title: str) -> bytes:
    """Reliability diagram: accuracy against mean confidence per bin, with bin counts."""

    def draw(figure) -> None:
        diagram, counts = figure.subplots(1, 2)
        centers = [(b["lower"] + b["upper"]) / 2 for b in bins]
        diagram.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfect calibration")
        diagram.bar(centers, [b["accuracy"] for b in bins], width=0.09, alpha=0.7, label="accuracy")
        diagram.plot(
            [b["mean_confidence"] for b in bins],
            [b["accuracy"] for b in bins],
            "o-",
            color="black",
            label="(confidence, accuracy)",
        )
        diagram.set(title=title, xlabel="top-label confidence", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1))
        diagram.legend(fontsize="small")
        counts.bar(centers, [b["count"] for b in bins], width=0.09)
        counts.set(title="questions per bin", xlabel="top-label confidence", ylabel="questions", xlim=(0, 1))
        for axis in (diagram, counts):
            axis.grid(alpha=0.3)

    return _figure_png(draw)


def coverage_png(thresholds: Thresholds) -> bytes:
    """Coverage-accuracy curve per question type, the target as a line and each chosen cut as a dot."""

    def draw(figure) -> None:
        axis = figure.subplots(1, 1)
        labelled = 0  # cuts labelled so far: each label one line lower, so cuts at one point stay readable
        for name, g in thresholds.types.items():
            if not g.curve:
                continue
            coverage, accuracy = [c[0] for c in g.curve], [c[1] for c in g.curve]
            (line,) = axis.step(coverage, accuracy, where="post", label=f"{name} (n={g.labelled})")
            if g.threshold is not None:
                axis.plot([g.coverage], [g.accuracy_above], "o", color=line.get_color())
                right = g.coverage > 0.8  # near the right edge the label goes left of its dot
                axis.annotate(
                    f"{name} cut {g.threshold:.3f}",
                    (g.coverage, g.accuracy_above),
                    textcoords="offset points",
                    xytext=(-6 if right else 6, -24 - 12 * labelled),
                    ha="right" if right else "left",
                    color=line.get_color(),
                    fontsize="small",
                )
                labelled += 1
        target = thresholds.target_accuracy
        axis.axhline(target, linestyle="--", color="grey", label=f"target {target:g}")
        axis.set(
            title=f"Coverage-accuracy ({thresholds.confidence} confidence, answers at or above each cut)",
            xlabel="coverage (share of answers accepted)",
            ylabel="accuracy of the accepted",
            xlim=(0, 1.02),
            ylim=(0, 1.02),
        )
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small", loc="lower left")

    return _figure_png(draw)


def _thresholds_html(run_dir: Path, thresholds: Thresholds) -> str:
    png = coverage_png(thresholds)
    (run_dir / COVERAGE_PNG).write_bytes(png)
    groups = [*thresholds.types.values(), *thresholds.keys.values()]
    return (
        f"<h2>Confidence thresholds (target accuracy {thresholds.target_accuracy:g})</h2>"
        f"<p>model <code>{html.escape(thresholds.model or 'n/a')}</code>, prompt "
        f"<code>{html.escape(thresholds.prompt_version or 'n/a')}</code>, confidence "
        f"<code>{html.escape(thresholds.confidence)}</code>; out-of-fold: {thresholds.folds} folds, "
        f"intervals: {thresholds.bootstrap} bootstrap resamples (thresholds.json)</p>"
        + _html_table(list(THRESHOLD_COLUMNS), [threshold_cells(g) for g in groups])
        + _img(png, "coverage-accuracy curve")
    )


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _html_table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _groups_html(groups: dict[str, GroupScore]) -> str:
    return _html_table(["group", *SCORE_COLUMNS], [_score_cells(n, g) for n, g in groups.items()])


def write_html_report(
    run_dir: Path, meta: RunMeta, summary: Summary, thresholds: Thresholds | None = None
) -> Path:
    """Write report.html (plots embedded, also saved as PNG files next to it) and summary.json.

    With `thresholds` (from `decide-eval thresholds`), the report also shows the cut-points and the
    coverage-accuracy curve."""
    (run_dir / SUMMARY_FILE).write_text(summary.model_dump_json(indent=2) + "\n", encoding="utf-8")
    label = summary.model or meta.target
    latency = latency_png({label: [r.latency_s for r in meta.requests]})
    reliability = reliability_png(summary.reliability, "Reliability (answered questions with known gold)")
    (run_dir / LATENCY_PNG).write_bytes(latency)
    (run_dir / RELIABILITY_PNG).write_bytes(reliability)
    sections = [
        f"<h1>decide-eval report</h1><p>target: <code>{html.escape(summary.target)}</code><br>"
        f"model: <code>{html.escape(summary.model or 'n/a')}</code><br>"
        f"cases: <code>{html.escape(meta.cases_path)}</code> (sha256 {meta.cases_sha256[:12]}…), "
        f"gold: <code>{html.escape(meta.gold_path or 'none')}</code><br>"
        f"started {html.escape(meta.started_at)}, concurrency {meta.concurrency}, "
        f"wall {fmt(meta.wall_s, 1)} s</p>",
        f"<p class='warn'>Run stopped early: {html.escape(summary.aborted)}</p>" if summary.aborted else "",
        f"<p class='warn'>Time-boxed: {html.escape(summary.time_budget)}</p>" if summary.time_budget else "",
        "<h2>Latency per request (seconds)</h2>",
        _html_table(list(LATENCY_COLUMNS), [_latency_cells(summary)]),
        _img(latency, "latency CDF and histogram"),
        "<h2>Quality</h2>",
        f"<p>questions {summary.questions}: answered {summary.answered}, errors {summary.errors}; "
        f"gold 'unknown' {summary.unknown_gold} (not scored), unlabelled {summary.unlabelled}. "
        f"Ordinal MAE (score): {fmt(summary.ordinal_mae)}; "
        f"noul abstentions (0.2&lt;p&lt;0.8): {fmt(summary.noul_abstention_rate)}.</p>",
        "<h3>By question type</h3>",
        _groups_html({**summary.by_type, "all": summary.overall}),
        "<h3>By domain</h3>",
        _groups_html(summary.by_domain),
        "<h3>Reliability diagram (10 equal-width bins, top-label)</h3>",
        _img(reliability, "reliability diagram"),
        _thresholds_html(run_dir, thresholds) if thresholds is not None else "",
        "<h2>Errors by code</h2>",
        _html_table(["code", "requests", "questions"], _error_rows(summary))
        if summary.errors
        else "<p>none</p>",
        f"<p class='note'>{html.escape(JEVBENCH_NOTICE)}</p>"
        if "jevbench" in meta.cases_path.lower()
        else "",
    ]
    style = (
        "body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;margin:.5em 0}"
        "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}"
        "td:first-child,th:first-child{text-align:left}img{max-width:100%}"
        ".warn{color:#b00}.note{color:#666;font-size:small}"
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>decide-eval report</title>"
        f"<style>{style}</style></head><body>{''.join(sections)}</body></html>\n"
    )
    path = run_dir / REPORT_FILE
    path.write_text(page, encoding="utf-8")
    return path
