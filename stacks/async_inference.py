"""Asynchronous inference for long work (`<variant>.invocation=async`; issue 18, item 4).

An endpoint config with `AsyncInferenceConfig` takes only `InvokeEndpointAsync`: the request body is
read from S3 (`X-Amzn-SageMaker-InputLocation`), the answer is written to S3, and SNS says when. This
construct adds, to the variant's `DeciderEndpoint` (through the L1 escape hatches, so the real-time
construct is unchanged):

- `AsyncInferenceConfig`: output and failure paths under `async/<endpoint>/` in the artifacts bucket,
  SNS success and error topics (customer key, TLS only) with the inference response included,
  `MaxConcurrentInvocationsPerInstance` from the container's capacity (its queue size);
- the execution role's grants: read `async/<endpoint>/input/`, write the output and failure paths,
  publish to the two topics;
- autoscaling that can go to zero: MinCapacity 0, target tracking on
  `ApproximateBacklogSizePerInstance` instead of invocations per instance, and a step policy on the
  `HasBacklogWithoutCapacity` alarm that adds an instance when requests wait and none runs;
- the container's deadline: the invocation timeout less 5 s (instead of 55 s), so a
  `/v1/systemone/batch` of 64 states or a 255-option question on CPU can finish.
"""

from __future__ import annotations

from aws_cdk import Aws, CfnOutput, Duration, RemovalPolicy, Stack
from aws_cdk import aws_applicationautoscaling as appscaling
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sagemaker as sagemaker
from aws_cdk import aws_sns as sns
from constructs import Construct

from decider.settings import Settings
from decider_stacks.config import VariantConfig, async_prefix
from decider_stacks.endpoint import DeciderEndpoint
from decider_stacks.nag import acknowledge

ANSWER_MARGIN_S = 5  # the container answers this long before SageMaker's invocation timeout
DEADLINE_ENV = "DECIDER_DEADLINE_SECONDS"


def async_environment(variant: VariantConfig, environment: dict[str, str]) -> dict[str, str]:
    """The container's environment for an async variant: the deadline follows the invocation timeout
    (unless `container.deadline_seconds` is set)."""
    if variant.invocation != "async" or "deadline_seconds" in variant.container:
        return environment
    deadline = max(1, variant.async_inference.invocation_timeout_s - ANSWER_MARGIN_S)
    return {**environment, DEADLINE_ENV: f"{float(deadline)}"}


def max_concurrent_invocations(variant: VariantConfig, settings: Settings) -> int:
    configured = variant.async_inference.max_concurrent_invocations_per_instance
    return configured if configured is not None else max(1, min(1000, settings.queue_size))


