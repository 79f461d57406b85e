"""ImageStack: what both endpoints share. ECR repository, artifacts bucket, the CodeBuild projects
that build the image and stage the model, the custom-resource provider that runs them at deploy time
(and the endpoint stacks' image checks and post-deploy checks), and the watcher that fails an image
build's wait condition when the build fails. The endpoint stacks request their own image build and
model staging from it (see `decider_stacks.deploy_time_build`), so deploying CpuStack never waits for a CUDA
build.

The endpoint stacks read this stack's outputs through weak references (`Fn::GetStackOutput`), which
do not stop a delete, so ImageStack has termination protection: delete GpuStack and CpuStack first
(docs/deploy.md, "Cost and clean-up")."""

from __future__ import annotations

import hashlib
import json

import yaml
from aws_cdk import ArnFormat, Aws, CfnOutput, Duration, RemovalPolicy, Stack, Tags
from aws_cdk import aws_codebuild as codebuild
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_s3_assets as s3_assets
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import custom_resources as cr
from constructs import Construct

from decider_stacks.common import retention_days
from decider_stacks.config import (
    BUILD_DEADLINE_GRACE_MINUTES,
    BUILD_START_RETRY_MINUTES,
    IS_COMPLETE_TIMEOUT_S,
    PROVIDER_TOTAL_TIMEOUT_MINUTES,
    AppConfig,
    ModelArtifact,
    VariantConfig,
    archive_key,
    cost_tags,
    deployed_image_parameter,
    expiring_prefixes,
)
from decider_stacks.handlers import build_jobs
from decider_stacks.handlers.build_states import FAILED_STATES
from decider_stacks.handlers.post_deploy_check import parked_prefix
from decider_stacks.nag import acknowledge
from decider_stacks.paths import (
    ASSET_EXCLUDES,
    BUILDSPEC_DIR,
    CONTAINER_DIR,
    HANDLERS_DIR,
    container_excludes,
)

# The provider framework polls every 30 s and gives up after 55 min: a custom resource cannot wait
# longer than one hour (ServiceTimeout 1-3600 s; aws/aws-cdk#24974). The image build itself is waited
# for by a WaitCondition in the endpoint stack.
BUILD_POLL_INTERVAL = Duration.seconds(30)
PROVIDER_TOTAL_TIMEOUT = Duration.minutes(PROVIDER_TOTAL_TIMEOUT_MINUTES)
# Outputs earlier endpoint stacks read (ImageStack._keep_earlier_outputs): logical id → what it held.
EARLIER_WEAK_OUTPUTS = {
    "PublishOutputRefBuildsImageBuildF0DD629132E8D2C4": "image-project",
    "PublishOutputRefBuildsModelStaging1D36922418A87208": "model-project",
    "PublishOutputRefImagesRepository2D0F5B9CAAD4A19B": "repository",
}
IMAGES_KEPT_PER_VARIANT = 20
# "keep-<digest>" marks deployed images; this count is never reached, so they never expire.
KEPT_DEPLOYED_IMAGES = 10_000


def image_tag(variant: VariantConfig, source_hash: str, buildspec: str) -> str:
    """`<cpu|cuda>-<hash of the build's inputs>`: immutable, never `latest`.

    The inputs are what the image is made of: the content hash of container/, the build arguments
    (the configured ones and the CUDA architectures) and the buildspec that runs the build (as
    inlined into the template: YAML comments do not count). A change of any of them rebuilds; a
    change of how the build runs (compute type, timeouts) does not.
    """
    recipe = hashlib.sha256(buildspec.encode()).hexdigest()
    inputs = [source_hash, variant.docker_build_args, recipe]
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return f"{variant.build_variant}-{digest}"


def artifacts_bucket_name(project: str) -> str:
    """`<project>-artifacts-<account>-<region>`: unique per environment, known to every stack
    without a cross-stack reference, and stable across deploys."""
    return f"{project}-artifacts-{Aws.ACCOUNT_ID}-{Aws.REGION}"


