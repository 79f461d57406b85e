"""Typed, validated configuration of the CDK app: one `VariantConfig` per endpoint.

Values come from the `cdk.json` context (objects `model`, `cpu`, `gpu`, plus a few top-level keys)
and from `-c` overrides on the command line, which may use dotted keys:

    npx cdk deploy CpuStack -c cpu.instance_type=ml.c7i.2xlarge -c cpu.container.n_ctx=4096

Everything is validated before a single construct is created, so a bad value fails `cdk synth`
with a message naming the key, not a CloudFormation error half an hour into a deploy.

This module must not import aws_cdk: the tools (promote, infra-diff, preflight, capacity-plan)
import it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from decider.memory_budget import GIB, Footprint, fit_problems, memory_need
from decider.settings import Settings
from decider_stacks.handlers.image_retention import IMAGE_URI_RE  # the handlers check the same form
from decider_stacks.instances import (
    GPU_FAMILIES,
    INSTANCE_TYPES,
    NON_GPU_ACCELERATOR_FAMILIES,
    gpu_model,
    instance_spec,
)
from decider_stacks.paths import CONTAINER_DIR

VariantName = Literal["cpu", "gpu"]
VARIANTS: tuple[VariantName, ...] = ("cpu", "gpu")
# The context keys this app owns; every other context key (CDK feature flags, …) is left alone.
ROOT_KEYS = ("project", "model", "cpu", "gpu", "image_uri", "model_s3_uri", "account", "region")

S3_PREFIX_RE = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])/(?P<prefix>(?:[^/]+/)+)$")
INSTANCE_TYPE_RE = re.compile(r"^ml\.(?P<family>[a-z0-9\-]+)\.(?P<size>[a-z0-9]+)$")
ENDPOINT_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
EMAIL_RE = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
# On every model and endpoint config of an endpoint (the stacks' and `promote apply`'s): which endpoint
# they belong to. `promote prune` deletes the unused ones it finds by this tag.
ENDPOINT_TAG = "promote:endpoint"
# The model as one gzip'd tar archive, for Batch Transform (ModelDataUrl): written by the model-staging
# build when a variant sets batch_transform, expected beside a prebuilt model_s3_uri prefix. Never under
# the prefix the endpoint's Model mounts: with S3Prefix, "SageMaker uses all objects that match the
# specified key name prefix" (S3ModelDataSource,
# https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_S3ModelDataSource.html), so every
# instance would download the model twice, and be denied the archive once batch_transform is off.
MODEL_ARCHIVE = "model.tar.gz"
ARCHIVE_PREFIX_SUFFIX = "-batch-transform/"


def archive_key(model_prefix: str) -> str:
    """The Batch Transform archive of the model under `model_prefix` (ending in /): in the sibling
    prefix `<prefix without its />-batch-transform/`, which the model prefix does not match."""
    return f"{model_prefix.rstrip('/')}{ARCHIVE_PREFIX_SUFFIX}{MODEL_ARCHIVE}"


TRANSFORM_MODEL_OUTPUT = "TransformModelName"  # the endpoint stack's output naming that Model (decide-batch)

# InferenceAmiVersion values CloudFormation accepts (the AWS::SageMaker::EndpointConfig schema in
# cfn-lint 1.58.0), minus the Neuron one, with the CUDA version of each AMI's driver (the
# ProductionVariant.InferenceAmiVersion API reference: 535 = 12.2, 550 = 12.4, 580 = 13.0).
INFERENCE_AMI_CUDA = {
    "al2-ami-sagemaker-inference-gpu-2": "12.2",
    "al2-ami-sagemaker-inference-gpu-2-1": "12.2",
    "al2-ami-sagemaker-inference-gpu-3-1": "12.4",
    "al2023-ami-sagemaker-inference-gpu-4-1": "13.0",
}
INFERENCE_AMI_VERSIONS = tuple(INFERENCE_AMI_CUDA)
# CUDA architectures the CUDA image can be compiled for: what its CUDA 12.4 toolkit supports and
# llama.cpp's CUDA backend runs on (Turing and newer). Blackwell (sm_100, sm_120) needs CUDA 12.8.
CUDA_IMAGE_ARCHITECTURES = frozenset({"75", "80", "86", "89", "90"})
CUDA_DEVEL_IMAGE_RE = re.compile(r"^ARG CUDA_DEVEL_IMAGE=\S+?:(\d+)\.(\d+)(?:\.\d+)?-devel", re.M)


def image_cuda_version(dockerfile: Path = CONTAINER_DIR / "Dockerfile") -> str:
    """The CUDA image's toolkit version (`12.4`), read from the Dockerfile's CUDA base image: the one
    place it is set, so the AMI below can never disagree with what the image was built with."""
    match = CUDA_DEVEL_IMAGE_RE.search(dockerfile.read_text())
    if match is None:
        raise ValueError(f"{dockerfile} names no CUDA_DEVEL_IMAGE with a version tag")
    return f"{match[1]}.{match[2]}"


def _cuda(version: str) -> tuple[int, int]:
    major, minor = version.split(".")
    return int(major), int(minor)


def inference_ami_for(cuda: str) -> str:
    """The AMI for an image built with CUDA `cuda`: the lowest driver of the same CUDA major that is
    at least as new. Same major because a CUDA 12 container on the CUDA 13 AMI (driver 580) was seen
    stuck in `Creating` with no log (aws/deep-learning-containers#6187: CUDA 12.9 image on
    al2023-ami-sagemaker-inference-gpu-4-1); at least as new so that no forward-compat is needed."""
    wanted = _cuda(cuda)
    fits = [
        (_cuda(c), ami)
        for ami, c in INFERENCE_AMI_CUDA.items()
        if _cuda(c)[0] == wanted[0] and _cuda(c) >= wanted
    ]
    if not fits:
        raise ValueError(f"no SageMaker inference AMI has a driver for CUDA {cuda}")
    return min(fits)[1]


CUDA_IMAGE_TOOLKIT = image_cuda_version()

# TransformAmiVersion values for Batch Transform (TransformResources, API reference:
# https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_TransformResources.html lists only
# al2-ami-sagemaker-batch-gpu-470 and al2-ami-sagemaker-batch-gpu-535), with the newest CUDA each
# driver runs natively (470 = CUDA 11.4, 535 = CUDA 12.2; R535's "maximum CUDA major version supported
# without forward compatibility package" is CUDA 12,
# https://docs.nvidia.com/datacenter/tesla/drivers/supported-drivers-and-cuda-toolkit-versions.html).
TRANSFORM_AMI_CUDA = {
    "al2-ami-sagemaker-batch-gpu-470": "11.4",
    "al2-ami-sagemaker-batch-gpu-535": "12.2",
}


def transform_ami_for(cuda: str) -> str:
    """The Batch Transform AMI for an image built with CUDA `cuda`: the newest driver of the image's
    CUDA major. No batch AMI has a driver as new as CUDA 12.4's (550), so the CUDA 12.4 image runs on
    driver 535 the way docs/deploy.md accepts for the endpoint's al2-ami-sagemaker-inference-gpu-2:
    CUDA minor version compatibility (a 12.x runtime on a 12.x driver; the image carries SASS for its
    GPUs, so no newer PTX is JIT-compiled) and, on top, the image's cuda-compat-12-4 forward
    compatibility libraries, which entrypoint.sh puts on LD_LIBRARY_PATH when the driver (535) is
    older than the compat library (550); forward compatibility is for data center GPUs, which every
    GPU type Batch Transform offers is. Another CUDA major (the 470 AMI under a CUDA 12 image, any
    batch AMI under a CUDA 13 image) is refused: decide-batch never submits a job that cannot load."""
    wanted = _cuda(cuda)
    fits = [(_cuda(c), ami) for ami, c in TRANSFORM_AMI_CUDA.items() if _cuda(c)[0] == wanted[0]]
    if not fits:
        offered = ", ".join(f"{ami} (CUDA {c})" for ami, c in TRANSFORM_AMI_CUDA.items())
        raise ValueError(
            f"no Batch Transform AMI has a driver of the CUDA image's major (CUDA {cuda}); "
            f"TransformAmiVersion offers only {offered}"
        )
    return max(fits)[1]


# Build arguments the app sets itself (per variant / from the instance types); never user-set.
RESERVED_BUILD_ARGS = frozenset({"VARIANT", "CUDA_ARCHITECTURES"})

# --- deploy-time limits (checked below, used by stacks/ and the build handler) ---------------------
# A CloudFormation custom resource waits at most 3600 s (ServiceTimeout is 1-3600; AWS CloudFormation
# template reference, AWS::CloudFormation::CustomResource), and the CDK provider framework cannot
# stretch that (aws/aws-cdk#24974). The provider gives up a little earlier, so it reports the timeout
# itself instead of CloudFormation's generic one.
CUSTOM_RESOURCE_TIMEOUT_S = 3600
PROVIDER_TOTAL_TIMEOUT_MINUTES = 55
# The provider's polling Lambda (isComplete): the post-deploy check's and the bake load's calls through
# sagemaker-runtime must end within it (stacks/handlers/runtime_client.py bounds each call).
IS_COMPLETE_TIMEOUT_S = 300
# The image build may take longer, so its result arrives as a signal on an
# AWS::CloudFormation::WaitCondition, whose Timeout is at most 43200 s (12 h).
WAIT_CONDITION_MAX_S = 43_200
IMAGE_WAIT_MARGIN_MINUTES = 15  # signal delivery, push, provisioning on top of queue + build time
# CodeBuild refuses StartBuild with AccountLimitExceededException while the account's concurrent-build
# quota is used up (0 on some new accounts); the handler retries with backoff for this long.
BUILD_START_RETRY_MINUTES = 10
# A build still running this long after its own timeout is stopped by the handler.
BUILD_DEADLINE_GRACE_MINUTES = 5
# Autoscaling on concurrency: a server taking requests one after the other, with random arrivals, holds
# on average rho / (1 - rho) requests at utilisation rho (M/M/1); at the 70 % the invocation targets use,
# 2.3 (tools/cli/capacity/planner.py prints the derivation).
TARGET_UTILISATION = 0.7
DEFAULT_CONCURRENCY_TARGET = round(TARGET_UTILISATION / (1 - TARGET_UTILISATION), 1)
DEFAULT_EBS_VOLUME_GB = 30  # ML storage volume on EBS-backed types: the 3 GB GGUF twice, plus room

# CloudWatch Logs' allowed retention periods, in the order of aws_logs.RetentionDays.
LOG_RETENTION_DAYS = (
    1,
    3,
    5,
    7,
    14,
    30,
    60,
    90,
    120,
    150,
    180,
    365,
    400,
    545,
    731,
    1096,
    1827,
    2192,
    2557,
    2922,
    3288,
    3653,
)


class ConfigError(ValueError):
    """The app's configuration is invalid; the message lists every problem, one per line."""


