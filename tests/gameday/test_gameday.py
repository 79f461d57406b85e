"""The game day's logic, offline: the lab is the app's own stacks (synthesized here with the lab's
overrides and each scenario's), its CDK CLI calls, every scenario's verdict on either answer against
stubbed AWS APIs (botocore Stubber), its teardown of what the stacks retain, and the hanging canary's
stand-in. No real AWS call: the game day itself runs only in a scratch account (`make game-day`)."""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
import pytest
from botocore.response import StreamingBody
from botocore.stub import ANY, Stubber

from decider_dev.gameday import cli, scenarios
from decider_dev.gameday.lab import (
    CDK,
    DELETERS,
    ENDPOINT_STACK,
    IMAGE_STACK,
    OTHER_INSTANCE,
    Cdk,
    Lab,
    Scratch,
    lab_context,
)
from decider_stacks.config import archive_key, load_config
from decider_stacks.handlers.post_deploy_check import parked_prefix
from decider_stacks.paths import ROOT
from decider_stacks.synth import cdk_json_context, synthesize

REGION, ACCOUNT = "us-east-1", "123456789012"
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SCRATCH = Scratch(
    run_id="abc123",
    account=ACCOUNT,
    region=REGION,
    image=f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/decider@sha256:" + "a" * 64,
    bucket="scratch-models",
    model_file="SmolLM2-135M-Instruct.Q4_1.gguf",
)
NAME = SCRATCH.name
SERVICES = ("sts", "cloudformation", "sagemaker", "s3", "iam", "ecr")


# -- the lab is the app's stacks ------------------------------------------------------------------


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The stacks the lab's first deploy synthesizes (cdk.json plus lab_context)."""
    return synthesize(tmp_path_factory.mktemp("gameday"), lab_context(SCRATCH))


