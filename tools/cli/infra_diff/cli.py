"""`infra-diff`: offline, resource-level diff of the CDK app between two revisions or against a baseline.

    infra-diff --base HEAD                     # working tree vs the last commit
    infra-diff --base main --head feature      # two revisions
    infra-diff --head-context cpu.image_uri=…  # what a `cdk deploy -c …` would change
    infra-diff --save-baseline .baseline/      # then later: infra-diff --baseline .baseline/

Exit status: 0 (no differences, or differences without --fail-on-change), 1 (differences with
--fail-on-change, or warnings with --fail-on-warning), 2 (bad usage, a revision that does not exist,
or a synthesis failure).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from decider_cli.infra_diff.diff import diff_templates
from decider_cli.infra_diff.render import show_report
from decider_cli.infra_diff.synth import (
    SynthError,
    SynthJob,
    cdk_json_context,
    export_revision,
    parse_context,
    synthesize_many,
)

EXIT_OK, EXIT_CHANGED, EXIT_ERROR = 0, 1, 2
BASELINE_INFO = "baseline.json"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infra-diff", description=__doc__.split("\n\n")[0])
    base = parser.add_mutually_exclusive_group()
    base.add_argument("--base", metavar="REV", help="git revision to compare against (e.g. HEAD, main)")
    base.add_argument("--baseline", metavar="DIR", type=Path, help="templates saved by --save-baseline")
    parser.add_argument("--head", metavar="REV", help="git revision to compare (default: the working tree)")
    parser.add_argument(
        "--save-baseline",
        metavar="DIR",
        type=Path,
        help="synthesize the head and save its templates to DIR (no diff unless a base is given)",
    )
    parser.add_argument(
        "-c",
        "--context",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="context override for both sides, like `cdk -c` (dotted keys allowed)",
    )
    parser.add_argument("--base-context", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--head-context", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--stack", action="append", default=[], help="only these stacks (repeat)")
    parser.add_argument(
        "--fail-on-change", action="store_true", help="exit 1 when anything differs (CI gate)"
    )
    parser.add_argument(
        "--fail-on-warning",
        action="store_true",
        help="exit 1 when a change would be refused by the service (e.g. an autoscaled instance-type change)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    parser.add_argument(
        "--repo", type=Path, default=None, help="repository root (default: git toplevel of cwd)"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per synthesis")
    return parser


def _repo_root(explicit: Path | None) -> Path:
    if explicit is not None:
        return explicit.resolve()
    result = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise SynthError("not inside a git repository; pass --repo")
    return Path(result.stdout.strip())


def load_baseline(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    info_path = directory / BASELINE_INFO
    if not info_path.is_file():
        raise SynthError(
            f"{directory} is not a baseline (no {BASELINE_INFO}); create one with --save-baseline"
        )
    try:
        info = json.loads(info_path.read_text())
        templates = {
            name: json.loads((directory / f"{name.replace('/', '__')}.template.json").read_text())
            for name in info["stacks"]
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SynthError(f"{directory} is not a readable baseline: {exc}") from exc
    return templates, info


def save_baseline(directory: Path, templates: dict[str, Any], info: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, template in templates.items():
        path = directory / f"{name.replace('/', '__')}.template.json"
        path.write_text(json.dumps(template, indent=1, sort_keys=True) + "\n")
    (directory / BASELINE_INFO).write_text(json.dumps({**info, "stacks": sorted(templates)}, indent=1) + "\n")


def _describe_source(repo: Path, revision: str | None) -> str:
    if revision is None:
        return "working tree"
    result = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", revision],
        capture_output=True,
        text=True,
        check=False,
    )
    return f"{revision} ({result.stdout.strip()})" if result.returncode == 0 else revision


def run(args: argparse.Namespace, console: Console) -> int:
    repo = _repo_root(args.repo)
    shared = parse_context(args.context)
    with tempfile.TemporaryDirectory(prefix="infra-diff-") as tmp:
        work = Path(tmp)
        head_tree = export_revision(repo, args.head, work / "head") if args.head else repo
        head_context = {**cdk_json_context(head_tree), **shared, **parse_context(args.head_context)}
        jobs = [SynthJob(head_tree, work / "head.out", head_context)]
        base_label = None
        if args.base is not None:
            base_tree = export_revision(repo, args.base, work / "base")
            base_context = {**cdk_json_context(base_tree), **shared, **parse_context(args.base_context)}
            jobs.append(SynthJob(base_tree, work / "base.out", base_context))
            base_label = _describe_source(repo, args.base)
        elif (
            args.baseline is None and (args.base_context or args.head_context) and args.save_baseline is None
        ):
            base_context = {**cdk_json_context(repo), **shared, **parse_context(args.base_context)}
            jobs.append(SynthJob(repo, work / "base.out", base_context))
            base_label = "working tree (base context)"
        results = synthesize_many(jobs, timeout=args.timeout)
    head = results[0]
    head_label = _describe_source(repo, args.head)
    if args.save_baseline is not None:
        save_baseline(
            args.save_baseline,
            head,
            {"source": head_label, "context": shared | parse_context(args.head_context)},
        )
        console.print(f"saved {len(head)} template(s) from {head_label} to {args.save_baseline}")
        if base_label is None and args.baseline is None:
            return EXIT_OK
    if args.baseline is not None:
        base, info = load_baseline(args.baseline)
        base_label = f"baseline {args.baseline} ({info.get('source', '?')})"
    elif base_label is not None:
        base = results[1]
    else:
        raise SynthError("nothing to compare: pass --base REV, --baseline DIR, or --base/--head-context")
    unknown = sorted(set(args.stack) - set(base) - set(head))
    if unknown:  # a misspelt --stack would otherwise diff nothing and pass a --fail-on-change gate
        known = ", ".join(sorted(set(base) | set(head))) or "none"
        raise SynthError(f"unknown --stack {', '.join(unknown)} (stacks: {known})")
    report = diff_templates(base, head, args.stack or None)
    if args.json:
        print(json.dumps({"base": base_label, "head": head_label, **report.to_json()}, indent=1, default=str))
    else:
        show_report(console, report, title=f"infra-diff: {base_label} → {head_label}")
    if report.warnings and args.fail_on_warning:
        return EXIT_CHANGED
    return EXIT_CHANGED if report.has_changes and args.fail_on_change else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(highlight=False)
    try:
        return run(args, console)
    except SynthError as exc:
        Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
