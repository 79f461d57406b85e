"""CpuStack / GpuStack: one SageMaker endpoint variant, its model staging and image build requests
(one after the other: new accounts often run one CodeBuild build at a time), alarms, dashboard, the
post-deploy check, the record of the deployed image (SSM) and outputs. Both stacks are this class
with a different `VariantConfig`."""

from __future__ import annotations

import json

from aws_cdk import Aws, CfnOutput, Fn, Stack, Tags
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from decider_stacks.async_inference import AsyncInference, async_environment
from decider_stacks.client_access import OpenAiPathPolicy, grant_batch_transform
from decider_stacks.config import (
    IMAGE_URI_RE,
    S3_PREFIX_RE,
    TRANSFORM_MODEL_OUTPUT,
    AppConfig,
    VariantConfig,
    archive_key,
    container_environment,
    container_settings,
    cost_tags,
    deployed_image_parameter,
)
from decider_stacks.deploy_time_build import (
    BakeLoad,
    DeployedImage,
    ImageBuild,
    ModelStaging,
    PostDeployCheck,
    UpdateGuard,
    guard_fingerprint,
)
from decider_stacks.endpoint import DeciderEndpoint, ImageLocation, ModelLocation
from decider_stacks.image_stack import ImageStack
from decider_stacks.monitoring import EndpointDashboard, unsubscribed

# A small decision request, used in the printed invoke command.
SAMPLE_DECISION = {
    "state": "Payouts failing for 3 days, losing sales!",
    "questions": {
        "refund": {"type": "noul", "instructions": "Is money back requested?"},
        "team": {
            "type": "choice",
            "instructions": "Which team owns this?",
            "criteria": {"billing": "Payments, refunds", "technical": "Bugs, outages"},
        },
    },
}


def invoke_command(endpoint_name: str, region: str) -> str:
    body = json.dumps(SAMPLE_DECISION, separators=(",", ":"))
    return (
        f"aws sagemaker-runtime invoke-endpoint --region {region} --endpoint-name {endpoint_name} "
        "--content-type application/json --accept application/json "
        "--custom-attributes route=/v1/systemone --cli-binary-format raw-in-base64-out "
        f"--body '{body}' /dev/stdout"
    )


def async_invoke_command(endpoint_name: str, region: str, timeout_s: int) -> str:
    return (
        f"decide-batch --region {region} async --endpoint {endpoint_name} --input request.json --wait  # or: "
        f"aws sagemaker-runtime invoke-endpoint-async --region {region} --endpoint-name {endpoint_name} "
        "--content-type application/json --custom-attributes route=/v1/systemone "
        f"--invocation-timeout-seconds {timeout_s} --input-location s3://…/async/{endpoint_name}/input/request.json"
    )


