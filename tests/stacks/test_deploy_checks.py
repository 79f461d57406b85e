"""The image check/protection, the post-deploy check and the build watcher, against stubbed AWS APIs
(botocore Stubber) and a local receiver for wait condition signals."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.stub import ANY
from handler_helpers import body, start_handle, stubbed_clients

from decider_stacks.handlers import (
    bake_load,
    build_jobs,
    build_watcher,
    codebuild_job,
    post_deploy_check,
    update_guard,
    wait_signal,
)
from decider_stacks.handlers.image_retention import parse_image_uri, protect_image
from decider_stacks.handlers.smoke import CHAT_REQUEST, DECISION_REQUEST

ACCOUNT, REGION = "123456789012", "us-east-1"
SERVICE_TOKEN = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:ImageStack-Provider"
DIGEST_HEX = "ab" * 32
IMAGE = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/decider-images@sha256:{DIGEST_HEX}"
MANIFEST = json.dumps({"schemaVersion": 2, "layers": []})
STACK_ID = f"arn:aws:cloudformation:{REGION}:{ACCOUNT}:stack/CpuStack/abc"
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
DECISION_OK = {"model": "qwen", "answers": {"refund": {"type": "noul", "noul": 0.97}}}
CHAT_OK = {"model": "qwen", "choices": [{"message": {"role": "assistant", "content": "OK"}}]}
JOBS = build_jobs.document(  # ImageStack's BUILD_JOBS: here only its repository matters
    image_project="ImageBuild",
    repository_name="decider-images",
    repository_uri=IMAGE.split("@")[0],
    images={},
    model_project="ModelStaging",
    model={},
    archive_key="",
)


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        build_jobs.ENV: json.dumps(JOBS),
    }.items():
        monkeypatch.setenv(name, value)
    clients, stubs = stubbed_clients()
    yield {"clients": clients, **stubs}
    for stub in stubs.values():
        stub.assert_no_pending_responses()
        stub.deactivate()


def event(request: str, props: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "RequestType": request,
        "RequestId": "r-1",
        "StackId": STACK_ID,
        "ResourceProperties": props,
        **extra,
    }


def deployed_props(**extra: Any) -> dict[str, Any]:
    return {"ServiceToken": SERVICE_TOKEN, "Kind": "DeployedImage", "EndpointName": "decider-cpu", **extra}


def expect_protection(aws: dict[str, Any], *, already: bool = False) -> None:
    aws["ecr"].add_response(
        "batch_get_image",
        {
            "images": [
                {
                    "imageId": {"imageDigest": f"sha256:{DIGEST_HEX}"},
                    "imageManifest": MANIFEST,
                    "imageManifestMediaType": "application/vnd.docker.distribution.manifest.v2+json",
                }
            ]
        },
        expected_params={
            "repositoryName": "decider-images",
            "imageIds": [{"imageDigest": f"sha256:{DIGEST_HEX}"}],
            "acceptedMediaTypes": ANY,
        },
    )
    params = {
        "repositoryName": "decider-images",
        "imageManifest": MANIFEST,
        "imageTag": f"keep-{DIGEST_HEX}",
        "imageDigest": f"sha256:{DIGEST_HEX}",
        "imageManifestMediaType": "application/vnd.docker.distribution.manifest.v2+json",
    }
    if already:
        aws["ecr"].add_client_error("put_image", "ImageAlreadyExistsException", expected_params=params)
    else:
        aws["ecr"].add_response(
            "put_image", {"image": {"imageId": {"imageTag": f"keep-{DIGEST_HEX}"}}}, params
        )


# --- DeployedImage: the signalled image, checked and kept out of the lifecycle ------------------------


def test_the_signalled_image_is_resolved_and_tagged_keep(aws):
    expect_protection(aws)
    wait_data = json.dumps({"image": IMAGE})  # the WaitCondition's Data attribute
    result = codebuild_job.on_event(
        event("Create", deployed_props(WaitData=wait_data)), clients=aws["clients"]
    )
    assert result["Data"] == {"ImageUri": IMAGE, "Protected": "true"}
    done = codebuild_job.is_complete(event("Create", deployed_props(WaitData=wait_data), **result))
    assert done == {"IsComplete": True, "Data": {"ImageUri": IMAGE, "Protected": "true"}}


def test_an_already_protected_prebuilt_image_passes(aws):
    expect_protection(aws, already=True)
    result = codebuild_job.on_event(event("Update", deployed_props(ImageUri=IMAGE)), clients=aws["clients"])
    assert result["Data"] == {"ImageUri": IMAGE, "Protected": "true"}


def test_a_digest_missing_from_the_repository_fails_the_deploy(aws):
    aws["ecr"].add_response(
        "batch_get_image",
        {
            "images": [],
            "failures": [{"failureCode": "ImageNotFound", "failureReason": "Requested image not found"}],
        },
    )
    with pytest.raises(codebuild_job.BuildFailedError, match="Requested image not found"):
        codebuild_job.on_event(event("Create", deployed_props(ImageUri=IMAGE)), clients=aws["clients"])


def test_an_image_in_another_repository_is_left_alone(aws):
    foreign = f"999999999999.dkr.ecr.{REGION}.amazonaws.com/ci@sha256:{DIGEST_HEX}"
    result = codebuild_job.on_event(event("Create", deployed_props(ImageUri=foreign)), clients=aws["clients"])
    assert result["Data"] == {"ImageUri": foreign, "Protected": "false"}  # no ECR call was made


@pytest.mark.parametrize("data", ["not json", json.dumps({"image": "repo:latest"}), json.dumps({})])
def test_wait_data_without_an_image_by_digest_fails(data):
    with pytest.raises(codebuild_job.BuildFailedError, match="wait condition"):
        codebuild_job.parse_wait_data(data)


def test_keep_tag_is_derived_from_the_digest():
    assert parse_image_uri(IMAGE).keep_tag == f"keep-{DIGEST_HEX}"
    with pytest.raises(ValueError, match="not a private ECR image by digest"):
        parse_image_uri("public.ecr.aws/x/y:latest")


def test_protect_image_reports_whether_it_added_the_tag(aws):
    expect_protection(aws)
    assert protect_image(aws["clients"]["ecr"], parse_image_uri(IMAGE)) is True
    expect_protection(aws, already=True)
    assert protect_image(aws["clients"]["ecr"], parse_image_uri(IMAGE)) is False


# --- PostDeployCheck ----------------------------------------------------------------------------------

CHECK_PROPS = {
    "ServiceToken": SERVICE_TOKEN,
    "Kind": "PostDeployCheck",
    "EndpointName": "decider-cpu",
    "EndpointConfigName": "DeciderConfig-NEW",
}


def stack_status(aws: dict[str, Any], status: str) -> None:
    aws["cloudformation"].add_response(
        "describe_stacks",
        {"Stacks": [{"StackName": "CpuStack", "StackStatus": status, "CreationTime": NOW}]},
        expected_params={"StackName": STACK_ID},
    )


def endpoint(aws: dict[str, Any], config: str, status: str = "InService", reason: str | None = None) -> None:
    response = {
        "EndpointName": "decider-cpu",
        "EndpointArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint/decider-cpu",
        "EndpointConfigName": config,
        "EndpointStatus": status,
        "CreationTime": NOW,
        "LastModifiedTime": NOW,
    }
    if reason:
        response["FailureReason"] = reason
    aws["sagemaker"].add_response("describe_endpoint", response, {"EndpointName": "decider-cpu"})


def invocations(aws: dict[str, Any], decision: Any, chat: Any) -> None:
    for route, payload, answer in (
        ("route=/v1/systemone", DECISION_REQUEST, decision),
        ("route=/v1/chat/completions", CHAT_REQUEST, chat),
    ):
        aws["sagemaker-runtime"].add_response(
            "invoke_endpoint",
            {"Body": body(answer), "ContentType": "application/json"},
            {
                "EndpointName": "decider-cpu",
                "ContentType": "application/json",
                "Accept": "application/json",
                "CustomAttributes": route,
                "Body": json.dumps(payload).encode(),
            },
        )


def test_check_passes_when_the_stacks_config_is_live_and_answers(aws):
    stack_status(aws, "UPDATE_IN_PROGRESS")
    started = codebuild_job.on_event(event("Update", CHECK_PROPS), clients=aws["clients"], now=NOW)
    assert started == {
        "PhysicalResourceId": "post-deploy-check:decider-cpu",
        "Data": {"StartedAt": NOW.isoformat()},
    }
    endpoint(aws, "DeciderConfig-NEW")
    invocations(aws, DECISION_OK, CHAT_OK)
    done = codebuild_job.is_complete(event("Update", CHECK_PROPS, **started), clients=aws["clients"], now=NOW)
    assert done["IsComplete"] is True
    assert "p(refund)=0.970" in done["Data"]["Result"] and "reply 'OK'" in done["Data"]["Result"]


def test_a_silent_sagemaker_rollback_fails_the_deploy(aws):
    """InService on the *old* config with an empty FailureReason: CloudFormation would call it done."""
    endpoint(aws, "DeciderConfig-OLD")
    data = {"StartedAt": NOW.isoformat()}
    with pytest.raises(
        post_deploy_check.PostDeployCheckError, match="runs endpoint config DeciderConfig-OLD"
    ):
        codebuild_job.is_complete(event("Update", CHECK_PROPS, Data=data), clients=aws["clients"], now=NOW)


def test_failing_smoke_calls_are_retried_then_fail_the_deploy(aws):
    data = {"StartedAt": NOW.isoformat()}
    endpoint(aws, "DeciderConfig-NEW")
    invocations(aws, {"error": {"code": "model_not_ready"}}, CHAT_OK)
    soon = NOW + timedelta(minutes=1)
    assert codebuild_job.is_complete(
        event("Update", CHECK_PROPS, Data=data), clients=aws["clients"], now=soon
    ) == {"IsComplete": False}
    endpoint(aws, "DeciderConfig-NEW")
    invocations(aws, {"error": {"code": "model_not_ready"}}, CHAT_OK)
    late = NOW + post_deploy_check.SMOKE_RETRY_WINDOW + timedelta(seconds=1)
    with pytest.raises(post_deploy_check.PostDeployCheckError, match="smoke calls on decider-cpu failed"):
        codebuild_job.is_complete(event("Update", CHECK_PROPS, Data=data), clients=aws["clients"], now=late)


def test_the_check_is_skipped_while_the_stack_rolls_back(aws):
    stack_status(aws, "UPDATE_ROLLBACK_IN_PROGRESS")
    started = codebuild_job.on_event(event("Update", CHECK_PROPS), clients=aws["clients"], now=NOW)
    assert started["Data"] == {"Skipped": "rollback"}
    done = codebuild_job.is_complete(event("Update", CHECK_PROPS, **started), clients=aws["clients"])
    assert done == {"IsComplete": True, "Data": {"Result": "skipped (rollback)"}}


# --- the build watcher and the signal itself ----------------------------------------------------------


def state_change(status: str, variables: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "detail-type": "CodeBuild Build State Change",
        "source": "aws.codebuild",
        "detail": {
            "build-status": status,
            "project-name": "ImageBuild",
            "build-id": f"arn:aws:codebuild:{REGION}:{ACCOUNT}:build/ImageBuild:42",
            "additional-information": {
                "environment": {"environment-variables": variables},
                "phases": [
                    {"phase-type": "PRE_BUILD", "phase-status": "SUCCEEDED"},
                    {
                        "phase-type": "BUILD",
                        "phase-status": "FAILED",
                        "phase-context": ["docker build failed"],
                    },
                ],
                "logs": {"deep-link": "https://console.aws.amazon.com/cloudwatch/logs/ImageBuild"},
            },
        },
    }


def test_a_failed_image_build_fails_its_wait_condition_at_once():
    handle, server = start_handle()
    try:
        variables = [{"name": "WAIT_HANDLE_URL", "value": handle.url, "type": "PLAINTEXT"}]
        result = build_watcher.on_build_state_change(state_change("FAILED", variables))
    finally:
        server.shutdown()
        server.server_close()
    assert result["signalled"] is True
    [signal] = handle.signals
    assert signal["Status"] == "FAILURE" and signal["UniqueId"] == "image"
    assert "ended FAILED in phase BUILD: docker build failed" in signal["Reason"]
    assert "Logs: https://console.aws.amazon.com" in signal["Reason"]


@pytest.mark.parametrize(
    ("status", "variables", "why"),
    [
        ("SUCCEEDED", [{"name": "WAIT_HANDLE_URL", "value": "https://x"}], "status SUCCEEDED"),
        ("FAILED", [{"name": "OTHER", "value": "1"}], "no wait handle"),
    ],
)
def test_the_watcher_ignores_successes_and_builds_outside_a_deploy(status, variables, why):
    sent: list[Any] = []
    result = build_watcher.on_build_state_change(
        state_change(status, variables), send=lambda *a: sent.append(a)
    )
    assert result == {"signalled": False, "why": why} and sent == []


def test_signals_refuse_urls_that_are_not_presigned_https():
    with pytest.raises(wait_signal.SignalError, match="https://"):
        wait_signal.send_signal("file:///etc/passwd", "SUCCESS", "x")
    with pytest.raises(ValueError, match="SUCCESS or FAILURE"):
        wait_signal.signal_body("MAYBE", "x", "")


# --- synthetic load while an update bakes -------------------------------------------------------------

LOAD_PROPS = {
    "ServiceToken": SERVICE_TOKEN,
    "Kind": "BakeLoad",
    "EndpointName": "decider-cpu",
    "EndpointConfigName": "DeciderConfig-NEW",
    "LoadPerMinute": "12",
}


class FakeTime:
    """Stands in for the `time` module of bake_load: a clock that only sleeps and invokes move."""

    def __init__(self, start: float) -> None:
        self.now = start

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


class InlineExecutor:
    """Stands in for bake_load's thread pool: runs each request at once, so that the fake clock says
    when it was sent (the dispatcher paces them 2 s apart: bake_load.PACE_S)."""

    def __init__(self, **_: Any) -> None:
        pass

    def submit(self, fn: Any, *args: Any) -> Any:
        from concurrent.futures import Future

        future: Future[None] = Future()
        fn(*args)
        future.set_result(None)
        return future

    def shutdown(self, wait: bool = True) -> None:
        pass


class SlowRuntime:
    """sagemaker-runtime answering each InvokeEndpoint (2 s apart: the dispatcher's pace)."""

    def __init__(self, clock: FakeTime, *, fail: bool = False) -> None:
        self.clock, self.fail = clock, fail
        self.calls: list[tuple[float, dict[str, Any]]] = []

    def invoke_endpoint(self, **kwargs: Any) -> dict[str, Any]:
        self.calls.append((self.clock.now, kwargs))
        if self.fail:
            raise ClientError({"Error": {"Code": "ModelError", "Message": "500"}}, "InvokeEndpoint")
        return {"Body": body(DECISION_OK), "ContentType": "application/json"}


class EndpointStatus:
    """DescribeEndpoint answering `status` (set by the test)."""

    def __init__(self, status: str, config: str = "DeciderConfig-OLD") -> None:
        self.status, self.config = status, config

    def describe_endpoint(self, EndpointName: str) -> dict[str, Any]:  # noqa: N803 - boto3's spelling
        return {
            "EndpointName": EndpointName,
            "EndpointStatus": self.status,
            "EndpointConfigName": self.config,
        }


def poll_bake(clients: dict[str, Any], clock: FakeTime, data: dict[str, Any]) -> dict[str, Any]:
    """One poll of the provider, then its 30 s query interval and ~1 s of invocation overhead."""
    result = bake_load.check(clients, LOAD_PROPS, data, now=datetime.fromtimestamp(clock.now, UTC))
    clock.now += 31.0
    return result


def test_every_minute_of_the_bake_gets_the_alarms_floor_of_synthetic_requests(monkeypatch):
    """With requests 2 s apart and the provider's 30 s between polls, every calendar minute (CloudWatch's
    period) of the bake gets LoadPerMinute (12) requests, at least error_rate_min_invocations (10)."""
    from decider_stacks.config import load_config
    from decider_stacks.synth import cdk_json_context

    clock = FakeTime(1_767_268_817.0)  # not on a minute boundary
    monkeypatch.setattr(bake_load, "time", clock)
    monkeypatch.setattr(bake_load, "ThreadPoolExecutor", InlineExecutor)
    runtime = SlowRuntime(clock)
    clients = {"sagemaker": EndpointStatus("Updating"), "sagemaker-runtime-load": runtime}
    data = {"StartedAt": datetime.fromtimestamp(clock.now, UTC).isoformat()}
    end = clock.now + 15 * 60
    while clock.now < end:
        assert poll_bake(clients, clock, data) == {"IsComplete": False}
    per_minute = Counter(int(t // 60) for t, _ in runtime.calls)
    full = sorted(per_minute)[1:-1]
    assert len(full) >= 12
    floor = load_config(cdk_json_context()).cpu.alarms.error_rate_min_invocations
    assert min(per_minute[m] for m in full) >= int(LOAD_PROPS["LoadPerMinute"]) >= floor, per_minute
    # PREFIX_AWARE routing hashes the body's first bytes: every synthetic request starts differently.
    heads = [call["Body"][:40] for _, call in runtime.calls]
    assert len(set(heads)) == len(heads)
    assert all(call["CustomAttributes"] == "route=/v1/systemone" for _, call in runtime.calls)
    assert json.loads(runtime.calls[0][1]["Body"])["questions"] == DECISION_REQUEST["questions"]


def test_a_broken_canary_keeps_getting_load_and_the_load_ends_with_the_update(aws, monkeypatch):
    clock = FakeTime(1_767_268_800.0)
    monkeypatch.setattr(bake_load, "time", clock)
    monkeypatch.setattr(bake_load, "ThreadPoolExecutor", InlineExecutor)
    stack_status(aws, "UPDATE_IN_PROGRESS")
    started = codebuild_job.on_event(event("Update", LOAD_PROPS), clients=aws["clients"], now=NOW)
    assert started["PhysicalResourceId"] == "bake-load:decider-cpu"
    data = started["Data"]
    status = EndpointStatus("InService")
    runtime = SlowRuntime(clock, fail=True)
    clients = {"sagemaker": status, "sagemaker-runtime-load": runtime}
    assert poll_bake(clients, clock, {"StartedAt": clock_iso(clock)}) == {"IsComplete": False}  # not begun
    assert runtime.calls == []
    status.status = "Updating"
    assert poll_bake(clients, clock, data | {"StartedAt": clock_iso(clock)}) == {"IsComplete": False}
    assert len(runtime.calls) >= 12  # failed calls are what the alarms count: the load goes on
    status.status, status.config = "InService", "DeciderConfig-NEW"
    assert poll_bake(clients, clock, {"StartedAt": clock_iso(clock, -20 * 60)})["IsComplete"] is True


def clock_iso(clock: FakeTime, offset_s: float = 0.0) -> str:
    return datetime.fromtimestamp(clock.now + offset_s, UTC).isoformat()


def test_no_load_on_create_or_rollback_and_never_past_the_providers_limit(aws):
    created = codebuild_job.on_event(event("Create", LOAD_PROPS), clients=aws["clients"], now=NOW)
    assert codebuild_job.is_complete(event("Create", LOAD_PROPS, **created), clients=aws["clients"])[
        "IsComplete"
    ]
    stack_status(aws, "UPDATE_ROLLBACK_IN_PROGRESS")
    rolled = codebuild_job.on_event(event("Update", LOAD_PROPS), clients=aws["clients"], now=NOW)
    assert rolled["Data"] == {"Skipped": "rollback"}
    data = {"StartedAt": NOW.isoformat()}
    endpoint(aws, "DeciderConfig-OLD", status="Updating")
    late = NOW + timedelta(minutes=51)
    done = codebuild_job.is_complete(event("Update", LOAD_PROPS, Data=data), clients=aws["clients"], now=late)
    assert done == {"IsComplete": True, "Data": {"Result": "gave up (update still running)"}}
    endpoint(aws, "DeciderConfig-OLD")  # never began within the grace: done, nothing sent
    after_grace = NOW + timedelta(minutes=6)
    done = codebuild_job.is_complete(
        event("Update", LOAD_PROPS, Data=data), clients=aws["clients"], now=after_grace
    )
    assert done["IsComplete"] is True


def test_an_async_endpoint_is_checked_by_its_config_without_smoke_calls(aws):
    """An async endpoint (invocation=async) refuses InvokeEndpoint: no smoke call is made (the
    Stubber fails on any unexpected call); the live config must still be the stack's."""
    endpoint(aws, "DeciderConfig-NEW")
    props = {**CHECK_PROPS, "Invocation": "async"}
    data = {"StartedAt": NOW.isoformat()}
    done = codebuild_job.is_complete(event("Update", props, Data=data), clients=aws["clients"], now=NOW)
    assert done == {
        "IsComplete": True,
        "Data": {"Result": "decider-cpu runs DeciderConfig-NEW (async: no smoke calls)"},
    }
    endpoint(aws, "DeciderConfig-OLD")
    with pytest.raises(
        post_deploy_check.PostDeployCheckError, match="runs endpoint config DeciderConfig-OLD"
    ):
        codebuild_job.is_complete(event("Update", props, Data=data), clients=aws["clients"], now=NOW)


# --- parking: wait, copy the synthesized config, park once, only in time (issue 24) ------------------

PREVIOUS_CONFIG = "DeciderConfig-OLD"
PARKED = post_deploy_check.parking_config_name("decider-cpu", PREVIOUS_CONFIG, "DeciderConfig-NEW")


class RecordingJson:
    """Stands in for decider_stacks.handlers.sagemaker_json.SageMakerJson: records each call's body."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def call(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((operation, body))
        name = body["EndpointConfigName"]
        return {"EndpointConfigArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint-config/{name}"}


def resolve(value: Any) -> Any:
    """A template value as CloudFormation would resolve it, with made-up names for references."""
    if isinstance(value, dict):
        if "Fn::Join" in value:
            separator, parts = value["Fn::Join"]
            return separator.join(str(resolve(part)) for part in parts)
        if "Fn::GetAtt" in value:
            return "-".join(value["Fn::GetAtt"])
        if "Ref" in value:
            return f"ref-{value['Ref']}"
        return {k: resolve(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v) for v in value]
    return value


def check_update(aws: dict[str, Any], old_props: dict[str, Any], now: datetime) -> dict[str, Any]:
    """onEvent of the check for an update from `old_props`, as the provider passes it on."""
    stack_status(aws, "UPDATE_IN_PROGRESS")
    update = event("Update", CHECK_PROPS, OldResourceProperties=old_props)
    return {**update, **codebuild_job.on_event(update, clients=aws["clients"], now=now)}


def config_missing(aws: dict[str, Any], name: str) -> None:
    aws["sagemaker"].add_client_error(
        "describe_endpoint_config",
        "ValidationException",
        "Could not find endpoint configuration",
        expected_params={"EndpointConfigName": name},
    )


@pytest.mark.parametrize("status", ["Updating", "SystemUpdating"])
def test_the_check_waits_while_the_endpoint_updates_on_its_own_config(aws, status):
    """Autoscaling's held-back scale-out right after the bake (or patching): wait, do not fail."""
    data = {"StartedAt": NOW.isoformat()}
    endpoint(aws, "DeciderConfig-NEW", status=status)
    soon = NOW + timedelta(minutes=3)
    assert codebuild_job.is_complete(
        event("Update", CHECK_PROPS, Data=data), clients=aws["clients"], now=soon
    ) == {"IsComplete": False}
    endpoint(aws, "DeciderConfig-NEW", status=status)
    late = NOW + post_deploy_check.UPDATING_WAIT + timedelta(seconds=1)
    with pytest.raises(post_deploy_check.PostDeployCheckError, match=f"still {status} on DeciderConfig-NEW"):
        codebuild_job.is_complete(event("Update", CHECK_PROPS, Data=data), clients=aws["clients"], now=late)


@pytest.mark.cdk
def test_parking_copies_every_field_of_the_synthesized_gpu_config(aws, synth_prebuilt):
    """The GPU config with PREFIX_AWARE routing and instance pools, as the template gives it to
    CloudFormation, is what the parked copy repeats: sent as JSON, not through the runtime's botocore."""
    template = synth_prebuilt.templates["GpuStack"]
    [check_props] = [
        r["Properties"] for r in template["Resources"].values() if r["Type"] == "Custom::PostDeployCheck"
    ]
    [config] = [
        r["Properties"]
        for r in template["Resources"].values()
        if r["Type"] == "AWS::SageMaker::EndpointConfig"
    ]
    synthesized = resolve({k: v for k, v in config.items() if k != "Tags"})
    variant = synthesized["ProductionVariants"][0]
    assert variant["RoutingConfig"]["PrefixAwareRoutingConfig"] == {
        "PrefixLength": 2048,
        "ConcurrencyThreshold": 2,
    }
    assert len(variant["InstancePools"]) == 3
    old = {
        **CHECK_PROPS,
        "EndpointConfigName": PREVIOUS_CONFIG,
        "EndpointConfig": resolve(check_props["EndpointConfig"]),
    }
    started = check_update(aws, old, NOW)
    aws["clients"]["sagemaker-json"] = recorder = RecordingJson()
    endpoint(aws, PREVIOUS_CONFIG)  # SageMaker rolled the update back on its own
    config_missing(aws, PARKED)
    aws["sagemaker"].add_response(
        "update_endpoint",
        {"EndpointArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint/decider-cpu"},
        {
            "EndpointName": "decider-cpu",
            "EndpointConfigName": PARKED,
            "RetainAllVariantProperties": True,
            "DeploymentConfig": post_deploy_check.parking_deployment(55 * 60 - 60),
        },
    )
    result = codebuild_job.is_complete(started, clients=aws["clients"], now=NOW + timedelta(minutes=1))
    assert result == {"IsComplete": False}
    [(operation, body)] = recorder.calls
    assert operation == "CreateEndpointConfig" and body["EndpointConfigName"] == PARKED
    assert {k: v for k, v in body.items() if k not in ("EndpointConfigName", "Tags")} == synthesized
    assert {"Key": "promote:endpoint", "Value": "decider-cpu"} in body["Tags"]
    policy = post_deploy_check.parking_deployment(3540)["BlueGreenUpdatePolicy"]
    assert policy["MaximumExecutionTimeoutInSeconds"] == 3540  # the parking update has a deadline


def test_a_parked_update_that_did_not_take_ends_the_check_without_parking_again(aws):
    data = {"StartedAt": NOW.isoformat(), "PreviousConfig": PREVIOUS_CONFIG}
    endpoint(aws, PREVIOUS_CONFIG, reason="the parked update was rolled back")
    parked_arn = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint-config/{PARKED}"
    described = {
        "EndpointConfigName": PARKED,
        "EndpointConfigArn": parked_arn,
        "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": "model-previous"}],
        "CreationTime": NOW,
    }
    aws["sagemaker"].add_response("describe_endpoint_config", described, {"EndpointConfigName": PARKED})
    aws["sagemaker"].add_response("describe_endpoint_config", described, {"EndpointConfigName": PARKED})
    aws["sagemaker"].add_response(
        "list_tags",
        {"Tags": [{"Key": "decider:parked-because", "Value": "smoke calls failed"}]},
        {"ResourceArn": parked_arn},
    )
    with pytest.raises(post_deploy_check.PostDeployCheckError) as failure:
        codebuild_job.is_complete(event("Update", CHECK_PROPS, Data=data), clients=aws["clients"], now=NOW)
    message = str(failure.value)
    assert message.startswith("smoke calls failed; parking decider-cpu on")  # the first failure, kept
    assert (
        "did not take" in message and "not parked twice" in message and "continue-update-rollback" in message
    )
    # (the Stubber fails on any UpdateEndpoint: none was made)


def test_no_parking_when_the_time_left_cannot_cover_provisioning_download_and_health_check(aws):
    data = {"StartedAt": NOW.isoformat(), "PreviousConfig": PREVIOUS_CONFIG}
    endpoint(aws, PREVIOUS_CONFIG)
    config_missing(aws, PARKED)
    late = NOW + timedelta(minutes=40)  # 15 min left; 600 + 900 + 900 s may be needed
    with pytest.raises(
        post_deploy_check.PostDeployCheckError, match=r"not parking decider-cpu: .* 2400 s, only 900 s"
    ):
        codebuild_job.is_complete(event("Update", CHECK_PROPS, Data=data), clients=aws["clients"], now=late)


def test_the_handlers_deadline_is_the_providers():
    from decider_stacks.config import PROVIDER_TOTAL_TIMEOUT_MINUTES

    expected = timedelta(minutes=PROVIDER_TOTAL_TIMEOUT_MINUTES)
    assert expected == post_deploy_check.PROVIDER_DEADLINE


@pytest.mark.parametrize("length", range(1, 64))
def test_the_parked_name_fits_and_keeps_the_iam_prefix(length):
    name = ("Ab1-" * 16)[:length].rstrip("-") or "a"
    parked = post_deploy_check.parking_config_name(name, "prev", "new")
    assert len(parked) <= 63 and parked.startswith(post_deploy_check.parked_prefix(name))


# --- the update guard: documented refusals and the quota, before the Endpoint is touched -------------

GUARD_PROPS = {
    "ServiceToken": SERVICE_TOKEN,
    "Kind": "UpdateGuard",
    "Variant": "cpu",
    "EndpointName": "decider-cpu",
    "Fingerprint": "f" * 32,
    "Invocation": "realtime",
    "InstanceTypes": ["ml.c7i.8xlarge"],
    "Autoscaling": "true",
    "InitialInstances": "2",
    "PeakInstances": "8",
}


def quotas(aws: dict[str, Any], value: float, applied: float | None = None) -> None:
    quota = {"QuotaName": "ml.c7i.8xlarge for endpoint usage", "QuotaCode": "L-1", "ServiceCode": "sagemaker"}
    aws["service-quotas"].add_response(
        "list_aws_default_service_quotas",
        {"Quotas": [{**quota, "Value": value}]},
        {"ServiceCode": "sagemaker"},
    )
    aws["service-quotas"].add_response(
        "list_service_quotas",
        {"Quotas": [{**quota, "Value": applied}] if applied is not None else []},
        {"ServiceCode": "sagemaker"},
    )


def test_the_guard_refuses_a_blue_green_peak_above_the_quota(aws):
    """Without a readable live fleet (the Stubber answers no DescribeEndpoint here): 2 x max_capacity."""
    stack_status(aws, "UPDATE_IN_PROGRESS")
    quotas(aws, 2, applied=6)  # the applied value wins over the default
    update = event("Update", GUARD_PROPS, OldResourceProperties={**GUARD_PROPS, "Fingerprint": "OLD"})
    with pytest.raises(
        update_guard.UpdateRefusedError, match=r"quota 'ml.c7i.8xlarge for endpoint usage' is 6, but"
    ):
        codebuild_job.on_event(update, clients=aws["clients"], now=NOW)
    stack_status(aws, "UPDATE_IN_PROGRESS")
    quotas(aws, 8)
    result = codebuild_job.on_event(update, clients=aws["clients"], now=NOW)
    assert result["PhysicalResourceId"] == "update-guard:decider-cpu"
    done = codebuild_job.is_complete({**update, **result}, clients=aws["clients"])
    assert done["IsComplete"] is True


def test_the_guard_refuses_a_rename_unless_replace_endpoint_names_the_endpoint_it_deletes(aws):
    """Issue 33 §3: EndpointName is create-only: a rename creates the new endpoint and deletes the old one
    and its log group. Refused before the Endpoint is touched, unless consented by name."""
    renamed = {**GUARD_PROPS, "EndpointName": "decider-cpu-async", "Invocation": "async"}
    old = {**GUARD_PROPS, "Fingerprint": "OLD"}
    stack_status(aws, "UPDATE_IN_PROGRESS")
    quotas(aws, 20)
    with pytest.raises(update_guard.UpdateRefusedError) as refused:
        codebuild_job.on_event(event("Update", renamed, OldResourceProperties=old), clients=aws["clients"])
    message = str(refused.value)
    assert "DELETE decider-cpu" in message and "/aws/sagemaker/Endpoints/decider-cpu" in message
    assert "-c cpu.replace_endpoint=decider-cpu" in message and "-c cpu.endpoint_name=decider-cpu" in message
    for consent in ("decider-gpu", "decider-cpu-async"):  # consent must name the endpoint deleted
        stack_status(aws, "UPDATE_IN_PROGRESS")
        quotas(aws, 20)
        with pytest.raises(update_guard.UpdateRefusedError):
            codebuild_job.on_event(
                event("Update", {**renamed, "ReplaceEndpoint": consent}, OldResourceProperties=old),
                clients=aws["clients"],
            )
    stack_status(aws, "UPDATE_IN_PROGRESS")
    quotas(aws, 20)
    accepted = codebuild_job.on_event(
        event("Update", {**renamed, "ReplaceEndpoint": "decider-cpu"}, OldResourceProperties=old),
        clients=aws["clients"],
    )
    assert "accepted" in accepted["Data"]["Result"]


def test_a_renamed_endpoint_is_not_parked_when_its_check_fails(aws):
    """Issue 33 §3: after a rename the endpoint is new (its rollback deletes it) and the previous config
    is the old endpoint's: the check fails without parking anything (the Stubber refuses any
    DescribeEndpointConfig, CreateEndpointConfig or UpdateEndpoint), and the bake load sends nothing."""
    old = {
        **CHECK_PROPS,
        "EndpointName": "decider-cpu-old",
        "EndpointConfigName": PREVIOUS_CONFIG,
        "EndpointConfig": json.dumps({"ProductionVariants": [{"VariantName": "AllTraffic"}]}),
    }
    started = check_update(aws, old, NOW)
    assert "PreviousConfig" not in started["Data"] and "Renamed" in started["Data"]
    aws["clients"]["sagemaker-json"] = recorder = RecordingJson()
    endpoint(aws, "DeciderConfig-NEW")
    invocations(aws, {"error": {"code": "model_not_ready"}}, CHAT_OK)
    late = NOW + post_deploy_check.SMOKE_RETRY_WINDOW + timedelta(seconds=1)
    with pytest.raises(post_deploy_check.PostDeployCheckError, match="smoke calls on decider-cpu failed"):
        codebuild_job.is_complete(started, clients=aws["clients"], now=late)
    assert recorder.calls == []
    load = event(
        "Update", LOAD_PROPS, OldResourceProperties={**LOAD_PROPS, "EndpointName": "decider-cpu-old"}
    )
    assert (
        "renamed from decider-cpu-old"
        in codebuild_job.on_event(load, clients=aws["clients"])["Data"]["Skipped"]
    )


def test_the_guard_checks_the_first_fleet_on_create_and_nothing_while_rolling_back(aws):
    quotas(aws, 1)
    with pytest.raises(update_guard.UpdateRefusedError, match="runs 2 instances to start"):
        codebuild_job.on_event(event("Create", GUARD_PROPS), clients=aws["clients"], now=NOW)
    stack_status(aws, "UPDATE_ROLLBACK_IN_PROGRESS")  # the way back is never refused (no quota read)
    flip = event("Update", GUARD_PROPS, OldResourceProperties={**GUARD_PROPS, "Invocation": "async"})
    assert codebuild_job.on_event(flip, clients=aws["clients"], now=NOW)["Data"] == {
        "Result": "skipped (rollback)"
    }


def live_endpoint(
    aws: dict[str, Any], current: int, desired: int, pools: dict[str, int] | None = None
) -> None:
    variant: dict[str, Any] = {
        "VariantName": "AllTraffic",
        "CurrentInstanceCount": current,
        "DesiredInstanceCount": desired,
    }
    if pools:
        variant["InstancePools"] = [{"InstanceType": t, "CurrentInstanceCount": n} for t, n in pools.items()]
    aws["sagemaker"].add_response(
        "describe_endpoint",
        {
            "EndpointName": "decider-cpu",
            "EndpointArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint/decider-cpu",
            "EndpointConfigName": "DeciderConfig-OLD",
            "EndpointStatus": "InService",
            "CreationTime": NOW,
            "LastModifiedTime": NOW,
            "ProductionVariants": [variant],
        },
        {"EndpointName": "decider-cpu"},
    )


def typed_quotas(aws: dict[str, Any], values: dict[str, float]) -> None:
    listed = [
        {
            "QuotaName": f"{t} for endpoint usage",
            "QuotaCode": f"L-{i}",
            "ServiceCode": "sagemaker",
            "Value": v,
        }
        for i, (t, v) in enumerate(values.items())
    ]
    aws["service-quotas"].add_response(
        "list_aws_default_service_quotas", {"Quotas": listed}, {"ServiceCode": "sagemaker"}
    )
    aws["service-quotas"].add_response("list_service_quotas", {"Quotas": []}, {"ServiceCode": "sagemaker"})


def test_the_guard_counts_the_blue_green_peak_of_the_live_fleet(aws):
    """Issue 33 §5: the peak is today's fleet twice (old + a new one of its size, retained), not
    2 x max_capacity: 2 live instances of max_capacity 4 fit a quota of 6; 4 live ones do not."""
    update = event("Update", GUARD_PROPS, OldResourceProperties={**GUARD_PROPS, "Fingerprint": "OLD"})
    stack_status(aws, "UPDATE_IN_PROGRESS")
    live_endpoint(aws, current=2, desired=2)
    quotas(aws, 6)
    assert "accepted" in codebuild_job.on_event(update, clients=aws["clients"], now=NOW)["Data"]["Result"]
    stack_status(aws, "UPDATE_IN_PROGRESS")
    live_endpoint(aws, current=4, desired=4)
    quotas(aws, 6)
    with pytest.raises(update_guard.UpdateRefusedError, match="is 6, but the endpoint runs 8 instances"):
        codebuild_job.on_event(update, clients=aws["clients"], now=NOW)


def test_the_guard_counts_each_pool_type_with_its_own_live_instances(aws):
    """Instance pools: the old fleet's instances of a type stay while the whole new fleet may land on
    that type; 3 + 4 on c7i and 1 + 4 on c6i, not 8 on each."""
    pooled = {**GUARD_PROPS, "InstanceTypes": ["ml.c7i.8xlarge", "ml.c6i.8xlarge"]}
    update = event("Update", pooled, OldResourceProperties={**pooled, "Fingerprint": "OLD"})
    stack_status(aws, "UPDATE_IN_PROGRESS")
    live_endpoint(aws, current=4, desired=4, pools={"ml.c7i.8xlarge": 3, "ml.c6i.8xlarge": 1})
    typed_quotas(aws, {"ml.c7i.8xlarge": 7, "ml.c6i.8xlarge": 5})
    assert "accepted" in codebuild_job.on_event(update, clients=aws["clients"], now=NOW)["Data"]["Result"]
    stack_status(aws, "UPDATE_IN_PROGRESS")
    live_endpoint(aws, current=4, desired=4, pools={"ml.c7i.8xlarge": 3, "ml.c6i.8xlarge": 1})
    typed_quotas(aws, {"ml.c7i.8xlarge": 6, "ml.c6i.8xlarge": 5})
    with pytest.raises(
        update_guard.UpdateRefusedError, match=r"'ml\.c7i\.8xlarge for endpoint usage' is 6, but"
    ):
        codebuild_job.on_event(update, clients=aws["clients"], now=NOW)


def test_without_autoscaling_the_new_fleet_is_the_configured_count(aws):
    fixed = {**GUARD_PROPS, "Autoscaling": "false", "InitialInstances": "3", "PeakInstances": "6"}
    update = event("Update", fixed, OldResourceProperties={**fixed, "InitialInstances": "2"})
    stack_status(aws, "UPDATE_IN_PROGRESS")
    live_endpoint(aws, current=2, desired=2)
    quotas(aws, 4)
    with pytest.raises(update_guard.UpdateRefusedError, match="runs 5 instances at the blue/green peak"):
        codebuild_job.on_event(update, clients=aws["clients"], now=NOW)


def test_the_guard_passes_when_the_quotas_cannot_be_read(aws):
    aws["service-quotas"].add_client_error("list_aws_default_service_quotas", "AccessDeniedException")
    result = codebuild_job.on_event(event("Create", GUARD_PROPS), clients=aws["clients"], now=NOW)
    assert "accepted" in result["Data"]["Result"]


# --- the signed-JSON SageMaker call (fields the runtime's botocore does not know) --------------------


class FakeHttp:
    def __init__(self, status: int, payload: dict[str, Any]) -> None:
        self.status, self.payload = status, payload
        self.sent: list[Any] = []

    def send(self, request: Any) -> Any:
        self.sent.append(request)
        return type(
            "Response", (), {"status_code": self.status, "content": json.dumps(self.payload).encode()}
        )()


def test_the_json_call_sends_the_body_as_given_signed_for_sagemaker(aws):
    from decider_stacks.handlers.sagemaker_json import SageMakerJson

    session = boto3.session.Session(
        aws_access_key_id="AKID", aws_secret_access_key="secret", region_name=REGION
    )
    client = SageMakerJson(session)
    client.http = http = FakeHttp(200, {"EndpointConfigArn": "arn:x"})
    body = {"EndpointConfigName": "c", "ProductionVariants": [{"RoutingConfig": {"FutureField": {"X": 1}}}]}
    assert client.call("CreateEndpointConfig", body) == {"EndpointConfigArn": "arn:x"}
    [request] = http.sent
    assert request.url == f"https://api.sagemaker.{REGION}.amazonaws.com/" and request.method == "POST"
    assert request.headers["X-Amz-Target"] == "SageMaker.CreateEndpointConfig"
    assert request.headers["Content-Type"] == "application/x-amz-json-1.1"
    assert request.headers["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKID/")
    assert f"/{REGION}/sagemaker/aws4_request" in request.headers["Authorization"]
    assert json.loads(request.body) == body  # unknown to any botocore model, and still sent
    client.http = FakeHttp(400, {"__type": "com.amazon.coral.validate#ValidationException", "message": "bad"})
    with pytest.raises(ClientError, match=r"ValidationException.*bad"):
        client.call("CreateEndpointConfig", body)


@pytest.mark.parametrize("status", ["Updating", "SystemUpdating"])
def test_the_check_waits_while_the_endpoint_updates_on_the_previous_config(aws, status):
    """Issue 33 §5: an endpoint still Updating on the previous config is not judged (nor parked, which
    UpdateEndpoint would refuse) at once: the check waits, then judges what it settles in."""
    old = {**CHECK_PROPS, "EndpointConfigName": PREVIOUS_CONFIG}
    started = check_update(aws, old, NOW)
    endpoint(aws, PREVIOUS_CONFIG, status=status)
    soon = NOW + timedelta(minutes=3)
    assert codebuild_job.is_complete(started, clients=aws["clients"], now=soon) == {"IsComplete": False}
    # it settles on this deploy's config: the smoke calls decide
    endpoint(aws, "DeciderConfig-NEW")
    invocations(aws, DECISION_OK, CHAT_OK)
    done = codebuild_job.is_complete(started, clients=aws["clients"], now=soon + timedelta(minutes=1))
    assert done["IsComplete"] is True
    # still there after the wait: it fails, saying so
    endpoint(aws, PREVIOUS_CONFIG, status=status)
    late = NOW + post_deploy_check.UPDATING_WAIT + timedelta(seconds=1)
    with pytest.raises(post_deploy_check.PostDeployCheckError, match=status):
        codebuild_job.is_complete(started, clients=aws["clients"], now=late)


def _resources_of(template: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {k: r for k, r in template["Resources"].items() if r["Type"] == kind}


def _depends_on(resource: dict[str, Any]) -> list[str]:
    depends = resource.get("DependsOn") or []
    return [depends] if isinstance(depends, str) else depends


def _references(value: Any) -> set[str]:
    """Logical ids a template value refers to (Ref, Fn::GetAtt)."""
    if isinstance(value, dict):
        found = set()
        if "Ref" in value:
            found.add(value["Ref"])
        if "Fn::GetAtt" in value:
            found.add(value["Fn::GetAtt"][0])
        for inner in value.values():
            found |= _references(inner)
        return found
    if isinstance(value, list):
        return set().union(*(_references(v) for v in value)) if value else set()
    return set()


@pytest.mark.cdk
@pytest.mark.parametrize("fixture", ["synth", "synth_prebuilt"])
def test_the_guard_runs_before_the_image_build_and_the_staging(fixture, request):
    """Issue 33 §5: Custom::UpdateGuard refers to nothing of its stack (synth-time properties, the
    provider's token from ImageStack) and the image build, the pinned image's check, the model staging
    and the Endpoint depend on it: a refusal comes before the long wait, not after it."""
    synthesized = request.getfixturevalue(fixture)
    for name in ("CpuStack", "GpuStack"):
        template = synthesized.templates[name]
        [(guard_id, guard)] = _resources_of(template, "Custom::UpdateGuard").items()
        own = _references(guard["Properties"]) & set(template["Resources"])
        assert own == set(), f"{name}: the guard waits for {own}"
        assert "Fingerprint" in guard["Properties"] and "EndpointConfigName" not in guard["Properties"]
        long_running = {
            **_resources_of(template, "Custom::ImageBuild"),
            **_resources_of(template, "Custom::ModelStaging"),
            **_resources_of(template, "Custom::DeployedImage"),
            **_resources_of(template, "AWS::CloudFormation::WaitCondition"),
            **_resources_of(template, "AWS::SageMaker::Endpoint"),
        }
        assert long_running, name
        for logical_id, resource in long_running.items():
            assert guard_id in _depends_on(resource), f"{name}: {logical_id} does not wait for the guard"


def test_the_guard_fingerprint_changes_with_the_variant_the_model_and_the_image():
    """The snapshots mask the fingerprint (it hashes the image tag); this holds what it follows:
    a changed variant setting, model or image re-runs the guard, an unchanged config does not."""
    from decider_stacks.config import load_config
    from decider_stacks.deploy_time_build import guard_fingerprint
    from decider_stacks.synth import cdk_json_context

    config = load_config(cdk_json_context())
    base = guard_fingerprint(config.cpu, config.model, "cpu-" + "a" * 64)
    assert base == guard_fingerprint(config.cpu, config.model, "cpu-" + "a" * 64)
    assert base != guard_fingerprint(config.cpu, config.model, "cpu-" + "b" * 64)
    assert base != guard_fingerprint(config.gpu, config.model, "cpu-" + "a" * 64)
    more = config.cpu.model_copy(update={"initial_instance_count": config.cpu.initial_instance_count + 1})
    assert base != guard_fingerprint(more, config.model, "cpu-" + "a" * 64)
