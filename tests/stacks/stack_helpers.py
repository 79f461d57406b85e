"""Helpers for reading synthesized CloudFormation templates in the stack tests."""

from __future__ import annotations

from typing import Any

STACKS = ("ImageStack", "CpuStack", "GpuStack")


def resources(template: dict[str, Any], cfn_type: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == cfn_type}


def only(template: dict[str, Any], cfn_type: str) -> dict[str, Any]:
    found = resources(template, cfn_type)
    assert len(found) == 1, f"expected one {cfn_type}, found {sorted(found)}"
    return next(iter(found.values()))