def instance_family(instance_type: str) -> str:
    match = INSTANCE_TYPE_RE.match(instance_type)
    if not match:
        raise ValueError(f"{instance_type!r} is not a SageMaker instance type like ml.c7i.xlarge")
    return match["family"]


def has_accelerator(instance_type: str) -> bool:
    """GPU, Inferentia or Trainium: from stacks/instances.py for known types, by family otherwise."""
    if instance_type in INSTANCE_TYPES:
        return INSTANCE_TYPES[instance_type].gpus > 0
    family = instance_family(instance_type)
    return family in GPU_FAMILIES or family in NON_GPU_ACCELERATOR_FAMILIES


def supports_volume_kms(instance_type: str) -> bool:
    """False for instance types with NVMe instance storage, which reject an endpoint-config KmsKeyId
    and VolumeSizeInGB (SageMaker provisions no EBS volume on them).

    Known types come from stacks/instances.py. For others: accelerator families are NVMe-backed, and
    so is every family with a `d` after its generation (c5d, m6id, …).
    """
    if instance_type in INSTANCE_TYPES:
        return INSTANCE_TYPES[instance_type].storage == "ebs"
    if has_accelerator(instance_type):
        return False
    return not re.fullmatch(r"[a-z]+\d+[a-z]*d[a-z]*", instance_family(instance_type))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelArtifact(_Strict):
    """The pinned GGUF that the model-staging build copies from Hugging Face into the artifacts bucket."""

    repository: str = Field(pattern=r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$", description="Hugging Face repository.")
    revision: str = Field(pattern=r"^[0-9a-f]{40}$", description="Commit sha of the repository (immutable).")
    file: str = Field(pattern=r"^[\w.\-]+\.gguf$", description="GGUF file name in the repository.")
    size_bytes: int = Field(gt=0, description="Exact file size; checked before hashing.")
    sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="Full sha256 of the file; checked by the build."
    )
    staging_timeout_minutes: int = Field(
        25, ge=5, le=60, description="Timeout of the model-staging build (download, hash, upload)."
    )
    staging_queued_timeout_minutes: int = Field(
        10, ge=5, le=60, description="How long the staging build may wait in CodeBuild's queue."
    )
    kv_bytes_per_token: int | None = Field(
        None,
        gt=0,
        description="KV cache bytes per context token (attention layers x KV heads x head size x K and V x "
        "2 bytes of f16): with the two below, the memory check of each variant at synth.",
    )
    recurrent_bytes_per_sequence: int | None = Field(
        None, ge=0, description="Recurrent state bytes per sequence (0 for a pure transformer)."
    )
    n_vocab: int | None = Field(None, gt=0, description="Vocabulary size (the logits buffer's row).")

    @model_validator(mode="after")
    def _fits_the_custom_resource_ceiling(self) -> ModelArtifact:
        total = staging_budget_minutes(self)
        if total > PROVIDER_TOTAL_TIMEOUT_MINUTES:
            raise ValueError(
                f"staging_timeout_minutes: {self.staging_timeout_minutes} + queue "
                f"{self.staging_queued_timeout_minutes} + start retries {BUILD_START_RETRY_MINUTES} + grace "
                f"{BUILD_DEADLINE_GRACE_MINUTES} = {total} min exceeds the {PROVIDER_TOTAL_TIMEOUT_MINUTES} "
                "min a custom resource can wait (CloudFormation allows 3600 s)"
            )
        return self

    @property
    def footprint(self) -> Footprint | None:
        """Its memory by shape (decider.memory_budget), when the three shape fields are given."""
        shape = (self.kv_bytes_per_token, self.recurrent_bytes_per_sequence, self.n_vocab)
        if any(value is None for value in shape):
            return None
        return Footprint(self.size_bytes, *shape)  # type: ignore[arg-type]

    @property
    def s3_prefix(self) -> str:
        """Where the staged model lives in the artifacts bucket: immutable, one GGUF per prefix."""
        return f"models/{self.repository}/{self.revision}/{self.sha256[:12]}/"

    @property
    def download_url(self) -> str:
        return f"https://huggingface.co/{self.repository}/resolve/{self.revision}/{self.file}"


