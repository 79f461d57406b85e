"""`capacity-plan`: the estimate behind the default instance types, and any others you ask for.

    capacity-plan                              # both variants of cdk.json, against their candidates
    capacity-plan --variant cpu --instance-type ml.c7i.4xlarge
    capacity-plan -c cpu.instance_type=ml.c7i.xlarge   # exit 1: p95 over half the deadline
    capacity-plan --p95-tokens 2000 --json

Exit status: 0 when every configured instance type keeps its estimated p95 under `--headroom` ×
the container's deadline (DECIDER_DEADLINE_SECONDS), 1 when one does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from decider_cli.capacity import planner
from decider_stacks.config import VARIANTS, AppConfig, ConfigError, container_settings, load_config
from decider_stacks.instances import PRICE_SOURCE
from decider_stacks.synth import context_with

EXIT_OK, EXIT_TOO_SLOW, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="capacity-plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=[*VARIANTS, "all"], default="all")
    parser.add_argument("--instance-type", action="append", default=[], help="also estimate this type")
    parser.add_argument("-c", "--context", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--p50-tokens", type=int, default=planner.REFERENCE_WORKLOAD.p50_tokens)
    parser.add_argument("--p95-tokens", type=int, default=planner.REFERENCE_WORKLOAD.p95_tokens)
    parser.add_argument("--mean-tokens", type=int, default=planner.REFERENCE_WORKLOAD.mean_tokens)
    parser.add_argument(
        "--headroom", type=float, default=0.5, help="p95 must stay under this share of the deadline"
    )
    parser.add_argument("--json", action="store_true")
    return parser


def _config(pairs: list[str]) -> AppConfig:
    return load_config(context_with(pairs))


def workload_of(args: argparse.Namespace) -> planner.Workload:
    """The reference workload, unless a token count was given on the command line."""
    reference = planner.REFERENCE_WORKLOAD
    given = (args.p50_tokens, args.p95_tokens, args.mean_tokens)
    if given == (reference.p50_tokens, reference.p95_tokens, reference.mean_tokens):
        return reference
    return planner.Workload(*given, source="command line")


def plan(args: argparse.Namespace) -> tuple[list[dict], bool]:
    config = _config(args.context)
    workload = workload_of(args)
    rows, all_fit = [], True
    for name in VARIANTS if args.variant == "all" else [args.variant]:
        variant = config.variant(name)
        deadline = container_settings(variant, config.model).deadline_seconds
        platform = "gpu" if variant.is_gpu else "cpu"
        types = list(
            dict.fromkeys([*variant.instance_types, *args.instance_type, *planner.candidates(platform)])
        )
        for instance_type in types:
            try:
                found = planner.estimate(
                    instance_type, deadline_s=deadline, headroom=args.headroom, workload=workload
                )
            except planner.UnknownInstanceError:
                if instance_type in variant.instance_types:
                    raise
                continue
            if bool(found.spec.gpus) != variant.is_gpu:
                continue
            configured = instance_type in variant.instance_types
            all_fit &= found.fits or not configured
            rows.append(
                {
                    "variant": name,
                    "instance_type": instance_type,
                    "configured": configured,
                    "units": found.units,
                    "p50_s": round(found.p50_s, 3),
                    "p95_s": round(found.p95_s, 3),
                    "deadline_s": deadline,
                    "fits": found.fits,
                    "requests_per_minute": round(found.requests_per_minute, 1),
                    "suggested_target_invocations_per_instance": found.suggested_target,
                    "configured_target": variant.target_invocations_per_instance if configured else None,
                    "suggested_target_concurrency_per_instance": found.suggested_concurrency_target,
                    "configured_concurrency_target": (
                        variant.target_concurrency_per_instance if configured else None
                    ),
                    "price_per_hour": found.spec.price_per_hour,
                    "fleet_price_per_hour": (
                        round(found.spec.price_per_hour * variant.min_capacity, 3)
                        if found.spec.price_per_hour is not None
                        else None
                    ),
                }
            )
    return rows, all_fit


def show(console: Console, rows: list[dict], headroom: float, workload: planner.Workload) -> None:
    cpu, gpu = planner.cpu_model(), planner.gpu_model_fit()
    console.print(
        "[bold]How[/]: time = fixed overhead + tokens / throughput, requests served back to back "
        "(batching adds ~1x on a compute-bound CPU; not counted on a GPU either)."
    )
    console.print(
        f"  autoscaling: 70 % of an instance's requests a minute (scaling_metric=invocations), or on "
        f"concurrency (the default) {planner.DEFAULT_CONCURRENCY_TARGET:g} requests in the container per "
        "instance: what a back-to-back server holds on average at 70 % utilisation, rho / (1 - rho)"
    )
    console.print(f"  latency measured: {escape(planner.GUIDE)}")
    console.print(
        f"    CPU {planner.CPU_MEASUREMENT.instance_type}: p50 {planner.CPU_MEASUREMENT.p50_s} s, "
        f"p95 {planner.CPU_MEASUREMENT.p95_s} s → {escape(cpu.note)}"
    )
    console.print(
        f"    GPU {planner.GPU_MEASUREMENT.instance_type}: p50 {planner.GPU_MEASUREMENT.p50_s} s, "
        f"p95 {planner.GPU_MEASUREMENT.p95_s} s → {escape(gpu.note)}"
    )
    console.print(
        f"  tokens per request: p50 {workload.p50_tokens}, p95 {workload.p95_tokens}, "
        f"mean {workload.mean_tokens} ({escape(workload.source)})"
    )
    console.print(
        "  assumed: CPU time ∝ 1/vCPUs at the measured per-vCPU speed; GPU time ∝ 1/dense FP16 TFLOPS "
        "(stacks/instances.py)"
    )
    console.print(f"  prices: {escape(PRICE_SOURCE)} (USD per instance-hour)")
    table = Table(title=f"p95 must stay under {headroom:.0%} of the deadline")
    for column in (
        "variant",
        "instance type",
        "vCPU / TFLOPS",
        "p50",
        "p95",
        "p95 / deadline",
        "req/min/instance",
        "target (suggested)",
        "$/h",
        "$/h min fleet",
    ):
        table.add_column(column, justify="left" if column in {"variant", "instance type"} else "right")
    for row in rows:
        mark = "[green]✓[/]" if row["fits"] else "[red]✗[/]"
        name = f"[bold]{row['instance_type']}[/] (configured)" if row["configured"] else row["instance_type"]
        target = str(row["suggested_target_invocations_per_instance"])
        if row["configured_target"] is not None:
            target = f"{row['configured_target']} ({target})"
        table.add_row(
            row["variant"],
            name,
            f"{row['units']:g}",
            f"{row['p50_s']:.2f} s",
            f"{row['p95_s']:.1f} s",
            f"{mark} {row['p95_s'] / row['deadline_s']:.0%}",
            f"{row['requests_per_minute']:.0f}",
            target,
            "—" if row["price_per_hour"] is None else f"{row['price_per_hour']:.3f}",
            "—" if row["fleet_price_per_hour"] is None else f"{row['fleet_price_per_hour']:.2f}",
        )
    console.print(table)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    try:
        rows, all_fit = plan(args)
    except (ConfigError, planner.UnknownInstanceError) as error:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
        return EXIT_USAGE
    if args.json:
        print(
            json.dumps(
                {
                    "cpu_model": asdict(planner.cpu_model()),
                    "gpu_model": asdict(planner.gpu_model_fit()),
                    "workload": asdict(workload_of(args)),
                    "rows": rows,
                },
                indent=1,
            )
        )
    else:
        show(console, rows, args.headroom, workload_of(args))
    if not all_fit:
        Console(stderr=True).print(
            "[bold red]a configured instance type's estimated p95 is over the headroom[/]: pick a larger "
            "type (or the GPU variant)"
        )
    return EXIT_OK if all_fit else EXIT_TOO_SLOW


if __name__ == "__main__":
    sys.exit(main())
