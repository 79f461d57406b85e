"""Readable output of a diff Report: per stack, per resource, replacements and IAM called out."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.markup import escape

from decider_cli.infra_diff.diff import Report, ResourceChange, leaf_changes, render_path

SYMBOL = {
    "add": "[green][+][/]",
    "remove": "[red][-][/]",
    "modify": "[yellow][~][/]",
    "replace": "[bold red][!][/]",
}
MAX_VALUE = 600  # long enough for any image URI or ARN; cuts only big JSON blobs


def _value(value: Any) -> str:
    if value is None:
        return "(absent)"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))
    return escape(text if len(text) <= MAX_VALUE else text[: MAX_VALUE - 1] + "…")


def _flags(change: ResourceChange) -> str:
    flags = []
    if change.action == "replace":
        flags.append("[bold red]REPLACE[/]")
    elif change.may_replace:
        flags.append("[red]MAY REPLACE[/]")
    if change.iam:
        flags.append("[magenta]IAM[/]")
    return " ".join(flags)


def show_resource(console: Console, change: ResourceChange) -> None:
    console.print(
        f"  {SYMBOL[change.action]} {change.type} [bold]{change.logical_id}[/] {_flags(change)}",
        soft_wrap=True,
    )
    if change.note:
        console.print(f"      [cyan]→ {escape(change.note)}[/]", soft_wrap=True)
    if change.fate:
        colour = "bold red" if change.old_resource == "deleted" else "yellow"
        console.print(f"      [{colour}]⇒ {escape(change.fate)}[/]", soft_wrap=True)
    for reason in change.reasons:
        console.print(f"      because {escape(reason)}", soft_wrap=True)
    for prop in change.changes:
        marker = " [bold red](replaces)[/]" if prop.replaces else ""
        console.print(f"      ~ {escape(prop.path)}{marker}", soft_wrap=True)
        console.print(f"          [red]- {_value(prop.old)}[/]", soft_wrap=True)
        console.print(f"          [green]+ {_value(prop.new)}[/]", soft_wrap=True)
        if prop.note:
            console.print(f"          [cyan]({escape(prop.note)})[/]", soft_wrap=True)
    for line in change.policy_statements:
        colour = "green" if line.startswith("+") else "red"
        console.print(f"      [magenta]policy[/] [{colour}]{escape(line)}[/]", soft_wrap=True)


def show_report(console: Console, report: Report, *, title: str) -> None:
    console.print(f"[bold]{escape(title)}[/]")
    if not report.has_changes:
        console.print("[green]No differences.[/]")
        return
    for stack in report.stacks_added:
        console.print(f"[green]stack added:[/] {stack}")
    for stack in report.stacks_removed:
        console.print(f"[red]stack removed:[/] {stack}")
    stacks = sorted({c.stack for c in report.resources} | {s.stack for s in report.sections})
    for stack in stacks:
        console.print(f"\n[bold underline]{stack}[/]")
        for change in (c for c in report.resources if c.stack == stack):
            show_resource(console, change)
        for section in (s for s in report.sections if s.stack == stack):
            console.print(
                f"  {SYMBOL[section.action]} {section.section} [bold]{escape(section.key)}[/]", soft_wrap=True
            )
            for path, old, new in leaf_changes(section.old, section.new):
                if path:
                    console.print(f"      ~ {escape(render_path(path))}", soft_wrap=True)
                console.print(f"          [red]- {_value(old)}[/]", soft_wrap=True)
                console.print(f"          [green]+ {_value(new)}[/]", soft_wrap=True)
    show_summary(console, report)


def show_summary(console: Console, report: Report) -> None:
    counts = {
        action: sum(1 for c in report.resources if c.action == action)
        for action in ("add", "remove", "modify", "replace")
    }
    console.print(
        f"\n[bold]Summary:[/] {counts['add']} added, {counts['remove']} removed, "
        f"{counts['modify']} modified, {counts['replace']} replaced, "
        f"{len(report.iam_changes)} IAM-relevant, {len(report.sections)} section changes, "
        f"{len(report.warnings)} warning(s)",
        soft_wrap=True,
    )
    for change in report.replacements:
        note = f" — {change.note}" if change.note else ""
        console.print(
            f"  [bold red]REPLACE[/] {change.stack}/{change.logical_id} ({change.type}){escape(note)}",
            soft_wrap=True,
        )
    for change in (c for c in report.resources if c.may_replace and c.action != "replace"):
        console.print(
            f"  [red]MAY REPLACE[/] {change.stack}/{change.logical_id} ({change.type})", soft_wrap=True
        )
    for change in report.iam_changes:
        console.print(
            f"  [magenta]IAM[/] {change.action} {change.stack}/{change.logical_id} ({change.type})",
            soft_wrap=True,
        )
    for warning in report.warnings:
        console.print(
            f"  [bold yellow]WARNING[/] {warning.stack}/{warning.logical_id} {escape(f'[{warning.code}]')}: "
            f"{escape(warning.message)}",
            soft_wrap=True,
        )
