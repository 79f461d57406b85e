"""Rollbacks that finish: a failed deploy, the post-deploy check, then CloudFormation's own rollback of
the Endpoint (UpdateEndpoint back to the previous config with the previous DeploymentConfig), played
against moto with the UpdateEndpoint simulator of tests/promote (which refuses, as SageMaker does, an
update to the config the endpoint already runs, and rolls an update back while an alarm is in ALARM).

1. SageMaker rolled the canary back on its own: the endpoint is InService on the previous config.
   Without parking, CloudFormation's rollback would be refused (UPDATE_ROLLBACK_FAILED).
2. The deploy went through but the smoke calls fail, and the rollback alarms are in ALARM: a plain
   rollback's blue/green would be rolled back by SageMaker in turn.
In both, the check parks the endpoint on a copy of the previous config, waits for the alarms, fails;
CloudFormation's rollback then reaches the previous config.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "promote"))
import moto_update_endpoint

from decider_stacks.handlers import codebuild_job, post_deploy_check

REGION, ACCOUNT = "us-east-1", "123456789012"
ENDPOINT, PREVIOUS, NEW = "decider-cpu", "DeciderConfigAAAA-previous", "DeciderConfigBBBB-new"
ALARMS = ["CpuStack-ErrorRate5xx-ABC", "CpuStack-ModelLatencyP90-DEF"]
DEPLOYMENT = {
    "BlueGreenUpdatePolicy": {
        "TrafficRoutingConfiguration": {
            "Type": "CANARY",
            "CanarySize": {"Type": "INSTANCE_COUNT", "Value": 1},
            "WaitIntervalInSeconds": 600,
        },
        "TerminationWaitInSeconds": 300,
    },
    "AutoRollbackConfiguration": {"Alarms": [{"AlarmName": a} for a in ALARMS]},
}
STACK_ID = f"arn:aws:cloudformation:{REGION}:{ACCOUNT}:stack/CpuStack/1"
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
PROPS = {
    "ServiceToken": f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:provider",
    "Kind": "PostDeployCheck",
    "EndpointName": ENDPOINT,
    "EndpointConfigName": NEW,
    "RollbackAlarms": ALARMS,
}


class Stacks:
    """DescribeStacks of CloudFormation: the stack is updating (the check runs in the forward pass)."""

    def describe_stacks(self, StackName: str) -> dict[str, Any]:  # noqa: N803 - boto3's spelling
        return {"Stacks": [{"StackName": "CpuStack", "StackStatus": "UPDATE_IN_PROGRESS"}]}


class FailingRuntime:
    """sagemaker-runtime whose every call fails as a broken model's would."""

    def invoke_endpoint(self, **_: Any) -> Any:
        raise ClientError({"Error": {"Code": "ModelError", "Message": "500 from primary"}}, "InvokeEndpoint")


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(name, value)
    moto_update_endpoint.install()
    simulator = moto_update_endpoint.SIMULATOR
    simulator.reset()
    simulator.refuse_same_config = True
    with mock_aws():
        sagemaker, cloudwatch = boto3.client("sagemaker"), boto3.client("cloudwatch")
        role = f"arn:aws:iam::{ACCOUNT}:role/decider"
        for name, image in (("model-previous", "a"), ("model-new", "b")):
            sagemaker.create_model(
                ModelName=name,
                ExecutionRoleArn=role,
                PrimaryContainer={
                    "Image": f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/decider@sha256:{image * 64}"
                },
            )
        for config, model in ((PREVIOUS, "model-previous"), (NEW, "model-new")):
            sagemaker.create_endpoint_config(
                EndpointConfigName=config,
                ProductionVariants=[
                    {
                        "VariantName": "AllTraffic",
                        "ModelName": model,
                        "InstanceType": "ml.c5.9xlarge",  # (moto knows older types only)
                        "InitialInstanceCount": 2,
                        "InitialVariantWeight": 1.0,
                    }
                ],
            )
        sagemaker.create_endpoint(EndpointName=ENDPOINT, EndpointConfigName=PREVIOUS)
        for alarm in ALARMS:
            cloudwatch.put_metric_alarm(
                AlarmName=alarm,
                MetricName="Invocation5XXErrors",
                Namespace="AWS/SageMaker",
                Statistic="Sum",
                Period=60,
                EvaluationPeriods=3,
                Threshold=5.0,
                ComparisonOperator="GreaterThanThreshold",
            )
        yield {
            "sagemaker": sagemaker,
            "cloudwatch": cloudwatch,
            "cloudformation": Stacks(),
            "sagemaker-runtime": FailingRuntime(),
            "simulator": simulator,
        }
    simulator.reset()