class ArtifactsStore(Construct):
    """The artifacts bucket (staged models, data capture) and the bucket receiving its access logs."""

    def __init__(
        self, scope: Construct, construct_id: str, *, project: str, captures: dict[str, int] | None = None
    ) -> None:
        """`captures`: prefix → days its objects are kept (data capture, async inference: they may hold
        prompts)."""
        super().__init__(scope, construct_id)
        self.access_logs = s3.Bucket(
            self,
            "AccessLogs",
            encryption=s3.BucketEncryption.S3_MANAGED,  # server access logging requires SSE-S3
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            versioned=True,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            lifecycle_rules=[
                s3.LifecycleRule(
                    expiration=Duration.days(365), noncurrent_version_expiration=Duration.days(30)
                )
            ],
            removal_policy=RemovalPolicy.RETAIN,
        )
        acknowledge(
            self.access_logs,
            "AwsSolutions-S1",
            "This bucket is the server-access-log destination of the artifacts bucket; logging it into "
            "itself would loop.",
        )
        self.bucket = s3.Bucket(
            self,
            "Artifacts",
            bucket_name=artifacts_bucket_name(project),
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            versioned=True,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            server_access_logs_bucket=self.access_logs,
            server_access_logs_prefix="artifacts/",
            lifecycle_rules=[
                s3.LifecycleRule(
                    noncurrent_version_expiration=Duration.days(30),
                    abort_incomplete_multipart_upload_after=Duration.days(2),
                ),
                *[
                    s3.LifecycleRule(
                        id=f"expire-{prefix.strip('/').replace('/', '-')}",
                        prefix=prefix,
                        expiration=Duration.days(days),
                        noncurrent_version_expiration=Duration.days(1),
                    )
                    for prefix, days in sorted((captures or {}).items())
                ],
            ],
            removal_policy=RemovalPolicy.RETAIN,
        )


class ImageRepository(Construct):
    """ECR repository for the decider images: immutable content-hash tags, scanned on push."""

    def __init__(self, scope: Construct, construct_id: str) -> None:
        super().__init__(scope, construct_id)
        self.repository = ecr.Repository(
            self,
            "Repository",
            image_tag_mutability=ecr.TagMutability.IMMUTABLE,
            image_scan_on_push=True,
            encryption=ecr.RepositoryEncryption.AES_256,
            removal_policy=RemovalPolicy.RETAIN,
            lifecycle_rules=[
                # First: an image that matches a higher-priority rule cannot be expired by a
                # lower-priority one (ECR lifecycle policy evaluation rules), so every image an endpoint
                # config references (tagged keep-<digest> at deploy) stays pullable.
                ecr.LifecycleRule(
                    rule_priority=1,
                    description="Deployed images (keep-<digest>): never expire",
                    tag_status=ecr.TagStatus.TAGGED,
                    tag_prefix_list=["keep-"],
                    max_image_count=KEPT_DEPLOYED_IMAGES,
                ),
                ecr.LifecycleRule(
                    rule_priority=2,
                    description="Untagged layers left by interrupted pushes",
                    tag_status=ecr.TagStatus.UNTAGGED,
                    max_image_age=Duration.days(14),
                ),
                ecr.LifecycleRule(
                    rule_priority=3,
                    description=f"Keep the last {IMAGES_KEPT_PER_VARIANT} CPU images",
                    tag_status=ecr.TagStatus.TAGGED,
                    tag_prefix_list=["cpu-"],
                    max_image_count=IMAGES_KEPT_PER_VARIANT,
                ),
                ecr.LifecycleRule(
                    rule_priority=4,
                    description=f"Keep the last {IMAGES_KEPT_PER_VARIANT} CUDA images",
                    tag_status=ecr.TagStatus.TAGGED,
                    tag_prefix_list=["cuda-"],
                    max_image_count=IMAGES_KEPT_PER_VARIANT,
                ),
                ecr.LifecycleRule(
                    rule_priority=5,
                    description="Backstop for anything else pushed here",
                    tag_status=ecr.TagStatus.ANY,
                    max_image_count=100,
                ),
            ],
        )
        # AES256 is ECR's default, which CDK leaves out of the template; state it explicitly.
        cfn_repository = self.repository.node.default_child
        cfn_repository.add_property_override("EncryptionConfiguration", {"EncryptionType": "AES256"})


