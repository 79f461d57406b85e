"""The deploy-time build handler against stubbed AWS APIs (botocore Stubber; nothing leaves the process)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber

from stacks.handlers import codebuild_job as job

DIGEST = "sha256:" + "ab" * 32
REPO_URI = "123456789012.dkr.ecr.us-east-1.amazonaws.com/decider-images"
IMAGE_PROPS = {
    "ServiceToken": "arn:aws:lambda:us-east-1:123456789012:function:provider",
    "Kind": "Image",
    "ProjectName": "ImageBuild",
    "SourceBucket": "cdk-assets",
    "SourceKey": "abc.zip",
    "RepositoryName": "decider-images",
    "RepositoryUri": REPO_URI,
    "ImageTag": "cpu-abc",
    "Variant": "cpu",
    "ComputeType": "BUILD_GENERAL1_LARGE",
    "TimeoutMinutes": "60",
}
MODEL_PROPS = {
    "ServiceToken": "arn:aws:lambda:us-east-1:123456789012:function:provider",
    "Kind": "Model",
    "ProjectName": "ModelStaging",
    "Bucket": "artifacts",
    "Prefix": "models/org/repo/rev/13c16f426047/",
    "Repository": "org/repo",
    "Revision": "a" * 40,
    "File": "model.gguf",
    "SizeBytes": "3013027808",
    "Sha256": "13c16f42" + "0" * 52 + "a983",
    "TimeoutMinutes": "60",
}
STARTED = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Real boto3 clients with Stubbers: every call must be expected, or the test fails."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    clients = {name: boto3.client(name) for name in ("codebuild", "ecr", "s3")}
    stubs = {name: Stubber(client) for name, client in clients.items()}
    for stub in stubs.values():
        stub.activate()
    yield {"clients": clients, **stubs}
    for stub in stubs.values():
        stub.assert_no_pending_responses()
        stub.deactivate()


def event(request: str, props: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"RequestType": request, "ResourceProperties": props, **extra}


def build(status: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": "ImageBuild:1234",
        "buildStatus": status,
        "startTime": STARTED,
        "logs": {"deepLink": "https://console.aws.amazon.com/cloudwatch/logs"},
        **fields,
    }


def test_image_build_starts_codebuild_with_the_source_and_variant(aws):
    aws["ecr"].add_client_error(
        "describe_images",
        "ImageNotFoundException",
        expected_params={"repositoryName": "decider-images", "imageIds": [{"imageTag": "cpu-abc"}]},
    )
    aws["codebuild"].add_response(
        "start_build",
        {"build": {"id": "ImageBuild:1234"}},
        expected_params={
            "projectName": "ImageBuild",
            "timeoutInMinutesOverride": 60,
            "sourceTypeOverride": "S3",
            "sourceLocationOverride": "cdk-assets/abc.zip",
            "computeTypeOverride": "BUILD_GENERAL1_LARGE",
            "environmentVariablesOverride": [
                {"name": "REPOSITORY_URI", "value": REPO_URI, "type": "PLAINTEXT"},
                {"name": "IMAGE_TAG", "value": "cpu-abc", "type": "PLAINTEXT"},
                {"name": "VARIANT", "value": "cpu", "type": "PLAINTEXT"},
                {"name": "EXTRA_BUILD_ARGS", "value": "PYTHON_IMAGE=mirror/python:3.11", "type": "PLAINTEXT"},
            ],
        },
    )
    props = {**IMAGE_PROPS, "BuildArgs": "PYTHON_IMAGE=mirror/python:3.11"}
    result = job.on_event(event("Create", props), clients=aws["clients"])
    assert result == {"PhysicalResourceId": f"{REPO_URI}:cpu-abc", "Data": {"BuildId": "ImageBuild:1234"}}


def test_existing_tag_is_reused_without_a_build(aws):
    aws["ecr"].add_response(
        "describe_images",
        {"imageDetails": [{"imageDigest": DIGEST, "imageTags": ["cpu-abc"]}]},
        expected_params={"repositoryName": "decider-images", "imageIds": [{"imageTag": "cpu-abc"}]},
    )
    started = job.on_event(event("Update", IMAGE_PROPS, PhysicalResourceId="old"), clients=aws["clients"])
    assert started["Data"] == {"BuildId": "", "ImageDigest": DIGEST, "ImageUri": f"{REPO_URI}@{DIGEST}"}
    done = job.is_complete(event("Update", IMAGE_PROPS, **started), clients=aws["clients"])
    assert done == {"IsComplete": True, "Data": {"ImageDigest": DIGEST, "ImageUri": f"{REPO_URI}@{DIGEST}"}}


def test_running_build_is_not_complete(aws):
    aws["codebuild"].add_response(
        "batch_get_builds",
        {"builds": [build("IN_PROGRESS", currentPhase="BUILD")]},
        expected_params={"ids": ["ImageBuild:1234"]},
    )
    result = job.check_job(aws["clients"], IMAGE_PROPS, "ImageBuild:1234", now=STARTED + timedelta(minutes=5))
    assert result == {"IsComplete": False}


def test_successful_build_returns_the_image_by_digest(aws):
    exported = [{"name": "IMAGE_DIGEST", "value": DIGEST}]
    aws["codebuild"].add_response(
        "batch_get_builds",
        {"builds": [build("SUCCEEDED", exportedEnvironmentVariables=exported)]},
        expected_params={"ids": ["ImageBuild:1234"]},
    )
    result = job.is_complete(
        event("Create", IMAGE_PROPS, PhysicalResourceId="x", Data={"BuildId": "ImageBuild:1234"}),
        clients=aws["clients"],
    )
    assert result == {"IsComplete": True, "Data": {"ImageDigest": DIGEST, "ImageUri": f"{REPO_URI}@{DIGEST}"}}


def test_failed_build_raises_with_the_phase_message_and_logs(aws):
    phases = [
        {"phaseType": "PRE_BUILD", "phaseStatus": "SUCCEEDED"},
        {
            "phaseType": "BUILD",
            "phaseStatus": "FAILED",
            "contexts": [{"statusCode": "COMMAND_EXECUTION_ERROR", "message": "docker build exit status 1"}],
        },
    ]
    aws["codebuild"].add_response("batch_get_builds", {"builds": [build("FAILED", phases=phases)]})
    with pytest.raises(
        job.BuildFailedError, match=r"ended FAILED in phase BUILD: docker build exit status 1.*Logs: https"
    ):
        job.check_job(aws["clients"], IMAGE_PROPS, "ImageBuild:1234")


def test_build_timed_out_in_codebuild_raises(aws):
    aws["codebuild"].add_response("batch_get_builds", {"builds": [build("TIMED_OUT")]})
    with pytest.raises(job.BuildFailedError, match="ended TIMED_OUT"):
        job.check_job(aws["clients"], IMAGE_PROPS, "ImageBuild:1234")


def test_build_past_its_deadline_is_stopped_and_fails(aws):
    aws["codebuild"].add_response("batch_get_builds", {"builds": [build("IN_PROGRESS")]})
    aws["codebuild"].add_response(
        "stop_build", {"build": {"id": "ImageBuild:1234"}}, {"id": "ImageBuild:1234"}
    )
    late = STARTED + timedelta(minutes=60) + job.DEADLINE_GRACE + timedelta(seconds=1)
    with pytest.raises(job.BuildFailedError, match="still running after 60 min"):
        job.check_job(aws["clients"], IMAGE_PROPS, "ImageBuild:1234", now=late)


def test_success_without_a_digest_is_a_failure(aws):
    exported = [{"name": "IMAGE_DIGEST", "value": ""}]
    aws["codebuild"].add_response(
        "batch_get_builds", {"builds": [build("SUCCEEDED", exportedEnvironmentVariables=exported)]}
    )
    with pytest.raises(job.BuildFailedError, match="exported no image digest"):
        job.check_job(aws["clients"], IMAGE_PROPS, "ImageBuild:1234")


def test_model_already_staged_with_the_pinned_hash_is_not_downloaded(aws):
    aws["s3"].add_response(
        "head_object",
        {"ContentLength": 3013027808, "Metadata": {"sha256": MODEL_PROPS["Sha256"]}},
        expected_params={"Bucket": "artifacts", "Key": MODEL_PROPS["Prefix"] + "model.gguf"},
    )
    result = job.on_event(event("Create", MODEL_PROPS), clients=aws["clients"])
    uri = "s3://artifacts/models/org/repo/rev/13c16f426047/"
    assert result == {"PhysicalResourceId": uri + "model.gguf", "Data": {"BuildId": "", "ModelS3Uri": uri}}


def test_model_with_another_hash_is_staged_again(aws):
    aws["s3"].add_response("head_object", {"ContentLength": 3013027808, "Metadata": {"sha256": "0" * 64}})
    aws["codebuild"].add_response(
        "start_build",
        {"build": {"id": "ModelStaging:1"}},
        expected_params={
            "projectName": "ModelStaging",
            "timeoutInMinutesOverride": 60,
            "environmentVariablesOverride": ANY,
        },
    )
    assert job.on_event(event("Create", MODEL_PROPS), clients=aws["clients"])["Data"] == {
        "BuildId": "ModelStaging:1"
    }


def test_missing_model_starts_the_staging_build_with_the_pin(aws):
    aws["s3"].add_client_error("head_object", "404", http_status_code=404)
    captured: dict[str, Any] = {}

    def capture(params, **_):
        captured.update(params)

    aws["clients"]["codebuild"].meta.events.register("provide-client-params.codebuild.StartBuild", capture)
    aws["codebuild"].add_response("start_build", {"build": {"id": "ModelStaging:2"}})
    job.on_event(event("Create", MODEL_PROPS), clients=aws["clients"])
    env = {v["name"]: v["value"] for v in captured["environmentVariablesOverride"]}
    assert env["MODEL_SHA256"] == MODEL_PROPS["Sha256"]
    assert env["MODEL_SIZE_BYTES"] == "3013027808"
    assert env["MODEL_PREFIX"].endswith("/")


def test_model_build_success_is_verified_against_the_bucket(aws):
    aws["codebuild"].add_response("batch_get_builds", {"builds": [build("SUCCEEDED")]})
    aws["s3"].add_response(
        "head_object", {"ContentLength": 12, "Metadata": {"sha256": MODEL_PROPS["Sha256"]}}
    )
    with pytest.raises(job.BuildFailedError, match="missing or has another sha256"):
        job.check_job(aws["clients"], MODEL_PROPS, "ModelStaging:2")


def test_delete_keeps_images_and_models(aws):
    result = job.on_event(event("Delete", IMAGE_PROPS, PhysicalResourceId="keep-me"), clients=aws["clients"])
    assert result == {"PhysicalResourceId": "keep-me"}
    assert job.is_complete(event("Delete", IMAGE_PROPS, PhysicalResourceId="keep-me")) == {"IsComplete": True}
