"""Requests to ImageStack's build provider, made from an endpoint stack.

Each request is a custom resource whose properties are immutable inputs only (source hash, pinned
model). An unchanged input means an unchanged resource: no build and an empty diff. A changed
container gives a new tag, so CloudFormation updates the resource, the handler builds and pushes
the image, and the new digest flows into a new SageMaker model and endpoint config.
"""

from __future__ import annotations

import hashlib
import json

from aws_cdk import Aws, CustomResource
from constructs import Construct

from stacks.config import ModelArtifact, VariantConfig
from stacks.image_stack import ImageStack

MODEL_STAGING_TIMEOUT_MINUTES = 60


def image_tag(variant: VariantConfig, source_hash: str) -> str:
    """`<cpu|cuda>-<content hash of container/>`: immutable, never `latest`.

    Extra build arguments change the image without changing the source, so they are folded into
    the hash (and a change of them rebuilds).
    """
    args = variant.image_build.build_args
    if not args:
        return f"{variant.build_variant}-{source_hash}"
    digest = hashlib.sha256(json.dumps([source_hash, args], sort_keys=True).encode()).hexdigest()
    return f"{variant.build_variant}-{digest}"


class ImageBuild(Construct):
    """Builds (or finds) this variant's image; `image_uri` is `<repository uri>@sha256:<digest>`."""

    def __init__(
        self, scope: Construct, construct_id: str, *, image_stack: ImageStack, variant: VariantConfig
    ):
        super().__init__(scope, construct_id)
        self.tag = image_tag(variant, image_stack.source_hash)
        source = image_stack.container_source
        self.resource = CustomResource(
            self,
            "Resource",
            service_token=image_stack.provider.service_token,
            resource_type="Custom::ImageBuild",
            properties={
                "Kind": "Image",
                "ProjectName": image_stack.projects.image.project_name,
                "SourceBucket": source.s3_bucket_name,
                "SourceKey": source.s3_object_key,
                "RepositoryName": image_stack.repository.repository_name,
                # Same account and region as ImageStack; built here rather than split from the ARN.
                "RepositoryUri": f"{Aws.ACCOUNT_ID}.dkr.ecr.{Aws.REGION}.{Aws.URL_SUFFIX}/"
                f"{image_stack.repository.repository_name}",
                "ImageTag": self.tag,
                "Variant": variant.build_variant,
                "ComputeType": variant.image_build.compute_type,
                "TimeoutMinutes": str(variant.image_build.timeout_minutes),
                "BuildArgs": "\n".join(f"{k}={v}" for k, v in variant.image_build.build_args.items()),
            },
        )
        self.image_uri = self.resource.get_att_string("ImageUri")


class ModelStaging(Construct):
    """Stages (or finds) the pinned GGUF; `model_s3_uri` is the uncompressed S3 prefix."""

    def __init__(self, scope: Construct, construct_id: str, *, image_stack: ImageStack, model: ModelArtifact):
        super().__init__(scope, construct_id)
        self.bucket_name = image_stack.artifacts_bucket_name
        self.prefix = model.s3_prefix
        self.file = model.file
        self.resource = CustomResource(
            self,
            "Resource",
            service_token=image_stack.provider.service_token,
            resource_type="Custom::ModelStaging",
            properties={
                "Kind": "Model",
                "ProjectName": image_stack.projects.model.project_name,
                "Bucket": self.bucket_name,
                "Prefix": self.prefix,
                "Repository": model.repository,
                "Revision": model.revision,
                "File": model.file,
                "SizeBytes": str(model.size_bytes),
                "Sha256": model.sha256,
                "TimeoutMinutes": str(MODEL_STAGING_TIMEOUT_MINUTES),
            },
        )
        self.model_s3_uri = self.resource.get_att_string("ModelS3Uri")