def staging_budget_minutes(model: ModelArtifact) -> int:
    """Worst case from the staging request to its result: start retries, queue, build, grace."""
    return (
        BUILD_START_RETRY_MINUTES
        + model.staging_queued_timeout_minutes
        + model.staging_timeout_minutes
        + BUILD_DEADLINE_GRACE_MINUTES
    )


class DeploymentConfig(_Strict):
    """Blue/green update policy of the endpoint (applies when the endpoint config changes)."""

    traffic_routing: Literal["CANARY", "LINEAR", "ALL_AT_ONCE"] = Field(
        "CANARY", description="How traffic moves to the new fleet."
    )
    step_instance_count: int = Field(
        1, ge=1, description="Instances in the canary (CANARY) or in each step (LINEAR)."
    )
    wait_interval_s: int = Field(600, ge=0, le=3600, description="Baking time between traffic steps.")
    termination_wait_s: int = Field(
        300, ge=0, le=3600, description="Final baking time before the old fleet is terminated."
    )
    maximum_execution_timeout_s: int = Field(
        7200, ge=600, le=28800, description="Upper bound for the whole deployment."
    )
    synthetic_load_per_minute: int = Field(
        12,
        ge=0,
        le=120,
        description="Small decision requests a minute sent while an update bakes, so that the rollback "
        "alarms can judge a quiet canary (0: none). At least alarms.error_rate_min_invocations to count.",
    )


class AlarmConfig(_Strict):
    """Thresholds of the endpoint's alarms; the first two roll a deployment back. Every alarm notifies
    the stack's SNS topic (and `email`, when set)."""

    error_rate_percent: float = Field(
        5.0,
        gt=0,
        le=100,
        description="Invocation5XXErrors / Invocations in % that trips rollback (2 of 3 minutes).",
    )
    error_rate_min_invocations: int = Field(
        10, ge=1, description="Invocations a minute below which the error rates count as 0 (noise)."
    )
    latency_p90_ms: int = Field(
        20_000, ge=1, le=600_000, description="ModelLatency p90 in ms that trips rollback (2 of 3 minutes)."
    )
    client_error_rate_percent: float = Field(
        25.0, gt=0, le=100, description="Invocation4XXErrors / Invocations in % that notifies (2 of 3)."
    )
    model_error_rate_percent: float = Field(
        10.0,
        gt=0,
        le=100,
        description="InvocationModelErrors (any non-2xx answer or timeout) / Invocations in % (2 of 3).",
    )
    model_setup_time_s: int = Field(
        900,
        ge=1,
        le=3600,
        description="ModelSetupTime that notifies (SageMaker documents it for serverless endpoints; an "
        "instance-backed variant may never report it).",
    )
    disk_percent: float = Field(
        90.0, gt=0, le=100, description="DiskUtilization of an instance (model, logs) that notifies (5 min)."
    )
    email: str | None = Field(None, description="Subscribes this address to the alarm topic (confirm it).")

    @field_validator("email")
    @classmethod
    def _email(cls, value: str | None) -> str | None:
        if value is not None and not EMAIL_RE.match(value):
            raise ValueError(f"{value!r} is not an e-mail address")
        return value


class DataCaptureConfig(_Strict):
    enabled: bool = Field(False, description="Capture requests and responses to the artifacts bucket.")
    sampling_percentage: int = Field(10, ge=1, le=100, description="Share of requests captured.")
    retention_days: int = Field(
        30,
        ge=1,
        le=3650,
        description="Captured requests and responses (they may hold prompts) expire after this many days.",
    )


class RoutingConfig(_Strict):
    """How SageMaker spreads requests over the instances (ProductionVariant RoutingConfig)."""

    strategy: Literal["LEAST_OUTSTANDING_REQUESTS", "RANDOM", "PREFIX_AWARE"] | None = Field(
        None, description="Unset: SageMaker's default. PREFIX_AWARE: same body prefix → same instance."
    )
    prefix_length: int = Field(
        4096, ge=1024, le=65536, description="PREFIX_AWARE: bytes of the body that form the prefix."
    )
    concurrency_threshold: int = Field(
        2, ge=1, le=1024, description="PREFIX_AWARE: in-flight requests before another instance is used."
    )


