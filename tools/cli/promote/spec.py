"""Pure computation of a promotion: overrides → new CreateModel / CreateEndpointConfig requests.

Nothing here calls AWS. The live state comes in as the dicts DescribeModel / DescribeEndpointConfig
return; the output is the exact request bodies `apply` sends, named by a hash of their content so
the same inputs always give the same names (idempotent re-apply).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from decider_cli.promote.errors import GuardrailError, PromoteError

# SageMaker names: at most 63 characters, alphanumerics separated by single or repeated hyphens.
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
DIGEST_PATTERN = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")
HASH_LENGTH = 12

# Keys of DescribeModel / DescribeEndpointConfig that are also CreateModel / CreateEndpointConfig inputs.
MODEL_KEYS = (
    "PrimaryContainer",
    "ExecutionRoleArn",
    "VpcConfig",
    "EnableNetworkIsolation",
    "InferenceExecutionConfig",
)
CONFIG_KEYS = (
    "ProductionVariants",
    "DataCaptureConfig",
    "KmsKeyId",
    "AsyncInferenceConfig",
    "ExplainerConfig",
    "ShadowProductionVariants",
    "ExecutionRoleArn",
    "VpcConfig",
    "EnableNetworkIsolation",
    "MetricsConfig",
    "CrossRegionTrafficConfig",
    "TracingConfig",
)
# Variant keys DescribeEndpointConfig returns that CreateEndpointConfig also accepts: every member of
# the ProductionVariant shape (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_ProductionVariant.html),
# held equal to the installed botocore's by tests/promote/test_promote_spec.py. A key left out is
# silently dropped from the copied config (InstancePools, VariantInstanceProvisionTimeoutInSeconds were).
VARIANT_KEYS = (
    "VariantName",
    "ModelName",
    "InitialInstanceCount",
    "InstanceType",
    "InstancePools",
    "VariantInstanceProvisionTimeoutInSeconds",
    "InitialVariantWeight",
    "AcceleratorType",
    "CoreDumpConfig",
    "ServerlessConfig",
    "VolumeSizeInGB",
    "ModelDataDownloadTimeoutInSeconds",
    "ContainerStartupHealthCheckTimeoutInSeconds",
    "EnableSSMAccess",
    "ManagedInstanceScaling",
    "RoutingConfig",
    "InferenceAmiVersion",
    "CapacityReservationConfig",
    "AcceleratorPartitionLayouts",
)


@dataclass(frozen=True)
class Overrides:
    """What the operator asked to change; None/empty means keep the live value."""

    image: str | None = None
    model_s3: str | None = None
    instance_type: str | None = None
    count: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    unset_env: tuple[str, ...] = ()
    variant: str | None = None


@dataclass(frozen=True)
class Promotion:
    """The computed target state next to the live one."""

    endpoint: str
    variant: str
    live_config_name: str
    live_model_name: str
    model_request: dict[str, Any]  # CreateModel body (ModelName included)
    config_request: dict[str, Any]  # CreateEndpointConfig body (EndpointConfigName included)
    live_model: dict[str, Any]  # live CreateModel-equivalent body
    live_config: dict[str, Any]  # live CreateEndpointConfig-equivalent body

    @property
    def model_name(self) -> str:
        return self.model_request["ModelName"]

    @property
    def config_name(self) -> str:
        return self.config_request["EndpointConfigName"]

    @property
    def new_model(self) -> bool:
        return self.model_name != self.live_model_name

    @property
    def changed(self) -> bool:
        return self.config_name != self.live_config_name

    @property
    def image(self) -> str:
        return self.model_request["PrimaryContainer"].get("Image", "")


def parse_env_pairs(pairs: list[str]) -> dict[str, str]:
    """`K=V` strings → dict; a malformed pair is a usage error."""
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise PromoteError("bad_env", f"--env expects KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def require_digest(image: str) -> None:
    """Refuse a mutable tag: the deployed image must be pinned by sha256 digest."""
    if not DIGEST_PATTERN.match(image):
        raise GuardrailError(
            "image_without_digest",
            f"image {image!r} is not pinned by digest",
            hint="pass --image <repo>@sha256:<64 hex> (tags move; SageMaker re-pulls when patching/scaling)",
        )


def derived_name(endpoint: str, kind: str, content: dict[str, Any]) -> str:
    """`<endpoint prefix>-<kind>-<sha256[:12]>`, always ≤ 63 chars and SageMaker-valid."""
    digest = content_hash({"endpoint": endpoint, "kind": kind, "content": content})
    name = f"{name_prefix(endpoint)}-{kind}-{digest}"
    if not NAME_PATTERN.match(name):
        raise PromoteError("bad_name", f"derived name {name!r} does not match SageMaker's name pattern")
    return name


def name_prefix(endpoint: str) -> str:
    """The endpoint-name part of derived names (leaves room for `-c-<12 hex>`)."""
    return endpoint[: 63 - len("-c-") - HASH_LENGTH].rstrip("-")


def content_hash(obj: Any) -> str:
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:HASH_LENGTH]


def _pruned(value: Any) -> Any:
    """Drop None and empty containers (Describe* returns some that Create* rejects)."""
    if isinstance(value, dict):
        out = {k: _pruned(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in (None, {}, [])}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def model_body(described: dict[str, Any]) -> dict[str, Any]:
    """CreateModel-equivalent body of a DescribeModel answer (without ModelName)."""
    containers = [c for c in described.get("Containers") or [] if c]
    if len(containers) > 1 or (containers and described.get("PrimaryContainer")):
        raise PromoteError(
            "multi_container_model",
            f"model {described.get('ModelName')!r} has several containers; promote handles one container",
        )
    body = {k: described[k] for k in MODEL_KEYS if k in described}
    if containers and not body.get("PrimaryContainer"):
        body["PrimaryContainer"] = containers[0]
    if body.get("EnableNetworkIsolation") is False:
        body.pop("EnableNetworkIsolation")  # the default; keeps hashes stable across describe shapes
    return _pruned(body)


def config_body(described: dict[str, Any]) -> dict[str, Any]:
    """CreateEndpointConfig-equivalent body of a DescribeEndpointConfig answer (without the name)."""
    body = {k: described[k] for k in CONFIG_KEYS if k in described}
    body["ProductionVariants"] = [
        {k: v[k] for k in VARIANT_KEYS if k in v} for v in described.get("ProductionVariants", [])
    ]
    if body.get("EnableNetworkIsolation") is False:
        body.pop("EnableNetworkIsolation")
    return _pruned(body)


def pick_variant(config: dict[str, Any], wanted: str | None) -> dict[str, Any]:
    variants = config.get("ProductionVariants", [])
    if wanted is not None:
        for variant in variants:
            if variant["VariantName"] == wanted:
                return variant
        names = ", ".join(v["VariantName"] for v in variants)
        raise PromoteError("unknown_variant", f"variant {wanted!r} not in the endpoint config (has: {names})")
    if len(variants) != 1:
        names = ", ".join(v["VariantName"] for v in variants)
        raise PromoteError(
            "ambiguous_variant",
            f"endpoint config has {len(variants)} variants ({names})",
            hint="pass --variant NAME",
        )
    return variants[0]


def _apply_model_overrides(body: dict[str, Any], ov: Overrides) -> dict[str, Any]:
    container = dict(body.get("PrimaryContainer", {}))
    if ov.image:
        container["Image"] = ov.image
    if ov.model_s3:
        if not ov.model_s3.startswith("s3://"):
            raise PromoteError("bad_model_s3", f"--model-s3 must be an s3:// URI, got {ov.model_s3!r}")
        if ov.model_s3.endswith(".tar.gz"):
            container.pop("ModelDataSource", None)
            container["ModelDataUrl"] = ov.model_s3
        else:
            if not ov.model_s3.endswith("/"):
                raise PromoteError(
                    "bad_model_s3",
                    f"uncompressed model prefix must end with '/', got {ov.model_s3!r}",
                    hint="use s3://bucket/prefix/ (mounted uncompressed) or s3://…/model.tar.gz",
                )
            container.pop("ModelDataUrl", None)
            source = dict(container.get("ModelDataSource", {}).get("S3DataSource", {}))
            source.update({"S3Uri": ov.model_s3, "S3DataType": "S3Prefix", "CompressionType": "None"})
            container["ModelDataSource"] = {"S3DataSource": source}
    if ov.env or ov.unset_env:
        env = dict(container.get("Environment", {}))
        for key in ov.unset_env:
            env.pop(key, None)
        env.update(ov.env)
        container["Environment"] = env
    return _pruned({**body, "PrimaryContainer": container})


def compute_promotion(
    endpoint: str,
    described_config: dict[str, Any],
    described_model: dict[str, Any],
    overrides: Overrides,
) -> Promotion:
    """Target model + config for `overrides` applied to the live config of `endpoint`."""
    live_config = config_body(described_config)
    live_model = model_body(described_model)
    live_variant = pick_variant(live_config, overrides.variant)
    if overrides.count is not None and overrides.count < 1:
        raise PromoteError("bad_count", f"--count must be ≥ 1, got {overrides.count}")

    new_model = _apply_model_overrides(live_model, overrides)
    if new_model == live_model:
        model_name = described_model["ModelName"]  # unchanged: keep serving the same model
    else:
        model_name = derived_name(endpoint, "m", new_model)

    variants = []
    for variant in live_config["ProductionVariants"]:
        variant = dict(variant)
        if variant["VariantName"] == live_variant["VariantName"]:
            variant["ModelName"] = model_name
            if overrides.instance_type:
                variant["InstanceType"] = overrides.instance_type
            if overrides.count is not None:
                variant["InitialInstanceCount"] = overrides.count
        variants.append(variant)
    new_config = {**live_config, "ProductionVariants": variants}
    live_config_name = described_config["EndpointConfigName"]
    config_name = live_config_name if new_config == live_config else derived_name(endpoint, "c", new_config)

    return Promotion(
        endpoint=endpoint,
        variant=live_variant["VariantName"],
        live_config_name=live_config_name,
        live_model_name=described_model["ModelName"],
        model_request={"ModelName": model_name, **new_model},
        config_request={"EndpointConfigName": config_name, **new_config},
        live_model={"ModelName": described_model["ModelName"], **live_model},
        live_config={"EndpointConfigName": live_config_name, **live_config},
    )


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dict/list → {"A.B[0].C": leaf}; variants are keyed by VariantName for readable paths."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(obj, list) and obj and all(isinstance(v, dict) and "VariantName" in v for v in obj):
        for value in obj:
            out.update(flatten(value, f"{prefix}[{value['VariantName']}]"))
    elif isinstance(obj, list) and obj:
        for index, value in enumerate(obj):
            out.update(flatten(value, f"{prefix}[{index}]"))
    else:
        out[prefix] = obj
    return out


@dataclass(frozen=True)
class FieldChange:
    resource: str  # "model" | "endpoint-config"
    path: str
    old: Any
    new: Any


def field_changes(promotion: Promotion) -> list[FieldChange]:
    """Field-by-field differences between the live and the target model and config."""
    changes: list[FieldChange] = []
    pairs = (
        ("model", promotion.live_model, promotion.model_request),
        ("endpoint-config", promotion.live_config, promotion.config_request),
    )
    for resource, old, new in pairs:
        flat_old, flat_new = flatten(old), flatten(new)
        for path in sorted(set(flat_old) | set(flat_new)):
            if flat_old.get(path) != flat_new.get(path):
                changes.append(FieldChange(resource, path, flat_old.get(path), flat_new.get(path)))
    return changes
