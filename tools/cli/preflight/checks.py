"""Read-only checks of an account and region before the first `cdk deploy` (and before the next).

- SageMaker: the quota "<instance type> for endpoint usage" of every instance type the config allows,
  against the blue/green peak: an update runs the old and the new fleet side by side, and the new one
  keeps the autoscaled size (RetainAllVariantProperties), so the peak is twice `max_capacity` (twice
  `initial_instance_count` without autoscaling), plus what other endpoints already run on that type.
- SageMaker, with `batch_transform`: "<instance type> for transform job usage" (often 0 on new accounts).
- CodeBuild: "Concurrently running builds for Linux/<size> environment" of the compute types the
  deploy-time builds use (0 on some new accounts: StartBuild then fails with AccountLimitExceededException).
- CDK bootstrap: the CDKToolkit stack and its version parameter (the templates require version 6).
- Leftovers of an earlier install that block a fresh ImageStack or endpoint: the fixed-name artifacts
  bucket, endpoints of the same name outside the stacks, and the endpoint's log group (a fixed name: a
  group left by a manual test, `promote apply` or a deleted stack makes the stack's creation fail with
  "already exists").
- A compute type CodeBuild does not offer in the region (no concurrent-builds quota for it) blocks.
- An update SageMaker documents it refuses (an `invocation` flip under the same name, a new instance type
  while the live variant is an autoscaling target) blocks, before CI builds anything; the stacks' update
  guard refuses it again at deploy time.
- A deploy that would start at a low instance count under load warns: the fleet cannot scale during
  the update, and the new fleet starts at the live count (RetainAllVariantProperties).

Nothing here changes anything; every finding says how to fix it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from decider_stacks.config import AppConfig, VariantConfig
from decider_stacks.handlers import update_guard

MIN_BOOTSTRAP_VERSION = 6  # the templates' CheckBootstrapVersion rule (tests/stacks checks it)
BOOTSTRAP_PARAMETER = "/cdk-bootstrap/hnb659fds/version"
BOOTSTRAP_STACK = "CDKToolkit"
CODEBUILD_SIZES = {
    "BUILD_GENERAL1_SMALL": "Small",
    "BUILD_GENERAL1_MEDIUM": "Medium",
    "BUILD_GENERAL1_LARGE": "Large",
    "BUILD_GENERAL1_XLARGE": "XLarge",
    "BUILD_GENERAL1_2XLARGE": "2XLarge",
}
STAGING_COMPUTE = "BUILD_GENERAL1_SMALL"  # ImageStack's model-staging project
CFN_STACK_TAG = "aws:cloudformation:stack-name"


@dataclass
class Finding:
    check: str
    status: str  # "ok" | "missing" | "unknown" | "warning" (does not block)
    detail: str
    fix: str = ""

    @property
    def blocking(self) -> bool:
        return self.status == "missing"


@dataclass(frozen=True)
class Target:
    """Which stacks and endpoints this run prepares, from the app's config."""

    config: AppConfig
    variants: tuple[VariantConfig, ...]
    region: str
    account: str


def _code(error: Exception) -> str:
    if isinstance(error, ClientError):
        return error.response.get("Error", {}).get("Code", "error")
    return type(error).__name__


def quota_values(service_quotas: Any, service_code: str) -> dict[str, tuple[str, float]]:
    """QuotaName → (QuotaCode, value): the applied values, the defaults where none is applied."""
    values: dict[str, tuple[str, float]] = {}
    for operation in ("list_aws_default_service_quotas", "list_service_quotas"):  # applied ones win
        for page in service_quotas.get_paginator(operation).paginate(ServiceCode=service_code):
            for quota in page.get("Quotas", []):
                values[quota["QuotaName"]] = (quota["QuotaCode"], float(quota["Value"]))
    return values


def peak_instances(variant: VariantConfig) -> int:
    """Instances a blue/green update runs at once at most (VariantConfig.blue_green_peak)."""
    return variant.blue_green_peak


