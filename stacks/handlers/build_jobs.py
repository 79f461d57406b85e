"""The builds the provider may start, fixed at synth time.

The provider's functions can be invoked by anything allowed to call them (a custom resource of any stack
in the account names their service token). So the privileged image build takes nothing that defines it
from a request: its project, buildspec and source are the CodeBuild project's own (ImageStack sets
them), and its repository, build arguments, compute type and timeouts come from the function's
environment (`BUILD_JOBS`, written by ImageStack from the app's config, in the shape `document` gives).
A request only names the content tag it wants; a tag the app did not synthesize is refused. The model
staging likewise stages only the model the app pins.

ImageStack writes the document and the handler reads it: this module owns its shape.
"""

from __future__ import annotations

import json
import os
from typing import Any

ENV = "BUILD_JOBS"
MODEL_FIELDS = ("Bucket", "Prefix", "Repository", "Revision", "File", "SizeBytes", "Sha256")


class UnknownJobError(RuntimeError):
    """A request for a build this app did not synthesize."""


def image_recipe(
    *, variant: str, build_args: str, compute_type: str, timeout_minutes: int, queued_timeout_minutes: int
) -> dict[str, str]:
    """How one content tag is built (its VARIANT, `--build-arg`s, and how the build runs)."""
    return {
        "Variant": variant,
        "BuildArgs": build_args,
        "ComputeType": compute_type,
        "TimeoutMinutes": str(timeout_minutes),
        "QueuedTimeoutMinutes": str(queued_timeout_minutes),
    }


def document(
    *,
    image_project: str,
    repository_name: str,
    repository_uri: str,
    images: dict[str, dict[str, str]],
    model_project: str,
    model: dict[str, str],
    archive_key: str,
) -> dict[str, Any]:
    """`BUILD_JOBS`: the image builds by content tag, and the one model to stage (MODEL_FIELDS)."""
    return {
        "Image": {
            "ProjectName": image_project,
            "RepositoryName": repository_name,
            "RepositoryUri": repository_uri,
            "Tags": images,
        },
        "Model": {"ProjectName": model_project, "ArchiveKey": archive_key, **model},
    }


def synthesized() -> dict[str, Any]:
    try:
        return json.loads(os.environ[ENV])
    except KeyError:
        raise RuntimeError(f"environment variable {ENV} is not set (ImageStack sets it)") from None


def repository() -> tuple[str, str]:
    """(name, URI) of ImageStack's repository."""
    image = synthesized()["Image"]
    return image["RepositoryName"], image["RepositoryUri"]


def project(kind: str) -> str:
    """The CodeBuild project of `Image` or `Model` jobs."""
    return synthesized()[kind]["ProjectName"]


def image_job(tag: str) -> dict[str, str]:
    """The recipe of a content tag the app synthesized; UnknownJobError for any other tag."""
    image = synthesized()["Image"]
    recipe = image["Tags"].get(tag)
    if recipe is None:
        known = ", ".join(sorted(image["Tags"])) or "none"
        raise UnknownJobError(
            f"image tag {tag} is not one ImageStack was deployed with ({known}): deploy ImageStack from "
            "the same tree as this stack (`cdk deploy` deploys it first unless --exclusively is given)"
        )
    return {**recipe, "RepositoryName": image["RepositoryName"], "RepositoryUri": image["RepositoryUri"]}


def model_job(props: dict[str, Any]) -> dict[str, str]:
    """The pinned model's staging, when `props` asks for exactly it; UnknownJobError otherwise."""
    if props.get("Archive"):  # a request of an earlier version: its buildspec wrote into the prefix
        raise UnknownJobError(
            "a model staging request of an earlier version (its Batch Transform archive inside the model "
            "prefix) is not built any more: the staging project's buildspec keeps the prefix clean"
        )
    model = synthesized()["Model"]
    differ = [field for field in MODEL_FIELDS if str(props.get(field, "")) != model[field]]
    if props.get("ArchiveKey") and props["ArchiveKey"] != model["ArchiveKey"]:
        differ.append("ArchiveKey")
    if differ:
        raise UnknownJobError(
            f"the model staging request differs from the model ImageStack pins in {', '.join(differ)}: "
            "deploy ImageStack from the same tree as this stack"
        )
    return model
