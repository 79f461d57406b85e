"""Deleting old endpoint configs and models of an endpoint: the ones `promote apply` created, and the
ones the stacks retained (replaced models and configs keep UpdateReplacePolicy/DeletionPolicy Retain,
so an endpoint that SageMaker rolled back still has its config).

Only resources tagged `promote:endpoint=<endpoint>` are candidates. Never deleted: the config the
endpoint runs, a pending config, the rollback target, a config any other endpoint runs, any
model a surviving config references, and the Batch Transform Model a stack that still exists names
in its `TransformModelName` output (no endpoint config uses it, and `decide-batch submit` runs it).
An endpoint that no longer exists (its stack was deleted) protects nothing of its own, so everything
tagged for it beyond `--keep` goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import ClientError

from decider_cli.promote.errors import GuardrailError
from decider_cli.promote.live import (
    BUSY_STATUSES,
    CFN_STACK_TAG,
    TAG_ENDPOINT,
    LiveEndpoint,
    describe_config,
    tags_of,
)
from decider_cli.promote.spec import name_prefix
from decider_stacks.config import TRANSFORM_MODEL_OUTPUT


@dataclass
class PrunePlan:
    keep_configs: dict[str, str] = field(default_factory=dict)  # name → why kept
    delete_configs: list[str] = field(default_factory=list)
    keep_models: dict[str, str] = field(default_factory=dict)
    delete_models: list[str] = field(default_factory=list)


def _owned(
    sagemaker: Any, resources: list[dict[str, Any]], arn_key: str, endpoint: str
) -> list[dict[str, Any]]:
    """The resources tagged for `endpoint`, each with its tags under the key "Tags"."""
    owned = []
    for resource in resources:
        tags = tags_of(sagemaker, resource[arn_key])
        if tags.get(TAG_ENDPOINT) == endpoint:
            owned.append({**resource, "Tags": tags})
    return owned


def _stack_transform_model(cloudformation: Any, stack: str, cache: dict[str, str | None]) -> str | None:
    """The Model a live stack names in its TransformModelName output; None when the stack is gone
    (DescribeStacks answers ValidationError "Stack with id … does not exist") or has no such output."""
    if stack not in cache:
        try:
            stacks = cloudformation.describe_stacks(StackName=stack)["Stacks"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ValidationError":
                raise
            stacks = []
        outputs = {o["OutputKey"]: o["OutputValue"] for s in stacks for o in s.get("Outputs") or []}
        cache[stack] = outputs.get(TRANSFORM_MODEL_OUTPUT)
    return cache[stack]


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


def _list(sagemaker: Any, operation: str, key: str, name_contains: str | None) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    kwargs = {"NameContains": name_contains} if name_contains else {}
    for page in sagemaker.get_paginator(operation).paginate(**kwargs):
        items.extend(page.get(key, []))
    return items


def _candidates(
    sagemaker: Any, operation: str, key: str, arn_key: str, name_key: str, endpoint: str, *, everywhere: bool
) -> list[dict[str, Any]]:
    """Resources tagged for `endpoint`: promote names them after it; the stacks' generated names do not
    contain it, so for a stack endpoint (or a deleted one) every resource's tags are read."""
    listed = {r[name_key]: r for r in _list(sagemaker, operation, key, name_prefix(endpoint))}
    if everywhere:
        listed |= {r[name_key]: r for r in _list(sagemaker, operation, key, None)}
    return _owned(sagemaker, list(listed.values()), arn_key, endpoint)


def plan_prune(
    sagemaker: Any, name: str, endpoint: LiveEndpoint | None, keep: int, cloudformation: Any = None
) -> PrunePlan:
    """Decide what to delete; changes nothing. `endpoint` is None when it does not exist any more.
    `cloudformation` reads the stacks' TransformModelName outputs; without it, any model a stack
    owns that no kept config uses is refused rather than risked."""
    if endpoint is not None and endpoint.status in BUSY_STATUSES:
        raise GuardrailError(
            "endpoint_busy",
            f"endpoint {endpoint.name!r} is {endpoint.status}; prune waits for "
            "the update to finish so it cannot delete a config in flight",
        )
    protected = dict(_configs_in_use_elsewhere(sagemaker, name))
    if endpoint is not None:
        protected[endpoint.config_name] = "in use"
        if endpoint.pending_config_name:
            protected[endpoint.pending_config_name] = "pending deployment"
        if endpoint.rollback_config:
            protected[endpoint.rollback_config] = "rollback target"
    everywhere = endpoint is None or endpoint.cfn_stack is not None
    configs = _candidates(
        sagemaker,
        "list_endpoint_configs",
        "EndpointConfigs",
        "EndpointConfigArn",
        "EndpointConfigName",
        name,
        everywhere=everywhere,
    )
    configs.sort(key=lambda c: c["CreationTime"], reverse=True)
    plan = PrunePlan()
    kept_unused = 0
    for config in configs:
        config_name = config["EndpointConfigName"]
        if config_name in protected:
            plan.keep_configs[config_name] = protected[config_name]
        elif kept_unused < keep:
            plan.keep_configs[config_name] = f"newest {keep} unused"
            kept_unused += 1
        else:
            plan.delete_configs.append(config_name)
    for config_name, why in protected.items():
        plan.keep_configs.setdefault(config_name, why)

    referenced: dict[str, str] = {}
    for config_name in plan.keep_configs:
        described = describe_config(sagemaker, config_name)
        for variant in (described or {}).get("ProductionVariants", []):
            referenced.setdefault(variant["ModelName"], f"used by config {config_name}")
    models = _candidates(
        sagemaker, "list_models", "Models", "ModelArn", "ModelName", name, everywhere=everywhere
    )
    stacks: dict[str, str | None] = {}
    stack_names = {endpoint.cfn_stack} if endpoint is not None and endpoint.cfn_stack else set()
    stack_names |= {m["Tags"][CFN_STACK_TAG] for m in models if CFN_STACK_TAG in m["Tags"]}
    if stack_names and cloudformation is None:
        raise GuardrailError(
            "prune_without_cloudformation",
            f"models of stack(s) {', '.join(sorted(stack_names))} are candidates and their "
            "TransformModelName outputs cannot be read",
        )
    for stack in sorted(stack_names):
        transform = _stack_transform_model(cloudformation, stack, stacks)
        if transform:
            referenced.setdefault(
                transform, f"Batch Transform model of stack {stack} ({TRANSFORM_MODEL_OUTPUT})"
            )
    for model in sorted(models, key=lambda m: m["CreationTime"], reverse=True):
        model_name = model["ModelName"]
        if model_name in referenced:
            plan.keep_models[model_name] = referenced[model_name]
        else:
            plan.delete_models.append(model_name)
    return plan


def execute_prune(sagemaker: Any, plan: PrunePlan) -> None:
    """Configs first, so a model is never deleted while a config still names it."""
    for name in plan.delete_configs:
        sagemaker.delete_endpoint_config(EndpointConfigName=name)
    for name in plan.delete_models:
        sagemaker.delete_model(ModelName=name)