class BuildProjects(Construct):
    """The two CodeBuild projects: the privileged image build and the model staging."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        repository: ecr.IRepository,
        artifacts: s3.IBucket,
        source: s3_assets.Asset,
        model: ModelArtifact,
        log_retention: logs.RetentionDays,
    ) -> None:
        super().__init__(scope, construct_id)
        self.image_buildspec = inline_buildspec("image.yml")
        self.model_buildspec = inline_buildspec("model.yml")
        self.key = kms.Key(
            self,
            "Key",
            description="Encrypts CodeBuild artifacts and caches of the decider image builds",
            enable_key_rotation=True,
            removal_policy=RemovalPolicy.DESTROY,
            pending_window=Duration.days(7),
        )
        image_logs = logs.LogGroup(
            self, "ImageBuildLogs", retention=log_retention, removal_policy=RemovalPolicy.DESTROY
        )
        self.image = codebuild.Project(
            self,
            "ImageBuild",
            description="Builds container/ into the decider image (VARIANT=cpu|cuda), "
            "pushes it by content tag",
            build_spec=self.image_buildspec,
            environment=codebuild.BuildEnvironment(
                build_image=codebuild.LinuxBuildImage.STANDARD_7_0,
                # Each variant sets its size, timeouts and buildspec at StartBuild (config). LARGE works
                # with the local Docker layer cache; a 2XLARGE build switches the cache off, which
                # CodeBuild does not support there (CodeBuild User Guide, "Local caching").
                compute_type=codebuild.ComputeType.LARGE,
                privileged=True,
            ),
            cache=codebuild.Cache.local(codebuild.LocalCacheMode.DOCKER_LAYER),
            timeout=Duration.minutes(60),
            queued_timeout=Duration.minutes(60),
            encryption_key=self.key,
            logging=codebuild.LoggingOptions(
                cloud_watch=codebuild.CloudWatchLoggingOptions(log_group=image_logs)
            ),
        )
        # The build's source is the project's own (the container/ asset), not StartBuild's: the provider
        # passes no source or buildspec (handlers/build_jobs.py). Set on the L1, so that the one narrow
        # read grant below stays the only one (Source.s3 would add CDK's wider bucket grant).
        cfn_image = self.image.node.default_child
        cfn_image.add_property_override("Source.Type", "S3")
        cfn_image.add_property_override("Source.Location", f"{source.s3_bucket_name}/{source.s3_object_key}")
        repository.grant_pull_push(self.image)
        # image.yml reads the pushed digest back (and finds an existing tag) with describe-images.
        repository.grant(self.image, "ecr:DescribeImages")
        grant_source_read(self.image, source)
        acknowledge(
            self.image,
            "AwsSolutions-CB3",
            "Privileged mode runs the Docker daemon that builds the container image; the build only "
            "runs our own container/ source.",
        )

        model_logs = logs.LogGroup(
            self, "ModelStagingLogs", retention=log_retention, removal_policy=RemovalPolicy.DESTROY
        )
        self.model = codebuild.Project(
            self,
            "ModelStaging",
            description="Copies the pinned GGUF from Hugging Face to the artifacts bucket, "
            "checking its sha256",
            build_spec=self.model_buildspec,
            environment=codebuild.BuildEnvironment(
                build_image=codebuild.LinuxBuildImage.STANDARD_7_0,
                compute_type=codebuild.ComputeType.SMALL,
            ),
            timeout=Duration.minutes(model.staging_timeout_minutes),
            queued_timeout=Duration.minutes(model.staging_queued_timeout_minutes),
            encryption_key=self.key,
            logging=codebuild.LoggingOptions(
                cloud_watch=codebuild.CloudWatchLoggingOptions(log_group=model_logs)
            ),
        )
        grant_models_access(self.model, artifacts, write=True)
        for project in (self.image, self.model):
            acknowledge(
                project,
                "AwsSolutions-IAM5[Action::kms:ReEncrypt*]",
                "CDK's grant for the CodeBuild encryption key; scoped to that single key.",
            )
            acknowledge(
                project,
                "AwsSolutions-IAM5[Action::kms:GenerateDataKey*]",
                "CDK's grant for the CodeBuild encryption key; scoped to that single key.",
            )
            name = Stack.of(project).get_logical_id(project.node.default_child)
            acknowledge(
                project,
                f"AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:logs:<AWS::Region>:<AWS::AccountId>:"
                f"log-group:/aws/codebuild/<{name}>:*]",
                "CodeBuild's default log group permission added by CDK, limited to this project's log "
                "streams (whose names CodeBuild generates per build).",
            )
            acknowledge(
                project,
                f"AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:codebuild:<AWS::Region>:<AWS::AccountId>:"
                f"report-group/<{name}>-*]",
                "CodeBuild's test-report groups of this project, added by CDK; named after the project.",
            )
        acknowledge(
            self.image,
            "AwsSolutions-IAM5[Resource::*]",
            "ecr:GetAuthorizationToken (docker login) has no resource-level permissions; kms:Decrypt of the "
            "bootstrap bucket's key (unknown at synth) is limited to S3 and to that bucket's objects.",
        )


class BuildProvider(Construct):
    """Custom-resource provider of the deploy-time jobs (stacks/handlers/codebuild_job.py), and the
    watcher that fails an image build's wait condition as soon as the build fails."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        projects: BuildProjects,
        repository: ecr.IRepository,
        artifacts: s3.IBucket,
        project: str,
        endpoint_stacks: dict[str, VariantConfig],
        jobs: dict[str, object],
        log_retention: logs.RetentionDays,
    ) -> None:
        """`jobs`: the builds it may start (handlers/build_jobs.py `document`), fixed at synth."""
        super().__init__(scope, construct_id)
        code = lambda_.Code.from_asset(str(HANDLERS_DIR), exclude=ASSET_EXCLUDES)
        limits = {
            "POLL_SECONDS": str(int(BUILD_POLL_INTERVAL.to_seconds())),
            "START_RETRY_MINUTES": str(BUILD_START_RETRY_MINUTES),
            "DEADLINE_GRACE_MINUTES": str(BUILD_DEADLINE_GRACE_MINUTES),
            build_jobs.ENV: Stack.of(self).to_json_string(jobs),
        }

        def handler(
            name: str, entry: str, timeout: Duration, description: str, *, environment: dict[str, str]
        ) -> lambda_.Function:
            return lambda_.Function(
                self,
                name,
                runtime=lambda_.Runtime.PYTHON_3_14,
                handler=entry,
                code=code,
                timeout=timeout,
                memory_size=256,
                description=description,
                environment=environment,
                log_group=logs.LogGroup(
                    self, f"{name}Logs", retention=log_retention, removal_policy=RemovalPolicy.DESTROY
                ),
            )

        on_event = handler(
            "OnEvent",
            "codebuild_job.on_event",
            Duration.minutes(2),
            "Deploy-time jobs: start or settle",
            environment=limits,
        )
        # The post-deploy check and the bake load start a sagemaker-runtime call only while this
        # function's time left holds it (every attempt hanging) and what follows (handlers/runtime_client.py).
        is_complete = handler(
            "IsComplete",
            "codebuild_job.is_complete",
            Duration.seconds(IS_COMPLETE_TIMEOUT_S),
            "Deploy-time jobs: poll",
            environment=limits,
        )
        stack = Stack.of(self)
        project_arns = [projects.image.project_arn, projects.model.project_arn]
        on_event.add_to_role_policy(
            iam.PolicyStatement(sid="StartBuilds", actions=["codebuild:StartBuild"], resources=project_arns)
        )
        # A rolled-back or deleted image request stops the build it started (found by its wait handle).
        on_event.add_to_role_policy(
            iam.PolicyStatement(
                sid="StopAbandonedImageBuilds",
                actions=["codebuild:ListBuildsForProject", "codebuild:BatchGetBuilds", "codebuild:StopBuild"],
                resources=[projects.image.project_arn],
            )
        )
        # Existing tag lookup, the deployed image's provenance (its manifest and config blob:
        # handlers/image_provenance.py), and its keep-<digest> tag (BatchGetImage + PutImage).
        on_event.add_to_role_policy(
            iam.PolicyStatement(
                sid="FindCheckAndKeepImages",
                actions=[
                    "ecr:DescribeImages",
                    "ecr:BatchGetImage",
                    "ecr:GetDownloadUrlForLayer",
                    "ecr:PutImage",
                ],
                resources=[repository.repository_arn],
            )
        )
        on_event.add_to_role_policy(
            iam.PolicyStatement(
                sid="ReadDeployedImageRecords",
                actions=["ssm:GetParameter"],
                resources=[
                    stack.format_arn(
                        service="ssm",
                        resource="parameter",
                        resource_name=deployed_image_parameter(project, variant).lstrip("/"),
                    )
                    for variant in endpoint_stacks.values()
                ],
            )
        )
        # The update guard compares the endpoint's blue/green peak with the account's quotas.
        on_event.add_to_role_policy(
            iam.PolicyStatement(
                sid="ReadEndpointQuotas",
                actions=["servicequotas:ListServiceQuotas", "servicequotas:ListAWSDefaultServiceQuotas"],
                resources=["*"],
            )
        )
        acknowledge(
            on_event,
            "AwsSolutions-IAM5[Resource::*]",
            "Service Quotas' List actions have no resource-level permissions; the update guard only reads "
            "SageMaker's instance quotas before an endpoint update.",
        )
        # ... and counts that peak from the live fleet (DescribeEndpoint: instances by pool type).
        on_event.add_to_role_policy(
            iam.PolicyStatement(
                sid="ReadLiveFleets",
                actions=["sagemaker:DescribeEndpoint"],
                resources=[
                    # SageMaker ARNs carry the endpoint name in lower case.
                    stack.format_arn(
                        service="sagemaker", resource="endpoint", resource_name=variant.endpoint_name.lower()
                    )
                    for variant in endpoint_stacks.values()
                ],
            )
        )
        # The post-deploy check and the update guard skip themselves while their stack rolls back.
        on_event.add_to_role_policy(
            iam.PolicyStatement(
                sid="SeeStackRollbacks",
                actions=["cloudformation:DescribeStacks"],
                resources=[
                    stack.format_arn(service="cloudformation", resource="stack", resource_name=f"{name}/*")
                    for name in endpoint_stacks
                ],
            )
        )
        for name in endpoint_stacks:
            acknowledge(
                on_event,
                f"AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:cloudformation:<AWS::Region>:"
                f"<AWS::AccountId>:stack/{name}/*]",
                "A stack ARN ends in an id CloudFormation generates; the function only reads the status "
                "of this endpoint stack.",
            )
        is_complete.add_to_role_policy(
            iam.PolicyStatement(
                sid="PollAndRetryBuilds",
                actions=[
                    "codebuild:BatchGetBuilds",
                    "codebuild:StopBuild",
                    "codebuild:StartBuild",
                    "codebuild:ListBuildsForProject",
                ],
                resources=project_arns,
            )
        )
        is_complete.add_to_role_policy(
            iam.PolicyStatement(
                sid="CheckDeployedEndpoints",
                actions=["sagemaker:DescribeEndpoint", "sagemaker:InvokeEndpoint"],
                resources=[
                    # SageMaker ARNs carry the endpoint name in lower case.
                    stack.format_arn(
                        service="sagemaker", resource="endpoint", resource_name=variant.endpoint_name.lower()
                    )
                    for variant in endpoint_stacks.values()
                ],
            )
        )
        self._allow_parking(is_complete, endpoint_stacks)
        for function in (on_event, is_complete):
            grant_models_access(function, artifacts, write=False)
        provider_logs = logs.LogGroup(
            self, "ProviderLogs", retention=log_retention, removal_policy=RemovalPolicy.DESTROY
        )
        self.provider = cr.Provider(
            self,
            "Provider",
            on_event_handler=on_event,
            is_complete_handler=is_complete,
            query_interval=BUILD_POLL_INTERVAL,
            total_timeout=PROVIDER_TOTAL_TIMEOUT,
            log_group=provider_logs,
            disable_waiter_state_machine_logging=False,
            waiter_state_machine_log_options=cr.LogOptions(
                destination=logs.LogGroup(
                    self, "WaiterLogs", retention=log_retention, removal_policy=RemovalPolicy.DESTROY
                ),
                level=sfn.LogLevel.ALL,
            ),
        )
        # A failed, stopped or timed-out image build fails its wait condition at once.
        watcher = handler(
            "BuildWatcher",
            "build_watcher.on_build_state_change",
            Duration.seconds(30),
            "Signals FAILURE to the wait condition of a failed image build",
            environment={},
        )
        projects.image.on_state_change(
            "ImageBuildFailed",
            target=targets.LambdaFunction(watcher, retry_attempts=4, max_event_age=Duration.hours(1)),
            event_pattern=events.EventPattern(detail={"build-status": list(FAILED_STATES)}),
            description="Failed image builds: signal FAILURE to their deploy's wait condition",
        )
        acknowledge(
            self,
            "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole]",
            "AWSLambdaBasicExecutionRole only lets the deploy-time functions write their own logs.",
        )
        acknowledge(
            self.provider,
            "AwsSolutions-IAM5[Resource::*]",
            "Step Functions log delivery (logs:CreateLogDelivery, PutResourcePolicy, …) has no "
            "resource-level permissions; granted by CDK to the waiter state machine only.",
        )
        acknowledge(
            self,
            "AwsSolutions-SF2",
            "The provider framework's waiter state machine only polls one build every 30 s; its "
            "execution history and ALL-level logs are enough to trace it without X-Ray.",
        )
        for child in self.node.find_all():
            if isinstance(child, lambda_.CfnFunction):
                acknowledge(
                    self,
                    f"AwsSolutions-IAM5[Resource::<{stack.get_logical_id(child)}.Arn>:*]",
                    "Invoke permission on the function's versions and aliases, generated by the "
                    "provider framework for its own functions.",
                )
        self.service_token = self.provider.service_token

    @staticmethod
    def _allow_parking(function: lambda_.Function, endpoint_stacks: dict[str, VariantConfig]) -> None:
        """A failing post-deploy check parks its endpoint on a copy of the previous config so that the
        stack's rollback can finish (stacks/handlers/post_deploy_check.py): it reads that config,
        creates `<endpoint>-parked-*`, updates the endpoint onto it and reads the rollback alarms."""
        stack = Stack.of(function)

        def arn(resource: str, name: str) -> str:
            return stack.format_arn(service="sagemaker", resource=resource, resource_name=name)

        endpoints = [variant.endpoint_name.lower() for variant in endpoint_stacks.values()]
        # The parked configs' names keep only the first characters of a long endpoint name.
        prefixes = [parked_prefix(variant.endpoint_name).lower() for variant in endpoint_stacks.values()]
        parked = [arn("endpoint-config", f"{prefix}*") for prefix in prefixes]
        function.add_to_role_policy(
            iam.PolicyStatement(
                sid="ReadPreviousConfigs",
                actions=["sagemaker:DescribeEndpointConfig"],
                resources=[arn("endpoint-config", "*")],
            )
        )
        function.add_to_role_policy(
            iam.PolicyStatement(
                sid="CreateParkedConfigs",
                actions=["sagemaker:CreateEndpointConfig", "sagemaker:AddTags", "sagemaker:ListTags"],
                resources=parked,
            )
        )
        function.add_to_role_policy(
            iam.PolicyStatement(
                sid="ParkEndpoints",
                actions=["sagemaker:UpdateEndpoint"],
                resources=[arn("endpoint", name) for name in endpoints] + parked,
            )
        )
        alarms = [
            stack.format_arn(
                service="cloudwatch",
                resource="alarm",
                resource_name=f"{name}-*",
                arn_format=ArnFormat.COLON_RESOURCE_NAME,
            )
            for name in endpoint_stacks
        ]
        function.add_to_role_policy(
            iam.PolicyStatement(
                sid="ReadRollbackAlarms", actions=["cloudwatch:DescribeAlarms"], resources=alarms
            )
        )
        # The caller of UpdateEndpoint must be allowed to use the config's volume key ("The KMS key
        # policy must grant permission to the IAM role that you specify in your CreateEndpoint,
        # UpdateEndpoint requests", CreateEndpointConfig KmsKeyId): through SageMaker only.
        function.add_to_role_policy(
            iam.PolicyStatement(
                sid="UseVolumeKeysThroughSageMaker",
                actions=["kms:CreateGrant", "kms:DescribeKey"],
                resources=["*"],
                conditions={"StringEquals": {"kms:ViaService": f"sagemaker.{Aws.REGION}.amazonaws.com"}},
            )
        )
        reason = (
            "Parking an endpoint for a rollback: endpoint configs have generated names (read any, create "
            "only <endpoint>-parked-*), alarm names end in a generated id, and the volume keys live in "
            "the endpoint stacks (used only through SageMaker)."
        )
        for resource in [
            "arn:<AWS::Partition>:sagemaker:<AWS::Region>:<AWS::AccountId>:endpoint-config/*",
            *[
                f"arn:<AWS::Partition>:sagemaker:<AWS::Region>:<AWS::AccountId>:endpoint-config/{prefix}*"
                for prefix in prefixes
            ],
            *[
                f"arn:<AWS::Partition>:cloudwatch:<AWS::Region>:<AWS::AccountId>:alarm:{n}-*"
                for n in endpoint_stacks
            ],
            "*",
        ]:
            acknowledge(function, f"AwsSolutions-IAM5[Resource::{resource}]", reason)


