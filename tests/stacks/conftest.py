"""Synthesize the CDK app once per session (in-process, offline) and share the templates."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Node 20 still works for jsii; keep its end-of-life banner out of the test output.
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")


PYTHON_MIRROR = "public.ecr.aws/docker/library/python:3.11.14-slim-bookworm"


@dataclass
class Synth:
    outdir: Path
    templates: dict[str, dict[str, Any]]
    decider: Any  # stacks.assembly.DeciderApp

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
        """The template with asset hashes replaced by `<asset:NAME>`, for snapshots."""
        text = self.raw(stack).decode()
        for asset_hash, label in self.asset_labels().items():
            text = text.replace(asset_hash, f"<asset:{label}>")
        return json.loads(text)


def run_synth(outdir: Path, context: dict[str, Any] | None = None) -> Synth:
    from stacks.synth import synthesize_assembly

    try:
        decider, assembly = synthesize_assembly(outdir, context)
    except RuntimeError as error:
        report = outdir / "validation-report.json"
        detail = report.read_text() if report.exists() else ""
        raise AssertionError(f"synth failed: {error}\n{detail}") from None
    templates = {stack.stack_name: stack.template for stack in assembly.stacks}
    return Synth(outdir=outdir, templates=templates, decider=decider)


@pytest.fixture(scope="session")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """The default app (cdk.json context only), synthesized once."""
    return run_synth(tmp_path_factory.mktemp("cdk-default"))


@pytest.fixture(scope="session")
def synth_prebuilt(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """The CI path: prebuilt image and model for both variants, data capture on, LINEAR on GPU."""
    context = {
        "image_uri": "123456789012.dkr.ecr.eu-west-1.amazonaws.com/decider@sha256:" + "a" * 64,
        "model_s3_uri": "s3://ci-models/qwen/",
        "cpu.data_capture.enabled": "true",
        "cpu.data_capture.sampling_percentage": "25",
        "gpu.deployment.traffic_routing": "LINEAR",
        "gpu.instance_type": "ml.g6.2xlarge",
        "gpu.autoscaling": "false",
        "cpu.image_uri": "null",  # as `-c cpu.image_uri=null`: the CPU image is still built (mirror)
        "cpu.image_build.build_args.PYTHON_IMAGE": PYTHON_MIRROR,
    }
    return run_synth(tmp_path_factory.mktemp("cdk-prebuilt"), context)