def set_alarms(aws: dict[str, Any], state: str) -> None:
    for alarm in ALARMS:
        aws["cloudwatch"].set_alarm_state(AlarmName=alarm, StateValue=state, StateReason="scenario")


def cloudformation_updates_the_endpoint(aws: dict[str, Any], config: str) -> dict[str, Any]:
    """What CloudFormation's AWS::SageMaker::Endpoint handler does: UpdateEndpoint, then wait."""
    aws["sagemaker"].update_endpoint(
        EndpointName=ENDPOINT,
        EndpointConfigName=config,
        RetainAllVariantProperties=True,
        DeploymentConfig=DEPLOYMENT,
    )
    for _ in range(10):
        described = aws["sagemaker"].describe_endpoint(EndpointName=ENDPOINT)
        if described["EndpointStatus"] != "Updating":
            return described
    raise AssertionError("the update never ended")


def run_check(aws: dict[str, Any], *, alarms_clear_after: int, old: dict[str, Any] | None = None) -> str:
    """The check's onEvent, then isComplete every minute (the provider's poll) until it fails; the
    alarms leave ALARM `alarms_clear_after` polls after the endpoint was parked. `old`: more of the
    previous deploy's properties (its synthesized `EndpointConfig`)."""
    update = {
        "RequestType": "Update",
        "StackId": STACK_ID,
        "RequestId": "r-1",
        "ResourceProperties": PROPS,
        "OldResourceProperties": {**PROPS, "EndpointConfigName": PREVIOUS, **(old or {})},
        "PhysicalResourceId": f"post-deploy-check:{ENDPOINT}",
    }
    clients = {k: v for k, v in aws.items() if k != "simulator"}
    started = codebuild_job.on_event(update, clients=clients, now=NOW)
    assert started["Data"]["PreviousConfig"] == PREVIOUS
    parked_polls = 0
    for minute in range(1, 60):
        now = NOW + timedelta(minutes=minute)
        try:
            result = codebuild_job.is_complete({**update, **started}, clients=clients, now=now)
        except post_deploy_check.PostDeployCheckError as error:
            return str(error)
        assert result == {"IsComplete": False}
        live = aws["sagemaker"].describe_endpoint(EndpointName=ENDPOINT)["EndpointConfigName"]
        if live.startswith(f"{ENDPOINT}-parked-"):
            parked_polls += 1
            if parked_polls == alarms_clear_after:
                set_alarms(aws, "OK")
    raise AssertionError("the check never finished")


def test_a_sagemaker_rollback_then_a_stack_rollback_that_finishes(aws):
    # The deploy: the canary trips an alarm and SageMaker returns the endpoint to the previous config.
    aws["simulator"].during_update.append(lambda backend, name: set_alarms(aws, "ALARM"))
    described = cloudformation_updates_the_endpoint(aws, NEW)
    assert (described["EndpointConfigName"], described["EndpointStatus"]) == (PREVIOUS, "InService")
    aws["simulator"].during_update.clear()
    # Without parking, CloudFormation's rollback is refused: the endpoint already runs PREVIOUS.
    with pytest.raises(ClientError, match="already runs endpoint config"):
        aws["sagemaker"].update_endpoint(EndpointName=ENDPOINT, EndpointConfigName=PREVIOUS)

    message = run_check(aws, alarms_clear_after=3)
    parked = post_deploy_check.parking_config_name(ENDPOINT, PREVIOUS, NEW)
    assert "SageMaker rolled the update back" in message and f"parked on {parked}" in message
    assert "still in ALARM" not in message
    parked_config = aws["sagemaker"].describe_endpoint_config(EndpointConfigName=parked)
    assert parked_config["ProductionVariants"][0]["ModelName"] == "model-previous"  # the previous image
    tags = aws["sagemaker"].list_tags(ResourceArn=parked_config["EndpointConfigArn"])["Tags"]
    assert {"Key": "promote:endpoint", "Value": ENDPOINT} in tags  # `promote prune` removes it later
    parking = aws["simulator"].update_calls[-1]
    assert parking["EndpointConfigName"] == parked
    assert "AutoRollbackConfiguration" not in parking["DeploymentConfig"]  # no alarm can undo it

    # CloudFormation's rollback: the previous config with the previous DeploymentConfig. It finishes.
    described = cloudformation_updates_the_endpoint(aws, PREVIOUS)
    assert (described["EndpointConfigName"], described["EndpointStatus"]) == (PREVIOUS, "InService")
    assert not described.get("FailureReason")