def inline_buildspec(name: str) -> codebuild.BuildSpec:
    """The buildspec from buildspec/<name>, inlined into the template so that `cdk diff` shows edits.

    (`BuildSpec.from_asset` would upload it to S3 and only the asset hash would change.)
    """
    spec = yaml.safe_load((BUILDSPEC_DIR / name).read_text(encoding="utf-8"))
    if not isinstance(spec, dict) or "phases" not in spec:
        raise ValueError(f"buildspec/{name} is not a CodeBuild buildspec (no phases)")
    return codebuild.BuildSpec.from_object_to_yaml(spec)


def grant_source_read(project: codebuild.Project, source: s3_assets.Asset) -> None:
    """Read exactly the container source object (not the whole bootstrap bucket)."""
    bucket_arn = Stack.of(project).format_arn(
        service="s3", region="", account="", resource=source.s3_bucket_name
    )
    project.add_to_role_policy(
        iam.PolicyStatement(
            actions=["s3:GetObject", "s3:GetObjectVersion"],
            resources=[f"{bucket_arn}/{source.s3_object_key}"],
        )
    )
    project.add_to_role_policy(
        iam.PolicyStatement(actions=["s3:GetBucketAcl", "s3:GetBucketLocation"], resources=[bucket_arn])
    )
    # A bootstrap bucket encrypted with a customer-managed key (`cdk bootstrap --bootstrap-kms-key-id`,
    # `--bootstrap-customer-key`) needs kms:Decrypt to read the source. The key is not known at synth:
    # allowed through S3 only, for objects of exactly this bucket (S3's encryption context is the
    # bucket's or the object's ARN); without such a key the statement grants nothing.
    project.add_to_role_policy(
        iam.PolicyStatement(
            sid="DecryptSourceWithBootstrapKey",
            actions=["kms:Decrypt"],
            resources=["*"],
            conditions={
                "StringEquals": {"kms:ViaService": f"s3.{Aws.REGION}.amazonaws.com"},
                "StringLike": {"kms:EncryptionContext:aws:s3:arn": [bucket_arn, f"{bucket_arn}/*"]},
            },
        )
    )


