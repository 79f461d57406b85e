"""`<variant>.invocation=async` (stacks/async_inference.py): the endpoint config's AsyncInferenceConfig,
scale to zero, the container's deadline, the grants, beside a real-time variant under another name;
cdk-nag passes (the synth fails otherwise) and cfn-lint is clean. The default is real-time (the
snapshots are unchanged)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from stack_helpers import Synth, only, resources, run_synth

from decider_stacks.config import ConfigError, load_config
from decider_stacks.synth import cdk_json_context

pytestmark = pytest.mark.cdk
ASYNC_NAME = "decider-cpu-async"


@pytest.fixture(scope="module")
def synth_async(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    context = {"cpu.invocation": "async", "cpu.endpoint_name": ASYNC_NAME}
    return run_synth(tmp_path_factory.mktemp("cdk-async"), context)


def _config(template: dict[str, Any]) -> dict[str, Any]:
    return only(template, "AWS::SageMaker::EndpointConfig")["Properties"]


def test_async_endpoint_config(synth_async: Synth) -> None:
    template = synth_async.templates["CpuStack"]
    config = _config(template)["AsyncInferenceConfig"]
    text = json.dumps(config["OutputConfig"])
    assert f"/async/{ASYNC_NAME}/output" in text and f"/async/{ASYNC_NAME}/failure" in text
    assert "decider-artifacts-" in text  # the artifacts bucket
    notification = config["OutputConfig"]["NotificationConfig"]
    topics = resources(template, "AWS::SNS::Topic")
    for key in ("SuccessTopic", "ErrorTopic"):
        assert notification[key]["Ref"] in topics
        assert "KmsMasterKeyId" in topics[notification[key]["Ref"]]["Properties"]
    assert notification["IncludeInferenceResponseIn"] == [
        "SUCCESS_NOTIFICATION_TOPIC",
        "ERROR_NOTIFICATION_TOPIC",
    ]
    assert config["ClientConfig"] == {"MaxConcurrentInvocationsPerInstance": 16}  # the container's queue_size
    assert "AsyncInferenceConfig" not in _config(synth_async.templates["GpuStack"])  # real-time beside it


def test_scale_to_zero(synth_async: Synth) -> None:
    template = synth_async.templates["CpuStack"]
    target = only(template, "AWS::ApplicationAutoScaling::ScalableTarget")["Properties"]
    assert target["MinCapacity"] == 0 and f"endpoint/{ASYNC_NAME}/variant/AllTraffic" == target["ResourceId"]
    policies = {
        props["PolicyType"]: props
        for props in (
            r["Properties"]
            for r in resources(template, "AWS::ApplicationAutoScaling::ScalingPolicy").values()
        )
    }
    tracking = policies["TargetTrackingScaling"]["TargetTrackingScalingPolicyConfiguration"]
    assert tracking["CustomizedMetricSpecification"] == {
        "MetricName": "ApproximateBacklogSizePerInstance",
        "Namespace": "AWS/SageMaker",
        "Dimensions": [{"Name": "EndpointName", "Value": ASYNC_NAME}],
        "Statistic": "Average",
    }
    assert "PredefinedMetricSpecification" not in tracking
    step = policies["StepScaling"]["StepScalingPolicyConfiguration"]
    assert step["AdjustmentType"] == "ChangeInCapacity"
    assert step["StepAdjustments"] == [{"MetricIntervalLowerBound": 0, "ScalingAdjustment": 1}]
    (alarm,) = [
        a["Properties"]
        for a in resources(template, "AWS::CloudWatch::Alarm").values()
        if a["Properties"].get("MetricName") == "HasBacklogWithoutCapacity"
    ]
    step_id = next(
        key
        for key, r in resources(template, "AWS::ApplicationAutoScaling::ScalingPolicy").items()
        if r["Properties"]["PolicyType"] == "StepScaling"
    )
    assert alarm["AlarmActions"] == [{"Ref": step_id}]
    assert alarm["Dimensions"] == [{"Name": "EndpointName", "Value": ASYNC_NAME}]
    assert alarm["ComparisonOperator"] == "GreaterThanOrEqualToThreshold" and alarm["Threshold"] == 1


def test_deadline_grants_and_post_deploy_check(synth_async: Synth) -> None:
    template = synth_async.templates["CpuStack"]
    environment = only(template, "AWS::SageMaker::Model")["Properties"]["PrimaryContainer"]["Environment"]
    assert environment["DECIDER_DEADLINE_SECONDS"] == "3595.0"
    gpu_env = only(synth_async.templates["GpuStack"], "AWS::SageMaker::Model")["Properties"][
        "PrimaryContainer"
    ]
    assert gpu_env["Environment"]["DECIDER_DEADLINE_SECONDS"] == "55.0"
    statements = {
        s["Sid"]: s
        for policy in resources(template, "AWS::IAM::Policy").values()
        for s in policy["Properties"]["PolicyDocument"]["Statement"]
        if "Sid" in s
    }
    assert f"async/{ASYNC_NAME}/input/*" in json.dumps(statements["ReadAsyncInput"]["Resource"])
    assert statements["NotifyAsync"]["Action"] == "sns:Publish"
    check = only(template, "Custom::PostDeployCheck")["Properties"]
    assert check["Invocation"] == "async"
    assert {"AsyncInputS3Uri", "AsyncOutputS3Uri", "AsyncSuccessTopicArn", "AsyncErrorTopicArn"} <= set(
        template["Outputs"]
    )


def test_cfn_lint_is_clean(synth_async: Synth) -> None:
    from cfnlint.api import ManualArgs, lint

    for stack in ("CpuStack", "GpuStack"):
        template = (synth_async.outdir / f"{stack}.template.json").read_text()
        matches = lint(template, config=ManualArgs(regions=["us-east-1", "eu-west-1"]))
        errors = [m for m in matches if m.rule.id.startswith("E")]
        assert errors == [], "\n".join(f"{m.rule.id} {m.message} ({m.path})" for m in errors)


def test_realtime_by_default_and_invalid_values_name_the_key(synth: Synth) -> None:
    assert "AsyncInferenceConfig" not in _config(synth.templates["CpuStack"])
    with pytest.raises(ConfigError, match="invocation"):
        load_config({**cdk_json_context(), "cpu.invocation": "sync"})
    with pytest.raises(ConfigError, match="invocation_timeout_s"):
        load_config({**cdk_json_context(), "cpu.async_inference.invocation_timeout_s": "7200"})


def test_async_requests_answers_and_failures_expire(synth_async: Synth) -> None:
    """They may hold prompts: the artifacts bucket expires async/<endpoint>/ like the data capture."""
    bucket = next(
        b["Properties"]
        for b in resources(synth_async.templates["ImageStack"], "AWS::S3::Bucket").values()
        if "BucketName" in b["Properties"]
    )
    rules = {r.get("Prefix"): r for r in bucket["LifecycleConfiguration"]["Rules"]}
    rule = rules[f"async/{ASYNC_NAME}/"]
    assert rule["ExpirationInDays"] == 30 and rule["Status"] == "Enabled"
    config = load_config(
        {**cdk_json_context(), "cpu.invocation": "async", "cpu.async_inference.retention_days": "7"}
    )
    assert config.cpu.async_inference.retention_days == 7
