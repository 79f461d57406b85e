"""Deploy-time jobs behind CloudFormation custom resources (CDK provider framework), by `Kind`:

* `Model`: stage the pinned GGUF from Hugging Face into the artifacts bucket with a CodeBuild build,
  checking size and sha256; returns `ModelS3Uri`. Skipped when the object is already there with the
  pinned sha256. `is_complete` polls the build.
* `Image`: *start* the image build of one variant, or settle it without one: an image pinned by an
  earlier `-c image_uri` deploy (recorded in SSM, kept unless `ImageSource` is `build`), or an
  already pushed tag. The result (`<repo>@sha256:…`) arrives on the AWS::CloudFormation::WaitCondition
  whose handle is `WaitHandle`: the buildspec signals SUCCESS after the push, the build watcher
  (build_watcher.py) signals FAILURE, and this handler signals a result that needs no build. A
  CUDA build may outlast the one hour a custom resource can wait; a wait condition waits up to 12 h.
* `DeployedImage`: the image the endpoint will run (from the wait condition's data, or a prebuilt
  URI), checked to exist and tagged `keep-<digest>` so that the ECR lifecycle never expires it.
* `PostDeployCheck`: after the endpoint update, fail the deploy unless the endpoint runs this
  stack's config and answers a decision and a chat request (post_deploy_check.py).
* `BakeLoad`: beside the endpoint update, a few synthetic decision requests a minute while it bakes,
  so that the rollback alarms can judge a quiet canary (bake_load.py).
* `UpdateGuard`: before the endpoint update, refuse what SageMaker documents it refuses (invocation
  flips, instance-type changes under autoscaling) and a blue/green peak above the quota (update_guard.py).

CodeBuild refuses StartBuild with AccountLimitExceededException while the account's concurrent-build
quota is used up (0 or 1 on many new accounts); `is_complete` then retries with exponential backoff
for START_RETRY_MINUTES. Deleting a resource keeps what it built: live endpoints and rollbacks need
it; an image build still running for a deleted or rolled-back request is stopped.
"""

from __future__ import annotations

import json
import logging
import os
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
from botocore.exceptions import ClientError

try:  # package import (tools, tests)
    from . import (
        bake_load,
        build_jobs,
        image_provenance,
        image_retention,
        post_deploy_check,
        runtime_client,
        sagemaker_json,
        update_guard,
        wait_signal,
    )
    from .build_states import FAILED_STATES
except ImportError:  # the Lambda asset's root
    import bake_load  # type: ignore[no-redef]
    import build_jobs  # type: ignore[no-redef]
    import image_provenance  # type: ignore[no-redef]
    import image_retention  # type: ignore[no-redef]
    import post_deploy_check  # type: ignore[no-redef]
    import runtime_client  # type: ignore[no-redef]
    import sagemaker_json  # type: ignore[no-redef]
    import update_guard  # type: ignore[no-redef]
    import wait_signal  # type: ignore[no-redef]
    from build_states import FAILED_STATES  # type: ignore[no-redef]

LOG = logging.getLogger()
LOG.setLevel(logging.INFO)

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# CodeBuild does not support local caching on BUILD_GENERAL1_2XLARGE (CodeBuild User Guide, "Local
# caching"): such builds run with the cache switched off.
NO_LOCAL_CACHE_COMPUTE = frozenset({"BUILD_GENERAL1_2XLARGE"})
RETRY_BASE_S, RETRY_MAX_GAP_S = 30, 300
RECENT_BUILDS = 25  # how far back a retried start looks for a build it may already have started


class BuildFailedError(RuntimeError):
    """The CodeBuild build did not succeed (or could not start); the message says why and where to look."""


class Clients:
    """boto3 clients by service name, created on first use (tests pass a dict of stubbed ones)."""

    def __init__(self) -> None:
        self._clients: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._clients:
            if name == "sagemaker-json":  # SageMaker calls with bodies the runtime's botocore would refuse
                self._clients[name] = sagemaker_json.SageMakerJson()
            elif name == "sagemaker-runtime":  # 70 s read timeout, bounded attempts (runtime_client.py)
                self._clients[name] = runtime_client.runtime_client()
            elif name == "sagemaker-runtime-load":  # the bake load's: one attempt per request
                self._clients[name] = runtime_client.runtime_client(
                    max_attempts=runtime_client.LOAD_MAX_ATTEMPTS,
                    max_pool_connections=runtime_client.LOAD_MAX_CONNECTIONS,
                )
            else:
                self._clients[name] = boto3.client(name)
        return self._clients[name]


