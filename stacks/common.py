"""Small helpers shared by the stacks."""

from __future__ import annotations

from aws_cdk import aws_logs as logs

from stacks.config import LOG_RETENTION_DAYS


def retention_days(days: int) -> logs.RetentionDays:
    """The RetentionDays member for a number of days (validated by the config)."""
    members = [m for m in logs.RetentionDays if m is not logs.RetentionDays.INFINITE]
    return dict(zip(LOG_RETENTION_DAYS, members, strict=True))[days]
