"""rich output for plans, smoke results, prune plans and errors."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from decider_cli.promote.errors import PromoteError
from decider_cli.promote.live import LiveEndpoint
from decider_cli.promote.prune import PrunePlan
from decider_cli.promote.smoke import SmokeResult
from decider_cli.promote.spec import Promotion, field_changes


def _cell(value: Any) -> str:
    if value is None:
        return "(absent)"
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def show_endpoint(console: Console, endpoint: LiveEndpoint) -> None:
    owner = (
        f"CloudFormation stack {endpoint.cfn_stack}" if endpoint.cfn_stack else "not CloudFormation-managed"
    )
    console.print(
        f"[bold]{endpoint.name}[/] {endpoint.status} · config [cyan]{endpoint.config_name}[/] · {owner}"
    )
    if endpoint.rollback_config:
        console.print(f"  rollback target: [cyan]{endpoint.rollback_config}[/]")
    if endpoint.failure_reason:
        console.print(f"  last failure: [red]{endpoint.failure_reason}[/]")


def show_plan(console: Console, promotion: Promotion) -> None:
    changes = field_changes(promotion)
    if not promotion.changed:
        console.print("[green]No change:[/] the live config already has this content.")
        return
    # One field per block, old and new on their own lines: CI logs never truncate a digest.
    console.print(f"[bold]Changes to {promotion.endpoint}[/] (variant {promotion.variant}):")
    for change in changes:
        console.print(f"  {change.resource} [bold]{escape(change.path)}[/]", soft_wrap=True)
        console.print(f"    [red]- {escape(_cell(change.old))}[/]", soft_wrap=True)
        console.print(f"    [green]+ {escape(_cell(change.new))}[/]", soft_wrap=True)
    model_note = "new" if promotion.new_model else "unchanged"
    console.print(f"model  {promotion.live_model_name} → [cyan]{promotion.model_name}[/] ({model_note})")
    console.print(f"config {promotion.live_config_name} → [cyan]{promotion.config_name}[/] (new)")


def show_smoke(console: Console, results: list[SmokeResult]) -> None:
    table = Table(title="Smoke tests")
    for column in ("call", "result", "seconds", "detail"):
        table.add_column(column)
    for result in results:
        mark = "[green]pass[/]" if result.ok else "[red]FAIL[/]"
        table.add_row(result.name, mark, f"{result.seconds:.2f}", result.detail)
    console.print(table)


def show_prune(console: Console, plan: PrunePlan, *, dry_run: bool) -> None:
    table = Table(title="Prune (dry run)" if dry_run else "Prune")
    for column in ("kind", "name", "action", "why"):
        table.add_column(column)
    for name, why in plan.keep_configs.items():
        table.add_row("config", name, "keep", why)
    for name in plan.delete_configs:
        table.add_row("config", name, "[red]delete[/]", "unused, older than the kept ones")
    for name, why in plan.keep_models.items():
        table.add_row("model", name, "keep", why)
    for name in plan.delete_models:
        table.add_row("model", name, "[red]delete[/]", "no surviving config uses it")
    console.print(table)


def show_error(console: Console, error: PromoteError) -> None:
    console.print(f"[bold red]error\\[{error.code}][/]: {escape(error.message)}", soft_wrap=True)
    if error.hint:
        console.print(f"  hint: {escape(error.hint)}", soft_wrap=True)
