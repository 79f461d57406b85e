"""`decide-eval`: decision quality and latency of a decision endpoint (local server or SageMaker).

    decide-eval run --target URL_OR_ENDPOINT --cases FILE [--gold FILE] [--limit N]
                    [--sequential | --concurrency N] [--seed S] [--warmup N] --out DIR
    decide-eval report DIR
    decide-eval compare DIR_A DIR_B [--out DIR]
    decide-eval calibrate DIR [--folds K] [--variant cpu|gpu]
    decide-eval thresholds DIR [--target-accuracy 0.95] [--min-key-labels N]
    decide-eval check DIR --baseline DIR_OR_FILE [--max-accuracy-drop A] [--max-ece-rise E]
                      [--max-p95-increase R] [--accept FILE]

Exit status: 0 done (check: passed); 1 the run stopped early (target unreachable), or check failed;
2 bad input; 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from decider_cli.evaluate.calibrate import calibrate_rows, print_calibration, write_calibration
from decider_cli.evaluate.cases import CaseFileError, default_gold_path, load_items, select_items
from decider_cli.evaluate.check import (
    Bounds,
    check_runs,
    load_run_or_baseline,
    print_check,
    save_baseline,
    write_check,
)
from decider_cli.evaluate.compare import compare_runs, print_comparison, write_comparison
from decider_cli.evaluate.report import print_summary, write_html_report
from decider_cli.evaluate.results import RESULTS_FILE, RunDirError, load_run
from decider_cli.evaluate.runner import new_meta, run_evaluation
from decider_cli.evaluate.summary import headline, summarize
from decider_cli.evaluate.targets import Reply, TargetError, make_target
from decider_cli.evaluate.thresholds import (
    THRESHOLDS_FILE,
    compute_thresholds,
    load_thresholds,
    print_thresholds,
    write_thresholds,
)

EXIT_OK, EXIT_ABORTED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError("must be in (0, 1]")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be 0 or more seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decide-eval", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="send cases to a target and measure quality and latency")
    run.add_argument(
        "--target",
        required=True,
        help="http(s)://host:port (a local or remote server) or a SageMaker endpoint name",
    )
    run.add_argument(
        "--cases",
        required=True,
        type=Path,
        help="JevBench cases.jsonl, labelled-decisions JSONL, or Benchmark Heaven tasks JSONL",
    )
    run.add_argument(
        "--gold",
        type=Path,
        help="JevBench gold.jsonl (default: ../../data/gold.jsonl next to a "
        "JevBench suite's cases.jsonl, when present)",
    )
    run.add_argument("--no-gold", action="store_true", help="do not look for a gold file (latency only)")
    run.add_argument("--limit", type=_positive, help="send only the first N cases (after --seed shuffling)")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--sequential", action="store_true", help="one request at a time (the default)")
    mode.add_argument("--concurrency", type=_positive, default=1, help="requests in flight at once")
    run.add_argument("--seed", type=int, help="shuffle the cases reproducibly before --limit")
    run.add_argument(
        "--warmup",
        type=_non_negative,
        default=1,
        help="untimed-in-percentiles warm-up requests before the run (default 1)",
    )
    run.add_argument("--out", required=True, type=Path, help="run directory to write")
    run.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    run.add_argument(
        "--route",
        choices=["invocations", "direct"],
        default="invocations",
        help="HTTP targets: POST /invocations with route=/v1/systemone (default) or /v1/systemone",
    )
    run.add_argument("--region", help="SageMaker targets: AWS region")
    run.add_argument("--profile", help="SageMaker targets: AWS profile")
    run.add_argument("--timeout", type=_seconds, default=70.0, help="seconds per request (default 70)")
    run.add_argument("--model", help="send this 'model' value (our server accepts any; Jev needs one)")
    run.add_argument("--permutations", type=_positive, help="ask for option-order averaging over K orders")
    run.add_argument("--mode", choices=["shared", "fresh"], help="ask decider for this decision mode")
    run.add_argument(
        "--no-extensions",
        action="store_true",
        help="do not ask for the extension block (no raw logits; calibrate then uses log p)",
    )
    run.add_argument(
        "--max-transport-errors",
        type=_non_negative,
        default=3,
        help="stop after this many network failures in a row (0 = never)",
    )
    run.add_argument(
        "--max-seconds",
        type=_seconds,
        help="time box: start no new request after this many seconds (the item set then depends on speed)",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")

    report = sub.add_parser("report", help="print a run's summary and rewrite its HTML report")
    report.add_argument("run_dir", type=Path)

    compare = sub.add_parser("compare", help="speed ratios and argmax differences between two runs")
    compare.add_argument("run_a", type=Path)
    compare.add_argument("run_b", type=Path)
    compare.add_argument("--out", type=Path, help="write compare.json and compare.html here")
    compare.add_argument("--max-rows", type=_positive, default=50, help="differences shown in the terminal")

    calibrate = sub.add_parser("calibrate", help="fit a temperature per question type (out-of-fold checked)")
    calibrate.add_argument("run_dir", type=Path)
    calibrate.add_argument("--folds", type=_positive, default=5)
    calibrate.add_argument("--seed", type=int, default=0)
    calibrate.add_argument("--min-samples", type=_positive, default=30)
    calibrate.add_argument(
        "--variant", choices=["cpu", "gpu"], default="cpu", help="stack the CDK hint targets"
    )

    thresholds = sub.add_parser(
        "thresholds", help="confidence cut-points meeting a target accuracy, per type and key (out-of-fold)"
    )
    thresholds.add_argument("run_dir", type=Path)
    thresholds.add_argument("--target-accuracy", type=_fraction, default=0.95)
    thresholds.add_argument(
        "--min-accepted", type=_positive, default=10, help="answers a cut must keep (default 10)"
    )
    thresholds.add_argument(
        "--min-key-labels",
        type=_positive,
        default=50,
        help="labelled answers a question key needs for a cut of its own (default 50)",
    )
    thresholds.add_argument("--folds", type=_positive, default=5)
    thresholds.add_argument("--bootstrap", type=_non_negative, default=1000, help="resamples (default 1000)")
    thresholds.add_argument("--seed", type=int, default=0)

    check = sub.add_parser(
        "check", help="gate: exit 1 when accuracy, ECE or p95 latency moved past bounds beyond noise"
    )
    check.add_argument("run_dir", type=Path)
    check.add_argument(
        "--baseline", required=True, type=Path, help="the accepted run: a run directory or a baseline file"
    )
    defaults = Bounds()
    check.add_argument(
        "--max-accuracy-drop",
        type=_non_negative_float,
        default=defaults.max_accuracy_drop,
        help=f"absolute (default {defaults.max_accuracy_drop:g})",
    )
    check.add_argument(
        "--max-ece-rise",
        type=_non_negative_float,
        default=defaults.max_ece_rise,
        help=f"absolute (default {defaults.max_ece_rise:g})",
    )
    check.add_argument(
        "--max-p95-increase",
        type=_non_negative_float,
        default=defaults.max_p95_increase,
        help=f"relative (default {defaults.max_p95_increase:g} = +{defaults.max_p95_increase * 100:g}%%)",
    )
    check.add_argument(
        "--confidence",
        type=_fraction,
        default=defaults.confidence,
        help="that noise alone does not fail the check, all comparisons together (default 0.95)",
    )
    check.add_argument(
        "--min-group",
        type=_positive,
        default=defaults.min_group,
        help=f"scored answers (requests, for latency) a group needs in both runs to be gated "
        f"(default {defaults.min_group})",
    )
    check.add_argument("--bootstrap", type=_positive, default=defaults.bootstrap)
    check.add_argument("--seed", type=int, default=defaults.seed)
    check.add_argument(
        "--accept", type=Path, help="when the check passes, write the run here as the next baseline file"
    )
    check.add_argument(
        "--allow-missing-baseline",
        action="store_true",
        help="a --baseline path that does not exist yet passes (the first run of a pipeline)",
    )
    check.add_argument("--all", action="store_true", help="show every domain row")
    return parser


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    if args.out.exists() and (args.out / RESULTS_FILE).exists() and not args.force:
        Console(stderr=True).print(
            f"[red]error:[/] {args.out} already holds a run (use --force to overwrite)"
        )
        return EXIT_USAGE
    (args.out / THRESHOLDS_FILE).unlink(missing_ok=True)  # an overwritten run's cut-points are not this one's
    gold = args.gold
    if gold is None and not args.no_gold:
        gold = default_gold_path(args.cases)
        if gold is not None:
            console.print(f"gold: {gold} (found next to the suite)")
    items = select_items(load_items(args.cases, gold), limit=args.limit, seed=args.seed)
    target = make_target(
        args.target, route=args.route, timeout=args.timeout, region=args.region, profile=args.profile
    )
    concurrency = 1 if args.sequential else args.concurrency
    console.print(
        f"target: {target.description}; {len(items)} cases, "
        f"{sum(len(i.questions) for i in items)} questions, "
        f"{'sequential' if concurrency == 1 else f'concurrency {concurrency}'}, warm-up {args.warmup}"
    )
    meta = new_meta(
        target=args.target,
        description=target.description,
        cases_path=args.cases,
        gold_path=gold,
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    )
    options = {
        "extensions": not args.no_extensions,
        "model": args.model,
        "permutations": args.permutations,
        "mode": args.mode,
    }
    errors = 0
    progress = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=args.no_progress,
        transient=False,
    )
    try:
        with progress:
            task = progress.add_task("deciding", total=len(items), status="warm-up" if args.warmup else "")

            def on_reply(_index: int, reply: Reply) -> None:
                nonlocal errors
                errors += 0 if reply.ok else 1
                progress.update(task, advance=1, status=f"last {reply.latency_s:.3f}s, errors {errors}")

            meta, rows = run_evaluation(
                target,
                items,
                out_dir=args.out,
                meta=meta,
                concurrency=concurrency,
                warmup=args.warmup,
                request_options=options,
                max_transport_errors=args.max_transport_errors,
                max_seconds=args.max_seconds,
                on_reply=on_reply,
            )
    finally:
        target.close()
    summary = summarize(meta, rows)
    print_summary(summary, console)
    report = write_html_report(args.out, meta, summary)
    console.print(f"results: {args.out / RESULTS_FILE}\nreport:  {report}")
    print(headline(summary), flush=True)
    return EXIT_ABORTED if meta.aborted else EXIT_OK


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    meta, rows = load_run(args.run_dir)
    summary = summarize(meta, rows)
    print_summary(summary, console)
    report = write_html_report(args.run_dir, meta, summary, load_thresholds(args.run_dir))
    console.print(f"report: {report}")
    print(headline(summary), flush=True)
    return EXIT_OK


def cmd_compare(args: argparse.Namespace, console: Console) -> int:
    run_a, run_b = load_run(args.run_a), load_run(args.run_b)
    comparison = compare_runs(str(args.run_a), run_a, str(args.run_b), run_b)
    print_comparison(comparison, console, max_rows=args.max_rows)
    if args.out:
        latencies = {
            f"A {run_a[0].model or args.run_a.name}": [r.latency_s for r in run_a[0].requests],
            f"B {run_b[0].model or args.run_b.name}": [r.latency_s for r in run_b[0].requests],
        }
        console.print(f"compare report: {write_comparison(args.out, comparison, latencies)}")
    return EXIT_OK


def cmd_calibrate(args: argparse.Namespace, console: Console) -> int:
    _meta, rows = load_run(args.run_dir)
    calibration = calibrate_rows(
        rows, folds=args.folds, seed=args.seed, min_samples=args.min_samples, variant=args.variant
    )
    print_calibration(calibration, console)
    console.print(f"written: {write_calibration(args.run_dir, calibration)}")
    return EXIT_OK


def cmd_thresholds(args: argparse.Namespace, console: Console) -> int:
    meta, rows = load_run(args.run_dir)
    thresholds = compute_thresholds(
        str(args.run_dir),
        meta,
        rows,
        target=args.target_accuracy,
        min_accepted=args.min_accepted,
        min_key_labels=args.min_key_labels,
        folds=args.folds,
        bootstrap=args.bootstrap,
        seed=args.seed,
    )
    print_thresholds(thresholds, console)
    console.print(f"written: {write_thresholds(args.run_dir, thresholds)}")
    report = write_html_report(args.run_dir, meta, summarize(meta, rows), thresholds)
    console.print(f"report:  {report} (coverage-accuracy curve)")
    return EXIT_OK


def cmd_check(args: argparse.Namespace, console: Console) -> int:
    run = load_run(args.run_dir)
    if not args.baseline.exists() and args.allow_missing_baseline:
        console.print(f"no baseline at {args.baseline}: nothing to compare with, the run passes (first run)")
        if args.accept:
            console.print(f"accepted as the baseline: {save_baseline(args.accept, *run)}")
        return EXIT_OK
    baseline = load_run_or_baseline(args.baseline)
    bounds = Bounds(
        max_accuracy_drop=args.max_accuracy_drop,
        max_ece_rise=args.max_ece_rise,
        max_p95_increase=args.max_p95_increase,
        confidence=args.confidence,
        min_group=args.min_group,
        bootstrap=args.bootstrap,
        seed=args.seed,
    )
    result = check_runs(str(args.run_dir), run, str(args.baseline), baseline, bounds)
    print_check(result, console, all_rows=args.all)
    write_check(args.run_dir, result)
    if result.failed:
        return EXIT_ABORTED
    if args.accept:
        console.print(f"accepted as the baseline: {save_baseline(args.accept, *run)}")
    return EXIT_OK


def make_console() -> Console:
    """Rich console for stdout; 120 columns when piped (rich's default of 80 squeezes the tables)."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else 120)


COMMANDS = {
    "run": cmd_run,
    "report": cmd_report,
    "compare": cmd_compare,
    "calibrate": cmd_calibrate,
    "thresholds": cmd_thresholds,
    "check": cmd_check,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = make_console()
    try:
        return COMMANDS[args.command](args, console)
    except (CaseFileError, TargetError, RunDirError) as exc:
        Console(stderr=True, highlight=False).print(f"[red]error:[/] {exc}", soft_wrap=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/] (a partial run, if any, was written)")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
