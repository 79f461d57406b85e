"""Checks before the Endpoint is touched: an update SageMaker documents as refused fails here first.

`Custom::UpdateGuard` sits between the endpoint config and the Endpoint (the Endpoint depends on it),
and its properties name the new config, so every endpoint update runs it. When it fails, CloudFormation
rolls the stack back before UpdateEndpoint was ever called: the Endpoint has nothing to undo, and no
rollback meets an endpoint that is mid-update or that already runs the config it returns to.

- A rename (`endpoint_name` changed on a deployed stack): EndpointName is create-only, so CloudFormation
  creates the new endpoint and then deletes the live one and its log group. Refused unless the
  variant's `replace_endpoint` names the endpoint that is deleted.
- `invocation` flips under one endpoint name: "The AsyncInferenceConfig parameter cannot be removed
  from this endpoint" (UpdateEndpoint refuses a change between a real-time and an async config;
  https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_UpdateEndpoint.html).
- A new instance type while the variant is registered with Application Auto Scaling: "If the update
  would change the instance type for any model that is a target for auto scaling, the update fails"
  (https://docs.aws.amazon.com/sagemaker/latest/dg/endpoint-scaling-update.html). The scalable target is
  only deregistered in the cleanup after the update, so `autoscaling=false` must be its own deploy.
- The blue/green peak against the account's "<instance type> for endpoint usage" quota (Service
  Quotas, https://docs.aws.amazon.com/general/latest/gr/sagemaker.html): an update runs the old fleet
  and a new one side by side, counted from the live endpoint (DescribeEndpoint), per instance type
  (peak_by_type); 2 x max_capacity only when the live fleet cannot be read. A quota that cannot be
  read is logged, not counted.

The guard's properties are synth-time values (a `Fingerprint` of the variant, model and image), so it
runs before the image build and the model staging: a refusal costs seconds, not the build.

While the stack rolls back (CloudFormation sends the old properties as an Update) nothing is checked:
refusing the way back would leave the stack in UPDATE_ROLLBACK_FAILED.
"""

from __future__ import annotations

import logging
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

try:  # package import (tools, tests)
    from . import post_deploy_check
except ImportError:  # the Lambda asset's root
    import post_deploy_check  # type: ignore[no-redef]

LOG = logging.getLogger(__name__)


class UpdateRefusedError(RuntimeError):
    """SageMaker would refuse this update (or the account cannot run it); the message says what to do."""


def endpoint_quota_name(instance_type: str) -> str:
    return f"{instance_type} for endpoint usage"


