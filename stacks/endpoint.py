"""The SageMaker real-time endpoint of one variant, on L1 resources.

The alpha L2 has no DeploymentConfig, ModelDataDownloadTimeout or InferenceAmiVersion, so this
construct wires `CfnModel` → `CfnEndpointConfig` → `CfnEndpoint` itself, plus autoscaling. The
endpoint keeps its configured name; models and endpoint configs get generated names, so any
change replaces them and updates the endpoint in place through the blue/green policy.

Replaced models and configs are *retained* (UpdateReplacePolicy and DeletionPolicy Retain): after an
update that SageMaker rolled back on its own, the endpoint still runs the old config, and deleting it
would leave the endpoint unable to scale out or replace an instance ("You must not delete an
EndpointConfig in use by an endpoint", SageMaker API reference, UpdateEndpoint). They carry the tag
`promote:endpoint=<name>`; `promote prune --endpoint <name> --keep N` deletes the unused ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import ArnFormat, Aws, CfnTag, Duration, RemovalPolicy, Stack
from aws_cdk import aws_applicationautoscaling as appscaling
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sagemaker as sagemaker
from constructs import Construct

from decider_stacks.common import identity, retention_days
from decider_stacks.config import (
    ENDPOINT_TAG,
    VariantConfig,
    archive_key,
    data_capture_prefix,
    supports_volume_kms,
)
from decider_stacks.monitoring import VARIANT_NAME, EndpointAlarms
from decider_stacks.nag import acknowledge


@dataclass(frozen=True)
class ModelLocation:
    """Where the model lives: the URI handed to SageMaker and the bucket/prefix the role may read."""

    s3_uri: str  # may be a token (custom resource output)
    bucket_name: str
    prefix: str
    file: str | None = None  # the one object under the prefix, when known (the pinned model)
    # The Batch Transform archive (batch_transform=true): beside the prefix, never under it (archive_key).
    archive_uri: str | None = None

    @property
    def archive_key(self) -> str:
        return archive_key(self.prefix)


@dataclass(frozen=True)
class ImageLocation:
    """The image by digest, the ECR repository the role may pull from, and how it was chosen."""

    uri: str  # may be a token (custom resource output)
    repository_arn: str
    source: str = "build"  # "pinned" (-c image_uri) or "build"; may be a token
    guard: Construct | None = None  # must exist before the model (the prebuilt image's check)


class ExecutionRole(Construct):
    """Least privilege: pull this image, read this model prefix, write this endpoint's logs and metrics.

    One role per model and image repository, replaced and retained with the Model that uses it. Every
    rollback (SageMaker's own, CloudFormation's, the post-deploy check's parking) starts a new fleet
    from the previous endpoint config, and that fleet downloads the previous model and pulls the
    previous image *with the previous Model's role* (CreateModel ExecutionRoleArn, "the IAM role that
    SageMaker can assume to access model artifacts and docker image for deployment",
    https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_CreateModel.html). Had the one role's
    policy been updated in place to the new model, CloudFormation would narrow it before it rolls the
    Endpoint back, and the old fleet could not start. So the role's logical id names what it may read:
    a new model or repository gets a new role, and the old role and its policy stay (Retain) for as long
    as the retained old Model may be used again; `promote prune` deletes unused models, the roles are
    listed in docs/deploy.md.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        variant: VariantConfig,
        image: ImageLocation,
        model: ModelLocation,
    ) -> None:
        super().__init__(scope, construct_id)
        # What a rollback's fleet must still read. Not the Batch Transform archive: turning
        # batch_transform on or off only adds or drops grants no endpoint fleet needs.
        reads = identity(
            self,
            {
                "bucket": model.bucket_name,
                "prefix": model.prefix,
                "file": model.file,
                "repository": image.repository_arn,
            },
        )
        self.role = iam.Role(
            self,
            f"Role{reads}",
            description=f"SageMaker execution role of the {variant.endpoint_name} endpoint",
            assumed_by=iam.ServicePrincipal(
                "sagemaker.amazonaws.com", conditions={"StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID}}
            ),
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="PullImage",
                actions=[
                    "ecr:BatchGetImage",
                    "ecr:GetDownloadUrlForLayer",
                    "ecr:BatchCheckLayerAvailability",
                ],
                resources=[image.repository_arn],
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(sid="EcrLogin", actions=["ecr:GetAuthorizationToken"], resources=["*"])
        )
        bucket_arn = Stack.of(self).format_arn(
            service="s3", region="", account="", resource=model.bucket_name
        )
        # The pinned model is one known object; a prebuilt prefix may hold several files.
        readable = [f"{model.prefix}{model.file}" if model.file else f"{model.prefix}*"]
        if model.archive_uri is not None:  # beside the prefix: `<prefix>*` does not cover it
            readable.append(model.archive_key)  # the Batch Transform Model's ModelDataUrl
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="ReadModel",
                actions=["s3:GetObject"],
                resources=[f"{bucket_arn}/{key}" for key in readable],
            )
        )
        if not model.file:
            acknowledge(
                self.role,
                f"AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:s3:::{model.bucket_name}/{model.prefix}*]",
                "A prebuilt model prefix (model_s3_uri) may hold several files (GGUF, tokenizer); "
                "SageMaker copies all of them. The role reads nothing outside that prefix.",
            )
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="ListModel",
                actions=["s3:ListBucket"],
                resources=[bucket_arn],
                conditions={"StringLike": {"s3:prefix": [f"{model.prefix}*"]}},
            )
        )
        log_group_arn = Stack.of(self).format_arn(
            service="logs",
            resource="log-group",
            resource_name=f"/aws/sagemaker/Endpoints/{variant.endpoint_name}",
            arn_format=ArnFormat.COLON_RESOURCE_NAME,
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="WriteLogs",
                actions=["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                resources=[log_group_arn, f"{log_group_arn}:log-stream:*"],
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="WriteMetrics",
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                conditions={"StringLike": {"cloudwatch:namespace": ["/aws/sagemaker/*", "AWS/SageMaker"]}},
            )
        )
        acknowledge(
            self.role,
            f"AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:logs:<AWS::Region>:<AWS::AccountId>:log-group:"
            f"/aws/sagemaker/Endpoints/{variant.endpoint_name}:log-stream:*]",
            "SageMaker names one log stream per instance and container at run time; the role writes "
            "only into this endpoint's log group.",
        )
        acknowledge(
            self.role,
            "AwsSolutions-IAM5[Resource::*]",
            "ecr:GetAuthorizationToken has no resource-level permissions; cloudwatch:PutMetricData has "
            "none either and is limited to SageMaker's namespaces by condition.",
        )

    def retain(self) -> None:
        """Keep the role and its policy when a new model or repository replaces them (class docstring)."""
        self.role.apply_removal_policy(RemovalPolicy.RETAIN)
        policy = self.role.node.find_child("DefaultPolicy")
        assert isinstance(policy, iam.Policy)
        policy.apply_removal_policy(RemovalPolicy.RETAIN)

    def allow_rollback_alarms(self, alarm_arns: list[str]) -> None:
        """SageMaker reads the auto-rollback alarms with the execution role: "Ensure that your IAM
        execution role has permission to perform the cloudwatch:DescribeAlarms action on the
        auto-rollback alarms you specify" (SageMaker, "Auto-Rollback Configuration and Monitoring").
        Metric alarms can be named by ARN (only composite alarms need `*`)."""
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="ReadRollbackAlarms", actions=["cloudwatch:DescribeAlarms"], resources=alarm_arns
            )
        )