class EndpointStack(Stack):
    """One endpoint variant (the `variant` argument picks `cpu` or `gpu` from the config)."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: AppConfig,
        variant: VariantConfig,
        image_stack: ImageStack,
        **kwargs,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.variant = variant
        # Cost allocation (activate the keys in Billing to report by them).
        for key, value in cost_tags(config, variant).items():
            Tags.of(self).add(key, value)
        self.add_stack_dependency(image_stack, "builds the image and stages the model")

        # Refusals SageMaker documents fail first, before the image build and the model staging (up to
        # hours) and before UpdateEndpoint is called (handlers/update_guard.py): every long-running
        # resource of the stack depends on the guard, and the guard on nothing of this stack.
        image_ref = variant.image_uri or image_stack.image_tag(variant)
        self.guard = UpdateGuard(
            self,
            "UpdateGuard",
            image_stack=image_stack,
            variant=variant,
            fingerprint=guard_fingerprint(variant, config.model, image_ref),
        )
        self.staging: ModelStaging | None = None
        model = self._model(variant, config, image_stack)
        image = self._image(variant, config, image_stack)
        self.endpoint = DeciderEndpoint(
            self,
            "Decider",
            variant=variant,
            image=image,
            model=model,
            environment=async_environment(variant, container_environment(variant, config.model)),
            data_capture_bucket=image_stack.artifacts_bucket_name,
            stack_tags=cost_tags(config, variant),
        )
        self._client_access(variant, image_stack)
        self.async_inference: AsyncInference | None = None
        if variant.invocation == "async":
            self.async_inference = AsyncInference(
                self,
                "Async",
                endpoint=self.endpoint,
                variant=variant,
                bucket_name=image_stack.artifacts_bucket_name,
                settings=container_settings(variant, config.model),
            )
        self.endpoint.endpoint.node.add_dependency(self.guard)
        if image.guard is not None:  # the image is checked and protected before the model uses it
            self.endpoint.model.node.add_dependency(image.guard)
        self.dashboard = EndpointDashboard(self, "Monitoring", variant=variant, alarms=self.endpoint.alarms)
        # An async endpoint refuses InvokeEndpoint: its canary cannot be fed synchronous requests.
        if variant.deployment.synthetic_load_per_minute and variant.invocation == "realtime":
            self.bake_load = BakeLoad(
                self,
                "BakeLoad",
                image_stack=image_stack,
                endpoint_name=variant.endpoint_name,
                endpoint_config_name=self.endpoint.endpoint_config.attr_endpoint_config_name,
                load_per_minute=variant.deployment.synthetic_load_per_minute,
            )
        self.check = PostDeployCheck(
            self,
            "PostDeployCheck",
            image_stack=image_stack,
            endpoint_name=self.endpoint.endpoint.attr_endpoint_name,
            endpoint_config_name=self.endpoint.endpoint_config.attr_endpoint_config_name,
            rollback_alarms=[alarm.alarm_name for alarm in self.endpoint.alarms.rollback_alarms],
            endpoint_config=self.endpoint.config_json(),
        )
        if variant.invocation == "async":  # InvokeEndpoint is refused there: check the config only
            self.check.resource.node.default_child.add_property_override("Invocation", "async")  # type: ignore[union-attr]
        # Written only after the check passed (a rollback restores the previous value); the next
        # deploy reads it to keep an image pinned with `-c image_uri` (stacks/handlers/codebuild_job.py).
        self.record = ssm.StringParameter(
            self,
            "DeployedImageRecord",
            parameter_name=deployed_image_parameter(config.project, variant),
            description=f"Image of the last successful {variant.endpoint_name} deploy, and its source",
            string_value=Fn.join("", ['{"image_uri":"', image.uri, '","source":"', image.source, '"}']),
        )
        self.record.node.add_dependency(self.check)
        self._outputs(image, model)

    def _client_access(self, variant: VariantConfig, image_stack: ImageStack) -> None:
        """Opt-in grants for Batch Transform and SageMaker's OpenAI-compatible path (client_access.py)."""
        if variant.batch_transform:
            grant_batch_transform(
                self.endpoint.execution.role, variant=variant, bucket_name=image_stack.artifacts_bucket_name
            )
        if variant.openai_path_policy:
            OpenAiPathPolicy(self, "OpenAiPath", variant=variant)

    def _image(self, variant: VariantConfig, config: AppConfig, image_stack: ImageStack) -> ImageLocation:
        if variant.image_uri:
            match = IMAGE_URI_RE.match(variant.image_uri)
            assert match is not None  # validated by the config
            repository_arn = (
                f"arn:{Aws.PARTITION}:ecr:{match['region']}:{match['account']}:"
                f"repository/{match['repository']}"
            )
            deployed = DeployedImage(
                self, "PinnedImage", image_stack=image_stack, variant=variant, image_uri=variant.image_uri
            )
            deployed.node.add_dependency(self.guard)
            return ImageLocation(
                uri=variant.image_uri, repository_arn=repository_arn, source="pinned", guard=deployed
            )
        build = ImageBuild(
            self, "ImageBuild", image_stack=image_stack, variant=variant, project=config.project
        )
        build.node.add_dependency(self.guard)
        if self.staging is not None:  # one CodeBuild build at a time: staging first, then the image
            build.resource.node.add_dependency(self.staging)
        return ImageLocation(
            uri=build.image_uri, repository_arn=image_stack.repository.repository_arn, source=build.source
        )

    def _model(self, variant: VariantConfig, config: AppConfig, image_stack: ImageStack) -> ModelLocation:
        if variant.model_s3_uri:
            match = S3_PREFIX_RE.match(variant.model_s3_uri)
            assert match is not None  # validated by the config
            return ModelLocation(
                s3_uri=variant.model_s3_uri,
                bucket_name=match["bucket"],
                prefix=match["prefix"],
                archive_uri=f"s3://{match['bucket']}/{archive_key(match['prefix'])}"
                if variant.batch_transform
                else None,
            )
        staging = self.staging = ModelStaging(
            self, "ModelStaging", image_stack=image_stack, model=config.model, archive=variant.batch_transform
        )
        staging.node.add_dependency(self.guard)
        return ModelLocation(
            s3_uri=staging.model_s3_uri,
            bucket_name=staging.bucket_name,
            prefix=staging.prefix,
            file=staging.file,
            archive_uri=staging.archive_uri,
        )

    def _outputs(self, image: ImageLocation, model: ModelLocation) -> None:
        name = self.variant.endpoint_name
        CfnOutput(
            self, "EndpointName", value=self.endpoint.endpoint.attr_endpoint_name, description="Endpoint"
        )
        CfnOutput(
            self,
            "ExecutionRoleArn",
            value=self.endpoint.execution.role.role_arn,
            description="SageMaker execution role of the endpoint",
        )
        CfnOutput(self, "ImageUri", value=image.uri, description="Image served, by digest")
        CfnOutput(
            self,
            "ImageSource",
            value=image.source,
            description="pinned (a -c image_uri deploy, kept until -c <variant>.image_source=build) or build",
        )
        CfnOutput(self, "ModelS3Uri", value=model.s3_uri, description="Model data (uncompressed S3 prefix)")
        transform = self.endpoint.transform_model
        if transform is not None:
            CfnOutput(
                self,
                TRANSFORM_MODEL_OUTPUT,
                value=transform.attr_model_name,
                description="The Model Batch Transform jobs run (decide-batch submit): the model.tar.gz "
                "through ModelDataUrl",
            )
        CfnOutput(
            self,
            "AlarmTopicArn",
            value=self.endpoint.alarms.topic.topic_arn,
            description="Every alarm of the endpoint notifies this SNS topic",
        )
        CfnOutput(
            self,
            "AlarmSubscribers",
            value=self.variant.alarms.email or f"NONE: {unsubscribed(self.variant)}",
            description="Who hears of an ALARM (-c <variant>.alarms.email)",
        )
        if self.variant.invocation == "async":
            CfnOutput(
                self,
                "InvokeCommand",
                value=async_invoke_command(
                    name, Aws.REGION, self.variant.async_inference.invocation_timeout_s
                ),
                description="Try the async endpoint: upload a request body to AsyncInputS3Uri first",
            )
        else:
            CfnOutput(
                self,
                "InvokeCommand",
                value=invoke_command(name, Aws.REGION),
                description="Try the endpoint (decision route); "
                "drop --custom-attributes for body-shape routing",
            )
        CfnOutput(
            self,
            "DashboardUrl",
            value=f"https://console.aws.amazon.com/cloudwatch/home?region={Aws.REGION}"
            f"#dashboards:name={self.dashboard.dashboard.dashboard_name}",
            description="CloudWatch dashboard of the endpoint",
        )