def other_usage(sagemaker: Any, own_endpoints: set[str]) -> dict[str, int]:
    """Instance type → instances that endpoints other than ours run now."""
    usage: dict[str, int] = {}
    for page in sagemaker.get_paginator("list_endpoints").paginate():
        for summary in page.get("Endpoints", []):
            if summary["EndpointName"] in own_endpoints:
                continue
            endpoint = sagemaker.describe_endpoint(EndpointName=summary["EndpointName"])
            config = sagemaker.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])
            types = {v["VariantName"]: v.get("InstanceType") for v in config.get("ProductionVariants", [])}
            for variant in endpoint.get("ProductionVariants", []):
                # A variant with instance pools reports its instances per pool (InstancePoolSummary).
                if variant.get("InstancePools"):
                    running = [
                        (p["InstanceType"], p["CurrentInstanceCount"]) for p in variant["InstancePools"]
                    ]
                else:
                    running = [(types.get(variant["VariantName"]), variant.get("CurrentInstanceCount", 0))]
                for instance_type, count in running:
                    if instance_type:
                        usage[instance_type] = usage.get(instance_type, 0) + int(count)
    return usage


def _increase(service: str, code: str, value: int, region: str) -> str:
    return (
        f"aws service-quotas request-service-quota-increase --service-code {service} --quota-code {code} "
        f"--desired-value {value} --region {region}"
    )


def sagemaker_quotas(service_quotas: Any, sagemaker: Any, target: Target) -> list[Finding]:
    try:
        quotas = quota_values(service_quotas, "sagemaker")
        usage = other_usage(sagemaker, {v.endpoint_name for v in target.variants})
    except (ClientError, BotoCoreError) as error:
        return [Finding("SageMaker endpoint quotas", "unknown", f"could not read them: {_code(error)}")]
    needed: dict[str, tuple[int, list[str]]] = {}
    for variant in target.variants:
        for instance_type in variant.instance_types:
            count, users = needed.get(instance_type, (0, []))
            needed[instance_type] = (count + peak_instances(variant), [*users, variant.endpoint_name])
    findings = []
    for instance_type, (peak, users) in needed.items():
        name = f"{instance_type} for endpoint usage"
        total = peak + usage.get(instance_type, 0)
        elsewhere = usage.get(instance_type, 0)
        what = f"{', '.join(users)}: {peak} at the blue/green peak + {elsewhere} in use elsewhere"
        if name not in quotas:
            findings.append(Finding(name, "unknown", f"no such quota in this region ({what})"))
            continue
        code, value = quotas[name]
        if value >= total:
            findings.append(Finding(name, "ok", f"{value:g} ≥ {total} ({what})"))
        else:
            findings.append(
                Finding(
                    name,
                    "missing",
                    f"{value:g} < {total} ({what})",
                    _increase("sagemaker", code, total, target.region),
                )
            )
    return findings


TRANSFORM_INSTANCES = 1  # decide-batch submit's default --instance-count


def transform_quotas(service_quotas: Any, target: Target) -> list[Finding]:
    """For variants with batch_transform: "<instance type> for transform job usage" (0 on many new
    accounts: CreateTransformJob then fails with ResourceLimitExceeded; SageMaker quotas,
    https://docs.aws.amazon.com/general/latest/gr/sagemaker.html)."""
    variants = [v for v in target.variants if v.batch_transform]
    if not variants:
        return []
    try:
        quotas = quota_values(service_quotas, "sagemaker")
    except (ClientError, BotoCoreError) as error:
        return [Finding("SageMaker transform job quotas", "unknown", f"could not read them: {_code(error)}")]
    findings = []
    for variant in variants:
        name = f"{variant.instance_type} for transform job usage"
        what = f"decide-batch submit --variant {variant.name} runs {TRANSFORM_INSTANCES} instance(s)"
        if name not in quotas:
            findings.append(Finding(name, "unknown", f"no such quota in this region ({what})"))
            continue
        code, value = quotas[name]
        if value >= TRANSFORM_INSTANCES:
            findings.append(Finding(name, "ok", f"{value:g} ({what})"))
        else:
            findings.append(
                Finding(
                    name,
                    "missing",
                    f"{value:g}: every transform job fails with ResourceLimitExceeded ({what})",
                    _increase("sagemaker", code, TRANSFORM_INSTANCES, target.region),
                )
            )
    return findings


