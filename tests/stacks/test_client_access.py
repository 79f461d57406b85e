"""The opt-in grants of issue 18 (stacks/client_access.py) on a synth that turns them on: Batch
Transform's S3 input/output and logs for decide-batch, and the managed policy for callers of
SageMaker's OpenAI-compatible chat path; cdk-nag passes (the synth fails otherwise) and cfn-lint is
clean. The default synth grants neither (the snapshots are unchanged)."""

from __future__ import annotations

from typing import Any

import pytest
from stack_helpers import Synth, only, resources, run_synth

pytestmark = pytest.mark.cdk


@pytest.fixture(scope="module")
def synth_access(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    context = {"cpu.batch_transform": "true", "cpu.openai_path_policy": "true"}
    return run_synth(tmp_path_factory.mktemp("cdk-client-access"), context)


def _statements(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for policy in resources(template, "AWS::IAM::Policy").values():
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]:
            if "Sid" in statement:
                out[statement["Sid"]] = statement
    return out


def _text(value: Any) -> str:
    import json

    return json.dumps(value)


def test_batch_transform_grants_the_input_output_and_logs_only(synth_access: Synth) -> None:
    statements = _statements(synth_access.templates["CpuStack"])
    assert statements["ReadBatchInput"]["Action"] == "s3:GetObject"
    assert "batch/decider-cpu/input/*" in _text(statements["ReadBatchInput"]["Resource"])
    assert sorted(statements["WriteBatchOutput"]["Action"]) == ["s3:AbortMultipartUpload", "s3:PutObject"]
    assert "batch/decider-cpu/output/*" in _text(statements["WriteBatchOutput"]["Resource"])
    assert statements["ListBatchInput"]["Condition"]["StringLike"]["s3:prefix"] == [
        "batch/decider-cpu/input/*",
        "batch/decider-cpu/output/*",
    ]
    assert "/aws/sagemaker/TransformJobs:log-stream:decide-cpu-*" in _text(statements["WriteBatchLogs"])
    for statement in statements.values():
        assert statement["Action"] not in ("s3:*", "*") and "Resource" in statement


def test_openai_path_policy(synth_access: Synth) -> None:
    template = synth_access.templates["CpuStack"]
    policy = only(template, "AWS::IAM::ManagedPolicy")["Properties"]["PolicyDocument"]["Statement"]
    by_sid = {statement["Sid"]: statement for statement in policy}
    assert by_sid["BearerToken"] == {
        "Action": "sagemaker:CallWithBearerToken",
        "Effect": "Allow",
        "Resource": "*",
        "Sid": "BearerToken",
    }
    invoke = by_sid["InvokeThisEndpoint"]
    assert sorted(invoke["Action"]) == [
        "sagemaker:InvokeEndpoint",
        "sagemaker:InvokeEndpointWithResponseStream",
    ]
    assert ":endpoint/decider-cpu" in _text(invoke["Resource"])
    assert "OpenAiPathPolicyArn" in template["Outputs"]


def test_off_by_default(synth: Synth) -> None:
    for stack in ("CpuStack", "GpuStack"):
        template = synth.templates[stack]
        assert not resources(template, "AWS::IAM::ManagedPolicy")
        assert "ReadBatchInput" not in _statements(template)
        assert "OpenAiPathPolicyArn" not in template.get("Outputs", {})
        assert "TransformModelName" not in template.get("Outputs", {})
        assert len(resources(template, "AWS::SageMaker::Model")) == 1


def test_cfn_lint_is_clean(synth_access: Synth) -> None:
    from cfnlint.api import ManualArgs, lint

    template = (synth_access.outdir / "CpuStack.template.json").read_text()
    matches = lint(template, config=ManualArgs(regions=["us-east-1", "eu-west-1"]))
    errors = [m for m in matches if m.rule.id.startswith("E")]
    assert errors == [], "\n".join(f"{m.rule.id} {m.message} ({m.path})" for m in errors)


def test_batch_transform_gets_a_model_on_a_tar_gz(synth_access: Synth) -> None:
    """Batch Transform cannot use ModelDataSource (ContainerDefinition): the stack adds a Model on the
    staged model.tar.gz through ModelDataUrl, outputs its name, and its role may read the archive."""
    template = synth_access.templates["CpuStack"]
    models = resources(template, "AWS::SageMaker::Model")
    transform = {k: m for k, m in models.items() if "ModelDataUrl" in m["Properties"]["PrimaryContainer"]}
    assert len(models) == 2 and len(transform) == 1
    [(logical, model)] = transform.items()
    container = model["Properties"]["PrimaryContainer"]
    assert "ModelDataSource" not in container
    staging_id = only_id(template, "Custom::ModelStaging")
    assert container["ModelDataUrl"] == {"Fn::GetAtt": [staging_id, "ModelArchiveUri"]}
    staging = template["Resources"][staging_id]["Properties"]
    # Beside the prefix the endpoint's Model mounts (S3Prefix takes every object under it; issue 33 §2).
    assert "Archive" not in staging
    assert staging["ArchiveKey"] == staging["Prefix"].rstrip("/") + "-batch-transform/model.tar.gz"
    assert not staging["ArchiveKey"].startswith(staging["Prefix"])
    assert template["Outputs"]["TransformModelName"]["Value"] == {"Fn::GetAtt": [logical, "ModelName"]}
    [endpoint_model] = [m for k, m in models.items() if k != logical]
    assert container["Image"] == endpoint_model["Properties"]["PrimaryContainer"]["Image"]
    assert container["Environment"] == endpoint_model["Properties"]["PrimaryContainer"]["Environment"]
    assert model["Properties"]["ExecutionRoleArn"] == endpoint_model["Properties"]["ExecutionRoleArn"]
    assert model["DeletionPolicy"] == "Retain" and model["UpdateReplacePolicy"] == "Retain"
    read = _text(_statements(template)["ReadModel"]["Resource"])
    assert "/model.tar.gz" in read and ".gguf" in read


def only_id(template: dict[str, Any], cfn_type: str) -> str:
    [logical] = resources(template, cfn_type)
    return logical


def test_turning_batch_transform_on_keeps_the_endpoints_model_and_role(
    synth: Synth, synth_access: Synth
) -> None:
    """Only grants and the Transform Model are added: no new role, so no endpoint update for it."""
    before = only(synth.templates["CpuStack"], "AWS::SageMaker::Model")["Properties"]
    after = [
        m["Properties"]
        for m in resources(synth_access.templates["CpuStack"], "AWS::SageMaker::Model").values()
        if "ModelDataSource" in m["Properties"]["PrimaryContainer"]
    ]
    assert after == [before]