class AsyncInferenceSettings(_Strict):
    """The endpoint config's AsyncInferenceConfig and its scale-to-zero autoscaling
    (`invocation: async`; stacks/async_inference.py)."""

    max_concurrent_invocations_per_instance: int | None = Field(
        None,
        ge=1,
        le=1000,
        description="MaxConcurrentInvocationsPerInstance; default: the container's queue_size (its capacity: "
        "more at once would be refused with 429).",
    )
    invocation_timeout_s: int = Field(
        3600,
        ge=1,
        le=3600,
        description="The InvocationTimeoutSeconds clients should send (decide-batch async does); the "
        "container's deadline is this less 5 s unless container.deadline_seconds is set.",
    )
    min_capacity: int = Field(0, ge=0, le=100, description="Autoscaling lower bound: 0 scales to zero.")
    backlog_per_instance: float = Field(
        4.0, gt=0, le=1000, description="Target tracking on ApproximateBacklogSizePerInstance."
    )
    scale_up_from_zero_cooldown_s: int = Field(
        300, ge=0, le=3600, description="Cooldown of the step policy on HasBacklogWithoutCapacity."
    )
    retention_days: int = Field(
        30,
        ge=1,
        le=3650,
        description="Request bodies, answers and failures under async/<endpoint>/ (they may hold prompts) "
        "expire after this many days.",
    )


class ImageBuildConfig(_Strict):
    compute_type: Literal[
        "BUILD_GENERAL1_MEDIUM", "BUILD_GENERAL1_LARGE", "BUILD_GENERAL1_XLARGE", "BUILD_GENERAL1_2XLARGE"
    ] = Field(
        "BUILD_GENERAL1_LARGE",
        description="CodeBuild compute for this variant's image build (2XLARGE builds run without the "
        "local Docker layer cache, which CodeBuild does not support there).",
    )
    timeout_minutes: int = Field(60, ge=10, le=600, description="Build timeout.")
    queued_timeout_minutes: int = Field(
        60, ge=5, le=480, description="How long the build may wait in CodeBuild's queue."
    )
    build_args: dict[str, str] = Field(
        default_factory=dict,
        description="Extra `docker build --build-arg`s, e.g. a base-image mirror "
        "(PYTHON_IMAGE=…); part of the image tag.",
    )

    @field_validator("build_args", mode="before")
    @classmethod
    def _scalars_as_text(cls, value: Any) -> Any:
        """`-c …build_args.X=80` arrives JSON-decoded as a number; a build argument is text."""
        if isinstance(value, dict):
            return {
                k: str(v).lower() if isinstance(v, bool) else str(v) if isinstance(v, int | float) else v
                for k, v in value.items()
            }
        return value

    @field_validator("build_args")
    @classmethod
    def _build_args(cls, value: dict[str, str]) -> dict[str, str]:
        for name, arg in value.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or name in RESERVED_BUILD_ARGS:
                raise ValueError(
                    f"{name!r} is not a usable build argument name (VARIANT is set per variant, "
                    "CUDA_ARCHITECTURES from the instance types)"
                )
            if not isinstance(arg, str) or "\n" in arg:
                raise ValueError(f"{name}: value must be a single-line string")
        return dict(sorted(value.items()))

    @model_validator(mode="after")
    def _fits_the_wait_condition(self) -> ImageBuildConfig:
        total = image_wait_minutes(self)
        if total * 60 > WAIT_CONDITION_MAX_S:
            raise ValueError(
                f"timeout_minutes: {self.timeout_minutes} + queue {self.queued_timeout_minutes} + margin "
                f"{IMAGE_WAIT_MARGIN_MINUTES} = {total} min exceeds the 720 min a CloudFormation "
                "WaitCondition can wait"
            )
        return self


def image_wait_minutes(build: ImageBuildConfig) -> int:
    """The image build's WaitCondition timeout: queue + build + margin."""
    return build.queued_timeout_minutes + build.timeout_minutes + IMAGE_WAIT_MARGIN_MINUTES


