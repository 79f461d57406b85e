"""Opt-in grants for the ways of calling a variant besides InvokeEndpoint (issue 18).

Both are off by default, so the default templates grant nothing more than before:

- `<variant>.batch_transform=true`: the execution role (which Batch Transform jobs of the stack's
  Model run as) may read `s3://<artifacts>/batch/<endpoint>/input/` and write
  `s3://<artifacts>/batch/<endpoint>/output/`, and write its job logs
  (`/aws/sagemaker/TransformJobs`, streams of jobs named `decide-<variant>-…`, `decide-batch`'s names).
- `<variant>.openai_path_policy=true`: a managed policy for callers of SageMaker's OpenAI-compatible
  chat path (`…/endpoints/<endpoint>/openai/v1/chat/completions` with a bearer token):
  `sagemaker:CallWithBearerToken` (which takes `Resource: "*"` only) and `sagemaker:InvokeEndpoint` on
  this endpoint alone; its ARN is an output, to attach to the callers' roles.
"""

from __future__ import annotations

from aws_cdk import ArnFormat, Aws, CfnOutput, Stack
from aws_cdk import aws_iam as iam
from constructs import Construct

from decider_stacks.config import VariantConfig
from decider_stacks.nag import acknowledge

TRANSFORM_LOG_GROUP = "/aws/sagemaker/TransformJobs"


def batch_prefix(endpoint_name: str) -> str:
    return f"batch/{endpoint_name}/"


def grant_batch_transform(role: iam.Role, *, variant: VariantConfig, bucket_name: str) -> None:
    """S3 read on the job input, write on its output, and the job's logs, for decide-batch."""
    stack = Stack.of(role)
    bucket_arn = stack.format_arn(service="s3", region="", account="", resource=bucket_name)
    prefix = batch_prefix(variant.endpoint_name)
    role.add_to_policy(
        iam.PolicyStatement(
            sid="ReadBatchInput", actions=["s3:GetObject"], resources=[f"{bucket_arn}/{prefix}input/*"]
        )
    )
    role.add_to_policy(
        iam.PolicyStatement(
            sid="ListBatchInput",
            actions=["s3:ListBucket"],
            resources=[bucket_arn],
            conditions={"StringLike": {"s3:prefix": [f"{prefix}input/*", f"{prefix}output/*"]}},
        )
    )
    role.add_to_policy(
        iam.PolicyStatement(
            sid="WriteBatchOutput",
            actions=["s3:PutObject", "s3:AbortMultipartUpload"],
            resources=[f"{bucket_arn}/{prefix}output/*"],
        )
    )
    log_group_arn = stack.format_arn(
        service="logs",
        resource="log-group",
        resource_name=TRANSFORM_LOG_GROUP,
        arn_format=ArnFormat.COLON_RESOURCE_NAME,
    )
    streams = f"{log_group_arn}:log-stream:decide-{variant.name}-*"
    role.add_to_policy(
        iam.PolicyStatement(
            sid="WriteBatchLogs",
            actions=[
                "logs:CreateLogGroup",
                "logs:CreateLogStream",
                "logs:PutLogEvents",
                "logs:DescribeLogStreams",
            ],
            resources=[log_group_arn, streams],
        )
    )
    bucket_token = bucket_name.replace(Aws.ACCOUNT_ID, "<AWS::AccountId>").replace(
        Aws.REGION, "<AWS::Region>"
    )
    for resource, why in (
        (f"arn:<AWS::Partition>:s3:::{bucket_token}/{prefix}input/*", "reads the job's input objects"),
        (
            f"arn:<AWS::Partition>:s3:::{bucket_token}/{prefix}output/*",
            "writes one .out object per input object",
        ),
        (
            f"arn:<AWS::Partition>:logs:<AWS::Region>:<AWS::AccountId>:log-group:{TRANSFORM_LOG_GROUP}"
            f":log-stream:decide-{variant.name}-*",
            "writes the log streams Batch Transform names after each decide-batch job and instance",
        ),
    ):
        acknowledge(
            role,
            f"AwsSolutions-IAM5[Resource::{resource}]",
            f"Batch Transform (batch_transform=true) {why}; nothing outside this endpoint's batch prefix.",
        )


class OpenAiPathPolicy(Construct):
    """What a caller of SageMaker's OpenAI-compatible chat path needs, and nothing else."""

    def __init__(self, scope: Construct, construct_id: str, *, variant: VariantConfig) -> None:
        super().__init__(scope, construct_id)
        endpoint_arn = Stack.of(self).format_arn(
            service="sagemaker", resource="endpoint", resource_name=variant.endpoint_name.lower()
        )
        self.policy = iam.ManagedPolicy(
            self,
            "Policy",
            description=f"Call {variant.endpoint_name}'s OpenAI-compatible chat path (bearer token)",
            statements=[
                iam.PolicyStatement(
                    sid="BearerToken", actions=["sagemaker:CallWithBearerToken"], resources=["*"]
                ),
                iam.PolicyStatement(
                    sid="InvokeThisEndpoint",
                    actions=["sagemaker:InvokeEndpoint", "sagemaker:InvokeEndpointWithResponseStream"],
                    resources=[endpoint_arn],
                ),
            ],
        )
        acknowledge(
            self.policy,
            "AwsSolutions-IAM5[Resource::*]",
            "sagemaker:CallWithBearerToken has no resource-level permissions (Resource must be *); "
            "InvokeEndpoint is limited to this endpoint.",
        )
        CfnOutput(
            Stack.of(self),
            "OpenAiPathPolicyArn",
            value=self.policy.managed_policy_arn,
            description="Attach to callers of …/endpoints/<endpoint>/openai/v1/chat/completions",
        )
