"""Guardrails checked before `apply` / `rollback` change anything."""

from __future__ import annotations

import shlex
from typing import Any

from decider_cli.promote.errors import GuardrailError, PromoteError
from decider_cli.promote.live import BUSY_STATUSES, LiveEndpoint
from decider_cli.promote.spec import Overrides

MAX_ROLLBACK_ALARMS = 10  # AutoRollbackConfiguration.Alarms takes 1-10 alarms
CONTAINER_ENV_PREFIX = "DECIDER_"  # decider.settings.Settings env prefix


def require_idle(endpoint: LiveEndpoint) -> None:
    """Refuse while an update (ours, CloudFormation's or the service's) is in flight."""
    if endpoint.status in BUSY_STATUSES:
        raise GuardrailError(
            "endpoint_busy",
            f"endpoint {endpoint.name!r} is {endpoint.status}; refusing to start another update",
            hint="wait for InService (`promote status`), then re-run",
        )
    if endpoint.status != "InService":
        reason = f": {endpoint.failure_reason}" if endpoint.failure_reason else ""
        raise GuardrailError(
            "endpoint_not_in_service", f"endpoint {endpoint.name!r} is {endpoint.status}{reason}"
        )


def variant_key(stack: str) -> str:
    """cdk.json context object for a stack: `cpu` / `gpu` by the stack name, else a placeholder."""
    lowered = stack.lower()
    for key in ("gpu", "cpu"):
        if key in lowered:
            return key
    return "<variant>"


def container_setting(env_key: str) -> str | None:
    """The decider.settings.Settings field an env var sets (Settings is the single source of truth)."""
    try:
        from decider.settings import Settings
    except ImportError:  # promote used without the container package installed
        suffix = env_key.removeprefix(CONTAINER_ENV_PREFIX)
        return suffix.lower() if suffix != env_key else None
    return {Settings.env_name(name): name for name in Settings.model_fields}.get(env_key)


def cdk_command(stack: str, overrides: Overrides) -> str:
    """The `npx cdk deploy` line that makes the same change through the stack that owns the endpoint."""
    key = variant_key(stack)
    settings = []
    if overrides.image:
        settings.append(f"{key}.image_uri={overrides.image}")
    if overrides.model_s3:
        settings.append(f"{key}.model_s3_uri={overrides.model_s3}")
    if overrides.instance_type:
        settings.append(f"{key}.instance_type={overrides.instance_type}")
    if overrides.count is not None:
        settings.append(f"{key}.initial_instance_count={overrides.count}")
    unmapped = []
    for env_key, value in overrides.env.items():
        field = container_setting(env_key)
        if field is None:
            unmapped.append(env_key)
        else:
            settings.append(f"{key}.container.{field}={value}")
    parts = ["npx", "cdk", "deploy", stack]
    for setting in settings:
        parts += ["-c", setting]
    command = shlex.join(parts)
    if unmapped or overrides.unset_env:
        command += f"  # not settable through the stack: {', '.join([*unmapped, *overrides.unset_env])}"
    return command


def require_not_cfn_managed(
    endpoint: LiveEndpoint, overrides: Overrides, *, force: bool, action: str
) -> None:
    """A CloudFormation-owned endpoint is promoted through its stack; `--force` is break-glass only."""
    stack = endpoint.cfn_stack
    if stack is None or force:
        return
    raise GuardrailError(
        "cloudformation_managed",
        f"endpoint {endpoint.name!r} belongs to CloudFormation stack {stack!r}; "
        f"`promote {action}` would drift it and the next deploy would undo it",
        hint=f"promote it through the stack: {cdk_command(stack, overrides)}  (--force: break-glass)",
    )


def require_alarms(cloudwatch: Any, names: list[str], *, allow_firing: bool = False) -> dict[str, str]:
    """Every rollback alarm must exist (DescribeAlarms) and, unless allowed, not already be in ALARM.

    Returns {alarm name: state}.
    """
    if not names:
        raise GuardrailError(
            "no_rollback_alarms",
            "a canary without rollback alarms cannot roll back automatically",
            hint="pass --alarm NAME (1-10), or --no-auto-rollback to accept an unguarded update",
        )
    if len(names) > MAX_ROLLBACK_ALARMS:
        raise PromoteError("too_many_alarms", f"{len(names)} alarms given; SageMaker accepts at most 10")
    states = alarm_states(cloudwatch, names)
    missing = [name for name in names if name not in states]
    if missing:
        raise GuardrailError(
            "alarm_not_found",
            f"rollback alarm(s) not found: {', '.join(missing)}",
            hint="create them first (the stacks create per-variant alarms) or fix the names",
        )
    firing = [name for name, state in states.items() if state == "ALARM"]
    if firing and not allow_firing:
        raise GuardrailError(
            "alarm_already_firing",
            f"rollback alarm(s) already in ALARM: {', '.join(firing)}; the canary would roll back at once",
            hint="fix the cause first, or pass --allow-firing-alarms",
        )
    return states


def alarm_states(cloudwatch: Any, names: list[str]) -> dict[str, str]:
    """{name: StateValue} for the metric and composite alarms among `names` that exist."""
    states: dict[str, str] = {}
    paginator = cloudwatch.get_paginator("describe_alarms")
    for page in paginator.paginate(AlarmNames=list(names), AlarmTypes=["MetricAlarm", "CompositeAlarm"]):
        for alarm in page.get("MetricAlarms", []) + page.get("CompositeAlarms", []):
            states[alarm["AlarmName"]] = alarm["StateValue"]
    return states