def test_failing_smoke_calls_with_alarms_in_alarm_then_a_stack_rollback_that_finishes(aws):
    described = cloudformation_updates_the_endpoint(aws, NEW)  # the deploy itself went through
    assert described["EndpointConfigName"] == NEW
    set_alarms(aws, "ALARM")  # the new model fails its callers

    message = run_check(aws, alarms_clear_after=2)
    assert "smoke calls on decider-cpu failed" in message or "failed the post-deploy check" in message
    assert "parked on" in message

    described = cloudformation_updates_the_endpoint(aws, PREVIOUS)
    assert (described["EndpointConfigName"], described["EndpointStatus"]) == (PREVIOUS, "InService")


def test_alarms_that_stay_in_alarm_are_named_and_the_check_still_ends(aws):
    cloudformation_updates_the_endpoint(aws, NEW)
    set_alarms(aws, "ALARM")
    message = run_check(aws, alarms_clear_after=10_000)
    assert "still in ALARM" in message and ALARMS[0] in message


def test_a_first_deploy_fails_at_once_its_rollback_deletes_the_endpoint(aws):
    create = {
        "RequestType": "Create",
        "StackId": STACK_ID,
        "RequestId": "r-0",
        "ResourceProperties": {**PROPS, "EndpointConfigName": PREVIOUS},
    }
    clients = {k: v for k, v in aws.items() if k != "simulator"}
    started = codebuild_job.on_event(create, clients=clients, now=NOW)
    assert "PreviousConfig" not in started["Data"]
    late = NOW + post_deploy_check.SMOKE_RETRY_WINDOW + timedelta(seconds=1)
    with pytest.raises(post_deploy_check.PostDeployCheckError, match="smoke calls"):
        codebuild_job.is_complete({**create, **started}, clients=clients, now=late)
    assert aws["simulator"].update_calls == []  # nothing parked


def test_a_refused_parking_fails_at_once_with_both_reasons(aws, monkeypatch):
    cloudformation_updates_the_endpoint(aws, NEW)
    set_alarms(aws, "ALARM")

    def refuse(*_: Any, **__: Any) -> None:
        raise ClientError(
            {"Error": {"Code": "AccessDeniedException", "Message": "no"}}, "CreateEndpointConfig"
        )

    monkeypatch.setattr(aws["sagemaker"], "create_endpoint_config", refuse)
    message = run_check(aws, alarms_clear_after=1)
    assert "smoke calls on decider-cpu failed" in message and "parking decider-cpu" in message
    assert "AccessDeniedException" in message and "Rollbacks that finish" in message


class MotoJson:
    """The signed-JSON SageMaker client, sending its body to moto through boto3 (the stand-in checks
    only that the body is a valid CreateEndpointConfig)."""

    def __init__(self, sagemaker: Any) -> None:
        self.sagemaker = sagemaker
        self.bodies: list[dict[str, Any]] = []

    def call(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
        assert operation == "CreateEndpointConfig"
        self.bodies.append(body)
        return self.sagemaker.create_endpoint_config(**body)


def test_parking_from_the_synthesized_previous_config_then_a_rollback_that_finishes(aws):
    """The previous deploy's `EndpointConfig` property (as CloudFormation resolved it) is what the parked
    copy repeats; CloudFormation's rollback then finishes as before."""
    import json

    synthesized = {
        "ProductionVariants": [
            {
                "VariantName": "AllTraffic",
                "ModelName": "model-previous",
                "InstanceType": "ml.c5.9xlarge",
                "InitialInstanceCount": 2,
                "InitialVariantWeight": 1,
                "ContainerStartupHealthCheckTimeoutInSeconds": 900,
                "ModelDataDownloadTimeoutInSeconds": 900,
            }
        ]
    }
    aws["sagemaker-json"] = recorder = MotoJson(aws["sagemaker"])
    aws["simulator"].during_update.append(lambda backend, name: set_alarms(aws, "ALARM"))
    cloudformation_updates_the_endpoint(aws, NEW)  # SageMaker rolls the canary back on its own
    aws["simulator"].during_update.clear()
    message = run_check(aws, alarms_clear_after=2, old={"EndpointConfig": json.dumps(synthesized)})
    assert "SageMaker rolled the update back" in message and "parked on" in message
    [body] = recorder.bodies
    assert {k: v for k, v in body.items() if k not in ("EndpointConfigName", "Tags")} == synthesized
    parking = aws["simulator"].update_calls[-1]
    assert parking["DeploymentConfig"]["BlueGreenUpdatePolicy"]["MaximumExecutionTimeoutInSeconds"] >= 600
    described = cloudformation_updates_the_endpoint(aws, PREVIOUS)
    assert (described["EndpointConfigName"], described["EndpointStatus"]) == (PREVIOUS, "InService")