def _resources(template: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [r for r in template["Resources"].values() if r["Type"] == kind]


def test_the_lab_deploys_the_app_s_own_stacks_small_and_named_for_the_run(templates):
    cpu = templates[ENDPOINT_STACK]
    kinds = {r["Type"] for r in cpu["Resources"].values()}
    # The shipped deploy-time machinery, which the old hand-written lab template lacked.
    assert {"Custom::UpdateGuard", "Custom::BakeLoad", "Custom::PostDeployCheck"} <= kinds
    [endpoint] = _resources(cpu, "AWS::SageMaker::Endpoint")
    assert endpoint["Properties"]["EndpointName"] == NAME
    [config] = _resources(cpu, "AWS::SageMaker::EndpointConfig")
    [variant] = config["Properties"]["ProductionVariants"]
    assert variant["InstanceType"] == "ml.c6i.large" and variant["InitialInstanceCount"] == 1
    [model] = _resources(cpu, "AWS::SageMaker::Model")
    container = model["Properties"]["PrimaryContainer"]
    assert container["Image"] == SCRATCH.image
    assert container["ModelDataSource"]["S3DataSource"]["S3Uri"] == SCRATCH.model_s3_uri
    # Nothing is built: no image or model build is started by the endpoint stack.
    assert not _resources(cpu, "Custom::ImageBuild") and not _resources(cpu, "Custom::ModelStaging")
    # Only the keys lab_context sets differ from what users deploy.
    default = load_config(cdk_json_context()).cpu
    lab = load_config({**cdk_json_context(), **lab_context(SCRATCH)}).cpu
    changed = {
        key
        for key in type(default).model_fields
        if getattr(default, key) != getattr(lab, key) and key != "deployment"
    }
    assert changed == {
        "endpoint_name",
        "image_uri",
        "model_s3_uri",
        "instance_type",
        "initial_instance_count",
        "min_capacity",
        "max_capacity",
        "log_retention_days",
    }
    assert lab.deployment.model_dump(exclude={"traffic_routing"}) == default.deployment.model_dump(
        exclude={"traffic_routing"}
    )


def test_every_resource_the_stacks_retain_has_a_deleter(templates):
    retained = {
        resource["Type"]
        for name in (IMAGE_STACK, ENDPOINT_STACK)
        for resource in templates[name]["Resources"].values()
        if resource.get("DeletionPolicy", "Delete") != "Delete"
    }
    assert retained and retained <= set(DELETERS), retained - set(DELETERS)


def test_every_scenario_s_change_is_a_valid_config_and_batch_reads_the_staged_archive(tmp_path):
    base = {**cdk_json_context(), **lab_context(SCRATCH)}
    changes = [
        scenarios.OTHER_INSTANCE_TYPE,
        scenarios.BATCH_ON,
        scenarios.BATCH_OFF_AND_NEW_CONFIG,
        scenarios.TRIPPED_ROLLBACK,
        {"cpu.endpoint_name": f"{NAME}-renamed"},
        {"cpu.model_s3_uri": f"s3://{SCRATCH.bucket}/{SCRATCH.work_prefix}missing-model/"},
        {"cpu.image_uri": SCRATCH.image.replace("a" * 64, "b" * 64)},
    ]
    for change in changes:
        load_config({**base, **change})  # a ConfigError here would stop the deploy at synth instead
    # One synth for two scenarios' templates (their overrides touch different resources).
    changed = {**lab_context(SCRATCH), **scenarios.BATCH_ON, **scenarios.TRIPPED_ROLLBACK}
    with_batch = synthesize(tmp_path, changed)[ENDPOINT_STACK]
    transform = next(
        r
        for r in _resources(with_batch, "AWS::SageMaker::Model")
        if "ModelDataUrl" in r["Properties"]["PrimaryContainer"]
    )
    # Where Lab.stage_model uploads the archive: beside the prefix the endpoint mounts, never under it.
    url = transform["Properties"]["PrimaryContainer"]["ModelDataUrl"]
    assert url == f"s3://{SCRATCH.bucket}/{archive_key(SCRATCH.model_prefix)}"
    assert not url.startswith(SCRATCH.model_s3_uri)
    # The tripped alarm is one SageMaker rolls back on, at 1 ms (ModelLatency is in microseconds).
    [endpoint] = _resources(with_batch, "AWS::SageMaker::Endpoint")
    rollback = endpoint["Properties"]["DeploymentConfig"]["AutoRollbackConfiguration"]["Alarms"]
    refs = {alarm["AlarmName"]["Ref"] for alarm in rollback}
    latency = [
        with_batch["Resources"][ref]
        for ref in refs
        if "ModelLatency" in json.dumps(with_batch["Resources"][ref]["Properties"])
    ]
    assert len(latency) == 1, refs
    assert latency[0]["Properties"]["Threshold"] == 1000


def test_the_cdk_cli_is_this_checkout_s_deploying_the_given_stacks_with_the_overrides():
    started: list[tuple[list[str], Path, dict[str, str]]] = []

    def start(argv: list[str], *, cwd: Path, env: dict[str, str]) -> Any:
        started.append((argv, cwd, env))
        return SimpleNamespace(wait=lambda: 0)

    cdk = Cdk(REGION, profile="scratch", start=start)
    assert cdk.deploy([ENDPOINT_STACK], {"b": "2", "a": "1"}).wait() == 0
    [(argv, cwd, env)] = started
    assert argv[:3] == [str(CDK), "deploy", ENDPOINT_STACK] and cwd == ROOT
    assert argv[argv.index("--require-approval") + 1] == "never" and "--ci" in argv
    assert argv[argv.index("--profile") + 1] == "scratch"
    assert argv[-4:] == ["-c", "a=1", "-c", "b=2"]
    assert env["AWS_REGION"] == env["AWS_DEFAULT_REGION"] == REGION
    assert CDK.name == "cdk" and CDK.parent == ROOT / "node_modules" / ".bin"


# -- the scenarios against stubbed APIs ------------------------------------------------------------


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


class FakeCdk(Cdk):
    """The CDK CLI's stand-in: each deploy exits with the next code and records its context."""

    def __init__(self, *codes: int) -> None:
        super().__init__(REGION, start=self._start)
        self.codes, self.contexts = list(codes), []

    def _start(self, argv: list[str], **_: Any) -> Any:
        pairs = [argv[i + 1] for i, arg in enumerate(argv) if arg == "-c"]
        self.contexts.append(dict(pair.split("=", 1) for pair in pairs))
        code = self.codes.pop(0)
        return SimpleNamespace(wait=lambda: code)


def lab(aws: dict[str, Any], *codes: int, scratch: Scratch = SCRATCH, **options: Any) -> Lab:
    clock = itertools.count(0, 30)
    return Lab(
        aws["clients"],
        scratch,
        FakeCdk(*codes),
        sleep=lambda _: None,
        now=lambda: float(next(clock)),
        poll_s=0,
        max_polls=5,
        **options,
    )


def endpoint(
    aws: dict[str, Any], status: str = "InService", config: str = "config-a", modified: datetime = NOW
) -> None:
    aws["sagemaker"].add_response(
        "describe_endpoint",
        {
            "EndpointName": NAME,
            "EndpointArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint/{NAME}",
            "EndpointConfigName": config,
            "EndpointStatus": status,
            "CreationTime": NOW,
            "LastModifiedTime": modified,
        },
        {"EndpointName": NAME},
    )


def stack(
    aws: dict[str, Any],
    status: str,
    name: str = ENDPOINT_STACK,
    outputs: dict | None = None,
    modified: datetime | None = None,
) -> None:
    described: dict[str, Any] = {"StackName": name, "StackStatus": status, "CreationTime": NOW}
    if modified:
        described["LastUpdatedTime"] = modified
    if outputs:
        described["Outputs"] = [{"OutputKey": k, "OutputValue": v} for k, v in outputs.items()]
    aws["cloudformation"].add_response("describe_stacks", {"Stacks": [described]}, {"StackName": name})


def summary(logical: str, physical: str, kind: str) -> dict[str, Any]:
    return {
        "LogicalResourceId": logical,
        "PhysicalResourceId": physical,
        "ResourceType": kind,
        "LastUpdatedTimestamp": NOW,
        "ResourceStatus": "CREATE_COMPLETE",
    }


def resources(aws: dict[str, Any], image: list | None = None, cpu: list | None = None) -> None:
    for name, listed in ((IMAGE_STACK, image or []), (ENDPOINT_STACK, cpu or [])):
        aws["cloudformation"].add_response(
            "list_stack_resources", {"StackResourceSummaries": listed}, {"StackName": name}
        )


def absent(aws: dict[str, Any], name: str = ENDPOINT_STACK) -> None:
    aws["cloudformation"].add_client_error(
        "describe_stacks", "ValidationError", f"Stack with id {name} does not exist", 400, {"StackName": name}
    )


def deployed(
    aws: dict[str, Any],
    status: str,
    failed: tuple[str, str, str] | None = None,
    before: str | None = "UPDATE_COMPLETE",
) -> None:
    """What Lab reads around a cdk deploy: the stack before and after, both stacks' resources, and
    the failed resource's event when the deploy failed."""
    if before is None:
        absent(aws)
    else:
        stack(aws, before)
    stack(aws, status, modified=NOW + timedelta(minutes=1))
    resources(aws)
    if failed is not None:
        logical, kind, reason = failed
        events = [
            {
                "StackId": "id",
                "EventId": str(i),
                "StackName": ENDPOINT_STACK,
                "LogicalResourceId": logical,
                "ResourceType": kind,
                "Timestamp": NOW,
                "ResourceStatus": status_,
                "ResourceStatusReason": reason_,
            }
            for i, (logical, kind, status_, reason_) in enumerate(
                [
                    (ENDPOINT_STACK, "AWS::CloudFormation::Stack", "UPDATE_ROLLBACK_COMPLETE", ""),
                    ("Endpoint", "AWS::SageMaker::Endpoint", "UPDATE_FAILED", "Resource update cancelled"),
                    (logical, kind, "UPDATE_FAILED", reason),
                    (ENDPOINT_STACK, "AWS::CloudFormation::Stack", "UPDATE_IN_PROGRESS", "User Initiated"),
                    # The deploy before: not this one's reason.
                    ("Older", "Custom::BakeLoad", "UPDATE_FAILED", "an older deploy's failure"),
                ]
            )
        ]
        aws["cloudformation"].add_response(
            "describe_stack_events", {"StackEvents": events}, {"StackName": ENDPOINT_STACK}
        )


GUARD = ("UpdateGuard0E8BCFDB", "Custom::UpdateGuard", "instance type change under autoscaling")


def test_the_guard_s_refusal_holds_when_it_is_fast_rolled_back_and_the_endpoint_untouched(aws):
    endpoint(aws)
    deployed(aws, "UPDATE_ROLLBACK_COMPLETE", GUARD)
    endpoint(aws)
    the_lab = lab(aws, 1)
    before = dict(the_lab.context)
    outcome = scenarios.guard_refuses_early(the_lab)
    assert outcome.settled is True, outcome
    assert the_lab.cdk.contexts == [{**before, "cpu.instance_type": OTHER_INSTANCE}]
    assert the_lab.context == before  # a refused deploy is not the base of the next one
    assert "UpdateGuard0E8BCFDB (Custom::UpdateGuard): instance type change" in outcome.observed


def test_a_refusal_after_the_endpoint_moved_or_by_another_resource_is_wrong(aws):
    endpoint(aws)
    deployed(aws, "UPDATE_ROLLBACK_COMPLETE", ("Endpoint", "AWS::SageMaker::Endpoint", "refused"))
    endpoint(aws, modified=NOW + timedelta(minutes=5))
    outcome = scenarios.rename_refused(lab(aws, 1))
    assert outcome.settled is False and "the guard must own this refusal" in outcome.recover
    endpoint(aws)
    deployed(aws, "UPDATE_ROLLBACK_FAILED", GUARD)
    endpoint(aws)
    outcome = scenarios.guard_refuses_early(lab(aws, 1))
    assert outcome.settled is False
    assert f"continue-update-rollback --stack-name {ENDPOINT_STACK} --resources-to-skip Endpoint" in (
        outcome.recover
    )


def test_a_failed_model_upgrade_holds_on_the_parked_copy_of_the_previous_config(aws):
    endpoint(aws, config="config-a")
    deployed(aws, "UPDATE_ROLLBACK_COMPLETE", ("DeciderPostDeployCheck", "Custom::PostDeployCheck", "no"))
    endpoint(aws, config=f"{parked_prefix(NAME)}0123456789")
    the_lab = lab(aws, 1)
    outcome = scenarios.failed_model_upgrade(the_lab)
    assert outcome.settled is True, outcome
    [context] = the_lab.cdk.contexts
    assert context["cpu.model_s3_uri"] == f"s3://scratch-models/{SCRATCH.work_prefix}missing-model/"


def test_the_second_deploy_holds_only_when_the_endpoint_is_untouched(aws):
    endpoint(aws)
    deployed(aws, "UPDATE_COMPLETE")
    endpoint(aws)
    assert scenarios.second_deploy(lab(aws, 0)).settled is True
    endpoint(aws)
    deployed(aws, "UPDATE_COMPLETE")
    endpoint(aws, config="config-b")
    assert scenarios.second_deploy(lab(aws, 0)).settled is False


def body(text: str) -> StreamingBody:
    data = text.encode()
    return StreamingBody(io.BytesIO(data), len(data))


def test_batch_transform_turns_batch_on_and_runs_decide_batch_with_the_lab_s_context(aws):
    deployed(aws, "UPDATE_COMPLETE")
    bucket, prefix = SCRATCH.artifacts_bucket, f"batch/{NAME}/"
    aws["s3"].add_response(
        "put_object", {}, {"Bucket": bucket, "Key": f"{prefix}input/requests.jsonl", "Body": ANY}
    )
    answer = {"answers": {"refund": {"type": "noul", "noul": 0.9}}}
    lines = "".join(json.dumps({"id": i, "SageMakerOutput": answer}) + "\n" for i in range(2))
    aws["s3"].add_response(
        "get_object", {"Body": body(lines)}, {"Bucket": bucket, "Key": f"{prefix}output/requests.jsonl.out"}
    )
    ran: list[list[str]] = []
    the_lab = lab(aws, 0, run_tool=lambda argv: ran.append(argv) or 0)
    outcome = scenarios.batch_transform(the_lab)
    assert outcome.settled is True and outcome.observed == "Completed; 2 output lines for 2 inputs"
    assert the_lab.context["cpu.batch_transform"] == "true"
    [argv] = ran
    assert Path(argv[0]).name == "decide-batch" and argv[argv.index("--job-name") + 1] == f"{NAME}-batch"
    assert argv[argv.index("--input") + 1] == f"s3://{bucket}/{prefix}input/"
    context = dict(argv[i + 1].split("=", 1) for i, arg in enumerate(argv) if arg == "-c")
    assert context == the_lab.context  # decide-batch finds the stack the lab deployed


def test_prune_is_wrong_when_it_deleted_the_transform_model(aws):
    stack(aws, "UPDATE_COMPLETE", outputs={"TransformModelName": "transform-model"})
    aws["sagemaker"].add_client_error(
        "describe_model", "ValidationException", "Could not find model", expected_params={"ModelName": ANY}
    )
    ran: list[list[str]] = []
    the_lab = lab(aws, run_tool=lambda argv: ran.append(argv) or 0)
    the_lab.context = {**the_lab.context, **scenarios.BATCH_ON}  # already on: no deploy
    outcome = scenarios.prune_keeps_transform_model(the_lab)
    assert outcome.settled is False and "Could not find model" in outcome.observed
    [argv] = ran
    assert Path(argv[0]).name == "promote" and argv[1:6] == ["prune", "--endpoint", NAME, "--keep", "0"]


def test_prune_without_a_transform_model_output_is_wrong_and_prunes_nothing(aws):
    stack(aws, "UPDATE_COMPLETE")
    the_lab = lab(aws, run_tool=lambda argv: pytest.fail(f"ran {argv}"))
    the_lab.context = {**the_lab.context, **scenarios.BATCH_ON}
    outcome = scenarios.prune_keeps_transform_model(the_lab)
    assert outcome.settled is False and "has no TransformModelName output" in outcome.observed


def test_the_alarm_scenario_holds_when_the_tripped_update_rolls_back_to_the_previous_config(aws):
    endpoint(aws)
    deployed(aws, "UPDATE_ROLLBACK_COMPLETE", ("PostDeployCheckFDEFED2C", "Custom::PostDeployCheck", "rb"))
    endpoint(aws, config="config-a")
    the_lab = lab(aws, 1)
    before = dict(the_lab.context)
    assert scenarios.alarm_rollback_parks(the_lab).settled is True
    assert the_lab.cdk.contexts == [{**before, **scenarios.TRIPPED_ROLLBACK}]
    endpoint(aws)
    deployed(aws, "UPDATE_COMPLETE")  # SageMaker never rolled back: the check had nothing to see
    endpoint(aws, config="config-b")
    outcome = scenarios.alarm_rollback_parks(lab(aws, 0))
    assert outcome.settled is False and "the update went through" in outcome.recover


def test_the_hanging_canary_is_unknown_without_a_hanging_image(aws):
    outcome = scenarios.hanging_canary(lab(aws))
    assert outcome.settled is None and "--hanging-image" in outcome.observed


def test_same_config_update_holds_when_sagemaker_refuses_it(aws):
    endpoint(aws)
    aws["sagemaker"].add_client_error(
        "update_endpoint",
        "ValidationException",
        "To update an endpoint, you must create a new EndpointConfig",
        expected_params={"EndpointName": NAME, "EndpointConfigName": "config-a"},
    )
    outcome = scenarios.same_config_update(lab(aws))
    assert outcome.settled is True and "refused: ValidationException" in outcome.observed


class RecordingJson:
    def __init__(self) -> None:
        self.bodies: list[tuple[str, dict[str, Any]]] = []

    def call(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append((operation, body))
        return {"EndpointConfigArn": "arn:x"}


def test_the_signed_json_config_scenario_creates_a_copy_and_compares_it(aws):
    variants = [{"VariantName": "AllTraffic", "ModelName": "m", "InstanceType": "ml.c6i.large"}]
    endpoint(aws)
    for name in ("config-a", f"{NAME}-json"):
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
    the_lab.clients = {**aws["clients"], "sagemaker-json": RecordingJson()}
    outcome = scenarios.signed_json_config(the_lab)
    assert outcome.settled is True and "variants equal: True" in outcome.observed
    assert ("AWS::SageMaker::EndpointConfig", f"{NAME}-json") in the_lab.seen  # deleted at teardown


# -- the run: account guard, staging, teardown ------------------------------------------------------

ARGS = ["--account", ACCOUNT, "--region", REGION, "--image", SCRATCH.image, "--bucket", SCRATCH.bucket]


def test_the_game_day_runs_only_in_a_scratch_account_that_cdk_can_deploy_to(aws, capsys):
    def caller(account: str) -> None:
        identity = {"Account": account, "Arn": "arn:aws:iam::1:user/x", "UserId": "U"}
        aws["sts"].add_response("get_caller_identity", identity)

    caller("999999999999")
    assert cli.main(ARGS, clients=aws["clients"]) == cli.EXIT_USAGE
    assert "the credentials are for account 999999999999, not the scratch account" in capsys.readouterr().err
    caller(ACCOUNT)
    stack(aws, "UPDATE_COMPLETE", name="ImageStack")
    assert cli.main(ARGS, clients=aws["clients"]) == cli.EXIT_USAGE
    assert "runs the app (ImageStack exists)" in capsys.readouterr().err
    caller(ACCOUNT)
    for name in ("ImageStack", "CpuStack", "GpuStack", "CDKToolkit"):
        absent(aws, name)
    assert cli.main(ARGS, clients=aws["clients"]) == cli.EXIT_USAGE
    assert f"npx cdk bootstrap aws://{ACCOUNT}/{REGION} first" in capsys.readouterr().err
    caller(ACCOUNT)
    for name in ("ImageStack", "CpuStack", "GpuStack"):
        absent(aws, name)
    stack(aws, "CREATE_COMPLETE", name="CDKToolkit")
    location = {"LocationConstraint": "eu-west-1"}
    aws["s3"].add_response("get_bucket_location", location, {"Bucket": SCRATCH.bucket})
    assert cli.main(ARGS, clients=aws["clients"]) == cli.EXIT_USAGE
    assert "s3://scratch-models is in eu-west-1; the game day runs in us-east-1" in capsys.readouterr().err
    assert cli.main([*ARGS[:5], "repo:latest", *ARGS[6:]], clients=aws["clients"]) == cli.EXIT_USAGE
    assert cli.main([*ARGS[:7], "Not_A_Bucket"], clients=aws["clients"]) == cli.EXIT_USAGE


def test_a_run_stages_the_model_and_tears_down_everything_even_when_a_scenario_fails(aws, tmp_path, capsys):
    gguf = tmp_path / SCRATCH.model_file
    gguf.write_bytes(b"GGUF" + bytes(60))
    aws["s3"].add_response(
        "put_object", {}, {"Bucket": SCRATCH.bucket, "Key": f"{SCRATCH.model_prefix}{gguf.name}", "Body": ANY}
    )
    archive = archive_key(SCRATCH.model_prefix)
    aws["s3"].add_response("put_object", {}, {"Bucket": SCRATCH.bucket, "Key": archive, "Body": ANY})
    absent(aws)
    stack(aws, "CREATE_COMPLETE")
    role = summary("Role", "gameday-role", "AWS::IAM::Role")
    config = summary("Config", "config-a", "AWS::SageMaker::EndpointConfig")
    repository = summary("Repo", NAME, "AWS::ECR::Repository")
    artifacts = summary("Store", SCRATCH.artifacts_bucket, "AWS::S3::Bucket")
    resources(aws, image=[repository, artifacts], cpu=[role, config])
    aws["sagemaker"].add_client_error("describe_endpoint", "ThrottlingException")  # the scenario fails
    resources(aws, image=[repository, artifacts], cpu=[role, config])
    for name in (ENDPOINT_STACK, IMAGE_STACK):
        aws["cloudformation"].add_response("delete_stack", {}, {"StackName": name})
        stack(aws, "DELETE_IN_PROGRESS", name=name)
        stack(aws, "DELETE_COMPLETE", name=name)
    parked = f"{parked_prefix(NAME)}0123456789"
    other = "someone-else-parked-0123456789"
    aws["sagemaker"].add_response(
        "list_endpoint_configs",
        {
            "EndpointConfigs": [
                {"EndpointConfigName": n, "EndpointConfigArn": f"arn:{n}", "CreationTime": NOW}
                for n in (parked, other)
            ]
        },
        {"NameContains": "-parked-"},
    )
    for name in sorted(("config-a", parked)):
        aws["sagemaker"].add_response("delete_endpoint_config", {}, {"EndpointConfigName": name})
    aws["iam"].add_response(
        "list_role_policies", {"PolicyNames": ["inline"], "IsTruncated": False}, {"RoleName": "gameday-role"}
    )
    aws["iam"].add_response("delete_role_policy", {}, {"RoleName": "gameday-role", "PolicyName": "inline"})
    aws["iam"].add_response(
        "list_attached_role_policies",
        {"AttachedPolicies": [{"PolicyArn": "arn:aws:iam::aws:policy/p"}], "IsTruncated": False},
        {"RoleName": "gameday-role"},
    )
    aws["iam"].add_response(
        "detach_role_policy", {}, {"RoleName": "gameday-role", "PolicyArn": "arn:aws:iam::aws:policy/p"}
    )
    aws["iam"].add_response("delete_role", {}, {"RoleName": "gameday-role"})
    aws["ecr"].add_response("delete_repository", {}, {"repositoryName": NAME, "force": True})
    aws["s3"].add_response(
        "list_object_versions",
        {"Versions": [{"Key": "batch/x", "VersionId": "v1"}], "DeleteMarkers": []},
        {"Bucket": SCRATCH.artifacts_bucket},
    )
    aws["s3"].add_response(
        "delete_objects",
        {},
        {
            "Bucket": SCRATCH.artifacts_bucket,
            "Delete": {"Objects": [{"Key": "batch/x", "VersionId": "v1"}], "Quiet": True},
        },
    )
    aws["s3"].add_response("delete_bucket", {}, {"Bucket": SCRATCH.artifacts_bucket})
    for key in (f"{SCRATCH.model_prefix}{gguf.name}", archive):
        aws["s3"].add_response("delete_object", {}, {"Bucket": SCRATCH.bucket, "Key": key})
    the_lab = lab(aws, 0)
    outcomes = cli.run(the_lab, ["same-config-update"], gguf, print)
    first, failed = outcomes
    assert first.scenario == "first-deploy" and first.settled is True
    assert the_lab.cdk.contexts == [lab_context(SCRATCH)]
    assert failed.settled is None and "ThrottlingException" in failed.observed
    cli.report(outcomes, print)
    out = capsys.readouterr().out
    assert "[unknown] same-config-update" in out and "left behind" not in out


def test_a_failed_first_deploy_runs_no_scenario_and_still_tears_down(aws, tmp_path):
    gguf = tmp_path / SCRATCH.model_file
    gguf.write_bytes(b"GGUF")
    aws["s3"].add_response("put_object", {}, None)
    aws["s3"].add_response("put_object", {}, None)
    deployed(aws, "ROLLBACK_COMPLETE", ("DeciderModel", "AWS::SageMaker::Model", "image not found"), None)
    resources(aws)
    for name in (ENDPOINT_STACK, IMAGE_STACK):
        aws["cloudformation"].add_response("delete_stack", {}, {"StackName": name})
        stack(aws, "DELETE_COMPLETE", name=name)
    aws["sagemaker"].add_response("list_endpoint_configs", {"EndpointConfigs": []}, None)
    for _ in range(2):
        aws["s3"].add_response("delete_object", {}, None)
    [first] = cli.run(lab(aws, 1), list(scenarios.SCENARIOS), gguf, lambda line: None)
    assert first.settled is False and "image not found" in first.observed


# -- the hanging canary's stand-in ------------------------------------------------------------------


def test_the_hanging_image_answers_ping_and_holds_every_invocation():
    path = ROOT / "tools" / "dev" / "gameday" / "hang" / "hang.py"
    spec = importlib.util.spec_from_file_location("hang", path)
    assert spec is not None and spec.loader is not None
    hang = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hang)
    server = hang.ThreadingHTTPServer(("127.0.0.1", 0), hang.Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with urllib.request.urlopen(f"{base}/ping", timeout=5) as response:
            assert response.status == 200
        request = urllib.request.Request(f"{base}/invocations", data=b"{}", method="POST")
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            urllib.request.urlopen(request, timeout=0.3)
        with urllib.request.urlopen(f"{base}/ping", timeout=5) as response:  # still healthy
            assert response.status == 200
    finally:
        server.shutdown()
    assert "FROM ${BASE}" in (path.parent / "Dockerfile").read_text()


def test_image_stack_stays_while_the_endpoint_stack_cannot_be_deleted(aws):
    resources(aws)
    aws["cloudformation"].add_response("delete_stack", {}, {"StackName": ENDPOINT_STACK})
    stack(aws, "DELETE_FAILED")
    problems = lab(aws).teardown()  # no delete_stack for ImageStack: CpuStack's provider lives there
    assert problems == [
        f"stack {ENDPOINT_STACK}: DELETE_FAILED; see its events, then delete it and what follows"
    ]


def test_a_deploy_that_fails_before_cloudformation_acts_says_so_not_the_last_failure(aws):
    endpoint(aws)
    stack(aws, "UPDATE_ROLLBACK_COMPLETE")  # an earlier scenario's refusal, before and after
    stack(aws, "UPDATE_ROLLBACK_COMPLETE")
    resources(aws)
    endpoint(aws)
    outcome = scenarios.guard_refuses_early(lab(aws, 1))
    assert "cdk deploy failed before CloudFormation changed CpuStack" in outcome.observed
    assert outcome.settled is not True


def test_a_first_deploy_that_never_created_the_endpoint_stack_is_reported(aws):
    absent(aws)
    absent(aws)
    resources(aws)
    created = lab(aws, 1).create()
    assert created.status == "NOT_CREATED" and not created.ok
    assert "ImageStack's events" in created.reason


def test_the_hanging_canary_runs_only_with_a_hanging_image_and_is_skipped_by_default():
    lines: list[str] = []
    assert "hanging-canary" not in cli.scenario_names(None, None, lines.append)
    assert lines == ["hanging-canary skipped: no --hanging-image (tools/dev/gameday/hang/)"]
    assert cli.scenario_names(None, SCRATCH.image, lines.append) == list(scenarios.SCENARIOS)
    with pytest.raises(cli.GameDayError, match="needs --hanging-image"):
        cli.scenario_names(["hanging-canary"], None, lines.append)


def test_a_ready_scratch_account_passes_the_checks(aws):
    aws["sts"].add_response(
        "get_caller_identity", {"Account": ACCOUNT, "Arn": "arn:aws:iam::1:user/x", "UserId": "U"}
    )
    for name in ("ImageStack", "CpuStack", "GpuStack"):
        absent(aws, name)
    stack(aws, "UPDATE_COMPLETE", name="CDKToolkit")
    aws["s3"].add_response("get_bucket_location", {}, {"Bucket": SCRATCH.bucket})  # us-east-1: no constraint
    cli.check_account(aws["clients"], SCRATCH)
