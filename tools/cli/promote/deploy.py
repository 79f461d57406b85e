"""Changing the endpoint: create the content-named model/config, UpdateEndpoint with guardrails, wait."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import ClientError
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from decider_cli.promote.errors import PromoteError
from decider_cli.promote.guards import alarm_states
from decider_cli.promote.live import (
    TAG_ENDPOINT,
    TAG_IN_FLIGHT,
    TAG_ROLLBACK,
    describe_config,
    describe_model,
)
from decider_cli.promote.spec import Promotion
from decider_stacks.handlers import image_retention

THROTTLING_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestThrottled",
        "SlowDown",
    }
)
TERMINAL_STATUSES = frozenset({"InService", "Failed", "UpdateRollbackFailed", "OutOfService"})
MAX_CANARY_PERCENT = 50  # policy: a canary over half the fleet is no canary (service limit unverified)
MIN_EXECUTION_TIMEOUT_S, MAX_EXECUTION_TIMEOUT_S = 600, 28800
UPDATE_REGISTER_GRACE_S = 60


@dataclass(frozen=True)
class GuardrailSettings:
    canary_percent: int = 10
    wait_minutes: int = 10  # canary bake time: WaitIntervalInSeconds
    timeout_minutes: int = 90  # MaximumExecutionTimeoutInSeconds and how long promote waits
    alarms: tuple[str, ...] = ()
    auto_rollback: bool = True


@dataclass
class Outcome:
    status: str
    config_name: str
    target_config: str
    failure_reason: str | None = None
    firing_alarms: list[str] = field(default_factory=list)
    timed_out: bool = False

    @property
    def succeeded(self) -> bool:
        return self.status == "InService" and self.config_name == self.target_config and not self.timed_out

    @property
    def rolled_back(self) -> bool:
        return self.status == "InService" and self.config_name != self.target_config


def deployment_config(settings: GuardrailSettings) -> dict[str, Any]:
    """Blue/green CANARY policy plus auto-rollback on the alarms (notes/sagemaker.md §6)."""
    if not 1 <= settings.canary_percent <= MAX_CANARY_PERCENT:
        raise PromoteError(
            "bad_canary_percent", f"--canary-percent must be 1-50, got {settings.canary_percent}"
        )
    if not 0 <= settings.wait_minutes <= 60:
        raise PromoteError(
            "bad_wait",
            f"--wait-minutes must be 0-60 (WaitIntervalInSeconds ≤ 3600), got {settings.wait_minutes}",
        )
    timeout_s = min(max(settings.timeout_minutes * 60, MIN_EXECUTION_TIMEOUT_S), MAX_EXECUTION_TIMEOUT_S)
    config: dict[str, Any] = {
        "BlueGreenUpdatePolicy": {
            "TrafficRoutingConfiguration": {
                "Type": "CANARY",
                "CanarySize": {"Type": "CAPACITY_PERCENT", "Value": settings.canary_percent},
                "WaitIntervalInSeconds": settings.wait_minutes * 60,
            },
            "TerminationWaitInSeconds": 0,
            "MaximumExecutionTimeoutInSeconds": timeout_s,
        }
    }
    if settings.auto_rollback:
        config["AutoRollbackConfiguration"] = {"Alarms": [{"AlarmName": name} for name in settings.alarms]}
    return config


def ensure_resources(sagemaker: Any, promotion: Promotion) -> list[str]:
    """Create the model and config unless they exist (same content → same name). Returns what was created."""
    created = []
    tags = [{"Key": TAG_ENDPOINT, "Value": promotion.endpoint}]
    if promotion.new_model and describe_model(sagemaker, promotion.model_name) is None:
        sagemaker.create_model(**promotion.model_request, Tags=tags)
        created.append(f"model {promotion.model_name}")
    if promotion.changed and describe_config(sagemaker, promotion.config_name) is None:
        sagemaker.create_endpoint_config(**promotion.config_request, Tags=tags)
        created.append(f"endpoint config {promotion.config_name}")
    return created


def start_update(
    sagemaker: Any,
    endpoint: str,
    config_name: str,
    deploy_config: dict[str, Any] | None,
    *,
    take_count: bool = False,
) -> None:
    """UpdateEndpoint keeping the live variant properties (RetainAllVariantProperties): without it
    an autoscaled fleet is reset to the new config's InitialInstanceCount ("If false, uses the new
    EndpointConfig's values", https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_UpdateEndpoint.html).

    Retaining keeps the live instance count too, so a `--count` change would do nothing: with
    `take_count`, ExcludeRetainedVariantProperties names DesiredInstanceCount, which "Overrides the
    existing variant instance counts using the InitialInstanceCount values in the ProductionVariants"
    of the new config, everything else still retained
    (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_VariantProperty.html)."""
    kwargs: dict[str, Any] = {
        "EndpointName": endpoint,
        "EndpointConfigName": config_name,
        "RetainAllVariantProperties": True,
    }
    if take_count:
        kwargs["ExcludeRetainedVariantProperties"] = [{"VariantPropertyType": "DesiredInstanceCount"}]
    if deploy_config is not None:
        kwargs["DeploymentConfig"] = deploy_config
    sagemaker.update_endpoint(**kwargs)


def mark_in_flight(sagemaker: Any, endpoint_arn: str, previous: str, target: str) -> None:
    """Before UpdateEndpoint: remember `previous → target` on the endpoint, so that an apply re-run
    after its CI job timed out (the endpoint now on `target`, "Already live") still smokes the new
    config and records `previous` as the rollback target. Config names match
    `[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}`, so a space separates them in a tag value."""
    sagemaker.add_tags(
        ResourceArn=endpoint_arn, Tags=[{"Key": TAG_IN_FLIGHT, "Value": f"{previous} {target}"}]
    )


def in_flight_from(tags: dict[str, str], target: str) -> str | None:
    """The config an unfinished apply to `target` left, from the endpoint's tags; None if none did."""
    previous, _, marked = tags.get(TAG_IN_FLIGHT, "").partition(" ")
    return previous if previous and marked == target else None


