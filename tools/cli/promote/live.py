"""Reading the live endpoint, its config, the model of the promoted variant and their tags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from decider_cli.promote.errors import PromoteError
from decider_stacks.config import ENDPOINT_TAG

# Tags written by `promote apply` / `promote rollback` (and, for TAG_ENDPOINT, by the stacks too).
TAG_ENDPOINT = ENDPOINT_TAG  # on models and configs: which endpoint they belong to
TAG_ROLLBACK = "promote:rollback-config"  # on the endpoint: the config `promote rollback` returns to
TAG_IN_FLIGHT = "promote:apply-in-flight"  # on the endpoint while an apply runs: "<previous> <target>"
CFN_STACK_TAG = "aws:cloudformation:stack-name"

# Endpoint statuses in which an update is in flight or the service is busy with the endpoint.
BUSY_STATUSES = frozenset({"Creating", "Updating", "SystemUpdating", "RollingBack", "Deleting"})


@dataclass(frozen=True)
class LiveEndpoint:
    name: str
    arn: str
    status: str
    config_name: str
    pending_config_name: str | None
    failure_reason: str | None
    tags: dict[str, str]
    raw: dict[str, Any]

    @property
    def cfn_stack(self) -> str | None:
        return self.tags.get(CFN_STACK_TAG)

    @property
    def rollback_config(self) -> str | None:
        return self.tags.get(TAG_ROLLBACK)


def tags_of(sagemaker: Any, arn: str) -> dict[str, str]:
    """All tags of a resource; a repeated key keeps its last value (AddTags overwrites)."""
    tags: dict[str, str] = {}
    for page in sagemaker.get_paginator("list_tags").paginate(ResourceArn=arn):
        for tag in page.get("Tags", []):
            tags[tag["Key"]] = tag["Value"]
    return tags


def _is_missing(exc: ClientError) -> bool:
    message = exc.response.get("Error", {}).get("Message", "")
    return exc.response.get("Error", {}).get("Code") in {"ValidationException", "ResourceNotFound"} and (
        "Could not find" in message or "does not exist" in message or "not found" in message.lower()
    )


def describe_endpoint(sagemaker: Any, name: str) -> LiveEndpoint:
    try:
        raw = sagemaker.describe_endpoint(EndpointName=name)
    except ClientError as exc:
        if _is_missing(exc):
            raise PromoteError("endpoint_not_found", f"endpoint {name!r} not found") from exc
        raise
    pending = (raw.get("PendingDeploymentSummary") or {}).get("EndpointConfigName")
    return LiveEndpoint(
        name=name,
        arn=raw["EndpointArn"],
        status=raw["EndpointStatus"],
        config_name=raw["EndpointConfigName"],
        pending_config_name=pending,
        failure_reason=raw.get("FailureReason"),
        tags=tags_of(sagemaker, raw["EndpointArn"]),
        raw=raw,
    )


def describe_config(sagemaker: Any, name: str) -> dict[str, Any] | None:
    """DescribeEndpointConfig, or None when it does not exist."""
    try:
        return sagemaker.describe_endpoint_config(EndpointConfigName=name)
    except ClientError as exc:
        if _is_missing(exc):
            return None
        raise


def describe_model(sagemaker: Any, name: str) -> dict[str, Any] | None:
    """DescribeModel, or None when it does not exist."""
    try:
        return sagemaker.describe_model(ModelName=name)
    except ClientError as exc:
        if _is_missing(exc):
            return None
        raise


def require_config(sagemaker: Any, name: str) -> dict[str, Any]:
    config = describe_config(sagemaker, name)
    if config is None:
        raise PromoteError("config_not_found", f"endpoint config {name!r} not found (deleted out of band?)")
    return config


def require_model(sagemaker: Any, name: str) -> dict[str, Any]:
    model = describe_model(sagemaker, name)
    if model is None:
        raise PromoteError("model_not_found", f"model {name!r} not found (deleted out of band?)")
    return model
