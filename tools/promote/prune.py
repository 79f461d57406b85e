"""Deleting old endpoint configs and models that `promote` created for an endpoint.

Only resources tagged `promote:endpoint=<endpoint>` are candidates (CloudFormation cleans up its own).
Never deleted: the config the endpoint runs, a pending config, the rollback target, a config any other
endpoint runs, and any model a surviving config references.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tools.promote.errors import GuardrailError
from tools.promote.live import BUSY_STATUSES, TAG_ENDPOINT, LiveEndpoint, describe_config, tags_of
from tools.promote.spec import name_prefix


@dataclass
class PrunePlan:
    keep_configs: dict[str, str] = field(default_factory=dict)  # name → why kept
    delete_configs: list[str] = field(default_factory=list)
    keep_models: dict[str, str] = field(default_factory=dict)
    delete_models: list[str] = field(default_factory=list)


def _owned(
    sagemaker: Any, resources: list[dict[str, Any]], arn_key: str, endpoint: str
) -> list[dict[str, Any]]:
    return [r for r in resources if tags_of(sagemaker, r[arn_key]).get(TAG_ENDPOINT) == endpoint]


def _configs_in_use_elsewhere(sagemaker: Any, endpoint: str) -> dict[str, str]:
    """Configs other endpoints run or are updating to (names are account-wide)."""
    in_use: dict[str, str] = {}
    for page in sagemaker.get_paginator("list_endpoints").paginate():
        for summary in page.get("Endpoints", []):
            name = summary["EndpointName"]
            if name == endpoint:
                continue
            raw = sagemaker.describe_endpoint(EndpointName=name)
            in_use[raw["EndpointConfigName"]] = f"in use by endpoint {name}"
            pending = (raw.get("PendingDeploymentSummary") or {}).get("EndpointConfigName")
            if pending:
                in_use[pending] = f"pending on endpoint {name}"
    return in_use


def _list(sagemaker: Any, operation: str, key: str, name_contains: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for page in sagemaker.get_paginator(operation).paginate(NameContains=name_contains):
        items.extend(page.get(key, []))
    return items


def plan_prune(sagemaker: Any, endpoint: LiveEndpoint, keep: int) -> PrunePlan:
    """Decide what to delete; changes nothing."""
    if endpoint.status in BUSY_STATUSES:
        raise GuardrailError(
            "endpoint_busy",
            f"endpoint {endpoint.name!r} is {endpoint.status}; prune waits for "
            "the update to finish so it cannot delete a config in flight",
        )
    protected = dict(_configs_in_use_elsewhere(sagemaker, endpoint.name))
    protected[endpoint.config_name] = "in use"
    if endpoint.pending_config_name:
        protected[endpoint.pending_config_name] = "pending deployment"
    if endpoint.rollback_config:
        protected[endpoint.rollback_config] = "rollback target"

    # promote names are "<endpoint prefix>-c-<hash>" / "-m-<hash>"; the tag is the authority.
    prefix = name_prefix(endpoint.name)
    configs = _owned(
        sagemaker,
        _list(sagemaker, "list_endpoint_configs", "EndpointConfigs", prefix),
        "EndpointConfigArn",
        endpoint.name,
    )
    configs.sort(key=lambda c: c["CreationTime"], reverse=True)
    plan = PrunePlan()
    kept_unused = 0
    for config in configs:
        name = config["EndpointConfigName"]
        if name in protected:
            plan.keep_configs[name] = protected[name]
        elif kept_unused < keep:
            plan.keep_configs[name] = f"newest {keep} unused"
            kept_unused += 1
        else:
            plan.delete_configs.append(name)
    for name, why in protected.items():
        plan.keep_configs.setdefault(name, why)

    referenced: dict[str, str] = {}
    for name in plan.keep_configs:
        described = describe_config(sagemaker, name)
        for variant in (described or {}).get("ProductionVariants", []):
            referenced.setdefault(variant["ModelName"], f"used by config {name}")
    models = _owned(sagemaker, _list(sagemaker, "list_models", "Models", prefix), "ModelArn", endpoint.name)
    for model in sorted(models, key=lambda m: m["CreationTime"], reverse=True):
        name = model["ModelName"]
        if name in referenced:
            plan.keep_models[name] = referenced[name]
        else:
            plan.delete_models.append(name)
    return plan


def execute_prune(sagemaker: Any, plan: PrunePlan) -> None:
    """Configs first, so a model is never deleted while a config still names it."""
    for name in plan.delete_configs:
        sagemaker.delete_endpoint_config(EndpointConfigName=name)
    for name in plan.delete_models:
        sagemaker.delete_model(ModelName=name)
