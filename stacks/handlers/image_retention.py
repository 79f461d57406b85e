"""Keeping deployed images out of reach of the ECR lifecycle policy.

A deployed (or promoted) image gets one extra, immutable tag `keep-<digest hex>`. ImageStack's
lifecycle policy has its highest-priority rule on the `keep-` prefix with a count no repository
reaches, and "an image that matches the tagging requirements of a higher priority rule cannot be
expired by a rule with a lower priority" (Amazon ECR User Guide, lifecycle policy evaluation rules).
So a digest that an endpoint config references can always be pulled again for a scale-out or an
instance replacement. Used by the stacks (DeployedImage custom resource) and by `promote apply`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

LOG = logging.getLogger(__name__)

KEEP_TAG_PREFIX = "keep-"
MANIFEST_TYPES = [  # BatchGetImage's acceptedMediaTypes: every single-image and index manifest we push
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
]
IMAGE_URI_RE = re.compile(
    r"^(?P<account>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9\-]+)\.amazonaws\.com(?:\.cn)?"
    r"/(?P<repository>[a-z0-9][a-z0-9._\-/]*)@sha256:(?P<hex>[0-9a-f]{64})$"
)


class ImageNotFoundError(RuntimeError):
    """The digest is not in the repository it names."""


@dataclass(frozen=True)
class ImageRef:
    account: str
    region: str
    repository: str
    digest: str  # sha256:<hex>

    @property
    def keep_tag(self) -> str:
        return f"{KEEP_TAG_PREFIX}{self.digest.removeprefix('sha256:')}"


def parse_image_uri(uri: str) -> ImageRef:
    """`<account>.dkr.ecr.<region>.amazonaws.com/<repo>@sha256:<hex>` → ImageRef; ValueError otherwise."""
    match = IMAGE_URI_RE.match(uri)
    if not match:
        raise ValueError(f"{uri!r} is not a private ECR image by digest")
    return ImageRef(match["account"], match["region"], match["repository"], f"sha256:{match['hex']}")


def protect_image(ecr: Any, image: ImageRef) -> bool:
    """Tag the image `keep-<digest>` (idempotent). True when the tag was added, False when it was there.

    Raises ImageNotFoundError when the repository has no such digest.
    """
    try:
        found = ecr.batch_get_image(
            repositoryName=image.repository,
            imageIds=[{"imageDigest": image.digest}],
            acceptedMediaTypes=MANIFEST_TYPES,
        )
    except ClientError as error:
        if error.response["Error"]["Code"] == "RepositoryNotFoundException":
            raise ImageNotFoundError(f"repository {image.repository} does not exist") from error
        raise
    images = found.get("images", [])
    if not images:
        reasons = "; ".join(f.get("failureReason", "") for f in found.get("failures", []))
        raise ImageNotFoundError(f"{image.repository}@{image.digest} not found ({reasons or 'no image'})")
    manifest = images[0]
    kwargs = {
        "repositoryName": image.repository,
        "imageManifest": manifest["imageManifest"],
        "imageTag": image.keep_tag,
        "imageDigest": image.digest,
    }
    if manifest.get("imageManifestMediaType"):
        kwargs["imageManifestMediaType"] = manifest["imageManifestMediaType"]
    try:
        ecr.put_image(**kwargs)
    except ClientError as error:  # the tag derives from the digest: an existing one is ours
        if error.response["Error"]["Code"] in {
            "ImageAlreadyExistsException",
            "ImageTagAlreadyExistsException",
        }:
            return False
        raise
    LOG.info("protected %s@%s with tag %s", image.repository, image.digest, image.keep_tag)
    return True