def codebuild_quotas(service_quotas: Any, target: Target) -> list[Finding]:
    needed: dict[str, list[str]] = {}
    for variant in target.variants:
        if variant.image_uri is None:
            needed.setdefault(variant.image_build.compute_type, []).append(f"{variant.name} image")
        if variant.model_s3_uri is None:
            needed.setdefault(STAGING_COMPUTE, []).append(f"{variant.name} model staging")
    if not needed:
        return [
            Finding(
                "CodeBuild concurrent builds",
                "ok",
                "nothing is built at deploy time (prebuilt image and model)",
            )
        ]
    try:
        quotas = quota_values(service_quotas, "codebuild")
    except (ClientError, BotoCoreError) as error:
        return [Finding("CodeBuild concurrent builds", "unknown", f"could not read them: {_code(error)}")]
    findings = []
    for compute, users in needed.items():
        size = CODEBUILD_SIZES[compute]
        pattern = re.compile(rf"concurrently running builds for linux/{size} environment", re.IGNORECASE)
        match = next(((n, q) for n, q in quotas.items() if pattern.fullmatch(n)), None)
        label = f"CodeBuild Linux/{size} concurrent builds"
        if match is None:
            # Service Quotas lists a quota per compute type CodeBuild offers in the region: none means
            # StartBuild cannot run this size here (2XLARGE is not offered everywhere).
            findings.append(
                Finding(
                    label,
                    "missing",
                    f"CodeBuild offers no {compute} in {target.region} (no 'Concurrently running builds for "
                    f"Linux/{size} environment' quota; {', '.join(users)})",
                    _compute_fix(compute, users, target),
                )
            )
            continue
        _, (code, value) = match
        # one build at a time is enough (staging and image run in turn); two when both stacks deploy at once
        if value >= 1:
            note = (
                "" if value >= 2 or len(users) < 2 else "; deploy CpuStack and GpuStack one after the other"
            )
            findings.append(Finding(label, "ok", f"{value:g} ({', '.join(users)}){note}"))
        else:
            findings.append(
                Finding(
                    label,
                    "missing",
                    f"{value:g}: StartBuild fails with AccountLimitExceededException ({', '.join(users)})",
                    _increase("codebuild", code, 2, target.region),
                )
            )
    return findings


def _compute_fix(compute: str, users: list[str], target: Target) -> str:
    variants = sorted({u.split()[0] for u in users if u.endswith(" image")})
    smaller = "BUILD_GENERAL1_XLARGE" if compute == "BUILD_GENERAL1_2XLARGE" else "BUILD_GENERAL1_LARGE"
    options = " ".join(f"-c {v}.image_build.compute_type={smaller}" for v in variants)
    prebuilt = " ".join(f"-c {v}.image_uri=<repo>@sha256:<digest>" for v in variants)
    if not variants:
        return f"deploy in a region where CodeBuild offers {compute}"
    return f"use a size offered in {target.region} ({options}), or build in CI and deploy {prebuilt}"


def bootstrap(ssm: Any, cloudformation: Any, target: Target) -> list[Finding]:
    fix = f"npx cdk bootstrap aws://{target.account}/{target.region}"
    try:
        stacks = cloudformation.describe_stacks(StackName=BOOTSTRAP_STACK)["Stacks"]
    except ClientError as error:
        if "does not exist" in error.response.get("Error", {}).get("Message", ""):
            return [
                Finding("CDK bootstrap", "missing", f"no {BOOTSTRAP_STACK} stack in {target.region}", fix)
            ]
        return [Finding("CDK bootstrap", "unknown", f"could not read {BOOTSTRAP_STACK}: {_code(error)}")]
    status = stacks[0]["StackStatus"]
    if not status.endswith("_COMPLETE") or "ROLLBACK" in status:
        return [Finding("CDK bootstrap", "missing", f"{BOOTSTRAP_STACK} is {status}", fix)]
    try:
        version = int(ssm.get_parameter(Name=BOOTSTRAP_PARAMETER)["Parameter"]["Value"])
    except ClientError as error:
        return [Finding("CDK bootstrap", "missing", f"{BOOTSTRAP_PARAMETER}: {_code(error)}", fix)]
    if version < MIN_BOOTSTRAP_VERSION:
        return [Finding("CDK bootstrap", "missing", f"version {version} < {MIN_BOOTSTRAP_VERSION}", fix)]
    return [Finding("CDK bootstrap", "ok", f"{BOOTSTRAP_STACK} {status}, version {version}")]


