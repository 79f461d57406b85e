"""`preflight`: read-only checks before a `cdk deploy` (quotas, CDK bootstrap, leftovers).

    preflight --region eu-west-1                 # both stacks, cdk.json's config
    preflight --variant gpu -c gpu.max_capacity=4
    preflight --json

Exit status: 0 when nothing blocks a deploy (findings marked `unknown` could not be read and are
shown, not counted), 1 when something is missing (each line says how to fix it), 2 on bad input or
missing credentials.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from decider_cli.preflight import checks
from decider_stacks.config import VARIANTS, ConfigError, load_config
from decider_stacks.synth import context_with

EXIT_OK, EXIT_MISSING, EXIT_USAGE = 0, 1, 2
CLIENT_CONFIG = Config(retries={"mode": "adaptive", "max_attempts": 8}, user_agent_extra="preflight/0.1")
SERVICES = (
    "service-quotas",
    "sagemaker",
    "ssm",
    "cloudformation",
    "s3",
    "sts",
    "logs",
    "cloudwatch",
    "application-autoscaling",
)
STYLE = {
    "ok": "[green]ok[/]",
    "missing": "[bold red]MISSING[/]",
    "unknown": "[yellow]unknown[/]",
    "warning": "[bold yellow]warning[/]",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="preflight", description=__doc__.split("\n\n")[0])
    parser.add_argument("--region", help="AWS region (default: the profile's / AWS_REGION)")
    parser.add_argument("--profile", help="AWS named profile")
    parser.add_argument("--variant", choices=[*VARIANTS, "all"], default="all")
    parser.add_argument("-c", "--context", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true")
    return parser


def _target(args: argparse.Namespace, clients: dict) -> checks.Target:
    config = load_config(context_with(args.context))
    names = VARIANTS if args.variant == "all" else (args.variant,)
    account = clients["sts"].get_caller_identity()["Account"]
    return checks.Target(
        config, tuple(config.variant(n) for n in names), clients["sts"].meta.region_name, account
    )


def make_clients(region: str | None, profile: str | None) -> dict:
    session = boto3.Session(region_name=region, profile_name=profile)
    if not session.region_name:
        raise ConfigError("no AWS region: pass --region or set AWS_REGION")
    return {name: session.client(name, config=CLIENT_CONFIG) for name in SERVICES}


def show(console: Console, target: checks.Target, findings: list[checks.Finding]) -> None:
    console.print(
        f"[bold]preflight[/] account {target.account}, region {target.region}: "
        + ", ".join(v.endpoint_name for v in target.variants)
    )
    table = Table()
    for column in ("check", "status", "detail"):
        table.add_column(column)
    for finding in findings:
        table.add_row(escape(finding.check), STYLE[finding.status], escape(finding.detail))
    console.print(table)
    fixes = [f for f in findings if f.fix]
    if fixes:
        console.print(
            "[bold]To fix before deploying[/] (quota increases can take a while to be granted; warnings "
            "do not block):"
        )
        for finding in fixes:
            console.print(f"  {escape(finding.check)}: {escape(finding.fix)}", soft_wrap=True)


def main(argv: Sequence[str] | None = None, clients: dict | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    errors = Console(stderr=True, highlight=False)
    try:
        clients = clients or make_clients(args.region, args.profile)
        target = _target(args, clients)
        findings = checks.run_all(clients, target)
    except ConfigError as error:
        errors.print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
        return EXIT_USAGE
    except (NoCredentialsError, ClientError, BotoCoreError) as error:
        errors.print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
        return EXIT_USAGE
    if args.json:
        print(
            json.dumps(
                {
                    "account": target.account,
                    "region": target.region,
                    "findings": [asdict(f) for f in findings],
                },
                indent=1,
            )
        )
    else:
        show(console, target, findings)
    return EXIT_MISSING if any(f.blocking for f in findings) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