class VariantConfig(_Strict):
    """Everything that differs between the CPU and the GPU endpoint."""

    name: VariantName
    endpoint_name: str = Field(description="Stable endpoint name (configs get generated names).")
    replace_endpoint: str | None = Field(
        None,
        description="Consent to rename the endpoint of a deployed stack, naming the endpoint the rename "
        "DELETES. EndpointName is create-only: CloudFormation creates the endpoint under the new name, then "
        "deletes this one and its log group. Without it the update guard refuses any rename.",
    )
    instance_type: str = Field(description="SageMaker hosting instance type (first choice).")
    instance_pools: list[str] = Field(
        default_factory=list,
        max_length=4,
        description="Fallback instance types, in order, when instance_type has no capacity "
        "(InstancePools, priorities 2-5).",
    )
    provision_timeout_s: int | None = Field(
        None,
        ge=300,
        le=3600,
        description="VariantInstanceProvisionTimeoutInSeconds: time to find capacity across the pools.",
    )
    initial_instance_count: int = Field(
        2, ge=1, le=100, description="Instances when the endpoint is created."
    )
    min_capacity: int = Field(2, ge=1, le=100, description="Autoscaling lower bound.")
    max_capacity: int = Field(4, ge=1, le=100, description="Autoscaling upper bound.")
    autoscaling: bool = Field(
        True,
        description="Register the variant with Application Auto Scaling (turn off to change instance type).",
    )
    scaling_metric: Literal["concurrency", "invocations"] = Field(
        "concurrency",
        description="Target tracking on SageMakerVariantConcurrentRequestsPerModelHighResolution (10 s, "
        "counts queued and streaming requests) or on SageMakerVariantInvocationsPerInstance (per minute).",
    )
    target_concurrency_per_instance: float = Field(
        DEFAULT_CONCURRENCY_TARGET,
        gt=0,
        le=1000,
        description="scaling_metric=concurrency: requests in the container per instance, on average "
        "(capacity-plan: what one back-to-back server holds at 70 % utilisation).",
    )
    target_invocations_per_instance: int = Field(
        60,
        ge=1,
        description="scaling_metric=invocations: target tracking on SageMakerVariantInvocationsPerInstance "
        "(per minute).",
    )
    scale_in_cooldown_s: int = Field(600, ge=0, le=3600, description="Wait after a scale-in.")
    scale_out_cooldown_s: int = Field(120, ge=0, le=3600, description="Wait after a scale-out.")
    container_startup_health_check_timeout_s: int = Field(
        900, ge=60, le=3600, description="Time for /ping to turn 200 after the container starts."
    )
    model_data_download_timeout_s: int = Field(
        900, ge=60, le=3600, description="Time to copy the model prefix to the instance."
    )
    volume_kms: bool | None = Field(
        None,
        description="Encrypt the instance's ML storage volume with a customer key; default: "
        "yes where the instance type allows it (not on NVMe types such as g5/g6).",
    )
    volume_size_gb: int | None = Field(
        None,
        ge=1,
        le=512,
        description=f"EBS ML storage volume (VolumeSizeInGB); default {DEFAULT_EBS_VOLUME_GB} on EBS-backed "
        "types, refused on NVMe types.",
    )
    inference_ami_version: str | None = Field(
        None,
        description="GPU driver AMI (GPU only); default: the one for the CUDA image's CUDA version "
        "(decider_stacks.config.inference_ami_for). Another is refused when its CUDA major differs.",
    )
    network_isolation: bool = Field(True, description="No outbound network from the container.")
    log_retention_days: int = Field(
        30, description="Log retention of the endpoint (ImageStack's build logs use cpu's value)."
    )
    log_kms: bool = Field(
        True,
        description="Encrypt the endpoint's log group (which may hold prompts) with a customer-managed key.",
    )
    image_uri: str | None = Field(
        None, description="Prebuilt image <repo>@sha256:<digest>: skips the build. Global key: image_uri."
    )
    image_source: Literal["auto", "build"] = Field(
        "auto",
        description="Without image_uri: `auto` keeps an image pinned by an earlier `-c image_uri` deploy "
        "(recorded in SSM), else builds container/; `build` always builds container/.",
    )
    model_s3_uri: str | None = Field(
        None, description="Prebuilt model prefix s3://bucket/prefix/: skips staging. Global: model_s3_uri."
    )
    invocation: Literal["realtime", "async"] = Field(
        "realtime",
        description="realtime (InvokeEndpoint) or async (AsyncInferenceConfig: InvokeEndpointAsync only, "
        "results in S3, SNS notifications, scale to zero). An endpoint is one or the other.",
    )
    async_inference: AsyncInferenceSettings = AsyncInferenceSettings()
    batch_transform: bool = Field(
        False,
        description="Let Batch Transform jobs of this Model (decide-batch) read batch/<endpoint>/input/ and "
        "write batch/<endpoint>/output/ in the artifacts bucket (stacks/client_access.py).",
    )
    openai_path_policy: bool = Field(
        False,
        description="A managed policy (output OpenAiPathPolicyArn) for callers of SageMaker's "
        "OpenAI-compatible chat path: sagemaker:CallWithBearerToken and InvokeEndpoint on this endpoint.",
    )
    image_build: ImageBuildConfig = ImageBuildConfig()
    deployment: DeploymentConfig = DeploymentConfig()
    alarms: AlarmConfig = AlarmConfig()
    routing: RoutingConfig = RoutingConfig()
    data_capture: DataCaptureConfig = DataCaptureConfig()
    container: dict[str, Any] = Field(
        default_factory=dict,
        description="Container settings (decider.settings.Settings field names), validated by Settings.",
    )

    @property
    def is_gpu(self) -> bool:
        return self.name == "gpu"

    @property
    def blue_green_peak(self) -> int:
        """Instances an update runs at once at most: the old fleet and a new one of its size (the new
        one keeps the autoscaled count, RetainAllVariantProperties)."""
        fleet = self.max_capacity if self.autoscaling else self.initial_instance_count
        return 2 * fleet

    @property
    def fleet_ceiling(self) -> tuple[int, str]:
        """The most instances the variant can run when an update starts, and the key that sets it."""
        if self.autoscaling:
            return self.max_capacity, "max_capacity"
        return self.initial_instance_count, "initial_instance_count"

    def blue_green_waits_s(self, fleet: int) -> int:
        """The waiting a blue/green update of `fleet` instances is told to do: WaitIntervalInSeconds
        after the canary (CANARY) or after every step (LINEAR: ceil(fleet / step) steps), once after
        the full shift (ALL_AT_ONCE), plus TerminationWaitInSeconds."""
        policy = self.deployment
        routing = self.traffic_routing
        steps = math.ceil(fleet / policy.step_instance_count) if routing == "LINEAR" else 1
        return steps * policy.wait_interval_s + policy.termination_wait_s

    def _blue_green_problems(self) -> list[str]:
        """What UpdateEndpoint refuses in the deployment policy, caught at synth rather than after the
        image build. TrafficRoutingConfig: LinearStepSize "must be 10-50% of the variant's total instance
        count" (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_TrafficRoutingConfig.html;
        the 50 % side is checked against floor_capacity above). BlueGreenUpdatePolicy:
        MaximumExecutionTimeoutInSeconds "should be larger than the total waiting time specified in
        TerminationWaitInSeconds and WaitIntervalInSeconds"
        (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_BlueGreenUpdatePolicy.html)."""
        problems = []
        policy = self.deployment
        fleet, fleet_key = self.fleet_ceiling
        if self.traffic_routing == "LINEAR" and policy.step_instance_count * 10 < fleet:
            problems.append(
                f"deployment.step_instance_count: {policy.step_instance_count} is below 10 % of {fleet_key} "
                f"({fleet}): SageMaker rejects a LINEAR step under 10 % of the variant's instance count "
                f"(LinearStepSize must be 10-50 %). Use at least {math.ceil(fleet / 10)}, or CANARY"
            )
        waits = self.blue_green_waits_s(fleet)
        if policy.maximum_execution_timeout_s <= waits:
            problems.append(
                f"deployment.maximum_execution_timeout_s: {policy.maximum_execution_timeout_s} s is not "
                f"larger than the update's waits ({waits} s: wait_interval_s {policy.wait_interval_s} x "
                f"{(waits - policy.termination_wait_s) // max(policy.wait_interval_s, 1)} step(s) at "
                f"{fleet_key} {fleet}, plus termination_wait_s {policy.termination_wait_s}); SageMaker "
                "needs MaximumExecutionTimeoutInSeconds above them, and the new fleet's launch on top. "
                "Raise it (up to 28800) or shorten the waits"
            )
        return problems

    @property
    def floor_capacity(self) -> tuple[int, str]:
        """The fewest instances the variant can run when an update starts, and the key that sets it:
        autoscaling's minimum (an async endpoint's may be 0), else the fixed instance count."""
        if not self.autoscaling:
            return self.initial_instance_count, "initial_instance_count"
        if self.invocation == "async":
            return self.async_inference.min_capacity, "async_inference.min_capacity"
        return self.min_capacity, "min_capacity"

    @property
    def traffic_routing(self) -> Literal["CANARY", "LINEAR", "ALL_AT_ONCE"]:
        """The blue/green routing the Endpoint gets. CanarySize and LinearStepSize "must be less than or
        equal to 50% of the variant's total instance count" (SageMaker API reference,
        https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_TrafficRoutingConfig.html): an
        async variant that scales to zero has no canary, so unless `deployment.traffic_routing` is set
        it updates ALL_AT_ONCE (an explicit CANARY there is refused by the validation)."""
        chosen = self.deployment.traffic_routing
        explicit = "traffic_routing" in self.deployment.model_fields_set
        too_small = self.deployment.step_instance_count * 2 > self.floor_capacity[0]
        if not explicit and self.invocation == "async" and too_small:
            return "ALL_AT_ONCE"
        return chosen

    @property
    def ami_version(self) -> str | None:
        """The endpoint's InferenceAmiVersion: the configured one, else the CUDA image's; None on CPU."""
        if not self.is_gpu:
            return None
        return self.inference_ami_version or inference_ami_for(CUDA_IMAGE_TOOLKIT)

    @property
    def build_variant(self) -> Literal["cpu", "cuda"]:
        """The Dockerfile's VARIANT build argument."""
        return "cuda" if self.is_gpu else "cpu"

    @property
    def instance_types(self) -> list[str]:
        """Every type the variant may run on, in priority order (instance_type, then the pools)."""
        return [self.instance_type, *self.instance_pools]

    @property
    def cuda_architectures(self) -> str | None:
        """`CMAKE_CUDA_ARCHITECTURES` for the GPUs of the allowed types, e.g. `86;89`; None on CPU."""
        if not self.is_gpu:
            return None
        archs = {model.cuda_arch for t in self.instance_types if (model := gpu_model(t)) is not None}
        return ";".join(sorted(archs, key=int))

    @property
    def docker_build_args(self) -> dict[str, str]:
        """Every `--build-arg` besides VARIANT: the configured ones plus the CUDA architectures."""
        args = dict(self.image_build.build_args)
        if self.cuda_architectures:
            args["CUDA_ARCHITECTURES"] = self.cuda_architectures
        return dict(sorted(args.items()))

    @property
    def on_ebs(self) -> bool:
        """All allowed types keep the ML storage volume on EBS (KmsKeyId and VolumeSizeInGB apply)."""
        return all(supports_volume_kms(t) for t in self.instance_types)

    @property
    def encrypt_volume(self) -> bool:
        return self.on_ebs if self.volume_kms is None else self.volume_kms

    @property
    def ebs_volume_size_gb(self) -> int | None:
        """VolumeSizeInGB for the endpoint config, or None on NVMe types."""
        if not self.on_ebs:
            return None
        return self.volume_size_gb or DEFAULT_EBS_VOLUME_GB

    @field_validator("endpoint_name")
    @classmethod
    def _endpoint_name(cls, value: str) -> str:
        if not ENDPOINT_NAME_RE.match(value):
            raise ValueError("must be 1-63 letters, digits or hyphens, starting with a letter or digit")
        return value

    @field_validator("replace_endpoint")
    @classmethod
    def _replace_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not ENDPOINT_NAME_RE.match(value):
            raise ValueError("must name an endpoint: 1-63 letters, digits or hyphens")
        return value

    @field_validator("instance_type")
    @classmethod
    def _instance_type(cls, value: str) -> str:
        instance_family(value)
        return value

    @field_validator("instance_pools")
    @classmethod
    def _instance_pools(cls, value: list[str]) -> list[str]:
        for item in value:
            instance_family(item)
        if len(set(value)) != len(value):
            raise ValueError("lists an instance type twice")
        return value

    @field_validator("log_retention_days")
    @classmethod
    def _retention(cls, value: int) -> int:
        if value not in LOG_RETENTION_DAYS:
            raise ValueError(f"must be one of the CloudWatch Logs retention periods {LOG_RETENTION_DAYS}")
        return value

    @field_validator("image_uri")
    @classmethod
    def _image_uri(cls, value: str | None) -> str | None:
        if value is not None and not IMAGE_URI_RE.match(value):
            raise ValueError(
                f"{value!r} must be a private ECR image referenced by digest, "
                "<account>.dkr.ecr.<region>.amazonaws.com/<repository>@sha256:<64 hex digits> "
                "(tags are mutable: SageMaker must run exactly the image that was tested)"
            )
        return value

    @field_validator("model_s3_uri")
    @classmethod
    def _model_s3_uri(cls, value: str | None) -> str | None:
        if value is not None and not S3_PREFIX_RE.match(value):
            raise ValueError(
                f"{value!r} must be an S3 prefix ending in '/', e.g. s3://my-bucket/models/qwen/ "
                "(SageMaker copies the uncompressed prefix to /opt/ml/model)"
            )
        return value

    @field_validator("container")
    @classmethod
    def _container(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            Settings.from_values(value)
        except ValidationError as error:
            details = "; ".join(
                ".".join(str(p) for p in item["loc"]) + ": " + item["msg"].removeprefix("Value error, ")
                if item["loc"]
                else item["msg"].removeprefix("Value error, ")
                for item in error.errors()
            )
            raise ValueError(f"invalid container setting(s): {details}") from None
        return value

    def _instance_problems(self) -> list[str]:
        problems: list[str] = []
        for key, instance_type in [("instance_type", self.instance_type)] + [
            ("instance_pools", t) for t in self.instance_pools
        ]:
            accelerated = has_accelerator(instance_type)
            if self.is_gpu:
                problems += _gpu_type_problems(key, instance_type)
            elif accelerated:
                problems.append(
                    f"{key}: {instance_type} is a GPU/accelerator type, but the cpu variant runs a "
                    "CPU-only image; use a CPU type such as ml.c7i.8xlarge, or deploy GpuStack"
                )
        if self.instance_pools and self.provision_timeout_s is None:
            problems.append(
                "provision_timeout_s: set it with instance_pools (300-3600 s: how long SageMaker tries "
                "the pools before the deploy fails)"
            )
        return problems

    @model_validator(mode="after")
    def _consistency(self) -> VariantConfig:
        problems = self._instance_problems()
        if self.replace_endpoint is not None and self.replace_endpoint == self.endpoint_name:
            problems.append(
                "replace_endpoint: names the endpoint a rename deletes (the deployed one), so it cannot be "
                f"endpoint_name ({self.endpoint_name}) itself"
            )
        if self.inference_ami_version is not None:
            if not self.is_gpu:
                problems.append("inference_ami_version: only applies to the gpu variant")
            elif self.inference_ami_version not in INFERENCE_AMI_VERSIONS:
                problems.append(f"inference_ami_version: must be one of {INFERENCE_AMI_VERSIONS}")
            elif _cuda(INFERENCE_AMI_CUDA[self.inference_ami_version])[0] != _cuda(CUDA_IMAGE_TOOLKIT)[0]:
                ami = self.inference_ami_version
                problems.append(
                    f"inference_ami_version: {ami} has a CUDA {INFERENCE_AMI_CUDA[ami]} driver and the "
                    f"CUDA image is built with CUDA {CUDA_IMAGE_TOOLKIT}: another CUDA major can leave the "
                    "endpoint in Creating with no log; leave it unset "
                    f"({inference_ami_for(CUDA_IMAGE_TOOLKIT)})"
                )
        if not self.on_ebs:
            nvme = ", ".join(t for t in self.instance_types if not supports_volume_kms(t))
            if self.volume_kms:
                problems.append(
                    f"volume_kms: {nvme} has NVMe instance storage, which SageMaker always "
                    "encrypts itself and which rejects a KmsKeyId"
                )
            if self.volume_size_gb is not None:
                problems.append(
                    f"volume_size_gb: {nvme} has NVMe instance storage of fixed size; SageMaker refuses "
                    "VolumeSizeInGB there"
                )
        if self.image_uri is not None and self.image_source == "build":
            problems.append(
                "image_source: `build` contradicts image_uri (a prebuilt image); drop one of them"
            )
        if self.min_capacity > self.max_capacity:
            problems.append(
                f"min_capacity: {self.min_capacity} must not exceed max_capacity ({self.max_capacity})"
            )
        elif not self.min_capacity <= self.initial_instance_count <= self.max_capacity:
            problems.append(
                f"initial_instance_count: {self.initial_instance_count} must lie within "
                f"min_capacity..max_capacity ({self.min_capacity}..{self.max_capacity})"
            )
        step = self.deployment.step_instance_count
        floor, floor_key = self.floor_capacity
        if self.traffic_routing != "ALL_AT_ONCE" and step * 2 > floor:
            problems.append(
                f"deployment.step_instance_count: {step} must be at most half of {floor_key} "
                f"({floor}): SageMaker rejects a {self.traffic_routing} step above 50% of the "
                "variant's instance count, and the fleet may be that small when the update starts. Raise "
                f"{floor_key} or use deployment.traffic_routing=ALL_AT_ONCE (still blue/green with alarm "
                "rollback)"
            )
        problems += self._blue_green_problems()
        load = self.deployment.synthetic_load_per_minute
        if 0 < load < self.alarms.error_rate_min_invocations:
            problems.append(
                f"deployment.synthetic_load_per_minute: {load} is below alarms.error_rate_min_invocations "
                f"({self.alarms.error_rate_min_invocations}): the rollback alarms count such a minute as "
                "0 %, so the synthetic load could never roll a broken canary back. Raise it, or set 0"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self


def _gpu_type_problems(key: str, instance_type: str) -> list[str]:
    """Why the CUDA image cannot run on `instance_type`, if it cannot (empty list otherwise)."""
    model = gpu_model(instance_type)
    if model is None:
        if has_accelerator(instance_type):
            return [f"{key}: {instance_type} has no NVIDIA GPU; the CUDA image needs one (e.g. ml.g6.xlarge)"]
        return [f"{key}: {instance_type} has no GPU; the gpu variant needs one (e.g. ml.g6.xlarge)"]
    if model.cuda_arch not in CUDA_IMAGE_ARCHITECTURES:
        known = {t.split(".")[1] for t in INSTANCE_TYPES}
        supported = ", ".join(
            f"{family} (sm_{m.cuda_arch})"
            for family, m in GPU_FAMILIES.items()
            if m.cuda_arch in CUDA_IMAGE_ARCHITECTURES and family in known
        )
        return [
            f"{key}: {instance_type} has an {model.name} (sm_{model.cuda_arch}), which needs CUDA 12.8 or "
            f"newer; the CUDA image is built with CUDA {CUDA_IMAGE_TOOLKIT} and runs on {supported}"
        ]
    if instance_type not in INSTANCE_TYPES:
        try:
            instance_spec(instance_type)
        except KeyError as error:
            return [f"{key}: {error.args[0]}"]
    return []


def deployed_image_parameter(project: str, variant: VariantConfig) -> str:
    """The SSM parameter recording the image of a variant's last successful deploy, and its source
    (`pinned` by `-c image_uri`, or `build`). Written by the endpoint stack, read by the next deploy."""
    return f"/{project}/{variant.endpoint_name}/image"


def cost_tags(config: AppConfig, variant: VariantConfig | None = None) -> dict[str, str]:
    """The cost-allocation tags of a stack's resources: `project`, and an endpoint stack's `variant`
    and `endpoint`."""
    tags = {"project": config.project}
    if variant is not None:
        tags |= {"variant": variant.name, "endpoint": variant.endpoint_name}
    return tags


def expiring_prefixes(variants: list[VariantConfig]) -> dict[str, int]:
    """Artifacts-bucket prefix → days its objects are kept: data capture and async inference (requests,
    answers and failures may hold prompts; nothing else reads them once the client has)."""
    prefixes = {data_capture_prefix(v): v.data_capture.retention_days for v in variants}
    for variant in variants:
        if variant.invocation == "async":
            prefixes[async_prefix(variant.endpoint_name)] = variant.async_inference.retention_days
    return prefixes


def async_prefix(endpoint_name: str) -> str:
    """Where an async endpoint's requests, answers and failures live in the artifacts bucket."""
    return f"async/{endpoint_name}/"


def data_capture_prefix(variant: VariantConfig) -> str:
    """Where a variant's captured requests and responses go in the artifacts bucket (expired there)."""
    return f"data-capture/{variant.endpoint_name}/"


def mounted_model_bytes(model: ModelArtifact, *, batch_transform: bool) -> int:
    """What an endpoint instance downloads: every object the staging build leaves under the prefix
    the Model mounts (S3Prefix). The GGUF, and the Batch Transform archive only if it were staged under
    that prefix (it is not: `archive_key`; gzip -1 keeps a GGUF's size)."""
    archive_inside = batch_transform and archive_key(model.s3_prefix).startswith(model.s3_prefix)
    return model.size_bytes * (2 if archive_inside else 1)


def estimated_volume_need_gb(model: ModelArtifact, *, batch_transform: bool = False) -> int:
    """What the instance downloads from the model prefix, in GB rounded up, twice (download + the
    mounted copy) plus 4 GB of room."""
    return 2 * math.ceil(mounted_model_bytes(model, batch_transform=batch_transform) / 1e9) + 4


class AppConfig(_Strict):
    """The whole app: the pinned model and the two endpoint variants."""

    project: str = Field("decider", pattern=r"^[a-z][a-z0-9\-]{1,20}$", description="Name prefix.")
    account: str | None = Field(None, pattern=r"^\d{12}$", description="Pins the stacks to an account.")
    region: str | None = Field(None, pattern=r"^[a-z]{2}(-[a-z]+)+-\d$", description="Pins the region.")
    model: ModelArtifact
    cpu: VariantConfig
    gpu: VariantConfig

    def variant(self, name: VariantName) -> VariantConfig:
        return self.cpu if name == "cpu" else self.gpu

    @field_validator("account", mode="before")
    @classmethod
    def _account_as_text(cls, value: Any) -> Any:
        """`-c account=123456789012` arrives JSON-decoded as a number; an account id is text."""
        return f"{value:012d}" if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _memory_holds_the_model(self) -> AppConfig:
        """Model, context, recurrent states, logits, an explicit host tier and the reserve fit every
        allowed instance type (decider.memory_budget); refused at synth with the numbers."""
        footprint = self.model.footprint
        problems = []
        for variant in (self.cpu, self.gpu):
            if footprint is None or variant.model_s3_uri is not None:
                continue  # no declared shape, or another model than the pinned one
            settings = container_settings(variant, self.model)
            host_tier = settings.cache_budget.host_bytes or 0  # unset: sized at start from what is left
            need = memory_need(
                footprint,
                n_ctx=settings.n_ctx,
                n_seq_max=settings.n_seq_max,
                n_batch=settings.logical_batch,
                host_tier=host_tier if settings.cache_budget.states else 0,
                on_gpu=variant.is_gpu and settings.n_gpu_layers != 0,
            )
            for instance_type in variant.instance_types:
                spec = INSTANCE_TYPES.get(instance_type)
                if spec is None:  # a type stacks/instances.py does not know: its memory neither
                    continue
                problems += [
                    f"{variant.name} on {instance_type}: {problem}"
                    for problem in fit_problems(
                        need, host_memory=spec.memory_bytes, gpu_memory=int(spec.gpu_memory_gib * GIB)
                    )
                ]
        if problems:
            raise ValueError(
                "the model does not fit (lower <variant>.container.n_ctx, n_seq_max, n_batch or "
                "state_cache_host_mib, or pick a larger instance type):\n" + "\n".join(problems)
            )
        return self

    @model_validator(mode="after")
    def _volume_holds_the_model(self) -> AppConfig:
        problems = [
            f"{variant.name}.volume_size_gb: {variant.volume_size_gb} GB is too small for the pinned "
            f"{self.model.size_bytes / 1e9:.1f} GB model (needs about {need} GB)"
            for variant in (self.cpu, self.gpu)
            if variant.volume_size_gb is not None
            and variant.model_s3_uri is None
            and variant.volume_size_gb
            < (need := estimated_volume_need_gb(self.model, batch_transform=variant.batch_transform))
        ]
        if problems:
            raise ValueError("\n".join(problems))
        return self


def container_settings(variant: VariantConfig, model: ModelArtifact) -> Settings:
    """The container's settings for one variant: the pinned model's file and hash, then the overrides.

    With a prebuilt model (`model_s3_uri`), the pinned model's name and hash do not apply; the
    container then takes the single GGUF in the prefix unless `container.model_file` names one.
    """
    pinned: dict[str, Any] = {}
    if variant.model_s3_uri is None:
        pinned = {"model_file": model.file, "model_sha256": model.sha256}
    return Settings.from_values({**pinned, **variant.container})


def container_environment(variant: VariantConfig, model: ModelArtifact) -> dict[str, str]:
    """`CfnModel.Environment`: every container setting spelled out, names from decider.settings."""
    return container_settings(variant, model).to_environment()


def _parse_scalar(text: Any) -> Any:
    """`-c` values arrive as strings; JSON-looking ones (numbers, true/false, null, objects) are decoded."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parents[: i + 1])}: is not an object, cannot set {dotted}")
        node = child
    node[leaf] = value


def merge_context(context: Mapping[str, Any]) -> dict[str, Any]:
    """The raw config tree: our root keys from the context, with dotted `-c` keys applied on top.

    Global `image_uri` / `model_s3_uri` apply to both variants unless a variant sets its own.
    """
    tree: dict[str, Any] = {}
    for key in ROOT_KEYS:
        if key in context:
            value = _parse_scalar(context[key])
            tree[key] = json.loads(json.dumps(value))  # deep copy, JSON types only
    dotted = sorted(k for k in context if "." in k and k.split(".", 1)[0] in ROOT_KEYS)
    for key in dotted:
        _set_dotted(tree, key, _parse_scalar(context[key]))
    for global_key in ("image_uri", "model_s3_uri"):
        value = tree.pop(global_key, None)
        if value is None:
            continue
        for name in VARIANTS:
            variant = tree.setdefault(name, {})
            if isinstance(variant, dict):
                variant.setdefault(global_key, value)
    for name in VARIANTS:
        if isinstance(tree.get(name), dict):
            tree[name].setdefault("name", name)
    return tree


def _format_errors(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key (check the spelling; see the config table in the README)"
        elif item["type"] == "missing":
            message = "required, but not set in cdk.json or with -c"
        value = item.get("input")
        shown = ""
        if item["type"] not in {"missing", "model_type", "value_error"} and not isinstance(value, dict):
            shown = f" (got {value!r})"
        if (item["type"] == "value_error" and "\n" in message) or re.match(r"^[a-z_.]+: ", message):
            # model-level checks name the field themselves: "instance_type: …"
            for line in message.splitlines():
                field, _, text = line.partition(": ")
                lines.append(f"  {location}.{field}: {text}" if location else f"  {line}")
            continue
        lines.append(f"  {location or '<root>'}: {message}{shown}")
    return "\n".join(lines)


def load_config(context: Mapping[str, Any]) -> AppConfig:
    """Validate the app's config from the CDK context; raise ConfigError listing every problem."""
    tree = merge_context(context)
    try:
        return AppConfig.model_validate(tree)
    except ValidationError as error:
        raise ConfigError("invalid CDK context configuration:\n" + _format_errors(error)) from None
