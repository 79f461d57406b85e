"""Synthesize the CDK app in-process, offline, exactly as `npx cdk synth` does.

    from decider_stacks.synth import synthesize
    templates = synthesize(Path("cdk.out.tmp"), {"cpu.instance_type": "ml.c7i.2xlarge"})
    templates["CpuStack"]["Resources"]...

Used by tools/cli/infra_diff and the tests: no CLI, no node process of our own, no credentials, no AWS
calls. The context is cdk.json's, plus `context` overrides spelled like `-c` keys.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from decider_stacks.paths import CDK_JSON

# What the CDK CLI adds to the context on `cdk synth` (with cdk.json's "versionReporting": false).
CLI_CONTEXT = {
    "aws:cdk:enable-path-metadata": True,
    "aws:cdk:enable-asset-metadata": True,
    "aws:cdk:version-reporting": False,
    "aws:cdk:bundling-stacks": ["**"],
}


def cdk_json_context(path: Path = CDK_JSON) -> dict[str, Any]:
    """The `context` object of cdk.json."""
    return dict(json.loads(path.read_text(encoding="utf-8")).get("context", {}))


def parse_context(pairs: list[str]) -> dict[str, str]:
    """`-c key=value` pairs (dotted keys allowed), as strings, exactly like the cdk CLI passes them.
    Raises ValueError for a pair without a key or an `=`."""
    context: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"-c expects KEY=VALUE, got {pair!r}")
        context[key] = value
    return context


def context_with(pairs: list[str]) -> dict[str, Any]:
    """cdk.json's context with `-c KEY=VALUE` overrides applied; decider_stacks.config.ConfigError
    for a bad pair."""
    from decider_stacks.config import ConfigError

    try:
        return {**cdk_json_context(), **parse_context(pairs)}
    except ValueError as error:
        raise ConfigError(str(error)) from None


def synthesize_assembly(outdir: Path, context: Mapping[str, Any] | None = None, *, nag: bool = True):
    """Build and synthesize the app into `outdir`; returns (DeciderApp, CloudAssembly).

    Raises decider_stacks.config.ConfigError for invalid configuration, and the CDK's validation error when
    cdk-nag (or CloudFormation validation) reports an unacknowledged violation.
    """
    from aws_cdk import App

    from decider_stacks.assembly import build_app

    merged = {**cdk_json_context(), **CLI_CONTEXT, **dict(context or {})}
    outdir.mkdir(parents=True, exist_ok=True)
    app = App(outdir=str(outdir), context=merged, analytics_reporting=False)
    decider = build_app(app, nag=nag)
    return decider, app.synth()


def templates_of(assembly: Any) -> dict[str, dict[str, Any]]:
    """Stack name → template, read from the assembly's files (a stack's `template` property sends the
    whole template over jsii's pipe instead: 5 % of a synth's CPU)."""
    return {
        stack.stack_name: json.loads(Path(stack.template_full_path).read_text(encoding="utf-8"))
        for stack in assembly.stacks
    }


def synthesize(outdir: Path, context: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Stack name → CloudFormation template (as parsed JSON), synthesized into `outdir`."""
    _, assembly = synthesize_assembly(outdir, context)
    return templates_of(assembly)