def grant_models_access(grantee: iam.IGrantable, artifacts: s3.IBucket, *, write: bool) -> None:
    """Read (and optionally write) the staged models under models/ of the artifacts bucket. Writing
    includes deleting: the staging build removes a Batch Transform archive an earlier version put
    under a model prefix the endpoint mounts (buildspec/model.yml)."""
    actions = ["s3:GetObject"] + (
        ["s3:PutObject", "s3:AbortMultipartUpload", "s3:DeleteObject"] if write else []
    )
    grantee.grant_principal.add_to_principal_policy(
        iam.PolicyStatement(actions=actions, resources=[artifacts.arn_for_objects("models/*")])
    )
    # ListBucket on the models/ prefix: a HeadObject on a missing key still answers 403 (there is no
    # unconditional ListBucket), and the handler tells absent from denied with a prefix listing.
    grantee.grant_principal.add_to_principal_policy(
        iam.PolicyStatement(
            actions=["s3:ListBucket"],
            resources=[artifacts.bucket_arn],
            conditions={"StringLike": {"s3:prefix": ["models/*"]}},
        )
    )
    bucket_id = Stack.of(artifacts).get_logical_id(artifacts.node.default_child)
    acknowledge(
        grantee,
        f"AwsSolutions-IAM5[Resource::<{bucket_id}.Arn>/models/*]",
        "Staged models live under models/<repository>/<revision>/<sha>/; the staging job and its "
        "handler address any pinned model below that prefix.",
    )


