"""cdk-nag helpers: every acknowledgement states why the finding does not apply."""

from __future__ import annotations

from aws_cdk import Acknowledgment, Validations
from constructs import IConstruct


def acknowledge(scope: IConstruct, rule: str, reason: str) -> None:
    """Acknowledge one cdk-nag finding on a scope and its children.

    `rule` is the finding as cdk-nag names it, e.g. `AwsSolutions-IAM5[Resource::*]`; the pack
    (`AwsSolutions`, `HIPAA.Security`, …) is the part before the first hyphen.
    """
    if len(reason) < 40:
        raise ValueError(f"acknowledging {rule} needs a specific reason, got {reason!r}")
    pack = rule.split("-", 1)[0]
    Validations.of(scope).acknowledge(Acknowledgment(id=f"{pack}::{rule}", reason=reason))
