"""Small helpers shared by the stacks."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from aws_cdk import Stack
from aws_cdk import aws_logs as logs
from constructs import Construct

from decider_stacks.config import LOG_RETENTION_DAYS


def retention_days(days: int) -> logs.RetentionDays:
    """The RetentionDays member for a number of days (validated by the config)."""
    members = [m for m in logs.RetentionDays if m is not logs.RetentionDays.INFINITE]
    return dict(zip(LOG_RETENTION_DAYS, members, strict=True))[days]


def identity(scope: Construct, value: Any) -> str:
    """12 hex digits naming `value` as the template will show it (tokens resolved to their `Ref`/
    `Fn::GetAtt`/`Fn::GetStackOutput` form): a suffix for logical ids that must change whenever
    `value` changes (an endpoint config that must be replaced, a wait handle that must be new)."""
    resolved = Stack.of(scope).resolve(value)
    text = json.dumps(resolved, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12].upper()