class DeciderEndpoint(Construct):
    """Model, endpoint config, endpoint with blue/green guardrails, and autoscaling for one variant."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        variant: VariantConfig,
        image: ImageLocation,
        model: ModelLocation,
        environment: dict[str, str],
        data_capture_bucket: str,
        stack_tags: dict[str, str] | None = None,
    ) -> None:
        """`stack_tags`: the tags the stack applies to every resource (the Endpoint's among them)."""
        super().__init__(scope, construct_id)
        self.variant = variant
        self.execution = ExecutionRole(self, "Execution", variant=variant, image=image, model=model)
        role = self.execution.role

        # SageMaker creates this log group on first start; owning it here sets its retention and key.
        log_group_name = f"/aws/sagemaker/Endpoints/{variant.endpoint_name}"
        self.log_key: kms.Key | None = None
        if variant.log_kms:
            # The container's logs may hold prompts. CloudWatch Logs encrypts with the key itself (its
            # regional service principal, limited to this log group by the encryption context); the
            # writers need no KMS permission (CloudWatch Logs User Guide, "Encrypt log data in
            # CloudWatch Logs using AWS KMS").
            self.log_key = kms.Key(
                self,
                "LogsKey",
                description=f"Encrypts the log group of the {variant.endpoint_name} endpoint",
                enable_key_rotation=True,
                removal_policy=RemovalPolicy.DESTROY,
                pending_window=Duration.days(7),
            )
            log_group_arn = Stack.of(self).format_arn(
                service="logs",
                resource="log-group",
                resource_name=log_group_name,
                arn_format=ArnFormat.COLON_RESOURCE_NAME,
            )
            self.log_key.add_to_resource_policy(
                iam.PolicyStatement(
                    sid="CloudWatchLogsEncrypt",
                    principals=[iam.ServicePrincipal(f"logs.{Aws.REGION}.amazonaws.com")],
                    actions=[
                        "kms:Encrypt*",
                        "kms:Decrypt*",
                        "kms:ReEncrypt*",
                        "kms:GenerateDataKey*",
                        "kms:Describe*",
                    ],
                    resources=["*"],  # in a key policy, "*" is this key
                    conditions={"ArnEquals": {"kms:EncryptionContext:aws:logs:arn": log_group_arn}},
                )
            )
        self.log_group = logs.LogGroup(
            self,
            "Logs",
            log_group_name=log_group_name,
            retention=retention_days(variant.log_retention_days),
            encryption_key=self.log_key,
            removal_policy=RemovalPolicy.DESTROY,
        )

        self.volume_key: kms.Key | None = None
        if variant.encrypt_volume:
            self.volume_key = kms.Key(
                self,
                "VolumeKey",
                description=f"Encrypts the ML storage volumes of the {variant.endpoint_name} endpoint",
                enable_key_rotation=True,
                removal_policy=RemovalPolicy.DESTROY,
                pending_window=Duration.days(7),
            )
            role.add_to_policy(
                iam.PolicyStatement(
                    sid="UseVolumeKey",
                    actions=[
                        "kms:Encrypt",
                        "kms:Decrypt",
                        "kms:GenerateDataKey",
                        "kms:CreateGrant",
                        "kms:DescribeKey",
                    ],
                    resources=[self.volume_key.key_arn],
                )
            )

        self.alarms = EndpointAlarms(self, "Alarms", variant=variant)
        self.execution.allow_rollback_alarms([alarm.alarm_arn for alarm in self.alarms.rollback_alarms])
        tags = [CfnTag(key=ENDPOINT_TAG, value=variant.endpoint_name)]

        self.model = sagemaker.CfnModel(
            self,
            "Model",
            execution_role_arn=role.role_arn,
            enable_network_isolation=variant.network_isolation,
            primary_container=sagemaker.CfnModel.ContainerDefinitionProperty(
                image=image.uri,
                mode="SingleModel",
                environment=dict(sorted(environment.items())),
                model_data_source=sagemaker.CfnModel.ModelDataSourceProperty(
                    s3_data_source=sagemaker.CfnModel.S3DataSourceProperty(
                        s3_uri=model.s3_uri, s3_data_type="S3Prefix", compression_type="None"
                    )
                ),
            ),
            tags=tags,
        )
        self.model.apply_removal_policy(RemovalPolicy.RETAIN)
        # CreateModel checks that the role can pull the image: the policy must exist first.
        self.model.node.add_dependency(role.node.find_child("DefaultPolicy"))
        self.transform_model: sagemaker.CfnModel | None = None
        if model.archive_uri is not None:
            self.transform_model = self._transform_model(role, image, model.archive_uri, environment, tags)
        self.execution.retain()

        data_capture = None
        if variant.data_capture.enabled:
            prefix = data_capture_prefix(variant)
            role.add_to_policy(
                iam.PolicyStatement(
                    sid="WriteDataCapture",
                    actions=["s3:PutObject"],
                    resources=[f"arn:{Aws.PARTITION}:s3:::{data_capture_bucket}/{prefix}*"],
                )
            )
            acknowledge(
                role,
                "AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:s3:::"
                + data_capture_bucket.replace(Aws.ACCOUNT_ID, "<AWS::AccountId>").replace(
                    Aws.REGION, "<AWS::Region>"
                )
                + f"/{prefix}*]",
                "SageMaker names captured objects by date and request at run time; the role may only "
                "add objects under this endpoint's data-capture prefix.",
            )
            data_capture = sagemaker.CfnEndpointConfig.DataCaptureConfigProperty(
                enable_capture=True,
                initial_sampling_percentage=variant.data_capture.sampling_percentage,
                destination_s3_uri=f"s3://{data_capture_bucket}/{prefix.rstrip('/')}",
                capture_options=[
                    sagemaker.CfnEndpointConfig.CaptureOptionProperty(capture_mode="Input"),
                    sagemaker.CfnEndpointConfig.CaptureOptionProperty(capture_mode="Output"),
                ],
                capture_content_type_header=sagemaker.CfnEndpointConfig.CaptureContentTypeHeaderProperty(
                    json_content_types=["application/json"]
                ),
                kms_key_id=self.volume_key.key_arn if self.volume_key else None,
            )

        # What the Endpoint resource carries besides its config name. UpdateEndpoint needs a new
        # EndpointConfig ("To update an endpoint, you must create a new EndpointConfig", SageMaker API
        # reference), so the config is named after these too: any change to the Endpoint (deployment
        # policy, retained variant properties, …) replaces the config under a new generated name.
        endpoint_settings = {
            "endpoint_name": variant.endpoint_name,
            "deployment_config": self._deployment_config(),
            # An update keeps the live instance count (autoscaled fleets are not reset to
            # initial_instance_count) and weight. Without autoscaling the configured count applies.
            # DataCaptureConfig cannot be excluded ("Not currently supported", SageMaker API
            # reference, VariantProperty).
            "retain_all_variant_properties": True,
            "exclude_retained_variant_properties": (
                None
                if variant.autoscaling
                else [
                    sagemaker.CfnEndpoint.VariantPropertyProperty(
                        variant_property_type="DesiredInstanceCount"
                    )
                ]
            ),
        }
        # The stack's tags reach the Endpoint too (Tags.of(stack)), after this constructor.
        self.endpoint_settings_id = identity(self, {**endpoint_settings, "tags": stack_tags or {}})

        self.endpoint_config = sagemaker.CfnEndpointConfig(
            self,
            f"Config{self.endpoint_settings_id}",
            # No EndpointConfigName: every property change replaces the config, which needs a new name.
            production_variants=[self._production_variant()],
            kms_key_id=self.volume_key.key_arn if self.volume_key else None,
            data_capture_config=data_capture,
            tags=tags,
        )
        self.endpoint_config.apply_removal_policy(RemovalPolicy.RETAIN)
        if self.volume_key is None and not variant.on_ebs:  # volume_kms=false on EBS stays a finding
            nvme = ", ".join(t for t in variant.instance_types if not supports_volume_kms(t))
            reason = (
                f"{nvme} keeps the model on local NVMe instance storage, which SageMaker "
                "encrypts with a hardware key and for which CreateEndpointConfig rejects KmsKeyId."
            )
            for pack in ("HIPAA.Security", "NIST.800.53.R5", "PCI.DSS.321"):
                acknowledge(
                    self.endpoint_config, f"{pack}-SageMakerEndpointConfigurationKMSKeyConfigured", reason
                )

        self.endpoint = sagemaker.CfnEndpoint(
            self,
            "Endpoint",
            endpoint_config_name=self.endpoint_config.attr_endpoint_config_name,
            **endpoint_settings,
        )
        self.endpoint.node.add_dependency(self.log_group)
        if variant.autoscaling:
            self._autoscaling()

    def _production_variant(self) -> sagemaker.CfnEndpointConfig.ProductionVariantProperty:
        """One variant: a single instance type, or InstancePools (priority 1 = instance_type) when
        fallbacks are configured ("replace the InstanceType parameter in the production variant with
        the InstancePools list", SageMaker, "Deploy to multiple instance types with instance pools")."""
        variant = self.variant
        pools = None
        if variant.instance_pools:
            pools = [
                sagemaker.CfnEndpointConfig.InstancePoolProperty(
                    instance_type=instance_type, priority=priority
                )
                for priority, instance_type in enumerate(variant.instance_types, start=1)
            ]
        routing = None
        if variant.routing.strategy is not None:
            prefix_aware = None
            if variant.routing.strategy == "PREFIX_AWARE":
                prefix_aware = sagemaker.CfnEndpointConfig.PrefixAwareRoutingConfigProperty(
                    prefix_length=variant.routing.prefix_length,
                    concurrency_threshold=variant.routing.concurrency_threshold,
                )
            routing = sagemaker.CfnEndpointConfig.RoutingConfigProperty(
                routing_strategy=variant.routing.strategy, prefix_aware_routing_config=prefix_aware
            )
        return sagemaker.CfnEndpointConfig.ProductionVariantProperty(
            variant_name=VARIANT_NAME,
            model_name=self.model.attr_model_name,
            instance_type=None if pools else variant.instance_type,
            instance_pools=pools,
            variant_instance_provision_timeout_in_seconds=variant.provision_timeout_s,
            initial_instance_count=variant.initial_instance_count,
            initial_variant_weight=1.0,
            container_startup_health_check_timeout_in_seconds=variant.container_startup_health_check_timeout_s,
            model_data_download_timeout_in_seconds=variant.model_data_download_timeout_s,
            # EBS-backed types only; SageMaker refuses VolumeSizeInGB on NVMe instance storage.
            volume_size_in_gb=variant.ebs_volume_size_gb,
            inference_ami_version=variant.ami_version,
            routing_config=routing,
        )

    def config_json(self) -> str:
        """The endpoint config's properties as the template gives them to CloudFormation (tokens
        resolved at deploy time), as one JSON string: what a parked copy of it must repeat. Called once
        the config is complete (after AsyncInference)."""
        config = self.endpoint_config
        rendered = config._render_properties(config._cfn_properties)  # the L1's own rendering
        body = {k: v for k, v in rendered.items() if k not in ("Tags", "EndpointConfigName")}
        return Stack.of(self).to_json_string(body)

    def _transform_model(
        self,
        role: iam.Role,
        image: ImageLocation,
        archive_uri: str,
        environment: dict[str, str],
        tags: list[CfnTag],
    ) -> sagemaker.CfnModel:
        """The Model Batch Transform jobs run: the same image and settings, the model from a
        `model.tar.gz` through ModelDataUrl. "Currently you cannot use ModelDataSource in conjunction
        with SageMaker batch transform" (ContainerDefinition, ModelDataSource,
        https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_ContainerDefinition.html), and
        ModelDataUrl "must point to a single gzip compressed tar archive (.tar.gz suffix)". SageMaker
        unpacks it into /opt/ml/model, so the container finds the same GGUF file name."""
        transform = sagemaker.CfnModel(
            self,
            "TransformModel",
            execution_role_arn=role.role_arn,
            enable_network_isolation=self.variant.network_isolation,
            primary_container=sagemaker.CfnModel.ContainerDefinitionProperty(
                image=image.uri,
                mode="SingleModel",
                environment=dict(sorted(environment.items())),
                model_data_url=archive_uri,
            ),
            tags=tags,
        )
        transform.apply_removal_policy(RemovalPolicy.RETAIN)
        transform.node.add_dependency(role.node.find_child("DefaultPolicy"))
        return transform

    def _deployment_config(self) -> sagemaker.CfnEndpoint.DeploymentConfigProperty:
        policy = self.variant.deployment
        traffic_routing = self.variant.traffic_routing
        step = sagemaker.CfnEndpoint.CapacitySizeProperty(
            type="INSTANCE_COUNT", value=policy.step_instance_count
        )
        routing = sagemaker.CfnEndpoint.TrafficRoutingConfigProperty(
            type=traffic_routing,
            wait_interval_in_seconds=policy.wait_interval_s,
            canary_size=step if traffic_routing == "CANARY" else None,
            linear_step_size=step if traffic_routing == "LINEAR" else None,
        )
        return sagemaker.CfnEndpoint.DeploymentConfigProperty(
            blue_green_update_policy=sagemaker.CfnEndpoint.BlueGreenUpdatePolicyProperty(
                traffic_routing_configuration=routing,
                termination_wait_in_seconds=policy.termination_wait_s,
                maximum_execution_timeout_in_seconds=policy.maximum_execution_timeout_s,
            ),
            auto_rollback_configuration=sagemaker.CfnEndpoint.AutoRollbackConfigProperty(
                alarms=[
                    sagemaker.CfnEndpoint.AlarmProperty(alarm_name=alarm.alarm_name)
                    for alarm in self.alarms.rollback_alarms
                ]
            ),
        )

    def _autoscaling(self) -> None:
        """Target tracking (L1: the L2 target would create an unused role). By default on the
        high-resolution concurrency metric: "the number of concurrent requests being received by a model
        container", queued and streaming ones included, every 10 s, so a fleet serving long requests
        scales out within a minute rather than after several minutes of invocation counts (SageMaker,
        "Define a scaling policy")."""
        variant = self.variant
        self.scalable_target = appscaling.CfnScalableTarget(
            self,
            "ScalableTarget",
            service_namespace="sagemaker",
            resource_id=f"endpoint/{variant.endpoint_name}/variant/{VARIANT_NAME}",
            scalable_dimension="sagemaker:variant:DesiredInstanceCount",
            min_capacity=variant.min_capacity,
            max_capacity=variant.max_capacity,
        )
        # Registering a target needs the endpoint; deregistering must happen before it is deleted.
        self.scalable_target.add_resource_dependency(self.endpoint)
        if variant.scaling_metric == "concurrency":
            metric = "SageMakerVariantConcurrentRequestsPerModelHighResolution"
            target, suffix = variant.target_concurrency_per_instance, "concurrency-per-instance"
        else:
            metric = "SageMakerVariantInvocationsPerInstance"
            target, suffix = float(variant.target_invocations_per_instance), "invocations-per-instance"
        self.scaling_policy = appscaling.CfnScalingPolicy(
            self,
            "TargetTracking",
            policy_name=f"{variant.endpoint_name}-{suffix}",
            policy_type="TargetTrackingScaling",
            scaling_target_id=self.scalable_target.ref,
            target_tracking_scaling_policy_configuration=appscaling.CfnScalingPolicy.TargetTrackingScalingPolicyConfigurationProperty(
                target_value=target,
                predefined_metric_specification=appscaling.CfnScalingPolicy.PredefinedMetricSpecificationProperty(
                    predefined_metric_type=metric
                ),
                scale_in_cooldown=variant.scale_in_cooldown_s,
                scale_out_cooldown=variant.scale_out_cooldown_s,
            ),
        )
