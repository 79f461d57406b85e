"""Deploy-time CodeBuild jobs behind a CloudFormation custom resource (CDK provider framework).

Two kinds of job, both idempotent and keyed by immutable inputs:

* `Image`: build the container image for one variant from the container source asset and push it
  with the tag `<variant>-<source hash>`. Returns `ImageUri` = `<repository uri>@sha256:<digest>`.
  If the tag already exists (immutable tags), its digest is returned without building.
* `Model`: stage the pinned GGUF from Hugging Face into the artifacts bucket and check its size and
  sha256. Returns `ModelS3Uri` (the uncompressed S3 prefix). If the object is already there with
  the expected sha256 metadata, nothing is downloaded.

`on_event` starts the job; the provider framework then calls `is_complete` every 30 s until it
returns IsComplete (it raises when the build failed, stopped or ran past its deadline, which fails
the CloudFormation resource and rolls the stack back). Deleting the resource keeps the image and
the model: live endpoints and rollbacks still need them.
"""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
from botocore.exceptions import ClientError

LOG = logging.getLogger()
LOG.setLevel(logging.INFO)

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
FAILED_STATES = frozenset({"FAILED", "FAULT", "STOPPED", "TIMED_OUT"})
# Queue time and provisioning come on top of the build's own timeout.
DEADLINE_GRACE = timedelta(minutes=15)


class BuildFailedError(RuntimeError):
    """The CodeBuild build did not succeed; the message says why and where its logs are."""


def _clients() -> dict[str, Any]:
    return {name: boto3.client(name) for name in ("codebuild", "ecr", "s3")}


