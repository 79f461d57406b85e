"""Synthesis and template helpers of the stack tests (a plain module: `conftest` is not importable by
name, since every test folder has its own)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STACKS = ("ImageStack", "CpuStack", "GpuStack")


def resources(template: dict[str, Any], cfn_type: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == cfn_type}


def only(template: dict[str, Any], cfn_type: str) -> dict[str, Any]:
    found = resources(template, cfn_type)
    assert len(found) == 1, f"expected one {cfn_type}, found {sorted(found)}"
    return next(iter(found.values()))


@dataclass
class Synth:
    outdir: Path
    templates: dict[str, dict[str, Any]]
    decider: Any  # decider_stacks.assembly.DeciderApp

    def raw(self, stack: str) -> bytes:
        return (self.outdir / f"{stack}.template.json").read_bytes()

    def asset_labels(self) -> dict[str, str]:
        """Asset hash → readable label (its construct path), from the assets manifests."""
        labels: dict[str, str] = {}
        for manifest in sorted(self.outdir.glob("*.assets.json")):
            for asset_hash, entry in json.loads(manifest.read_text())["files"].items():
                if entry["source"].get("packaging") == "zip":
                    labels[asset_hash] = entry.get("displayName", "asset")
        return labels

    def masked(self, stack: str) -> dict[str, Any]:
        """The template with asset hashes replaced by `<asset:NAME>`, and the names derived from the
        container's content hash (image tags, the build's wait condition) by placeholders, for
        snapshots: a change under container/ alone leaves them as they are."""
        text = self.raw(stack).decode()
        for asset_hash, label in self.asset_labels().items():
            text = text.replace(asset_hash, f"<asset:{label}>")
        text = re.sub(r"\b(cpu|cuda)-[0-9a-f]{64}\b", r"\1-<image-tag>", text)
        text = re.sub(r"(Handle|Wait)[0-9A-F]{12}([0-9A-F]{8})?", r"\1<build-inputs>", text)
        # the update guard's fingerprint hashes the image tag too (tests/stacks/test_update_guard*.py
        # hold that it changes with the settings)
        text = re.sub(r'"Fingerprint": "[0-9a-f]{32}"', '"Fingerprint": "<fingerprint>"', text)
        return json.loads(text)


def run_synth(outdir: Path, context: dict[str, Any] | None = None, *, nag: bool = True) -> Synth:
    from decider_stacks.synth import synthesize_assembly, templates_of

    try:
        decider, assembly = synthesize_assembly(outdir, context, nag=nag)
    except RuntimeError as error:
        report = outdir / "validation-report.json"
        detail = report.read_text() if report.exists() else ""
        raise AssertionError(f"synth failed: {error}\n{detail}") from None
    templates = templates_of(assembly)
    return Synth(outdir=outdir, templates=templates, decider=decider)


def acknowledgements(outdir: Path) -> list[tuple[str, str, str]]:
    """(construct path, rule id, reason) for every acknowledgement recorded in the assembly."""
    found = []
    for metadata in sorted(outdir.glob("*.metadata.json")):
        for path, entries in json.loads(metadata.read_text()).items():
            for entry in entries:
                if entry["type"] == "aws:cdk:acknowledged-rules":
                    for rule, reason in entry["data"].items():
                        found.append((path, rule.split("::", 1)[1], reason))
    return found
