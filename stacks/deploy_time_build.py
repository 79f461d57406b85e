"""Requests to ImageStack's build provider, made from an endpoint stack.

Each request is a custom resource whose properties are immutable inputs only (source hash, pinned
model). An unchanged input means an unchanged resource: no build and an empty diff. A changed
container gives a new tag, so CloudFormation updates the resource, the handler builds and pushes
the image, and the new digest flows into a new SageMaker model and endpoint config.

The image build may take longer than the hour a custom resource can wait (ServiceTimeout is at most
3600 s), so the `Custom::ImageBuild` resource only *starts* it; an AWS::CloudFormation::WaitCondition
(Timeout up to 43200 s) waits for the build's signal, and `Custom::DeployedImage` then checks the
signalled digest and protects it from the ECR lifecycle. A wait condition cannot be updated and a
handle must not be reused ("Anytime you add a WaitCondition resource during a stack update, you must
associate the wait condition with a new WaitConditionHandle resource", CloudFormation template
reference), so both are named after the inputs of the build: new inputs, new handle and condition.
"""

from __future__ import annotations

import hashlib
import json

from aws_cdk import CfnWaitCondition, CfnWaitConditionHandle, CustomResource, Duration, Token
from constructs import Construct

from decider_stacks.common import identity
from decider_stacks.config import (
    CUSTOM_RESOURCE_TIMEOUT_S,
    ModelArtifact,
    VariantConfig,
    archive_key,
    deployed_image_parameter,
    image_wait_minutes,
)
from decider_stacks.handlers.build_jobs import MODEL_FIELDS
from decider_stacks.image_stack import ImageStack, staging_fields


def provider_request(
    scope: Construct, image_stack: ImageStack, resource_type: str, properties: dict[str, object]
) -> CustomResource:
    """One request to ImageStack's build provider: the custom resource `Resource` under `scope`, with
    the provider's service token and the longest wait a custom resource may have."""
    return CustomResource(
        scope,
        "Resource",
        service_token=image_stack.provider.service_token,
        resource_type=resource_type,
        service_timeout=Duration.seconds(CUSTOM_RESOURCE_TIMEOUT_S),
        properties=properties,
    )


class ImageBuild(Construct):
    """Builds, reuses or keeps this variant's image; `image_uri` is `<repository uri>@sha256:<digest>`."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        image_stack: ImageStack,
        variant: VariantConfig,
        project: str,
    ):
        super().__init__(scope, construct_id)
        self.tag = image_stack.image_tag(variant)
        wait_minutes = image_wait_minutes(variant.image_build)
        # Only the tag: how it is built (project, source, buildspec, build arguments, compute) is fixed
        # in ImageStack's provider at synth (handlers/build_jobs.py), and the tag hashes all of it.
        properties = {
            "Kind": "Image",
            "ImageTag": self.tag,
            "ImageSource": variant.image_source,
            "DeployedImageParameter": deployed_image_parameter(project, variant),
        }
        # Every property of the build request, the service token and the wait's timeout name the
        # handle and the wait condition: any change to the request is an update of Custom::ImageBuild,
        # and "to update a resource with a wait condition, associate the wait condition with a new
        # WaitConditionHandle" (and a wait condition's Timeout cannot be updated).
        service_token = image_stack.provider.service_token
        # The service token is a cross-stack reference: its final form (which names ImageStack's
        # region and account) is only known once the app is synthesized, so they are named here.
        inputs = identity(
            self,
            {
                "service_token": service_token,
                "provider_environment": [image_stack.stack_name, image_stack.account, image_stack.region],
                "service_timeout_s": CUSTOM_RESOURCE_TIMEOUT_S,
                "wait_timeout_s": wait_minutes * 60,
                **properties,
            },
        )
        handle = CfnWaitConditionHandle(self, f"Handle{inputs}")
        self.resource = provider_request(
            self, image_stack, "Custom::ImageBuild", {**properties, "WaitHandle": handle.ref}
        )
        self.wait = CfnWaitCondition(
            self,
            f"Wait{inputs}",
            handle=handle.ref,
            count=1,
            timeout=str(wait_minutes * 60),
        )
        # The wait starts once the build has started (or was found unnecessary).
        self.wait.node.add_dependency(self.resource)
        self.source = self.resource.get_att_string("Source")
        self.deployed = DeployedImage(
            self,
            "Deployed",
            image_stack=image_stack,
            variant=variant,
            wait_data=Token.as_string(self.wait.attr_data),
            built={
                "ImageTag": self.tag,
                "ImageSource": self.source,
                "DeployedImageParameter": properties["DeployedImageParameter"],
            },
        )
        self.image_uri = self.deployed.image_uri


class DeployedImage(Construct):
    """The image the endpoint runs, checked in ECR and tagged `keep-<digest>` (never expired).

    A signalled image (`wait_data`) comes with what it must be (`built`: the content tag, and whether
    the build kept a pinned image): the handler checks the signal against ECR and the stack's record."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        image_stack: ImageStack,
        variant: VariantConfig,
        image_uri: str | None = None,
        wait_data: str | None = None,
        built: dict[str, str] | None = None,
    ):
        super().__init__(scope, construct_id)
        properties = {"Kind": "DeployedImage", "EndpointName": variant.endpoint_name}
        properties |= {"ImageUri": image_uri} if image_uri else {"WaitData": wait_data, **(built or {})}
        self.resource = provider_request(self, image_stack, "Custom::DeployedImage", properties)
        self.image_uri = self.resource.get_att_string("ImageUri")


