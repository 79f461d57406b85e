"""The game day's logic against stubbed AWS APIs (botocore Stubber): its account guard, the verdicts
of its scenarios on either answer, its teardown, and the lab's template (cfn-lint clean). No real AWS
call: the game day itself runs only in a scratch account (`make game-day`)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import boto3
import pytest
from botocore.response import StreamingBody
from botocore.stub import ANY, Stubber

from decider_dev.gameday import cli, scenarios
from decider_dev.gameday.lab import Lab, Scratch, Variant, template

REGION, ACCOUNT = "us-east-1", "123456789012"
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SCRATCH = Scratch(
    run_id="abc123",
    image=f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/decider@sha256:" + "a" * 64,
    model_s3_uri="s3://scratch-models/models/smol/",
    model_file="smol.gguf",
)
NAME = SCRATCH.name
SERVICES = ("sts", "cloudformation", "sagemaker", "s3", "iam", "cloudwatch")


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(key, value)
    clients = {name: boto3.client(name, region_name=REGION) for name in SERVICES}
    stubs = {name: Stubber(client) for name, client in clients.items()}
    for stub in stubs.values():
        stub.activate()
    yield {"clients": clients, **stubs}
    for stub in stubs.values():
        stub.assert_no_pending_responses()
        stub.deactivate()


def lab(aws: dict[str, Any]) -> Lab:
    return Lab(aws["clients"], SCRATCH, sleep=lambda _: None, poll_s=0, max_polls=5)


def endpoint(aws: dict[str, Any], status: str = "InService", config: str = "gameday-config-a") -> None:
    aws["sagemaker"].add_response(
        "describe_endpoint",
        {
            "EndpointName": NAME,
            "EndpointArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint/{NAME}",
            "EndpointConfigName": config,
            "EndpointStatus": status,
            "CreationTime": NOW,
            "LastModifiedTime": NOW,
        },
        {"EndpointName": NAME},
    )


def stack(aws: dict[str, Any], status: str, outputs: dict[str, str] | None = None, name: str = NAME) -> None:
    described: dict[str, Any] = {"StackName": name, "StackStatus": status, "CreationTime": NOW}
    if outputs:
        described["Outputs"] = [{"OutputKey": k, "OutputValue": v} for k, v in outputs.items()]
    aws["cloudformation"].add_response("describe_stacks", {"Stacks": [described]}, {"StackName": name})


def no_stack(aws: dict[str, Any], name: str) -> None:
    aws["cloudformation"].add_client_error(
        "describe_stacks",
        "ValidationError",
        f"Stack with id {name} does not exist",
        expected_params={"StackName": name},
    )


def body(text: str) -> StreamingBody:
    data = text.encode()
    return StreamingBody(io.BytesIO(data), len(data))


ARGS = [
    "--account",
    ACCOUNT,
    "--region",
    REGION,
    "--image",
    SCRATCH.image,
    "--model-s3-uri",
    SCRATCH.model_s3_uri,
]


def test_the_game_day_runs_only_in_a_scratch_account(aws, capsys):
    aws["sts"].add_response(
        "get_caller_identity", {"Account": "999999999999", "Arn": "arn:aws:iam::9:user/x", "UserId": "U"}
    )
    assert cli.main(ARGS, clients=aws["clients"]) == cli.EXIT_USAGE
    assert "the credentials are for account 999999999999, not the scratch account" in capsys.readouterr().err
    aws["sts"].add_response(
        "get_caller_identity", {"Account": ACCOUNT, "Arn": "arn:aws:iam::1:user/x", "UserId": "U"}
    )
    stack(aws, "UPDATE_COMPLETE", name="ImageStack")
    assert cli.main(ARGS, clients=aws["clients"]) == cli.EXIT_USAGE
    assert "runs the app (ImageStack exists)" in capsys.readouterr().err
    assert cli.main([*ARGS[:5], "repo:latest", *ARGS[6:]], clients=aws["clients"]) == cli.EXIT_USAGE


def test_same_config_update_holds_when_sagemaker_refuses_it(aws):
    endpoint(aws)
    aws["sagemaker"].add_client_error(
        "update_endpoint",
        "ValidationException",
        "To update an endpoint, you must create a new EndpointConfig",
        expected_params={"EndpointName": NAME, "EndpointConfigName": "gameday-config-a"},
    )
    outcome = scenarios.same_config_update(lab(aws))
    assert outcome.settled is True and outcome.verdict == "holds"
    assert "refused: ValidationException: To update an endpoint" in outcome.observed


def test_same_config_update_is_wrong_when_sagemaker_accepts_it(aws):
    endpoint(aws)
    aws["sagemaker"].add_response(
        "update_endpoint", {"EndpointArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint/{NAME}"}
    )
    endpoint(aws, "Updating")
    endpoint(aws)
    outcome = scenarios.same_config_update(lab(aws))
    assert outcome.settled is False and outcome.verdict == "WRONG"
    assert "accepted; the endpoint ended InService" in outcome.observed and "parking" in outcome.recover


def test_batch_transform_holds_with_one_answer_per_line(aws):
    aws["s3"].add_response(
        "put_object",
        {},
        {"Bucket": "scratch-models", "Key": "gameday/abc123/batch/input/requests.jsonl", "Body": ANY},
    )
    stack(aws, "CREATE_COMPLETE", {"TransformModelName": "gameday-transform"})
    aws["sagemaker"].add_response(
        "create_transform_job",
        {"TransformJobArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:transform-job/{NAME}-batch"},
        {
            "TransformJobName": f"{NAME}-batch",
            "ModelName": "gameday-transform",
            "BatchStrategy": "MultiRecord",
            "TransformInput": ANY,
            "TransformOutput": ANY,
            "TransformResources": {"InstanceType": "ml.c6i.large", "InstanceCount": 1},
            "DataProcessing": {"JoinSource": "Input"},
        },
    )
    job = {
        "TransformJobName": f"{NAME}-batch",
        "TransformJobArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:transform-job/{NAME}-batch",
        "ModelName": "gameday-transform",
        "TransformInput": {"DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": "s3://b/i/"}}},
        "TransformResources": {"InstanceType": "ml.c6i.large", "InstanceCount": 1},
        "CreationTime": NOW,
    }
    aws["sagemaker"].add_response("describe_transform_job", {**job, "TransformJobStatus": "InProgress"})
    aws["sagemaker"].add_response("describe_transform_job", {**job, "TransformJobStatus": "Completed"})
    answer = {"answers": {"refund": {"type": "noul", "noul": 0.9}}}
    lines = "".join(json.dumps({"id": i, "SageMakerOutput": answer}) + "\n" for i in range(2))
    aws["s3"].add_response(
        "get_object",
        {"Body": body(lines)},
        {"Bucket": "scratch-models", "Key": "gameday/abc123/batch/output/requests.jsonl.out"},
    )
    the_lab = lab(aws)
    outcome = scenarios.batch_transform(the_lab)
    assert outcome.settled is True, outcome
    assert outcome.observed == "Completed; 2 output lines for 2 inputs"
    assert len(the_lab.objects) == 2  # the input and output objects, deleted at teardown


def test_a_refused_update_whose_rollback_fails_says_how_to_continue(aws):
    endpoint(aws, config="gameday-config-a")
    aws["cloudformation"].add_response("update_stack", {"StackId": "id"})
    stack(aws, "UPDATE_ROLLBACK_IN_PROGRESS")
    stack(aws, "UPDATE_ROLLBACK_FAILED")
    aws["cloudformation"].add_response(
        "list_stack_resources", {"StackResourceSummaries": []}, {"StackName": NAME}
    )
    endpoint(aws, config="gameday-config-a")
    outcome = scenarios.refused_update_rollback(lab(aws))
    assert outcome.settled is False
    assert f"continue-update-rollback --stack-name {NAME} --resources-to-skip Endpoint" in outcome.recover


def test_a_run_tears_down_the_stack_and_what_it_retained_even_when_a_scenario_fails(aws, capsys):
    aws["cloudformation"].add_response("create_stack", {"StackId": "id"})
    stack(aws, "CREATE_IN_PROGRESS")
    stack(aws, "CREATE_COMPLETE")

    def summary(logical: str, physical: str, kind: str) -> dict[str, Any]:
        return {
            "LogicalResourceId": logical,
            "PhysicalResourceId": physical,
            "ResourceType": kind,
            "LastUpdatedTimestamp": NOW,
            "ResourceStatus": "CREATE_COMPLETE",
        }

    resources = {
        "StackResourceSummaries": [
            summary("Model", "gameday-model-a", "AWS::SageMaker::Model"),
            summary("ConfigA", "gameday-config-a", "AWS::SageMaker::EndpointConfig"),
            summary("Role", "gameday-role", "AWS::IAM::Role"),
        ]
    }
    aws["cloudformation"].add_response("list_stack_resources", resources, {"StackName": NAME})
    aws["sagemaker"].add_client_error("describe_endpoint", "ThrottlingException")  # the scenario fails
    aws["cloudformation"].add_response("list_stack_resources", resources, {"StackName": NAME})
    aws["cloudformation"].add_response("delete_stack", {}, {"StackName": NAME})
    no_stack(aws, NAME)
    aws["sagemaker"].add_response("delete_endpoint_config", {}, {"EndpointConfigName": "gameday-config-a"})
    aws["sagemaker"].add_response("delete_model", {}, {"ModelName": "gameday-model-a"})
    aws["iam"].add_response(
        "list_role_policies", {"PolicyNames": ["gameday"], "IsTruncated": False}, {"RoleName": "gameday-role"}
    )
    aws["iam"].add_response("delete_role_policy", {}, {"RoleName": "gameday-role", "PolicyName": "gameday"})
    aws["iam"].add_response("delete_role", {}, {"RoleName": "gameday-role"})
    outcomes = cli.run(lab(aws), ["same-config-update"], print)
    [outcome] = outcomes
    assert (
        outcome.settled is None
        and "could not run" in outcome.observed
        and "ThrottlingException" in outcome.observed
    )
    cli.report(outcomes, print)
    assert "[unknown] same-config-update" in capsys.readouterr().out


def test_the_lab_template_keeps_a_role_per_model_and_lints_clean():
    from cfnlint.api import ManualArgs, lint

    base, upgrade = (
        template(SCRATCH),
        template(SCRATCH, Variant(config="D", model_prefix="gameday/abc123/missing-model/")),
    )
    roles = [k for k, v in base["Resources"].items() if v["Type"] == "AWS::IAM::Role"]
    new_roles = [k for k, v in upgrade["Resources"].items() if v["Type"] == "AWS::IAM::Role"]
    assert roles != new_roles and base["Resources"][roles[0]]["DeletionPolicy"] == "Retain"
    model = base["Resources"]["Model"]["Properties"]["PrimaryContainer"]
    transform = base["Resources"]["TransformModel"]["Properties"]["PrimaryContainer"]
    assert "ModelDataSource" in model and transform["ModelDataUrl"].endswith("/models/smol/model.tar.gz")
    for variant in (None, Variant(config="B", alarm_breaching=True)):
        text = json.dumps(template(SCRATCH, variant))
        matches = lint(text, config=ManualArgs(regions=[REGION]))
        assert [m for m in matches if m.rule.id.startswith("E")] == [], [str(m) for m in matches]


class RecordingJson:
    def __init__(self, sagemaker: Any) -> None:
        self.sagemaker, self.bodies = sagemaker, []

    def call(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append((operation, body))
        return {"EndpointConfigArn": "arn:x"}


def test_the_signed_json_config_scenario_creates_a_copy_and_compares_it(aws):
    variants = [
        {
            "VariantName": "AllTraffic",
            "ModelName": "m",
            "InstanceType": "ml.c6i.large",
            "InitialInstanceCount": 1,
        }
    ]
    endpoint(aws)
    for name in ("gameday-config-a", f"{NAME}-json"):
        aws["sagemaker"].add_response(
            "describe_endpoint_config",
            {
                "EndpointConfigName": name,
                "EndpointConfigArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint-config/{name}",
                "ProductionVariants": variants,
                "CreationTime": NOW,
            },
            {"EndpointConfigName": name},
        )
    the_lab = lab(aws)
    the_lab.clients = {**aws["clients"], "sagemaker-json": RecordingJson(aws["clients"]["sagemaker"])}
    outcome = scenarios.signed_json_config(the_lab)
    assert outcome.settled is True and "variants equal: True" in outcome.observed
    [(operation, body)] = the_lab.clients["sagemaker-json"].bodies
    assert operation == "CreateEndpointConfig" and body == {
        "EndpointConfigName": f"{NAME}-json",
        "ProductionVariants": variants,
    }
    assert ("EndpointConfig", f"{NAME}-json") in the_lab.seen  # deleted at teardown
