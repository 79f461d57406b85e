"""The main job (`make demo`): the whole loop on the bundled model, locally.

1. start the real server (`serve`, as the image runs it) on the bundled SmolLM2-135M model;
2. decide one sample request and print its typed answers;
3. evaluate a JevBench subset against it (`decide-eval run`, sequential, as published);
4. print the report, a calibration fit, the confidence cut-points for 95 % accuracy (`decide-eval
   thresholds`), and where the HTML report is.

The server is always stopped on exit, on Ctrl-C and on SIGTERM. The JevBench data (Apache-2.0,
Copyright 2026 Chen Feng; not affiliated with TypeSafe AI) comes from the `jevbench` package and the
repository's copy of its gold labels (decider_cli.evaluate.jevbench).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from decider_cli.evaluate import cli as decide_eval
from decider_cli.evaluate.jevbench import GOLD_240, JEVBENCH_240_CASES, MISSING_HINT
from decider_cli.evaluate.targets import CUSTOM_ATTRIBUTES
from decider_dev import REPO_ROOT
from decider_dev.local_server import run_local_server, sigterm_unwinds

DEFAULT_CASES = JEVBENCH_240_CASES
DEFAULT_GOLD = GOLD_240
DEFAULT_LIMIT = 12
DEFAULT_MAX_SECONDS = 150.0  # time box for the evaluation step: "a few minutes here at most"
DEFAULT_OUT = REPO_ROOT / "runs" / "demo"

SAMPLE_REQUEST: dict[str, Any] = {
    "state": "Payouts have been failing for 3 days and we are losing sales! Fix it or refund this month.",
    "questions": {
        "team": {
            "type": "choice",
            "instructions": "Which team owns this?",
            "criteria": {"billing": "Payments, refunds", "technical": "Bugs, outages", "sales": None},
        },
        "anger": {
            "type": "score",
            "instructions": "How frustrated is the customer?",
            "criteria": ["Calm", "Civil", "Very angry"],
        },
        "refund": {"type": "noul", "instructions": "Is money back requested?"},
    },
}


def print_sample_answers(base_url: str, console: Console) -> None:
    started = time.perf_counter()
    response = httpx.post(
        f"{base_url}/invocations",
        json=SAMPLE_REQUEST,
        headers={"X-Amzn-SageMaker-Custom-Attributes": CUSTOM_ATTRIBUTES},
        timeout=120,
    )
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    body = response.json()
    table = Table(title=f"Sample decision ({elapsed:.2f} s, model {body['model']})", title_justify="left")
    for column in ("key", "type", "answer", "probabilities", "confidence"):
        table.add_column(column)
    for key, answer in body["answers"].items():
        if answer["type"] == "noul":
            shown, probs, confidence = f"p(true) = {answer['noul']:.3f}", "", "-"
        else:
            shown = (
                answer["choice"] if answer["type"] == "choice" else f"expected level {answer['score']:.2f}"
            )
            probs = " ".join(f"{k}:{p:.3f}" for k, p in answer["probabilities"].items())
            confidence = f"{answer['confidence']:.3f}"
        table.add_row(key, answer["type"], shown, probs, confidence)
    console.print(f"state: {SAMPLE_REQUEST['state']}")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--limit", type=int, default=DEFAULT_LIMIT, help=f"JevBench cases (default {DEFAULT_LIMIT})"
    )
    parser.add_argument("--seed", type=int, default=0, help="case sample (default 0)")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=DEFAULT_MAX_SECONDS,
        help=f"time box for the evaluation (default {DEFAULT_MAX_SECONDS:g}; 0 = none)",
    )
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    parser.add_argument("--gold", type=Path, default=DEFAULT_GOLD)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    console = decide_eval.make_console()
    if not args.cases.is_file() or not args.gold.is_file():
        console.print(
            f"[red]error:[/] JevBench data not found ({args.cases}, {args.gold}): {MISSING_HINT}; "
            "pass --cases/--gold to use another copy."
        )
        return 2
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored
    with sigterm_unwinds():  # SIGTERM unwinds as Ctrl-C does: the server is stopped, then exit 130
        return _run(args, console)


def _run(args: argparse.Namespace, console: Console) -> int:
    try:
        console.rule("1. start the local server (bundled SmolLM2-135M-Instruct Q4_1)")
        started = time.perf_counter()
        with run_local_server() as server:
            console.print(
                f"server ready at {server.base_url} in {time.perf_counter() - started:.1f} s "
                f"(pid {server.process.pid})"
            )
            console.rule("2. decide one sample request")
            print_sample_answers(server.base_url, console)
            box = f", time box {args.max_seconds:g} s" if args.max_seconds else ""
            console.rule(f"3. evaluate up to {args.limit} JevBench-240 cases (sequential, 1 warm-up{box})")
            command = [
                "run",
                "--target",
                server.base_url,
                "--cases",
                str(args.cases),
                "--gold",
                str(args.gold),
                "--limit",
                str(args.limit),
                "--seed",
                str(args.seed),
                "--warmup",
                "1",
                "--out",
                str(args.out),
                "--force",
                *(["--max-seconds", str(args.max_seconds)] if args.max_seconds else []),
            ]
            console.print("decide-eval " + " ".join(command), soft_wrap=True)
            code = decide_eval.main(command)
        console.print("server stopped.")
        if code == decide_eval.EXIT_INTERRUPTED:
            raise KeyboardInterrupt
        if code != 0:
            console.print(f"[red]the evaluation did not complete (exit {code})[/]")
            return code
        console.rule("4. calibration (temperature per question type, out-of-fold)")
        decide_eval.main(["calibrate", str(args.out), "--min-samples", "20"])
        console.rule("5. thresholds (confidence cut-points for 95 % accuracy, out-of-fold)")
        decide_eval.main(["thresholds", str(args.out), "--target-accuracy", "0.95"])
        report = (args.out / "report.html").resolve()
        console.rule("done")
        console.print(f"HTML report: {report}\n             {report.as_uri()}", soft_wrap=True)
        console.print(f"Results per question: {(args.out / 'results.jsonl').resolve()}", soft_wrap=True)
        console.print(
            "The bundled 135M model is far too small to judge meaning: expect accuracy near the "
            "'chance' column. The point is the loop; point --target at a real endpoint for real numbers."
        )
        return 0
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: the server was stopped[/]")
        return 130
    except (RuntimeError, TimeoutError, FileNotFoundError, httpx.HTTPError) as exc:
        console.print(f"[red]error:[/] {exc}", soft_wrap=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