def _stack_exists(cloudformation: Any, name: str) -> bool:
    try:
        stacks = cloudformation.describe_stacks(StackName=name)["Stacks"]
    except ClientError as error:
        if "does not exist" in error.response.get("Error", {}).get("Message", ""):
            return False
        raise
    return bool(stacks) and stacks[0]["StackStatus"] != "DELETE_COMPLETE"


def leftovers(s3: Any, sagemaker: Any, cloudformation: Any, target: Target) -> list[Finding]:
    """Fixed names a fresh deploy needs free: the artifacts bucket, the endpoint names."""
    findings = []
    bucket = f"{target.config.project}-artifacts-{target.account}-{target.region}"
    try:
        image_stack = _stack_exists(cloudformation, "ImageStack")
        try:
            s3.head_bucket(Bucket=bucket)
            exists = True
        except ClientError as error:
            if _code(error) not in {"404", "NoSuchBucket", "NotFound"}:
                raise
            exists = False
        if exists and not image_stack:
            findings.append(
                Finding(
                    "artifacts bucket name",
                    "missing",
                    f"s3://{bucket} exists (kept by an earlier install) but ImageStack does not: its deploy "
                    "would fail",
                    f"empty and delete s3://{bucket} (all versions), or deploy with "
                    "-c project=<another name>",
                )
            )
        else:
            findings.append(
                Finding("artifacts bucket name", "ok", "ImageStack owns it" if exists else "free")
            )
        for variant in target.variants:
            findings.append(_endpoint_name(sagemaker, variant))
    except (ClientError, BotoCoreError) as error:
        findings.append(Finding("leftovers", "unknown", f"could not check: {_code(error)}"))
    return findings


def endpoint_log_group(variant: VariantConfig) -> str:
    """The endpoint's log group, as SageMaker names it and the stack owns it (stacks/endpoint.py)."""
    return f"/aws/sagemaker/Endpoints/{variant.endpoint_name}"


def log_groups(logs: Any, cloudformation: Any, target: Target) -> list[Finding]:
    """The endpoint log groups: free, or owned by their stack. A leftover one blocks the stack's creation."""
    findings = []
    for variant in target.variants:
        name, stack = endpoint_log_group(variant), "GpuStack" if variant.is_gpu else "CpuStack"
        label = f"log group {name}"
        try:
            groups = logs.describe_log_groups(logGroupNamePrefix=name).get("logGroups", [])
            if not any(g.get("logGroupName") == name for g in groups):
                findings.append(Finding(label, "ok", "free"))
            elif _stack_exists(cloudformation, stack):
                findings.append(Finding(label, "ok", f"{stack} exists (it owns the group)"))
            else:
                findings.append(
                    Finding(
                        label,
                        "missing",
                        f"exists without {stack} (left by a manual test, `promote apply` or a deleted "
                        f"stack): creating {stack} would fail with 'already exists'",
                        "export what you need (aws logs create-export-task …), then aws logs "
                        f"delete-log-group --log-group-name {name} --region {target.region}; or deploy with "
                        f"-c {variant.name}.endpoint_name=<another name>",
                    )
                )
        except (ClientError, BotoCoreError) as error:
            findings.append(Finding(label, "unknown", f"could not check: {_code(error)}"))
    return findings