class ModelStaging(Construct):
    """Stages (or finds) the pinned GGUF; `model_s3_uri` is the uncompressed S3 prefix."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        image_stack: ImageStack,
        model: ModelArtifact,
        archive: bool = False,
    ):
        """`archive`: also write the Batch Transform Model's ModelDataUrl, `model.tar.gz` beside the
        model prefix (config.archive_key: never under the prefix the endpoint mounts)."""
        super().__init__(scope, construct_id)
        self.bucket_name = image_stack.artifacts_bucket_name
        self.prefix = model.s3_prefix
        self.file = model.file
        extra = {"ArchiveKey": archive_key(model.s3_prefix)} if archive else {}
        # The model it stages (the provider stages only the one ImageStack pins: handlers/build_jobs.py);
        # the project, its buildspec and run limits are ImageStack's.
        fields = {k: v for k, v in staging_fields(model, self.bucket_name).items() if k in MODEL_FIELDS}
        self.resource = provider_request(
            self, image_stack, "Custom::ModelStaging", {"Kind": "Model", **fields, **extra}
        )
        self.model_s3_uri = self.resource.get_att_string("ModelS3Uri")
        self.archive_uri = self.resource.get_att_string("ModelArchiveUri") if archive else None


class PostDeployCheck(Construct):
    """After the endpoint update: the live config must be the stack's, and the endpoint must answer."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        image_stack: ImageStack,
        endpoint_name: str,
        endpoint_config_name: str,
        rollback_alarms: list[str],
        endpoint_config: str,
    ):
        """`endpoint_config`: this deploy's endpoint config as JSON (a token); the next deploy gets it
        in OldResourceProperties and parks on an exact copy (handlers/post_deploy_check.py)."""
        super().__init__(scope, construct_id)
        self.resource = provider_request(
            self,
            image_stack,
            "Custom::PostDeployCheck",
            {
                "Kind": "PostDeployCheck",
                "EndpointName": endpoint_name,
                "EndpointConfigName": endpoint_config_name,
                "EndpointConfig": endpoint_config,
                # A failing check waits for these to leave ALARM before the stack rolls back.
                "RollbackAlarms": rollback_alarms,
            },
        )
        self.result = self.resource.get_att_string("Result")


class BakeLoad(Construct):
    """Synthetic decision requests while the endpoint's blue/green update bakes (handlers/bake_load.py).

    It depends on the new endpoint config, as the Endpoint does, and not on the Endpoint, so
    CloudFormation runs it beside the update; its properties name the config, so every update gets one."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        image_stack: ImageStack,
        endpoint_name: str,
        endpoint_config_name: str,
        load_per_minute: int,
    ):
        super().__init__(scope, construct_id)
        self.resource = provider_request(
            self,
            image_stack,
            "Custom::BakeLoad",
            {
                "Kind": "BakeLoad",
                "EndpointName": endpoint_name,
                "EndpointConfigName": endpoint_config_name,
                "LoadPerMinute": str(load_per_minute),
            },
        )


def guard_fingerprint(variant: VariantConfig, model: object, image: str) -> str:
    """What the update guard is re-run on: the variant's whole configuration, the model and the image
    it deploys (the build's content tag, or the pinned URI), hashed at synth time. Any of them changing
    is what changes the endpoint config, so every endpoint update still runs the guard, and none of it
    waits for a deploy-time resource: the guard runs before the image build and the model staging."""
    dump = getattr(model, "model_dump", None)
    inputs = {
        "variant": variant.model_dump(mode="json"),
        "model": dump(mode="json") if dump else str(model),
        "image": image,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:32]


class UpdateGuard(Construct):
    """Before anything long runs (the image build, the model staging) and before the Endpoint is
    updated: refuse what SageMaker documents it refuses, and a blue/green peak above the quota
    (handlers/update_guard.py). Its properties are synth-time values only, so CloudFormation can
    run it first: the image build, the staging and (through the model) the Endpoint depend on it,
    and `Fingerprint` changes with everything that changes the endpoint config."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        image_stack: ImageStack,
        variant: VariantConfig,
        fingerprint: str,
    ):
        super().__init__(scope, construct_id)
        self.resource = provider_request(
            self,
            image_stack,
            "Custom::UpdateGuard",
            {
                "Kind": "UpdateGuard",
                "Variant": variant.name,
                "EndpointName": variant.endpoint_name,
                "Fingerprint": fingerprint,
                "Invocation": variant.invocation,
                "InstanceTypes": variant.instance_types,
                "Autoscaling": str(variant.autoscaling).lower(),
                "InitialInstances": str(variant.initial_instance_count),
                # The synth-time bound (2 x the largest fleet), used only when the live fleet cannot
                # be read; the guard counts the peak from DescribeEndpoint (update_guard.py).
                "PeakInstances": str(variant.blue_green_peak),
                # Consent to delete this endpoint by a rename (update_guard.py); absent unless set.
                **({"ReplaceEndpoint": variant.replace_endpoint} if variant.replace_endpoint else {}),
            },
        )