def clear_in_flight(sagemaker: Any, endpoint_arn: str) -> None:
    sagemaker.delete_tags(ResourceArn=endpoint_arn, TagKeys=[TAG_IN_FLIGHT])


def protect_image(ecr: Any, image: str) -> str:
    """Tag the image `keep-<digest>` so that an ECR lifecycle rule on `keep-` never expires it
    (ImageStack's repository has that rule first). Nothing removes the tag again, not even `prune`:
    a digest a config once ran stays pullable until the tag is deleted by hand. Best effort: returns
    what happened, one line; never raises for an image it cannot tag."""
    try:
        ref = image_retention.parse_image_uri(image)
    except ValueError:
        return f"{image} is not a private ECR image by digest; not protected from lifecycle rules"
    try:
        added = image_retention.protect_image(ecr, ref)
    except image_retention.ImageNotFoundError as exc:
        return f"could not protect {image} from lifecycle rules: {exc}"
    except ClientError as exc:
        return f"could not tag {image} {ref.keep_tag}: {exc.response.get('Error', {}).get('Code', exc)}"
    return f"kept {image} out of lifecycle rules: tag {ref.keep_tag}" + ("" if added else " (already there)")


def record_rollback_target(sagemaker: Any, endpoint_arn: str, config_name: str) -> None:
    """Remember the config `promote rollback` returns to (AddTags overwrites the previous value)."""
    sagemaker.add_tags(ResourceArn=endpoint_arn, Tags=[{"Key": TAG_ROLLBACK, "Value": config_name}])


def is_throttling(exc: ClientError) -> bool:
    return exc.response.get("Error", {}).get("Code") in THROTTLING_CODES


def call_with_backoff(
    call: Callable[[], Any],
    *,
    attempts: int = 8,
    base_delay: float = 1.0,
    max_delay: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
) -> Any:
    """Retry a call on throttling with exponential backoff, beyond botocore's own retries.

    Used for the long polling loops, where giving up on a burst of throttling would abandon a
    deployment that is still progressing.
    """
    delay = base_delay
    for attempt in range(attempts):
        try:
            return call()
        except ClientError as exc:
            if not is_throttling(exc) or attempt == attempts - 1:
                raise
            sleep(delay)
            delay = min(delay * 2, max_delay)
    raise AssertionError("unreachable")  # pragma: no cover


def wait_for_update(
    sagemaker: Any,
    cloudwatch: Any,
    endpoint: str,
    target_config: str,
    *,
    alarms: tuple[str, ...],
    timeout_s: float,
    poll_s: float,
    console: Console,
    sleep: Callable[[float], None] = time.sleep,
) -> Outcome:
    """Poll DescribeEndpoint (and the alarms) until the update ends or `timeout_s` passes."""
    started = time.monotonic()
    last_line = ""
    seen_update = False  # guards against reading the old InService state before the update registers
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task(f"updating {endpoint}", total=None)
        while True:
            raw = call_with_backoff(lambda: sagemaker.describe_endpoint(EndpointName=endpoint), sleep=sleep)
            status = raw["EndpointStatus"]
            states = (
                call_with_backoff(lambda: alarm_states(cloudwatch, list(alarms)), sleep=sleep)
                if alarms
                else {}
            )
            firing = sorted(name for name, state in states.items() if state == "ALARM")
            alarm_text = ", ".join(f"{n}={s}" for n, s in sorted(states.items())) or "no alarms"
            line = f"{status} on {raw['EndpointConfigName']} ({alarm_text})"
            progress.update(task, description=f"{endpoint}: {line}")
            if line != last_line:
                console.log(line)
                last_line = line
            seen_update = seen_update or status != "InService" or raw["EndpointConfigName"] == target_config
            elapsed = time.monotonic() - started
            done = status in TERMINAL_STATUSES and (seen_update or elapsed > UPDATE_REGISTER_GRACE_S)
            if done or elapsed > timeout_s:
                return Outcome(
                    status,
                    raw["EndpointConfigName"],
                    target_config,
                    raw.get("FailureReason"),
                    firing,
                    timed_out=not done,
                )
            sleep(poll_s)
