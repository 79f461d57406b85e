"""Is the image a deploy is about to run the one this app's build made for its content tag?

Two checks, both on what ECR holds now, neither on what a signal or a request says:

* **the tag's own digest**: the digest signalled to the wait condition must be the one the content tag
  points to (DescribeImages by tag). Anyone holding the wait handle's presigned URL could signal another
  digest of the repository;
* **built for this tag**: the image's config (its blob, fetched through GetDownloadUrlForLayer and checked
  against its sha256) carries the label `org.opencontainers.image.version` = the tag, which
  buildspec/image.yml sets on every build. A tag that someone pushed by hand, or that another tool took
  first, fails here. Tags are immutable, so such an image is never overwritten by a build: it must be
  deleted before the deploy can build the real one, and the error says how.
"""

from __future__ import annotations

import hashlib
import json
import urllib.request
from collections.abc import Callable
from typing import Any

from botocore.exceptions import ClientError

try:  # package import (tools, tests)
    from .image_retention import MANIFEST_TYPES
except ImportError:  # the Lambda asset's root
    from image_retention import MANIFEST_TYPES  # type: ignore[no-redef]

BUILT_FOR_LABEL = "org.opencontainers.image.version"  # set to IMAGE_TAG by buildspec/image.yml
INDEX_TYPES = {MANIFEST_TYPES[1], MANIFEST_TYPES[3]}
PLATFORM = {"os": "linux", "architecture": "amd64"}  # what CodeBuild's x86 image build produces
MAX_CONFIG_BYTES = 4 * 2**20
FETCH_TIMEOUT_S = 20

Fetch = Callable[[str], bytes]


class ProvenanceError(RuntimeError):
    """The image is not the one this app's build pushed for the tag; the message says what to do."""


def fetch_url(url: str) -> bytes:
    """GET a presigned ECR layer URL (https only), at most MAX_CONFIG_BYTES."""
    if not url.startswith("https://"):
        raise ProvenanceError(f"ECR gave a layer URL that is not https: {url[:80]!r}")
    with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:  # noqa: S310 - https checked
        return response.read(MAX_CONFIG_BYTES + 1)


def tag_digest(ecr: Any, repository: str, tag: str) -> str | None:
    """The digest the tag points to now, or None when the tag does not exist."""
    try:
        found = ecr.describe_images(repositoryName=repository, imageIds=[{"imageTag": tag}])
    except ClientError as error:
        if error.response["Error"]["Code"] == "ImageNotFoundException":
            return None
        raise
    details = found.get("imageDetails", [])
    return details[0]["imageDigest"] if details else None


def _manifest(ecr: Any, repository: str, digest: str) -> tuple[dict[str, Any], str]:
    found = ecr.batch_get_image(
        repositoryName=repository, imageIds=[{"imageDigest": digest}], acceptedMediaTypes=MANIFEST_TYPES
    )
    images = found.get("images", [])
    if not images:
        reasons = "; ".join(f.get("failureReason", "") for f in found.get("failures", []))
        raise ProvenanceError(f"{repository}@{digest} not found ({reasons or 'no image'})")
    manifest = json.loads(images[0]["imageManifest"])
    media_type = images[0].get("imageManifestMediaType") or manifest.get("mediaType", "")
    return manifest, media_type


def image_config(ecr: Any, repository: str, digest: str, fetch: Fetch | None = None) -> dict[str, Any]:
    """The image config (labels, platform) of `repository@digest`; of its linux/amd64 entry for an index."""
    manifest, media_type = _manifest(ecr, repository, digest)
    if media_type in INDEX_TYPES or "manifests" in manifest:
        entries = [
            entry
            for entry in manifest.get("manifests", [])
            if {k: entry.get("platform", {}).get(k) for k in PLATFORM} == PLATFORM
        ]
        if not entries:
            raise ProvenanceError(f"{repository}@{digest} is an index with no linux/amd64 image")
        manifest, _ = _manifest(ecr, repository, entries[0]["digest"])
    config_digest = manifest.get("config", {}).get("digest", "")
    if not config_digest.startswith("sha256:"):
        raise ProvenanceError(f"{repository}@{digest} has no image config in its manifest")
    url = ecr.get_download_url_for_layer(repositoryName=repository, layerDigest=config_digest)["downloadUrl"]
    blob = (fetch or fetch_url)(url)
    if len(blob) > MAX_CONFIG_BYTES or f"sha256:{hashlib.sha256(blob).hexdigest()}" != config_digest:
        raise ProvenanceError(
            f"the config of {repository}@{digest} does not match its digest {config_digest}"
        )
    return json.loads(blob)


def check_built_image(ecr: Any, repository: str, tag: str, digest: str, fetch: Fetch | None = None) -> None:
    """Raise ProvenanceError unless `digest` is what `tag` points to and its image was built for `tag`."""
    current = tag_digest(ecr, repository, tag)
    if current is None:
        raise ProvenanceError(f"the image tag {repository}:{tag} does not exist (was it deleted?)")
    if current != digest:
        raise ProvenanceError(
            f"the wait condition was signalled {digest}, but {repository}:{tag} is {current}: only the "
            "tag's own image is deployed"
        )
    config = image_config(ecr, repository, digest, fetch)
    built_for = (config.get("config") or {}).get("Labels", {}).get(BUILT_FOR_LABEL)
    platform = {k: config.get(k) for k in PLATFORM}
    if built_for != tag or platform != PLATFORM:
        raise ProvenanceError(
            f"{repository}:{tag} ({digest}) was not pushed by this app's image build for that tag "
            f"(label {BUILT_FOR_LABEL}={built_for!r}, platform {platform['os']}/{platform['architecture']}). "
            "Tags are immutable, so the build cannot replace it: delete it "
            f"(aws ecr batch-delete-image --repository-name {repository} --image-ids imageTag={tag}) "
            "and deploy again"
        )
