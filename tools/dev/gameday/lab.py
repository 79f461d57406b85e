"""The scratch lab of a game day: one CloudFormation stack with the smallest endpoint the app can run,
and the calls the scenarios make on it. Everything is named `gameday-<run id>` and torn down after.

The stack holds its own execution role (the model prefix read, the image pulled, the game day's S3
prefix written), a Model on the GGUF prefix (ModelDataSource, as the stacks' endpoint Model), a Model on
the prefix's `model.tar.gz` (ModelDataUrl, as the stacks' Batch Transform Model), an endpoint config,
the Endpoint (blue/green with one auto-rollback alarm the scenarios can set to ALARM) and its
scalable target. Scenarios update it with variants of the same template, as a CDK deploy would.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import ClientError

from decider_stacks.config import IMAGE_URI_RE, MODEL_ARCHIVE, S3_PREFIX_RE

SMALLEST_INSTANCE = "ml.c6i.large"  # the cheapest CPU type the CPU image runs on (stacks/instances.py)
OTHER_INSTANCE = "ml.m6i.large"  # an instance-type change for the refused-update scenario
TERMINAL = re.compile(r"(_COMPLETE|_FAILED)$")


@dataclass(frozen=True)
class Scratch:
    """What a game day runs: a scratch account's image, model prefix and a run id."""

    run_id: str
    image: str  # <account>.dkr.ecr.<region>.amazonaws.com/<repository>@sha256:<digest>
    model_s3_uri: str  # s3://bucket/prefix/ holding the GGUF and model.tar.gz
    model_file: str  # the GGUF's name in the prefix
    instance_type: str = SMALLEST_INSTANCE

    @property
    def name(self) -> str:
        return f"gameday-{self.run_id}"

    @property
    def bucket(self) -> str:
        match = S3_PREFIX_RE.match(self.model_s3_uri)
        assert match is not None, self.model_s3_uri
        return match["bucket"]

    @property
    def model_prefix(self) -> str:
        match = S3_PREFIX_RE.match(self.model_s3_uri)
        assert match is not None, self.model_s3_uri
        return match["prefix"]

    @property
    def work_prefix(self) -> str:
        """Where the game day writes (the Batch Transform input and output)."""
        return f"gameday/{self.run_id}/"

    @property
    def repository_arn(self) -> str:
        match = IMAGE_URI_RE.match(self.image)
        assert match is not None, self.image
        return f"arn:aws:ecr:{match['region']}:{match['account']}:repository/{match['repository']}"


@dataclass
class Variant:
    """What a scenario changes in the lab's template."""

    config: str = "A"  # a new letter: a new endpoint config (new logical id, new generated name)
    model_prefix: str | None = None  # another model prefix (the failed upgrade points at a missing one)
    instance_type: str | None = None
    alarm_breaching: bool = False  # the rollback alarm goes to ALARM (missing data breaches)