def _endpoint_name(sagemaker: Any, variant: VariantConfig) -> Finding:
    label = f"endpoint name {variant.endpoint_name}"
    try:
        endpoint = sagemaker.describe_endpoint(EndpointName=variant.endpoint_name)
    except ClientError as error:
        if _code(error) == "ValidationException":  # SageMaker's "Could not find endpoint"
            return Finding(label, "ok", "free")
        raise
    tags = {
        t["Key"]: t["Value"] for t in sagemaker.list_tags(ResourceArn=endpoint["EndpointArn"]).get("Tags", [])
    }
    owner = tags.get(CFN_STACK_TAG)
    expected = "GpuStack" if variant.is_gpu else "CpuStack"
    if owner == expected:
        return Finding(label, "ok", f"owned by {owner}")
    return Finding(
        label,
        "missing",
        f"an endpoint of that name exists outside {expected} (owner: {owner or 'none'})",
        f"delete it, or deploy with -c {variant.name}.endpoint_name=<another name>",
    )


def run_all(clients: dict[str, Any], target: Target) -> list[Finding]:
    return [
        *bootstrap(clients["ssm"], clients["cloudformation"], target),
        *sagemaker_quotas(clients["service-quotas"], clients["sagemaker"], target),
        *codebuild_quotas(clients["service-quotas"], target),
        *transform_quotas(clients["service-quotas"], target),
        *leftovers(clients["s3"], clients["sagemaker"], clients["cloudformation"], target),
        *log_groups(clients["logs"], clients["cloudformation"], target),
        *frozen_scaling(
            clients["sagemaker"],
            clients["cloudwatch"],
            target,
            autoscaling=clients["application-autoscaling"],
        ),
    ]


LOAD_WINDOW = timedelta(minutes=15)
LOW_COUNT_LOAD = 0.5  # of the scaling target (concurrency or invocations per instance): "under load"


def _load_per_instance(
    cloudwatch: Any, variant: VariantConfig, count: int, now: datetime
) -> tuple[float, float, str]:
    """(load per instance over the last 15 minutes, the scaling target, what they count), on the
    metric the variant's target tracking follows: ConcurrentRequestsPerModel ("the number of
    concurrent requests being received by a model container", one per instance) under concurrency
    scaling, InvocationsPerInstance's source (Invocations / instances, a minute) otherwise
    (https://docs.aws.amazon.com/sagemaker/latest/dg/endpoint-auto-scaling-add-code-define.html)."""
    concurrency = variant.scaling_metric == "concurrency"
    points = cloudwatch.get_metric_statistics(
        Namespace="AWS/SageMaker",
        MetricName="ConcurrentRequestsPerModel" if concurrency else "Invocations",
        Dimensions=[
            {"Name": "EndpointName", "Value": variant.endpoint_name},
            {"Name": "VariantName", "Value": "AllTraffic"},
        ],
        StartTime=now - LOAD_WINDOW,
        EndTime=now,
        Period=60,
        Statistics=["Average" if concurrency else "Sum"],
    ).get("Datapoints", [])
    if concurrency:
        average = sum(p["Average"] for p in points) / len(points) if points else 0.0
        return average, variant.target_concurrency_per_instance, "concurrent requests per instance"
    per_minute = sum(p["Sum"] for p in points) / (LOAD_WINDOW.total_seconds() / 60)
    return (
        per_minute / max(count, 1),
        float(variant.target_invocations_per_instance),
        "invocations a minute each",
    )


def live_state(
    sagemaker: Any, autoscaling: Any, endpoint: dict[str, Any], variant: VariantConfig
) -> dict[str, Any]:
    """What the live endpoint is, in the shape of Custom::UpdateGuard's properties (its last deploy)."""
    config = sagemaker.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])
    production = (config.get("ProductionVariants") or [{}])[0]
    pools = sorted(production.get("InstancePools") or [], key=lambda pool: pool.get("Priority", 0))
    types = [pool["InstanceType"] for pool in pools] or [production.get("InstanceType")]
    targets = autoscaling.describe_scalable_targets(
        ServiceNamespace="sagemaker",
        ResourceIds=[f"endpoint/{variant.endpoint_name}/variant/AllTraffic"],
        ScalableDimension="sagemaker:variant:DesiredInstanceCount",
    ).get("ScalableTargets", [])
    return {
        "EndpointName": variant.endpoint_name,
        "Variant": variant.name,
        "Invocation": "async" if config.get("AsyncInferenceConfig") else "realtime",
        "InstanceTypes": [t for t in types if t],
        "Autoscaling": "true" if targets else "false",
    }


