"""cdk-nag helpers: every acknowledgement states why the finding does not apply."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from aws_cdk import Acknowledgment, Stack, Token, Validations
from constructs import IConstruct

_RECORDING: ContextVar[bool] = ContextVar("decider_nag_recording", default=True)


@contextmanager
def unvalidated() -> Iterator[None]:
    """Build without recording acknowledgements: for an app that no validation plugin checks
    (`build_app(nag=False)`). They feed only the plugins (the templates are the same bytes), and each
    costs a handful of jsii calls (together about a tenth of such a synth)."""
    token = _RECORDING.set(False)
    try:
        yield
    finally:
        _RECORDING.reset(token)


def acknowledge(scope: IConstruct, rule: str, reason: str) -> None:
    """Acknowledge one cdk-nag finding on a scope and its children.

    `rule` is the finding as cdk-nag names it, e.g. `AwsSolutions-IAM5[Resource::*]`; the pack
    (`AwsSolutions`, `HIPAA.Security`, …) is the part before the first hyphen.
    """
    if len(reason) < 40:
        raise ValueError(f"acknowledging {rule} needs a specific reason, got {reason!r}")
    if not _RECORDING.get():
        return
    pack = rule.split("-", 1)[0]
    rules = {rule}
    # With `-c account=… -c region=…` the stacks are pinned and the findings name the literal values.
    stack = Stack.of(scope)
    pinned = rule
    for placeholder, value in (
        ("<AWS::AccountId>", stack.account),
        ("<AWS::Region>", stack.region),
        ("<AWS::Partition>", stack.partition),
    ):
        if not Token.is_unresolved(value):
            pinned = pinned.replace(placeholder, value)
    rules.add(pinned)
    for name in sorted(rules):
        Validations.of(scope).acknowledge(Acknowledgment(id=f"{pack}::{name}", reason=reason))