def rename_refusal(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """A rename of a deployed endpoint without consent naming it. EndpointName is create-only
    ("Update requires: Replacement", AWS::SageMaker::Endpoint): CloudFormation creates the endpoint under
    the new name first, and deletes the old one (UpdateReplacePolicy Delete, the default:
    https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/aws-attribute-updatereplacepolicy.html)
    with its log group, once the update succeeded: the clients of the old name lose it."""
    before, after = old.get("EndpointName"), new.get("EndpointName")
    if not old or not before or before == after:
        return None
    if new.get("ReplaceEndpoint") == before:
        LOG.warning(
            "renaming %s -> %s: %s and its log group are deleted after the update", before, after, before
        )
        return None
    variant = new.get("Variant", "<variant>")
    return (
        f"{before} -> {after}: EndpointName is create-only, so this deploy would CREATE {after} and then "
        f"DELETE {before} (its instances, its traffic, and its log group /aws/sagemaker/Endpoints/{before}). "
        f"To keep {before}, deploy with -c {variant}.endpoint_name={before}; to delete it, say so: "
        f"-c {variant}.replace_endpoint={before}"
    )


def update_refusals(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What SageMaker documents it refuses in the change from `old` to `new` properties, and a rename
    that would delete the live endpoint without consent."""
    renamed = rename_refusal(old, new)
    if renamed:
        return [renamed]
    if not old or old.get("EndpointName") != new.get("EndpointName"):
        return []  # a consented rename: a new endpoint, nothing to update
    name, variant = new["EndpointName"], new.get("Variant", "<variant>")
    problems = []
    before, after = old.get("Invocation", "realtime"), new.get("Invocation", "realtime")
    if before != after:
        problems.append(
            f"{name}: invocation {before} -> {after} under the same endpoint name. UpdateEndpoint refuses "
            "to drop AsyncInferenceConfig ('The AsyncInferenceConfig parameter cannot be removed from this "
            "endpoint'), and adding one to a real-time endpoint is documented nowhere. A new name on this "
            f"stack REPLACES {name}: CloudFormation deletes it and its log group once the new endpoint "
            f"exists. Keep {name} as it is, or accept its deletion: -c {variant}.invocation={after} "
            f"-c {variant}.endpoint_name=<new name> -c {variant}.replace_endpoint={name}"
        )
    old_types, new_types = list(old.get("InstanceTypes") or []), list(new.get("InstanceTypes") or [])
    if str(old.get("Autoscaling")).lower() == "true" and old_types != new_types:
        problems.append(
            f"{name}: instance types {', '.join(old_types)} -> {', '.join(new_types)} while the variant is "
            "an Application Auto Scaling target, which SageMaker refuses. Deploy -c "
            f"{variant}.autoscaling=false alone first (it deregisters the target), then the new instance "
            f"type, then -c {variant}.autoscaling=true"
        )
    return problems


def quota_values(service_quotas: Any) -> dict[str, float]:
    """SageMaker's quotas by name: the applied values, the defaults where none is applied."""
    values: dict[str, float] = {}
    for operation in ("list_aws_default_service_quotas", "list_service_quotas"):  # applied ones win
        for page in service_quotas.get_paginator(operation).paginate(ServiceCode="sagemaker"):
            for quota in page.get("Quotas", []):
                values[quota["QuotaName"]] = float(quota["Value"])
    return values


def live_fleet(
    sagemaker: Any, props: dict[str, Any], old: dict[str, Any]
) -> tuple[dict[str, int], int] | None:
    """The instances the endpoint runs now, by instance type, and the fleet an update keeps: from
    DescribeEndpoint (ProductionVariantSummary: CurrentInstanceCount/DesiredInstanceCount, and per
    instance pool InstancePoolSummary.CurrentInstanceCount,
    https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_ProductionVariantSummary.html).
    A variant without pools runs the old config's instance type. None when the endpoint does not
    exist or cannot be read (the synth-time bound is used then)."""
    try:
        raw = sagemaker.describe_endpoint(EndpointName=props["EndpointName"])
    except (ClientError, BotoCoreError) as error:
        LOG.warning("cannot read %s (%s): the synth-time peak is counted", props["EndpointName"], error)
        return None
    old_types = list(old.get("InstanceTypes") or props.get("InstanceTypes") or [])
    running: dict[str, int] = {}
    fleet = 0
    for variant in raw.get("ProductionVariants") or []:
        current = int(variant.get("CurrentInstanceCount") or 0)
        fleet += max(current, int(variant.get("DesiredInstanceCount") or 0))
        pools = variant.get("InstancePools") or []
        for pool in pools:
            running[pool["InstanceType"]] = running.get(pool["InstanceType"], 0) + int(
                pool.get("CurrentInstanceCount") or 0
            )
        if not pools and old_types:
            running[old_types[0]] = running.get(old_types[0], 0) + current
    return running, fleet


def peak_by_type(
    props: dict[str, Any], request: str, live: tuple[dict[str, int], int] | None
) -> dict[str, int]:
    """The most instances of each instance type this request runs at once. A create: the initial
    fleet. A blue/green update: the old fleet keeps running until the new one has taken all traffic
    (BlueGreenUpdatePolicy, "SageMaker creates a new fleet during the deployment while maintaining the
    old fleet"), and the new fleet is the live one's size when autoscaling (RetainAllVariantProperties
    keeps DesiredInstanceCount) or the configured count (DesiredInstanceCount excluded from the
    retained properties). The new fleet may land on any of its pool types (priority order, then
    whichever has capacity), so each type is counted with the whole new fleet beside the instances
    of that type the old one runs now. Without a readable live fleet: 2 x the largest fleet."""
    types = list(props.get("InstanceTypes") or [])
    if request != "Update":
        return {t: int(props.get("InitialInstances") or 0) for t in types}
    if live is None:
        return {t: int(props.get("PeakInstances") or 0) for t in types}
    running, fleet = live
    autoscaled = str(props.get("Autoscaling")).lower() == "true"
    new_fleet = fleet if autoscaled else int(props.get("InitialInstances") or 0)
    return {t: running.get(t, 0) + new_fleet for t in types}


def quota_shortfalls(
    service_quotas: Any, props: dict[str, Any], request: str, peaks: dict[str, int] | None = None
) -> list[str]:
    """Instance types whose endpoint quota is below what this request runs at its peak."""
    if peaks is None:
        peaks = peak_by_type(props, request, None)
    try:
        quotas = quota_values(service_quotas)
    except (ClientError, BotoCoreError) as error:
        LOG.warning("cannot read the SageMaker quotas (%s): not checked; run `preflight`", error)
        return []
    problems = []
    for instance_type in props.get("InstanceTypes") or []:
        name = endpoint_quota_name(instance_type)
        needed = peaks.get(instance_type, 0)
        if name not in quotas:
            LOG.warning("no quota %r in this region: not checked", name)
            continue
        if quotas[name] < needed:
            what = "at the blue/green peak (old and new fleet)" if request == "Update" else "to start"
            problems.append(
                f"{props['EndpointName']}: quota '{name}' is {quotas[name]:g}, but the endpoint runs "
                f"{needed} instances {what}. Request more (aws service-quotas request-service-quota-increase "
                f"--service-code sagemaker ...; `preflight` prints the command), then deploy again"
            )
    return problems


def start(clients: Any, event: dict[str, Any]) -> dict[str, Any]:
    """onEvent: raise UpdateRefusedError with every problem, or note what was checked."""
    props = event["ResourceProperties"]
    request = event["RequestType"]
    if request == "Update" and post_deploy_check.rolling_back(clients["cloudformation"], event["StackId"]):
        return {"Result": "skipped (rollback)"}
    problems = []
    old = event.get("OldResourceProperties") or {}
    live = None
    if request == "Update":
        problems += update_refusals(old, props)
        if old.get("EndpointName") == props["EndpointName"]:  # a rename creates a new endpoint
            live = live_fleet(clients["sagemaker"], props, old)
        else:
            request = "Create"
    peaks = peak_by_type(props, request, live)
    problems += quota_shortfalls(clients["service-quotas"], props, request, peaks)
    if problems:
        raise UpdateRefusedError(
            "refused before the endpoint was touched (nothing to roll back): " + " | ".join(problems)
        )
    return {"Result": f"{props['EndpointName']}: update accepted by the documented rules"}