def update_rules(
    sagemaker: Any, autoscaling: Any, endpoint: dict[str, Any], variant: VariantConfig
) -> Finding:
    """The refusals SageMaker documents for an update from the live endpoint to this config (the rules
    of stacks/handlers/update_guard.py, which also checks them at deploy time), before CI builds."""
    label = f"update of {variant.endpoint_name}"
    try:
        old = live_state(sagemaker, autoscaling, endpoint, variant)
    except (ClientError, BotoCoreError) as error:
        return Finding(label, "unknown", f"could not read the live config: {_code(error)}")
    new = {**old, "Invocation": variant.invocation, "InstanceTypes": variant.instance_types}
    problems = update_guard.update_refusals(old, new)
    if problems:
        return Finding(label, "missing", "; ".join(problems), "see the detail: deploy in the steps it names")
    return Finding(
        label, "ok", f"{old['Invocation']}, {', '.join(old['InstanceTypes'])}: an update SageMaker accepts"
    )


def frozen_scaling(
    sagemaker: Any,
    cloudwatch: Any,
    target: Target,
    now: datetime | None = None,
    autoscaling: Any | None = None,
) -> list[Finding]:
    """For each existing endpoint: with `autoscaling` (an application-autoscaling client), the
    documented update refusals (`update_rules`); then warn when it runs below max_capacity while its
    load per instance over the last 15 minutes reaches half its scaling target (on the metric the
    target tracking follows): an update runs for the whole canary, linear and termination bake (and
    its fleet keeps the live count), during which autoscaling does not scale."""
    now = now or datetime.now(UTC)
    findings = []
    for variant in target.variants:
        if not variant.autoscaling and autoscaling is None:
            continue
        label = f"instances of {variant.endpoint_name} before the update"
        try:
            endpoint = sagemaker.describe_endpoint(EndpointName=variant.endpoint_name)
        except ClientError as error:
            if _code(error) == "ValidationException":  # no endpoint yet: a create, nothing to scale
                continue
            findings.append(Finding(label, "unknown", f"could not read it: {_code(error)}"))
            continue
        if autoscaling is not None:
            findings.append(update_rules(sagemaker, autoscaling, endpoint, variant))
        if not variant.autoscaling:
            continue
        try:
            count = sum(int(v.get("CurrentInstanceCount", 0)) for v in endpoint.get("ProductionVariants", []))
            load, goal, unit = _load_per_instance(cloudwatch, variant, count, now)
        except (ClientError, BotoCoreError) as error:
            findings.append(Finding(label, "unknown", f"could not read the load: {_code(error)}"))
            continue
        bake = variant.deployment.wait_interval_s + variant.deployment.termination_wait_s
        what = (
            f"{count} of at most {variant.max_capacity} instances, {load:.1f} {unit} over the last 15 min "
            f"(target {goal:g})"
        )
        if count < variant.max_capacity and load >= LOW_COUNT_LOAD * goal:
            findings.append(
                Finding(
                    label,
                    "warning",
                    f"{what}: autoscaling cannot add instances during the update (at least "
                    f"{bake // 60} min of baking), and the new fleet starts at this count",
                    "scale out first: aws application-autoscaling register-scalable-target "
                    "--service-namespace sagemaker --scalable-dimension "
                    f"sagemaker:variant:DesiredInstanceCount --resource-id endpoint/{variant.endpoint_name}"
                    f"/variant/AllTraffic --min-capacity {variant.max_capacity}, and the same with "
                    f"--min-capacity {variant.min_capacity} after the deploy; or deploy at a quieter hour",
                )
            )
        else:
            findings.append(Finding(label, "ok", what))
    return findings