def _setting(name: str) -> int:
    """A limit the stack passes as a Lambda environment variable (values from stacks/config.py)."""
    try:
        return int(os.environ[name])
    except KeyError:
        raise RuntimeError(f"environment variable {name} is not set (the stack sets it)") from None


def poll_seconds() -> int:
    return _setting("POLL_SECONDS")


def start_retry() -> timedelta:
    return timedelta(minutes=_setting("START_RETRY_MINUTES"))


def deadline_grace() -> timedelta:
    return timedelta(minutes=_setting("DEADLINE_GRACE_MINUTES"))


def _env(pairs: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": name, "value": str(value), "type": "PLAINTEXT"} for name, value in pairs.items()]


def _image_uri(digest: str) -> str:
    return f"{build_jobs.repository()[1]}@{digest}"


def _model_uri(props: dict[str, Any]) -> str:
    return f"s3://{props['Bucket']}/{props['Prefix']}"


# The archive an earlier version staged *inside* the model prefix (`Archive`, relative to it). The
# endpoint's Model mounts every object under the prefix (S3ModelDataSource S3Prefix), so it is removed.
LEGACY_ARCHIVE = "model.tar.gz"


def _archive_key(props: dict[str, Any]) -> str | None:
    """The Batch Transform archive's key, when the request asks for one: `ArchiveKey` (beside the model
    prefix), or `Archive` (inside it: a request of an earlier version, e.g. during a rollback)."""
    if props.get("ArchiveKey"):
        return str(props["ArchiveKey"])
    if props.get("Archive"):
        return f"{props['Prefix']}{props['Archive']}"
    return None


def _model_outputs(props: dict[str, Any]) -> dict[str, str]:
    """The staged model's prefix, and its model.tar.gz when the request asks for one."""
    outputs = {"ModelS3Uri": _model_uri(props)}
    archive = _archive_key(props)
    if archive:
        outputs["ModelArchiveUri"] = f"s3://{props['Bucket']}/{archive}"
    return outputs


def _physical_id(props: dict[str, Any]) -> str:
    kind = props["Kind"]
    if kind == "Image":  # an earlier version's request names the repository itself
        return f"{props.get('RepositoryUri') or build_jobs.repository()[1]}:{props['ImageTag']}"
    if kind == "Model":
        return f"{_model_uri(props)}{props['File']}"
    if kind == "PostDeployCheck":
        return f"post-deploy-check:{props['EndpointName']}"
    if kind == "BakeLoad":
        return f"bake-load:{props['EndpointName']}"
    if kind == "UpdateGuard":
        return f"update-guard:{props['EndpointName']}"
    return f"deployed-image:{props.get('EndpointName', '')}"


# --- what exists already -----------------------------------------------------------------------------


def staged_model_present(s3: Any, props: dict[str, Any]) -> bool:
    """True when the GGUF is already in the bucket with the pinned sha256 and size (and, when the
    request asks for it, the model.tar.gz made from it: its `sha256` metadata names the GGUF's), and
    the model prefix holds no archive an earlier version put there (the build removes it)."""
    if not _staged_object(s3, props, f"{props['Prefix']}{props['File']}", check_size=True):
        return False
    archive = _archive_key(props)
    if archive and not _staged_object(s3, props, archive, check_size=False):
        return False
    if props.get("Archive"):  # an earlier version's request: its archive belongs in the prefix
        return True
    return not _object_exists(s3, props["Bucket"], f"{props['Prefix']}{LEGACY_ARCHIVE}")


def _object_exists(s3: Any, bucket: str, key: str) -> bool:
    try:
        _head(s3, bucket, key)
    except FileNotFoundError:
        return False
    return True


def _head(s3: Any, bucket: str, key: str) -> dict[str, Any]:
    """HeadObject; FileNotFoundError when the key is absent.

    Without an unconditional s3:ListBucket, S3 answers HeadObject on a missing key with 403, not 404
    (Amazon S3 API Reference, HeadObject). The role's ListBucket is limited to the models/ prefix, so
    a 403 is settled with a prefix listing: not listed means absent; listed means a real denial.
    """
    try:
        return dict(s3.head_object(Bucket=bucket, Key=key))
    except ClientError as error:
        code = error.response["Error"]["Code"]
        if code in {"404", "NoSuchKey", "NotFound"}:
            raise FileNotFoundError(key) from None
        if code not in {"403", "AccessDenied", "Forbidden"}:
            raise
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
        if not any(item["Key"] == key for item in listed.get("Contents", [])):
            raise FileNotFoundError(key) from None
        raise BuildFailedError(
            f"s3://{bucket}/{key} exists, but HeadObject on it is denied (403); the handler role needs "
            "s3:GetObject on the models/ prefix"
        ) from error


def _staged_object(s3: Any, props: dict[str, Any], key: str, *, check_size: bool) -> bool:
    """One staged object: present with the pinned sha256 (and size).

    Without an unconditional s3:ListBucket, S3 answers HeadObject on a missing key with 403, not 404
    (Amazon S3 API Reference, HeadObject). The role's ListBucket is limited to the models/ prefix, so
    a 403 is settled with a prefix listing: not listed means absent; listed means a real denial.
    """
    try:
        head = _head(s3, props["Bucket"], key)
    except FileNotFoundError:
        return False
    if head.get("Metadata", {}).get("sha256") != props["Sha256"]:
        return False
    return not check_size or int(head["ContentLength"]) == int(props["SizeBytes"])


def pinned_image(ssm: Any, parameter: str) -> str | None:
    """The image an earlier deploy pinned with `-c image_uri`, from the stack's SSM record, or None."""
    try:
        value = ssm.get_parameter(Name=parameter)["Parameter"]["Value"]
    except ClientError as error:
        if error.response["Error"]["Code"] == "ParameterNotFound":
            return None
        raise
    try:
        record = json.loads(value)
    except ValueError:
        LOG.warning("SSM parameter %s is not a deploy record: %r", parameter, value[:200])
        return None
    if record.get("source") == "pinned" and image_retention.IMAGE_URI_RE.match(record.get("image_uri", "")):
        return record["image_uri"]
    return None


# --- starting builds ---------------------------------------------------------------------------------


def job(props: dict[str, Any]) -> dict[str, str]:
    """What the app synthesized for this request (build_jobs.py); UnknownJobError when it did not."""
    if props["Kind"] == "Image":
        return build_jobs.image_job(props["ImageTag"])
    if props["Kind"] == "Model":
        return build_jobs.model_job(props)
    raise ValueError(f"{props['Kind']!r} jobs have no build")


def build_request(props: dict[str, Any], request_id: str) -> dict[str, Any]:
    """The StartBuild arguments for a request (the same on every retry). The project's own buildspec
    and source run: only the synthesized job's variables and run settings are passed (build_jobs.py)."""
    spec = job(props)
    request: dict[str, Any] = {
        "projectName": build_jobs.project(props["Kind"]),
        "timeoutInMinutesOverride": int(spec["TimeoutMinutes"]),
        "queuedTimeoutInMinutesOverride": int(spec["QueuedTimeoutMinutes"]),
    }
    if props["Kind"] == "Image":
        variables = {
            "REPOSITORY_URI": spec["RepositoryUri"],
            "IMAGE_TAG": props["ImageTag"],
            "VARIANT": spec["Variant"],
            "EXTRA_BUILD_ARGS": spec["BuildArgs"],
            "WAIT_HANDLE_URL": props["WaitHandle"],
            "DEPLOY_REQUEST_ID": request_id,
        }
        request["computeTypeOverride"] = spec["ComputeType"]
        if spec["ComputeType"] in NO_LOCAL_CACHE_COMPUTE:
            request["cacheOverride"] = {"type": "NO_CACHE"}
    else:
        variables = {
            "ARTIFACTS_BUCKET": props["Bucket"],
            "MODEL_PREFIX": props["Prefix"],
            "MODEL_REPOSITORY": props["Repository"],
            "MODEL_REVISION": props["Revision"],
            "MODEL_FILE": props["File"],
            "MODEL_SIZE_BYTES": props["SizeBytes"],
            "MODEL_SHA256": props["Sha256"],
            "DEPLOY_REQUEST_ID": request_id,
        }
        if props.get("ArchiveKey"):  # also write the Batch Transform archive (buildspec/model.yml)
            variables["MODEL_ARCHIVE_KEY"] = props["ArchiveKey"]
    request["environmentVariablesOverride"] = _env(variables)
    return request


def try_start(codebuild: Any, request: dict[str, Any]) -> dict[str, Any] | None:
    """StartBuild; None when CodeBuild refuses it for the account's concurrent-build quota."""
    try:
        build = codebuild.start_build(**request)["build"]
    except ClientError as error:
        if error.response["Error"]["Code"] != "AccountLimitExceededException":
            raise
        LOG.warning("CodeBuild refused the build for now: %s", error.response["Error"].get("Message", ""))
        return None
    LOG.info("started build %s", build["id"])
    return build


def retry_due(elapsed_s: float, poll_s: float) -> bool:
    """Whether a start retry is due in the poll that ends at `elapsed_s`: retries at 30, 90, 210, 450,
    750, … s after the first refusal (the gap doubles up to 5 min). The poll interval is fixed, so the
    schedule needs no state."""
    offset, gap = 0.0, float(RETRY_BASE_S)
    while offset <= elapsed_s:
        offset += gap
        if elapsed_s - poll_s < offset <= elapsed_s:
            return True
        gap = min(gap * 2, RETRY_MAX_GAP_S)
    return False


def find_started_build(codebuild: Any, project: str, request_id: str) -> dict[str, Any] | None:
    """A build of `project` that a retry for this CloudFormation request already started."""
    ids = codebuild.list_builds_for_project(projectName=project, sortOrder="DESCENDING").get("ids", [])
    if not ids:
        return None
    for build in codebuild.batch_get_builds(ids=ids[:RECENT_BUILDS]).get("builds", []):
        variables = build.get("environment", {}).get("environmentVariables", [])
        if any(v["name"] == "DEPLOY_REQUEST_ID" and v.get("value") == request_id for v in variables):
            return build
    return None


def _pending(now: datetime) -> dict[str, Any]:
    return {"BuildId": "", "Pending": "true", "RequestedAt": now.isoformat()}


def resume_pending(
    clients: Any, event: dict[str, Any], data: dict[str, Any], now: datetime
) -> dict[str, Any] | None:
    """The build a refused start eventually got (found or started now), or None while still waiting."""
    props, codebuild = event["ResourceProperties"], clients["codebuild"]
    project = build_jobs.project(props["Kind"])
    build = find_started_build(codebuild, project, event["RequestId"])
    if build is not None:
        return build
    elapsed = now - datetime.fromisoformat(data["RequestedAt"])
    if retry_due(elapsed.total_seconds(), poll_seconds()):
        build = try_start(codebuild, build_request(props, event["RequestId"]))
        if build is not None:
            return build
    if elapsed > start_retry():
        raise BuildFailedError(
            f"CodeBuild refused to start {project} for {elapsed} "
            "(AccountLimitExceededException: the account's concurrent-build quota for this compute type "
            "is used up or 0). Request more 'Concurrently running builds' in Service Quotas (run "
            "`preflight` to see them), then deploy again"
        )
    return None


# --- the jobs ----------------------------------------------------------------------------------------


def start_model(clients: Any, event: dict[str, Any], now: datetime) -> dict[str, Any]:
    props = event["ResourceProperties"]
    if staged_model_present(clients["s3"], props):
        LOG.info("model %s%s already staged; not downloading", _model_uri(props), props["File"])
        return {"BuildId": "", **_model_outputs(props)}
    build = try_start(clients["codebuild"], build_request(props, event["RequestId"]))
    return {"BuildId": build["id"]} if build else _pending(now)


def deploy_builds_running(codebuild: Any, project: str, wait_handle: str) -> list[str]:
    """Ids of the running builds of `project` that were started for the wait handle `wait_handle`."""
    ids = codebuild.list_builds_for_project(projectName=project, sortOrder="DESCENDING").get("ids", [])
    if not ids:
        return []
    running = []
    for build in codebuild.batch_get_builds(ids=ids[:RECENT_BUILDS]).get("builds", []):
        if build.get("buildStatus") != "IN_PROGRESS":
            continue
        variables = build.get("environment", {}).get("environmentVariables", [])
        if any(v["name"] == "WAIT_HANDLE_URL" and v.get("value") == wait_handle for v in variables):
            running.append(build["id"])
    return running


def stop_abandoned_builds(clients: Any, props: dict[str, Any]) -> list[str]:
    """Stop the image build a deploy started and no longer waits for (its resource is rolled back or
    deleted): a 2XLARGE CUDA build runs up to 100 min. Never fails the delete or rollback itself."""
    codebuild = clients["codebuild"]
    stopped = []
    try:
        for build_id in deploy_builds_running(codebuild, build_jobs.project("Image"), props["WaitHandle"]):
            codebuild.stop_build(id=build_id)
            LOG.info("stopped image build %s: its deploy no longer waits for it", build_id)
            stopped.append(build_id)
    except ClientError as error:
        LOG.warning("could not stop the abandoned image build of %s: %s", props.get("ImageTag"), error)
    return stopped


def recorded_source(ssm: Any, props: dict[str, Any]) -> str:
    """How the forward path chose the image for these properties: `pinned` when an `-c image_uri`
    deploy's record is kept (image_source=auto), else `build`. During a rollback the record is still
    the one of the last successful deploy, the one the stack returns to."""
    if props.get("ImageSource", "auto") == "auto" and pinned_image(ssm, props["DeployedImageParameter"]):
        return "pinned"
    return "build"


def start_image(clients: Any, event: dict[str, Any], now: datetime) -> dict[str, Any]:
    props = event["ResourceProperties"]
    handle = props["WaitHandle"]
    if event["RequestType"] == "Update" and post_deploy_check.rolling_back(
        clients["cloudformation"], event["StackId"]
    ):
        # The rollback's Update carries the old properties, whose handle was signalled long ago:
        # signalling it again could only fail the rollback itself. The build the failed deploy
        # started (if any) is stopped, and the source is the old one, so that the ImageSource output
        # and the SSM record the stack returns to stay as they were (a pinned image stays pinned).
        old = event.get("OldResourceProperties") or {}
        if old.get("WaitHandle") and old["WaitHandle"] != handle:
            stop_abandoned_builds(clients, {**props, **old})
        source = recorded_source(clients["ssm"], props)
        LOG.info(
            "stack is rolling back: keeping image %s (%s), no build, no signal", props["ImageTag"], source
        )
        return {"BuildId": "", "Source": source}
    if props.get("ImageSource", "auto") == "auto":
        pinned = pinned_image(clients["ssm"], props["DeployedImageParameter"])
        if pinned:
            LOG.info(
                "keeping %s, pinned by an earlier -c image_uri deploy (image_source=build rebuilds)", pinned
            )
            wait_signal.send_signal(handle, "SUCCESS", "kept the image pinned by the last deploy", pinned)
            return {"BuildId": "", "Source": "pinned"}
    spec = job(props)  # only a tag the app synthesized is built, or reused
    digest = image_provenance.tag_digest(clients["ecr"], spec["RepositoryName"], props["ImageTag"])
    if digest:  # Custom::DeployedImage checks that it was built for this tag before anything runs it
        LOG.info("image %s:%s exists (%s); not rebuilding", spec["RepositoryName"], props["ImageTag"], digest)
        wait_signal.send_signal(handle, "SUCCESS", f"tag {props['ImageTag']} exists", _image_uri(digest))
        return {"BuildId": "", "Source": "build"}
    build = try_start(clients["codebuild"], build_request(props, event["RequestId"]))
    return {"BuildId": build["id"], "Source": "build"} if build else {**_pending(now), "Source": "build"}


def check_build(
    clients: Any, props: dict[str, Any], build_id: str, now: datetime | None = None
) -> dict[str, Any]:
    """Poll a staging build: not complete while it runs, its outputs once it succeeded, raise otherwise."""
    codebuild = clients["codebuild"]
    builds = codebuild.batch_get_builds(ids=[build_id]).get("builds", [])
    if not builds:
        raise BuildFailedError(f"CodeBuild build {build_id} not found")
    build = builds[0]
    status = build["buildStatus"]
    logs = build.get("logs", {}).get("deepLink", "(no logs link)")
    if status == "IN_PROGRESS":
        now = now or datetime.now(UTC)
        # The build's own limits (what StartBuild gave it), not the request's.
        budget = int(build["queuedTimeoutInMinutes"]) + int(build["timeoutInMinutes"])
        if now > build["startTime"] + timedelta(minutes=budget) + deadline_grace():
            codebuild.stop_build(id=build_id)
            raise BuildFailedError(
                f"CodeBuild build {build_id} still running after {budget} min (queue + timeout) plus "
                f"{deadline_grace()}; stopped it. Logs: {logs}"
            )
        LOG.info("build %s in phase %s", build_id, build.get("currentPhase"))
        return {"IsComplete": False}
    if status in FAILED_STATES:
        failed = [p for p in build.get("phases", []) if p.get("phaseStatus") not in (None, "SUCCEEDED")]
        detail = ""
        if failed:
            phase = failed[0]
            messages = "; ".join(c.get("message", "") for c in phase.get("contexts", []) if c.get("message"))
            detail = f" in phase {phase['phaseType']}" + (f": {messages}" if messages else "")
        raise BuildFailedError(f"CodeBuild build {build_id} ended {status}{detail}. Logs: {logs}")
    if status != "SUCCEEDED":
        raise BuildFailedError(f"CodeBuild build {build_id} has unexpected status {status}. Logs: {logs}")
    if not staged_model_present(clients["s3"], props):
        raise BuildFailedError(
            f"CodeBuild build {build_id} succeeded but {_model_uri(props)}{props['File']} (or its "
            f"{_archive_key(props) or 'archive'}) is missing or has another sha256, or the prefix still "
            f"holds a {LEGACY_ARCHIVE}. Logs: {logs}"
        )
    return {"IsComplete": True, "Data": _model_outputs(props)}


def parse_wait_data(text: str) -> str:
    """The image URI from a wait condition's `Data` attribute (a JSON object: signal id → data)."""
    try:
        signals = json.loads(text)
    except ValueError:
        raise BuildFailedError(f"the image wait condition returned no JSON: {text[:200]!r}") from None
    value = signals.get(wait_signal.SIGNAL_ID) if isinstance(signals, dict) else None
    if not isinstance(value, str) or not image_retention.IMAGE_URI_RE.match(value):
        raise BuildFailedError(f"the image wait condition carried no image by digest: {text[:300]!r}")
    return value


def deployed_image(clients: Any, event: dict[str, Any]) -> dict[str, Any]:
    """Resolve, check and protect the image the endpoint will run.

    A signalled image (`WaitData`) is checked against what ECR and the stack's record hold, not taken
    from the signal: a built one must be its content tag's own image, built for that tag
    (image_provenance.py); a kept pinned one must be the one the last deploy recorded. A request of an
    earlier version (no `ImageTag`) and a URI fixed at synth (`ImageUri`) are only checked to exist.
    """
    props = event["ResourceProperties"]
    uri = props.get("ImageUri") or parse_wait_data(props["WaitData"])
    image = image_retention.parse_image_uri(uri)
    repository = build_jobs.repository()[0]
    if "WaitData" in props and props.get("ImageTag"):
        try:
            _check_signalled(clients, props, image, uri)
        except image_provenance.ProvenanceError as error:
            raise BuildFailedError(f"cannot deploy {uri}: {error}") from error
    # The provider runs in ImageStack's account and region: its function ARN says which.
    _, _, _, region, account, *_ = props["ServiceToken"].split(":")
    if (image.account, image.region, image.repository) != (account, region, repository):
        LOG.info("%s is not in ImageStack's repository; its lifecycle policy is not this app's", uri)
        return {"ImageUri": uri, "Protected": "false"}
    try:
        added = image_retention.protect_image(clients["ecr"], image)
    except image_retention.ImageNotFoundError as error:
        raise BuildFailedError(f"cannot deploy {uri}: {error}") from error
    LOG.info("%s %s tag %s", uri, "got" if added else "already had", image.keep_tag)
    return {"ImageUri": uri, "Protected": "true"}


def _check_signalled(clients: Any, props: dict[str, Any], image: image_retention.ImageRef, uri: str) -> None:
    """Raise ProvenanceError unless the signalled image is what the request says it must be."""
    if props.get("ImageSource") == "pinned":
        pinned = pinned_image(clients["ssm"], props["DeployedImageParameter"])
        if uri != pinned:
            raise image_provenance.ProvenanceError(
                f"the wait condition was signalled a kept image, but the stack's record "
                f"{props['DeployedImageParameter']} pins {pinned or 'none'}"
            )
        return
    name, repository_uri = build_jobs.repository()
    if uri != f"{repository_uri}@{image.digest}":
        raise image_provenance.ProvenanceError(f"a built image lives in {repository_uri}")
    image_provenance.check_built_image(clients["ecr"], name, props["ImageTag"], image.digest)


# --- provider framework entry points -----------------------------------------------------------------


def on_event(
    event: dict[str, Any], _context: Any = None, clients: Any = None, now: datetime | None = None
) -> dict[str, Any]:
    """Create/Update start (or settle) the job; Delete keeps what was built."""
    request = event["RequestType"]
    props = event["ResourceProperties"]
    # Not logged: the buildspec (long) and the wait handle (a presigned URL that can signal the stack).
    LOG.info(
        "%s %s",
        request,
        {k: v for k, v in props.items() if k not in {"ServiceToken", "Buildspec", "WaitHandle"}},
    )
    clients = clients if clients is not None else Clients()
    if request == "Delete":
        if props.get("Kind") == "Image" and props.get("WaitHandle"):
            stop_abandoned_builds(clients, props)
        return {"PhysicalResourceId": event["PhysicalResourceId"]}
    now = now or datetime.now(UTC)
    kind = props["Kind"]
    if kind == "Model":
        data = start_model(clients, event, now)
    elif kind == "Image":
        data = start_image(clients, event, now)
    elif kind == "DeployedImage":
        data = deployed_image(clients, event)
    elif kind == "PostDeployCheck":
        data = post_deploy_check.start(clients, event, now)
    elif kind == "BakeLoad":
        data = bake_load.start(clients, event, now)
    elif kind == "UpdateGuard":
        data = update_guard.start(clients, event)
    else:
        raise ValueError(f"unknown job kind {kind!r}")
    return {"PhysicalResourceId": _physical_id(props), "Data": data}


def is_complete(
    event: dict[str, Any], context: Any = None, clients: Any = None, now: datetime | None = None
) -> dict[str, Any]:
    """Done when the job's result exists; raises (and so fails the resource) when it cannot. The
    handlers that call sagemaker-runtime start a call only while this Lambda's time left (`context`)
    holds it and what must follow it (parking): a Lambda timeout would fail the resource at once."""
    if event["RequestType"] == "Delete":
        return {"IsComplete": True}
    props = event["ResourceProperties"]
    data = dict(event.get("Data") or {})
    clients = clients if clients is not None else Clients()
    now = now or datetime.now(UTC)
    kind = props["Kind"]
    if kind == "PostDeployCheck":
        return post_deploy_check.check(clients, props, data, now, time_left=runtime_client.time_left(context))
    if kind == "BakeLoad":
        return bake_load.check(clients, props, data, now, time_left=runtime_client.time_left(context))
    if kind in ("DeployedImage", "UpdateGuard"):
        return {"IsComplete": True, "Data": data}
    build_id = data.get("BuildId", "")
    if data.get("Pending"):
        build = resume_pending(clients, event, data, now)
        if build is None:
            return {"IsComplete": False}
        build_id = build["id"]
    if kind == "Image":  # started (or settled): the wait condition waits for the image itself
        return {"IsComplete": True, "Data": {"BuildId": build_id, "Source": data.get("Source", "build")}}
    if not build_id:
        return {"IsComplete": True, "Data": {k: v for k, v in data.items() if k != "BuildId"}}
    return check_build(clients, props, build_id, now)