def template(scratch: Scratch, variant: Variant | None = None) -> dict[str, Any]:
    """The lab stack's template for `variant` (the base one by default)."""
    variant = variant or Variant()
    prefix = variant.model_prefix or scratch.model_prefix
    bucket_arn = f"arn:aws:s3:::{scratch.bucket}"
    environment = {"DECIDER_MODEL_FILE": scratch.model_file}
    role_id = "Role" + re.sub(r"[^A-Za-z0-9]", "", prefix)[-40:]  # one role per model, as the stacks
    statements = [
        {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": f"{bucket_arn}/{prefix}*"},
        {
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject"],
            "Resource": f"{bucket_arn}/{scratch.work_prefix}*",
        },
        {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": bucket_arn},
        {
            "Effect": "Allow",
            "Action": ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"],
            "Resource": scratch.repository_arn,
        },
        {
            "Effect": "Allow",
            "Action": [
                "ecr:GetAuthorizationToken",
                "cloudwatch:PutMetricData",
                "cloudwatch:DescribeAlarms",
                "logs:CreateLogGroup",
                "logs:CreateLogStream",
                "logs:PutLogEvents",
                "logs:DescribeLogStreams",
            ],
            "Resource": "*",
        },
    ]
    retain = {"DeletionPolicy": "Retain", "UpdateReplacePolicy": "Retain"}
    resources: dict[str, Any] = {
        role_id: {
            "Type": "AWS::IAM::Role",
            **retain,
            "Properties": {
                "AssumeRolePolicyDocument": {
                    "Version": "2012-10-17",
                    "Statement": [
                        {
                            "Effect": "Allow",
                            "Principal": {"Service": "sagemaker.amazonaws.com"},
                            "Action": "sts:AssumeRole",
                        }
                    ],
                },
                "Policies": [
                    {
                        "PolicyName": "gameday",
                        "PolicyDocument": {"Version": "2012-10-17", "Statement": statements},
                    }
                ],
                "Tags": [{"Key": "gameday", "Value": scratch.run_id}],
            },
        },
        "Model": {
            "Type": "AWS::SageMaker::Model",
            **retain,
            "Properties": {
                "ExecutionRoleArn": {"Fn::GetAtt": [role_id, "Arn"]},
                "EnableNetworkIsolation": True,
                "PrimaryContainer": {
                    "Image": scratch.image,
                    "Environment": environment,
                    "ModelDataSource": {
                        "S3DataSource": {
                            "S3Uri": f"s3://{scratch.bucket}/{prefix}",
                            "S3DataType": "S3Prefix",
                            "CompressionType": "None",
                        }
                    },
                },
            },
        },
        "TransformModel": {
            "Type": "AWS::SageMaker::Model",
            "Properties": {
                "ExecutionRoleArn": {"Fn::GetAtt": [role_id, "Arn"]},
                "EnableNetworkIsolation": True,
                "PrimaryContainer": {
                    "Image": scratch.image,
                    "Environment": environment,
                    "ModelDataUrl": f"s3://{scratch.bucket}/{scratch.model_prefix}{MODEL_ARCHIVE}",
                },
            },
        },
        "RollbackAlarm": {
            "Type": "AWS::CloudWatch::Alarm",
            "Properties": {
                "AlarmName": f"{scratch.name}-rollback",
                "Namespace": "AWS/SageMaker",
                "MetricName": "Invocation5XXErrors",
                "Dimensions": [
                    {"Name": "EndpointName", "Value": scratch.name},
                    {"Name": "VariantName", "Value": "AllTraffic"},
                ],
                "Statistic": "Sum",
                "Period": 60,
                "EvaluationPeriods": 1,
                "Threshold": 1000000,
                "ComparisonOperator": "GreaterThanThreshold",
                "TreatMissingData": "breaching" if variant.alarm_breaching else "notBreaching",
            },
        },
        f"Config{variant.config}": {
            "Type": "AWS::SageMaker::EndpointConfig",
            **retain,
            "Properties": {
                "ProductionVariants": [
                    {
                        "VariantName": "AllTraffic",
                        "ModelName": {"Fn::GetAtt": ["Model", "ModelName"]},
                        "InstanceType": variant.instance_type or scratch.instance_type,
                        "InitialInstanceCount": 1,
                        "InitialVariantWeight": 1.0,
                        "ContainerStartupHealthCheckTimeoutInSeconds": 600,
                        "ModelDataDownloadTimeoutInSeconds": 600,
                    }
                ]
            },
        },
        "Endpoint": {
            "Type": "AWS::SageMaker::Endpoint",
            "Properties": {
                "EndpointName": scratch.name,
                "EndpointConfigName": {"Fn::GetAtt": [f"Config{variant.config}", "EndpointConfigName"]},
                "RetainAllVariantProperties": True,
                "DeploymentConfig": {
                    "BlueGreenUpdatePolicy": {
                        "TrafficRoutingConfiguration": {"Type": "ALL_AT_ONCE", "WaitIntervalInSeconds": 300},
                        "TerminationWaitInSeconds": 0,
                        "MaximumExecutionTimeoutInSeconds": 3600,
                    },
                    "AutoRollbackConfiguration": {"Alarms": [{"AlarmName": {"Ref": "RollbackAlarm"}}]},
                },
            },
        },
        "ScalableTarget": {
            "Type": "AWS::ApplicationAutoScaling::ScalableTarget",
            "DependsOn": "Endpoint",
            "Properties": {
                "ServiceNamespace": "sagemaker",
                "ResourceId": f"endpoint/{scratch.name}/variant/AllTraffic",
                "ScalableDimension": "sagemaker:variant:DesiredInstanceCount",
                "MinCapacity": 1,
                "MaxCapacity": 2,
            },
        },
    }
    outputs = {
        "EndpointConfigName": {"Value": {"Fn::GetAtt": [f"Config{variant.config}", "EndpointConfigName"]}},
        "TransformModelName": {"Value": {"Fn::GetAtt": ["TransformModel", "ModelName"]}},
    }
    return {"AWSTemplateFormatVersion": "2010-09-09", "Resources": resources, "Outputs": outputs}


@dataclass
class Lab:
    """The scratch stack and the clients the scenarios use; `sleep` and `poll_s` are for the tests."""

    clients: dict[str, Any]
    scratch: Scratch
    sleep: Callable[[float], None] = time.sleep
    poll_s: float = 30.0
    max_polls: int = 240  # 2 h at 30 s
    seen: set[tuple[str, str]] = field(default_factory=set)  # models, configs, roles the stack made
    objects: list[str] = field(default_factory=list)  # S3 keys the scenarios wrote (scratch bucket)

    @property
    def cloudformation(self) -> Any:
        return self.clients["cloudformation"]

    @property
    def sagemaker(self) -> Any:
        return self.clients["sagemaker"]

    def wait_stack(self) -> dict[str, Any]:
        """Poll the stack until its status is terminal (…_COMPLETE, …_FAILED)."""
        for _ in range(self.max_polls):
            stack = self.cloudformation.describe_stacks(StackName=self.scratch.name)["Stacks"][0]
            if TERMINAL.search(stack["StackStatus"]):
                return stack
            self.sleep(self.poll_s)
        raise TimeoutError(f"{self.scratch.name} still changing after {self.max_polls} polls")

    def create(self) -> dict[str, Any]:
        self.cloudformation.create_stack(
            StackName=self.scratch.name,
            TemplateBody=json.dumps(template(self.scratch)),
            Capabilities=["CAPABILITY_IAM"],
            OnFailure="DELETE",
            Tags=[{"Key": "gameday", "Value": self.scratch.run_id}],
        )
        return self._note(self.wait_stack())

    def update(self, variant: Variant) -> dict[str, Any]:
        self.cloudformation.update_stack(
            StackName=self.scratch.name,
            TemplateBody=json.dumps(template(self.scratch, variant)),
            Capabilities=["CAPABILITY_IAM"],
        )
        return self._note(self.wait_stack())

    def _note(self, stack: dict[str, Any]) -> dict[str, Any]:
        """Remember what the stack holds now: a later update retains and forgets it."""
        self.seen |= set(self._retained())
        return stack

    def output(self, key: str) -> str:
        stack = self.cloudformation.describe_stacks(StackName=self.scratch.name)["Stacks"][0]
        return next(o["OutputValue"] for o in stack.get("Outputs", []) if o["OutputKey"] == key)

    def endpoint(self) -> dict[str, Any]:
        return self.sagemaker.describe_endpoint(EndpointName=self.scratch.name)

    def wait_endpoint(self) -> dict[str, Any]:
        for _ in range(self.max_polls):
            endpoint = self.endpoint()
            if endpoint["EndpointStatus"] not in ("Creating", "Updating", "SystemUpdating", "RollingBack"):
                return endpoint
            self.sleep(self.poll_s)
        raise TimeoutError(f"{self.scratch.name} still updating after {self.max_polls} polls")

    def teardown(self) -> list[str]:
        """Delete the stack, then what it retains and what the scenarios made; returns what failed."""
        problems: list[str] = []
        self.seen |= set(self._retained())
        try:
            self.cloudformation.delete_stack(StackName=self.scratch.name)
            self.wait_deleted()
        except ClientError as error:
            problems.append(f"stack {self.scratch.name}: {error}")
        for key in self.objects:
            try:
                self.clients["s3"].delete_object(Bucket=self.scratch.bucket, Key=key)
            except ClientError as error:
                problems.append(f"s3://{self.scratch.bucket}/{key}: {error}")
        for kind, name in sorted(self.seen):
            try:
                self._delete(kind, name)
            except ClientError as error:
                if "ValidationException" not in str(error) and "NoSuchEntity" not in str(error):
                    problems.append(f"{kind} {name}: {error}")
        return problems

    def wait_deleted(self) -> None:
        for _ in range(self.max_polls):
            try:
                stack = self.cloudformation.describe_stacks(StackName=self.scratch.name)["Stacks"][0]
            except ClientError:
                return
            if stack["StackStatus"] in ("DELETE_COMPLETE", "DELETE_FAILED"):
                return
            self.sleep(self.poll_s)

    def _retained(self) -> list[tuple[str, str]]:
        """Every model, endpoint config and role the stack ever made (retained ones survive it)."""
        found: list[tuple[str, str]] = []
        try:
            pages = self.cloudformation.get_paginator("list_stack_resources").paginate(
                StackName=self.scratch.name
            )
            for page in pages:
                for resource in page.get("StackResourceSummaries", []):
                    kind = resource["ResourceType"].split("::")[-1]
                    if kind in ("Model", "EndpointConfig", "Role") and resource.get("PhysicalResourceId"):
                        found.append((kind, resource["PhysicalResourceId"]))
        except ClientError:
            pass
        return found

    def _delete(self, kind: str, name: str) -> None:
        if kind == "Model":
            self.sagemaker.delete_model(ModelName=name)
        elif kind == "EndpointConfig":
            self.sagemaker.delete_endpoint_config(EndpointConfigName=name)
        elif kind == "Role":
            iam = self.clients["iam"]
            for policy in iam.list_role_policies(RoleName=name).get("PolicyNames", []):
                iam.delete_role_policy(RoleName=name, PolicyName=policy)
            iam.delete_role(RoleName=name)
