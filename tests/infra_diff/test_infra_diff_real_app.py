"""The real CDK app, synthesized offline twice (one subprocess, ~20 s): a new CPU image digest must show
as a Model + EndpointConfig replacement and an in-place Endpoint update in CpuStack only."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from decider_cli.infra_diff.diff import diff_templates
from decider_cli.infra_diff.render import show_report
from decider_cli.infra_diff.synth import SynthJob, cdk_json_context, synthesize_many

pytestmark = pytest.mark.cdk

REPO = Path(__file__).resolve().parents[2]
NEW_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/decider@sha256:" + "b" * 64


@pytest.fixture(scope="module")
def two_synths(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    if not (REPO / "app.py").is_file():
        pytest.fail("the CDK app (app.py) is missing")
    out = tmp_path_factory.mktemp("synth")
    context = cdk_json_context(REPO)
    base, head = synthesize_many(
        [
            SynthJob(REPO, out / "base", context),
            SynthJob(REPO, out / "head", {**context, "cpu.image_uri": NEW_IMAGE}),
        ]
    )
    return base, head


def _of_type(report, stack, resource_type):
    return [c for c in report.resources if c.stack == stack and c.type == resource_type]


def test_unrelated_stacks_synthesize_identically(two_synths):
    """Determinism: no timestamps or random names, so only the overridden stack differs."""
    base, head = two_synths
    assert {"CpuStack", "GpuStack"} <= set(base) and set(base) == set(head)
    unrelated = [name for name in base if name != "CpuStack"]
    assert not diff_templates({n: base[n] for n in unrelated}, {n: head[n] for n in unrelated}).has_changes


def test_new_cpu_image_replaces_the_endpoint_config_and_updates_the_endpoint(two_synths):
    base, head = two_synths
    report = diff_templates(base, head)
    [config] = _of_type(report, "CpuStack", "AWS::SageMaker::EndpointConfig")
    assert config.action == "replace"
    [model] = _of_type(report, "CpuStack", "AWS::SageMaker::Model")
    assert model.action == "replace"
    assert any(
        c.path == "PrimaryContainer.Image" and c.new == NEW_IMAGE and c.replaces for c in model.changes
    )
    [endpoint] = _of_type(report, "CpuStack", "AWS::SageMaker::Endpoint")
    assert endpoint.action == "modify" and "UpdateEndpoint" in endpoint.note
    assert not [c for c in report.resources if c.stack == "GpuStack"]

    console = Console(record=True, width=240)
    show_report(console, report, title="real app")
    text = console.export_text()
    assert f"REPLACE CpuStack/{config.logical_id} (AWS::SageMaker::EndpointConfig)" in text
    assert NEW_IMAGE in text