class AsyncInference(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint: DeciderEndpoint,
        variant: VariantConfig,
        bucket_name: str,
        settings: Settings,
    ) -> None:
        super().__init__(scope, construct_id)
        self.variant = variant
        name = variant.endpoint_name
        prefix = async_prefix(name)
        self.output_uri = f"s3://{bucket_name}/{prefix}output"
        self.failure_uri = f"s3://{bucket_name}/{prefix}failure"
        self.input_uri = f"s3://{bucket_name}/{prefix}input/"
        self.key = kms.Key(
            self,
            "Key",
            description=f"Encrypts the async inference notifications of the {name} endpoint",
            enable_key_rotation=True,
            removal_policy=RemovalPolicy.DESTROY,
            pending_window=Duration.days(7),
        )
        self.success_topic = sns.Topic(
            self, "Success", display_name=f"{name} async results", master_key=self.key, enforce_ssl=True
        )
        self.error_topic = sns.Topic(
            self, "Error", display_name=f"{name} async failures", master_key=self.key, enforce_ssl=True
        )
        self._grant(endpoint.execution.role, bucket_name, prefix)
        endpoint.endpoint_config.async_inference_config = (
            sagemaker.CfnEndpointConfig.AsyncInferenceConfigProperty(
                output_config=sagemaker.CfnEndpointConfig.AsyncInferenceOutputConfigProperty(
                    s3_output_path=self.output_uri,
                    s3_failure_path=self.failure_uri,
                    notification_config=sagemaker.CfnEndpointConfig.AsyncInferenceNotificationConfigProperty(
                        success_topic=self.success_topic.topic_arn,
                        error_topic=self.error_topic.topic_arn,
                        include_inference_response_in=[
                            "SUCCESS_NOTIFICATION_TOPIC",
                            "ERROR_NOTIFICATION_TOPIC",
                        ],
                    ),
                ),
                client_config=sagemaker.CfnEndpointConfig.AsyncInferenceClientConfigProperty(
                    max_concurrent_invocations_per_instance=max_concurrent_invocations(variant, settings)
                ),
            )
        )
        if variant.autoscaling:
            self._scale_to_zero(endpoint)
        stack = Stack.of(self)
        CfnOutput(
            stack, "AsyncInputS3Uri", value=self.input_uri, description="Upload async request bodies here"
        )
        CfnOutput(stack, "AsyncOutputS3Uri", value=self.output_uri, description="Async answers")
        CfnOutput(
            stack, "AsyncSuccessTopicArn", value=self.success_topic.topic_arn, description="Async results"
        )
        CfnOutput(stack, "AsyncErrorTopicArn", value=self.error_topic.topic_arn, description="Async failures")

    def _grant(self, role: iam.Role, bucket_name: str, prefix: str) -> None:
        bucket_arn = Stack.of(self).format_arn(service="s3", region="", account="", resource=bucket_name)
        role.add_to_policy(
            iam.PolicyStatement(
                sid="ReadAsyncInput", actions=["s3:GetObject"], resources=[f"{bucket_arn}/{prefix}input/*"]
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                sid="WriteAsyncOutput",
                actions=["s3:PutObject", "s3:AbortMultipartUpload"],
                resources=[f"{bucket_arn}/{prefix}output/*", f"{bucket_arn}/{prefix}failure/*"],
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                sid="NotifyAsync",
                actions=["sns:Publish"],
                resources=[self.success_topic.topic_arn, self.error_topic.topic_arn],
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                sid="UseAsyncTopicKey",
                actions=["kms:Decrypt", "kms:GenerateDataKey*"],
                resources=[self.key.key_arn],
            )
        )
        bucket_token = bucket_name.replace(Aws.ACCOUNT_ID, "<AWS::AccountId>").replace(
            Aws.REGION, "<AWS::Region>"
        )
        for suffix, why in (
            ("input/*", "reads the request bodies clients put there (X-Amzn-SageMaker-InputLocation)"),
            ("output/*", "writes each answer under a name it chooses per request"),
            ("failure/*", "writes each failed request's error under a name it chooses"),
        ):
            acknowledge(
                role,
                f"AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:s3:::{bucket_token}/{prefix}{suffix}]",
                f"Async inference {why}; nothing outside this endpoint's async prefix.",
            )
        acknowledge(
            role,
            "AwsSolutions-IAM5[Action::kms:GenerateDataKey*]",
            "Publishing to the KMS-encrypted async topics needs GenerateDataKey* on their one key.",
        )

    def _scale_to_zero(self, endpoint: DeciderEndpoint) -> None:
        variant = self.variant
        settings = variant.async_inference
        name = variant.endpoint_name
        endpoint.scalable_target.min_capacity = settings.min_capacity
        dimension = appscaling.CfnScalingPolicy.MetricDimensionProperty(name="EndpointName", value=name)
        policy = endpoint.scaling_policy
        policy.policy_name = f"{name}-backlog-per-instance"
        tracking = appscaling.CfnScalingPolicy.TargetTrackingScalingPolicyConfigurationProperty
        policy.target_tracking_scaling_policy_configuration = tracking(
            target_value=settings.backlog_per_instance,
            customized_metric_specification=appscaling.CfnScalingPolicy.CustomizedMetricSpecificationProperty(
                metric_name="ApproximateBacklogSizePerInstance",
                namespace="AWS/SageMaker",
                dimensions=[dimension],
                statistic="Average",
            ),
            scale_in_cooldown=variant.scale_in_cooldown_s,
            scale_out_cooldown=variant.scale_out_cooldown_s,
        )
        self.scale_up = appscaling.CfnScalingPolicy(
            self,
            "ScaleUpFromZero",
            policy_name=f"{name}-has-backlog-without-capacity",
            policy_type="StepScaling",
            scaling_target_id=endpoint.scalable_target.ref,
            step_scaling_policy_configuration=appscaling.CfnScalingPolicy.StepScalingPolicyConfigurationProperty(
                adjustment_type="ChangeInCapacity",
                cooldown=settings.scale_up_from_zero_cooldown_s,
                metric_aggregation_type="Average",
                step_adjustments=[
                    appscaling.CfnScalingPolicy.StepAdjustmentProperty(
                        metric_interval_lower_bound=0, scaling_adjustment=1
                    )
                ],
            ),
        )
        self.backlog_alarm = cloudwatch.CfnAlarm(
            self,
            "HasBacklogWithoutCapacity",
            alarm_description=f"{name}: async requests wait and no instance runs; scale up from zero",
            namespace="AWS/SageMaker",
            metric_name="HasBacklogWithoutCapacity",
            dimensions=[cloudwatch.CfnAlarm.DimensionProperty(name="EndpointName", value=name)],
            statistic="Average",
            period=60,
            evaluation_periods=2,
            datapoints_to_alarm=2,
            threshold=1,
            comparison_operator="GreaterThanOrEqualToThreshold",
            treat_missing_data="missing",
            alarm_actions=[self.scale_up.ref],
        )