class ImageStack(Stack):
    """Shared resources of both endpoint stacks. Termination protection is on: the endpoint stacks
    depend on it through weak references that would not stop its deletion."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: AppConfig,
        endpoint_stacks: dict[str, VariantConfig],
        **kwargs,
    ) -> None:
        super().__init__(scope, construct_id, termination_protection=True, **kwargs)
        for key, value in cost_tags(config).items():  # cost allocation
            Tags.of(self).add(key, value)
        retention = retention_days(config.cpu.log_retention_days)
        self.store = ArtifactsStore(
            self,
            "Store",
            project=config.project,
            captures=expiring_prefixes(list(endpoint_stacks.values())),
        )
        self.artifacts = self.store.bucket
        self.artifacts_bucket_name = artifacts_bucket_name(config.project)
        self.repository = ImageRepository(self, "Images").repository
        # The image's build context. Its hash is a content hash of container/ (paths and bytes, not
        # modes or mtimes) minus caches, so an unchanged container keeps its tag and its diff empty.
        self.container_source = s3_assets.Asset(
            self, "ContainerSource", path=str(CONTAINER_DIR), exclude=container_excludes()
        )
        self.projects = BuildProjects(
            self,
            "Builds",
            repository=self.repository,
            artifacts=self.artifacts,
            source=self.container_source,
            model=config.model,
            log_retention=retention,
        )
        # The buildspecs as inlined into the projects (an input of the image tag).
        self.image_buildspec = self.projects.image_buildspec.to_build_spec()
        self.model_buildspec = self.projects.model_buildspec.to_build_spec()
        self.provider = BuildProvider(
            self,
            "BuildRunner",
            projects=self.projects,
            repository=self.repository,
            artifacts=self.artifacts,
            project=config.project,
            endpoint_stacks=endpoint_stacks,
            jobs=self._build_jobs(config.model, list(endpoint_stacks.values())),
            log_retention=retention,
        )
        self._keep_earlier_outputs()
        CfnOutput(
            self,
            "ImageRepositoryUri",
            value=self.repository.repository_uri,
            description="Push CI images here (buildspec/pipeline.yml IMAGE_REPOSITORY_URI): deployed digests "
            "get the keep-<digest> tag its lifecycle policy never expires",
        )

    def _keep_earlier_outputs(self) -> None:
        """Outputs that endpoint stacks deployed by an earlier version read by weak reference
        (`Fn::GetStackOutput`): their requests named the build projects and the repository. Nothing
        reads them now, but a rollback of such a stack to its previous template resolves them again,
        and CloudFormation does not track weak references, so removing them would surface only as an
        UPDATE_ROLLBACK_FAILED. Same names (a top-level construct id is its logical id), same values."""
        for name, value in EARLIER_WEAK_OUTPUTS.items():
            target = {
                "image-project": self.projects.image.project_name,
                "model-project": self.projects.model.project_name,
                "repository": self.repository.repository_name,
            }[value]
            CfnOutput(self, name, value=target, description=f"Read by earlier endpoint stacks ({value})")

    @property
    def source_hash(self) -> str:
        return self.container_source.asset_hash

    def image_tag(self, variant: VariantConfig) -> str:
        """The content tag of the variant's image, built from this stack's source and buildspec."""
        return image_tag(variant, self.source_hash, self.image_buildspec)

    def _build_jobs(self, model: ModelArtifact, variants: list[VariantConfig]) -> dict[str, object]:
        """What the provider may build: each variant's content tag, and the pinned model."""
        images = {
            self.image_tag(variant): build_jobs.image_recipe(
                variant=variant.build_variant,
                build_args="\n".join(f"{k}={v}" for k, v in variant.docker_build_args.items()),
                compute_type=variant.image_build.compute_type,
                timeout_minutes=variant.image_build.timeout_minutes,
                queued_timeout_minutes=variant.image_build.queued_timeout_minutes,
            )
            for variant in variants
        }
        return build_jobs.document(
            image_project=self.projects.image.project_name,
            repository_name=self.repository.repository_name,
            repository_uri=self.repository.repository_uri,
            images=images,
            model_project=self.projects.model.project_name,
            model=staging_fields(model, self.artifacts_bucket_name),
            archive_key=archive_key(model.s3_prefix),
        )


def staging_fields(model: ModelArtifact, bucket: str) -> dict[str, str]:
    """The model staging request's fields (build_jobs.MODEL_FIELDS) and its run limits."""
    return {
        "Bucket": bucket,
        "Prefix": model.s3_prefix,
        "Repository": model.repository,
        "Revision": model.revision,
        "File": model.file,
        "SizeBytes": str(model.size_bytes),
        "Sha256": model.sha256,
        "TimeoutMinutes": str(model.staging_timeout_minutes),
        "QueuedTimeoutMinutes": str(model.staging_queued_timeout_minutes),
    }