def _env(pairs: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": name, "value": str(value), "type": "PLAINTEXT"} for name, value in pairs.items()]


def _image_uri(props: dict[str, Any], digest: str) -> str:
    return f"{props['RepositoryUri']}@{digest}"


def _model_uri(props: dict[str, Any]) -> str:
    return f"s3://{props['Bucket']}/{props['Prefix']}"


def _physical_id(props: dict[str, Any]) -> str:
    if props["Kind"] == "Image":
        return f"{props['RepositoryUri']}:{props['ImageTag']}"
    return f"{_model_uri(props)}{props['File']}"


def existing_image_digest(ecr: Any, props: dict[str, Any]) -> str | None:
    """The digest of the already pushed tag, or None."""
    try:
        response = ecr.describe_images(
            repositoryName=props["RepositoryName"], imageIds=[{"imageTag": props["ImageTag"]}]
        )
    except ClientError as error:
        if error.response["Error"]["Code"] == "ImageNotFoundException":
            return None
        raise
    details = response.get("imageDetails", [])
    return details[0]["imageDigest"] if details else None


def staged_model_present(s3: Any, props: dict[str, Any]) -> bool:
    """True when the GGUF is already in the bucket with the pinned sha256 and size."""
    try:
        head = s3.head_object(Bucket=props["Bucket"], Key=f"{props['Prefix']}{props['File']}")
    except ClientError as error:
        if error.response["Error"]["Code"] in {"404", "NoSuchKey", "NotFound"}:
            return False
        raise
    return head.get("Metadata", {}).get("sha256") == props["Sha256"] and int(head["ContentLength"]) == int(
        props["SizeBytes"]
    )


def start_job(clients: dict[str, Any], props: dict[str, Any]) -> dict[str, Any]:
    """Start the build unless its result already exists; returns the provider's response Data."""
    codebuild = clients["codebuild"]
    common = {
        "projectName": props["ProjectName"],
        "timeoutInMinutesOverride": int(props["TimeoutMinutes"]),
    }
    if props["Kind"] == "Image":
        digest = existing_image_digest(clients["ecr"], props)
        if digest:
            LOG.info(
                "image %s:%s exists (%s); not rebuilding", props["RepositoryName"], props["ImageTag"], digest
            )
            return {"BuildId": "", "ImageDigest": digest, "ImageUri": _image_uri(props, digest)}
        build = codebuild.start_build(
            **common,
            sourceTypeOverride="S3",
            sourceLocationOverride=f"{props['SourceBucket']}/{props['SourceKey']}",
            computeTypeOverride=props["ComputeType"],
            environmentVariablesOverride=_env(
                {
                    "REPOSITORY_URI": props["RepositoryUri"],
                    "IMAGE_TAG": props["ImageTag"],
                    "VARIANT": props["Variant"],
                    "EXTRA_BUILD_ARGS": props.get("BuildArgs", ""),
                }
            ),
        )["build"]
    elif props["Kind"] == "Model":
        if staged_model_present(clients["s3"], props):
            LOG.info("model %s%s already staged; not downloading", _model_uri(props), props["File"])
            return {"BuildId": "", "ModelS3Uri": _model_uri(props)}
        build = codebuild.start_build(
            **common,
            environmentVariablesOverride=_env(
                {
                    "ARTIFACTS_BUCKET": props["Bucket"],
                    "MODEL_PREFIX": props["Prefix"],
                    "MODEL_REPOSITORY": props["Repository"],
                    "MODEL_REVISION": props["Revision"],
                    "MODEL_FILE": props["File"],
                    "MODEL_SIZE_BYTES": props["SizeBytes"],
                    "MODEL_SHA256": props["Sha256"],
                }
            ),
        )["build"]
    else:
        raise ValueError(f"unknown job kind {props['Kind']!r}")
    LOG.info("started build %s", build["id"])
    return {"BuildId": build["id"]}


def check_job(
    clients: dict[str, Any], props: dict[str, Any], build_id: str, now: datetime | None = None
) -> dict[str, Any]:
    """Poll one build: IsComplete False while it runs, the outputs when it succeeded, raise otherwise."""
    codebuild = clients["codebuild"]
    builds = codebuild.batch_get_builds(ids=[build_id]).get("builds", [])
    if not builds:
        raise BuildFailedError(f"CodeBuild build {build_id} not found")
    build = builds[0]
    status = build["buildStatus"]
    logs = build.get("logs", {}).get("deepLink", "(no logs link)")
    if status == "IN_PROGRESS":
        now = now or datetime.now(UTC)
        deadline = build["startTime"] + timedelta(minutes=int(props["TimeoutMinutes"])) + DEADLINE_GRACE
        if now > deadline:
            codebuild.stop_build(id=build_id)
            raise BuildFailedError(
                f"CodeBuild build {build_id} still running after {props['TimeoutMinutes']} min "
                f"plus {DEADLINE_GRACE}; stopped it. Logs: {logs}"
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
    exported = {v["name"]: v.get("value", "") for v in build.get("exportedEnvironmentVariables", [])}
    if props["Kind"] == "Image":
        digest = exported.get("IMAGE_DIGEST", "")
        if not DIGEST_RE.match(digest):
            raise BuildFailedError(
                f"CodeBuild build {build_id} succeeded but exported no image digest "
                f"(got {digest!r}). Logs: {logs}"
            )
        return {"IsComplete": True, "Data": {"ImageDigest": digest, "ImageUri": _image_uri(props, digest)}}
    if not staged_model_present(clients["s3"], props):
        raise BuildFailedError(
            f"CodeBuild build {build_id} succeeded but {_model_uri(props)}{props['File']} is missing or has "
            f"another sha256. Logs: {logs}"
        )
    return {"IsComplete": True, "Data": {"ModelS3Uri": _model_uri(props)}}


def on_event(
    event: dict[str, Any], _context: Any = None, clients: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Provider framework onEvent: Create/Update start the job; Delete keeps what was built."""
    request = event["RequestType"]
    props = event["ResourceProperties"]
    LOG.info("%s %s", request, {k: v for k, v in props.items() if k != "ServiceToken"})
    if request == "Delete":
        return {"PhysicalResourceId": event["PhysicalResourceId"]}
    data = start_job(clients or _clients(), props)
    return {"PhysicalResourceId": _physical_id(props), "Data": data}


def is_complete(
    event: dict[str, Any], _context: Any = None, clients: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Provider framework isComplete: done when the build succeeded (or nothing had to be built)."""
    if event["RequestType"] == "Delete":
        return {"IsComplete": True}
    data = event.get("Data") or {}
    build_id = data.get("BuildId", "")
    if not build_id:
        return {"IsComplete": True, "Data": {k: v for k, v in data.items() if k != "BuildId"}}
    return check_job(clients or _clients(), event["ResourceProperties"], build_id)
