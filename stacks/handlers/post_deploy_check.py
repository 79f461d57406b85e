"""The post-deploy check of an endpoint stack: does the endpoint really run this deploy's config, and
does it answer?

After a blue/green update that SageMaker rolled back on its own, the endpoint can report InService on
the *old* config with an empty FailureReason (hashicorp/terraform-provider-aws#48997), and
CloudFormation counts the update as done. This check runs after the endpoint resource: it compares
the live EndpointConfigName with the stack's, then sends one decision and one chat request through
sagemaker-runtime. A failure fails the custom resource, so CloudFormation rolls the stack back.

A failed check must leave CloudFormation a rollback that can finish. CloudFormation rolls the
Endpoint back with UpdateEndpoint(previous config, previous DeploymentConfig). That is refused when
the endpoint already runs the previous config (SageMaker rolled it back itself: "To update an
endpoint, you must create a new EndpointConfig"), and it is rolled back in turn when the rollback
alarms are still in ALARM. So before it fails, the check *parks* the endpoint: it copies the previous
config under a new name (`<endpoint>-parked-<hash>`, tagged for `promote prune`), moves the endpoint
onto it with an all-at-once blue/green update without alarms (the previous image: the safe state),
waits for the rollback alarms to leave ALARM, and only then fails. CloudFormation's rollback then
moves the endpoint from the parked copy back to the previous config, which it can. A first deploy
(Create) has no previous config and needs no parking: its rollback deletes the endpoint. Nor does a
rename (`EndpointName` changed): the endpoint under the new name is new, the rollback deletes it, and
the previous config belongs to the old endpoint, which the failed update never touched.

During a rollback (the stack is in UPDATE_ROLLBACK_IN_PROGRESS, where CloudFormation sends this
resource its old properties) nothing is checked: a failure there would leave the stack in
UPDATE_ROLLBACK_FAILED.

What parking relies on:
- The parked copy is made from the previous config's *synthesized* properties: the resource's property
  `EndpointConfig` carries this deploy's config as JSON, so an update's `OldResourceProperties` carry
  the previous one exactly as CloudFormation created it. It is sent to CreateEndpointConfig as that JSON
  (sagemaker_json.py), not through the Lambda runtime's botocore, which drops no field it does not know
  only because it refuses them (PrefixAwareRoutingConfig, MetricsConfig, …). Stacks deployed before
  this property existed fall back to a DescribeEndpointConfig copy.
- It parks once: a parked config that exists while the endpoint neither runs it nor moves to it means
  the parking update itself failed or rolled back; the check then ends, saying what to run.
- It parks only when the time left before the provider's deadline covers provisioning, the model
  download and the container's health check of the previous config, and it bounds the parking update
  by that time (BlueGreenUpdatePolicy MaximumExecutionTimeoutInSeconds, 600-28800 s;
  https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_BlueGreenUpdatePolicy.html).
- While the endpoint is `Updating` or `SystemUpdating` on this deploy's config (autoscaling's held-back
  scale-out, which "is blocked during an update", or patching), the check waits instead of failing; so
  it does on the previous config (the update not switched over yet, or being rolled back), and judges
  the state the endpoint settles in: parking needs an InService endpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from botocore.exceptions import ClientError

try:  # package import (tools, tests)
    from . import runtime_client, smoke
except ImportError:  # the Lambda asset's root
    import runtime_client  # type: ignore[no-redef]
    import smoke  # type: ignore[no-redef]

LOG = logging.getLogger(__name__)

# The first requests after an update may meet a warming instance: retry the smoke calls this long.
SMOKE_RETRY_WINDOW = timedelta(minutes=5)
# How long a failing check waits, after parking, for the rollback alarms to leave ALARM (counted from
# the check's start; the provider gives up after 55 min).
ALARM_SETTLE_DEADLINE = timedelta(minutes=45)
ENDPOINT_TAG = "promote:endpoint"  # as decider_stacks.config.ENDPOINT_TAG (a Lambda cannot import stacks)
PARKED_TAG = "decider:parked-for"
REASON_TAG = "decider:parked-because"  # the first failure, for the message the stack fails with
MAX_TAG_VALUE = 256
# The provider gives up on a resource this long after its start
# (decider_stacks.config.PROVIDER_TOTAL_TIMEOUT_MINUTES, which a Lambda cannot import; a test keeps
# them equal).
PROVIDER_DEADLINE = timedelta(minutes=55)
# How long the check waits for an endpoint that is Updating/SystemUpdating on this deploy's config.
UPDATING_WAIT = timedelta(minutes=30)
# A parking update's fleet: when the previous config names no provisioning timeout, this is assumed.
DEFAULT_PROVISION_S = 600
DEFAULT_DOWNLOAD_S = 900
DEFAULT_HEALTH_CHECK_S = 900
# The endpoint-config name prefix a parked copy keeps of the endpoint's name (63 characters in all).
PARKED_NAME_KEEP = 42
WAITING_STATES = ("Updating", "SystemUpdating")
# What a poll keeps, after its last sagemaker-runtime call, for parking: a few SageMaker control-plane
# calls (DescribeEndpointConfig, CreateEndpointConfig, UpdateEndpoint, ListTags) that answer in seconds.
PARKING_RESERVE_S = 30
# A smoke call starts only while the Lambda's time left holds it (every attempt hanging) and parking.
SMOKE_CALL_NEED_S = runtime_client.call_budget_s() + PARKING_RESERVE_S
# The fields of a DescribeEndpointConfig answer that CreateEndpointConfig takes back.
CONFIG_FIELDS = (
    "ProductionVariants",
    "DataCaptureConfig",
    "KmsKeyId",
    "AsyncInferenceConfig",
    "ShadowProductionVariants",
    "ExplainerConfig",
    "ExecutionRoleArn",
    "VpcConfig",
    "EnableNetworkIsolation",
)


class PostDeployCheckError(RuntimeError):
    """The endpoint does not run the stack's config, or does not answer correctly."""


def rolling_back(cloudformation: Any, stack_id: str) -> bool:
    stacks = cloudformation.describe_stacks(StackName=stack_id).get("Stacks", [])
    status = stacks[0]["StackStatus"] if stacks else ""
    return status.endswith("ROLLBACK_IN_PROGRESS")


def start(clients: Any, event: dict[str, Any], now: datetime | None = None) -> dict[str, Any]:
    """onEvent: note the start time and the config a rollback returns to, or skip the whole check
    while the stack rolls back."""
    if rolling_back(clients["cloudformation"], event["StackId"]):
        LOG.info("stack is rolling back: not checking %s", event["ResourceProperties"]["EndpointName"])
        return {"Skipped": "rollback"}
    data = {"StartedAt": (now or datetime.now(UTC)).isoformat()}
    old = event.get("OldResourceProperties") or {}
    previous = old.get("EndpointConfigName")
    renamed = old.get("EndpointName") not in (None, event["ResourceProperties"]["EndpointName"])
    if renamed:  # a new endpoint (the old one is deleted after the update): no previous config to park on
        LOG.info(
            "%s replaces %s: a failure is not parked",
            event["ResourceProperties"]["EndpointName"],
            old["EndpointName"],
        )
        data["Renamed"] = f"{old['EndpointName']} -> {event['ResourceProperties']['EndpointName']}"
    elif event["RequestType"] == "Update" and previous:
        data["PreviousConfig"] = previous
        if old.get("EndpointConfig"):  # the previous config as synthesized (parking copies it)
            data["PreviousConfigProperties"] = old["EndpointConfig"]
    return data


def parked_prefix(endpoint_name: str) -> str:
    """What every parked config of an endpoint starts with (the IAM pattern is this, then `*`)."""
    return f"{endpoint_name[:PARKED_NAME_KEEP]}-parked-"


def parking_config_name(endpoint_name: str, previous: str, failed: str) -> str:
    """The copy of `previous` a failed deploy of `failed` parks the endpoint on (at most 63 characters)."""
    digest = hashlib.sha256(f"{previous}|{failed}".encode()).hexdigest()[:10]
    return f"{parked_prefix(endpoint_name)}{digest}"


def previous_properties(data: dict[str, Any]) -> dict[str, Any] | None:
    """The previous config's synthesized properties (CreateEndpointConfig's shape), when the stack
    passed them (the `EndpointConfig` property of the previous deploy)."""
    text = data.get("PreviousConfigProperties")
    if not text:
        return None
    properties = json.loads(text)
    return {k: v for k, v in properties.items() if k not in ("Tags", "EndpointConfigName")}


def parking_need_s(properties: dict[str, Any] | None) -> int:
    """Seconds a parking update may need: provisioning, the model download and the health check of
    the previous config's slowest variant (their configured timeouts; defaults where unset)."""
    variants = (properties or {}).get("ProductionVariants") or [{}]
    return max(
        int(v.get("VariantInstanceProvisionTimeoutInSeconds") or DEFAULT_PROVISION_S)
        + int(v.get("ModelDataDownloadTimeoutInSeconds") or DEFAULT_DOWNLOAD_S)
        + int(v.get("ContainerStartupHealthCheckTimeoutInSeconds") or DEFAULT_HEALTH_CHECK_S)
        for v in variants
    )


def parking_deployment(seconds_left: int) -> dict[str, Any]:
    """All at once, no alarms, and no longer than the time left (600-28800 s)."""
    return {
        "BlueGreenUpdatePolicy": {
            "TrafficRoutingConfiguration": {"Type": "ALL_AT_ONCE", "WaitIntervalInSeconds": 0},
            "TerminationWaitInSeconds": 0,
            "MaximumExecutionTimeoutInSeconds": max(600, min(28_800, seconds_left)),
        }
    }


def _config_exists(sagemaker: Any, name: str) -> bool:
    try:
        sagemaker.describe_endpoint_config(EndpointConfigName=name)
    except ClientError as error:
        if error.response["Error"]["Code"] == "ValidationException":
            return False
        raise
    return True


def park(
    clients: Any,
    endpoint_name: str,
    previous: str,
    parked: str,
    reason: str,
    *,
    properties: dict[str, Any] | None = None,
    seconds_left: int = 3600,
) -> None:
    """Create `parked` as a copy of `previous` and move the endpoint onto it, all at once, without
    alarms. The copy is `properties` (the previous config as synthesized) sent as JSON, or, without
    them, a DescribeEndpointConfig copy of the fields botocore knows."""
    sagemaker = clients["sagemaker"]
    tags = [
        {"Key": ENDPOINT_TAG, "Value": endpoint_name},
        {"Key": PARKED_TAG, "Value": previous},
        {"Key": REASON_TAG, "Value": _tag_text(reason)},
    ]
    if properties is not None:
        clients["sagemaker-json"].call(
            "CreateEndpointConfig", {**properties, "EndpointConfigName": parked, "Tags": tags}
        )
    else:
        described = sagemaker.describe_endpoint_config(EndpointConfigName=previous)
        copy = {key: described[key] for key in CONFIG_FIELDS if described.get(key) not in (None, [], {})}
        sagemaker.create_endpoint_config(EndpointConfigName=parked, Tags=tags, **copy)
    sagemaker.update_endpoint(
        EndpointName=endpoint_name,
        EndpointConfigName=parked,
        RetainAllVariantProperties=True,
        DeploymentConfig=parking_deployment(seconds_left),
    )
    LOG.warning(
        "parked %s on %s (a copy of %s) so that the stack's rollback can finish",
        endpoint_name,
        parked,
        previous,
    )


def _tag_text(text: str) -> str:
    """A tag value: at most 256 characters of letters, digits, spaces and `_.:/=+-@`."""
    cleaned = "".join(c if c.isalnum() or c in " _.:/=+-@" else " " for c in text)
    return cleaned[:MAX_TAG_VALUE]


def parked_reason(sagemaker: Any, parked: str, default: str) -> str:
    """Why the endpoint was parked (the first failure), from the parked config's tag."""
    try:
        arn = sagemaker.describe_endpoint_config(EndpointConfigName=parked)["EndpointConfigArn"]
        tags = sagemaker.list_tags(ResourceArn=arn).get("Tags", [])
    except ClientError as error:
        LOG.warning("could not read why %s was parked: %s", parked, error)
        return default
    return next((t["Value"] for t in tags if t["Key"] == REASON_TAG), default)


def alarms_in_alarm(cloudwatch: Any, names: list[str]) -> list[str]:
    if not names:
        return []
    found = cloudwatch.describe_alarms(AlarmNames=names).get("MetricAlarms", [])
    return [alarm["AlarmName"] for alarm in found if alarm.get("StateValue") == "ALARM"]


def _fail(
    clients: Any,
    props: dict[str, Any],
    data: dict[str, Any],
    endpoint: dict[str, Any],
    reason: str,
    now: datetime,
) -> dict[str, Any]:
    """Park the endpoint on a copy of the previous config (when there is one), let the rollback
    alarms settle, then raise `reason`: CloudFormation's rollback can then finish."""
    previous = data.get("PreviousConfig")
    if not previous:
        raise PostDeployCheckError(reason)
    name = props["EndpointName"]
    parked = parking_config_name(name, previous, props["EndpointConfigName"])
    live, status = endpoint["EndpointConfigName"], endpoint["EndpointStatus"]
    pending = (endpoint.get("PendingDeploymentSummary") or {}).get("EndpointConfigName")
    if status in ("Updating", "SystemUpdating") and parked in (pending, live):
        LOG.info("%s moving to the parked config %s", name, parked)
        return {"IsComplete": False}
    if live != parked:
        if status != "InService":
            raise PostDeployCheckError(
                f"{reason}; {name} is {status}, so it could not be parked for the rollback"
            )
        if _config_exists(clients["sagemaker"], parked):  # park once: the parking update did not take
            why = endpoint.get("FailureReason") or "no FailureReason given"
            first = parked_reason(clients["sagemaker"], parked, reason)
            raise PostDeployCheckError(
                f"{first}; parking {name} on {parked} (a copy of {previous}) did not take: it runs "
                f"{live} ({why}), and it is not parked twice. If the "
                "stack's rollback fails, see docs/deploy.md, 'Rollbacks that finish' (aws cloudformation "
                "continue-update-rollback)"
            )
        properties = previous_properties(data)
        left = int((datetime.fromisoformat(data["StartedAt"]) + PROVIDER_DEADLINE - now).total_seconds())
        need = parking_need_s(properties)
        if left < need:
            raise PostDeployCheckError(
                f"{reason}; not parking {name}: provisioning, download and health check of {previous} "
                f"may take {need} s, only {max(left, 0)} s are left before the custom resource's "
                "deadline. If the stack's rollback fails, see docs/deploy.md, 'Rollbacks that finish'"
            )
        LOG.warning("%s; parking %s for the rollback", reason, name)
        try:
            park(clients, name, previous, parked, reason, properties=properties, seconds_left=left)
        except ClientError as error:  # fail now with both reasons: the rollback may need a hand
            raise PostDeployCheckError(
                f"{reason}; parking {name} on a copy of {previous} failed ({error}): if the stack's rollback "
                "fails, see docs/deploy.md, 'Rollbacks that finish'"
            ) from error
        return {"IsComplete": False}
    if status != "InService":
        raise PostDeployCheckError(f"{reason}; parking {name} on {parked} left it {status}")
    firing = alarms_in_alarm(clients["cloudwatch"], list(props.get("RollbackAlarms") or []))
    if firing and now - datetime.fromisoformat(data["StartedAt"]) < ALARM_SETTLE_DEADLINE:
        LOG.info("parked; waiting for %s to leave ALARM before the stack rolls back", ", ".join(firing))
        return {"IsComplete": False}
    reason = parked_reason(clients["sagemaker"], parked, reason)
    still = (
        f" ({', '.join(firing)} still in ALARM: the rollback's blue/green may be rolled back too)"
        if firing
        else ""
    )
    raise PostDeployCheckError(
        f"{reason}. {name} is parked on {parked} (a copy of {previous}); CloudFormation's rollback returns "
        f"it to {previous}{still}"
    )


def smoke_gate(time_left: runtime_client.TimeLeft | None) -> Any:
    """Before each smoke call: None when this Lambda's time left holds one more call (every attempt
    hanging) plus parking, else why not."""
    if time_left is None:
        return None

    def may_start() -> str | None:
        left = time_left()
        if left >= SMOKE_CALL_NEED_S:
            return None
        return (
            f"{left:.0f} s left in this poll, a call may take {runtime_client.call_budget_s():.0f} s "
            f"and parking {PARKING_RESERVE_S} s"
        )

    return may_start


def check(
    clients: Any,
    props: dict[str, Any],
    data: dict[str, Any],
    now: datetime | None = None,
    *,
    time_left: runtime_client.TimeLeft | None = None,
) -> dict[str, Any]:
    """isComplete: a config mismatch or smoke calls failing past their retry window fail the deploy,
    after parking the endpoint so that the stack's rollback can finish. `time_left`: the seconds this
    Lambda has left; a smoke call starts only while it holds that call and parking."""
    if data.get("Skipped"):
        return {"IsComplete": True, "Data": {"Result": f"skipped ({data['Skipped']})"}}
    now = now or datetime.now(UTC)
    endpoint_name, expected = props["EndpointName"], props["EndpointConfigName"]
    endpoint = clients["sagemaker"].describe_endpoint(EndpointName=endpoint_name)
    live, status = endpoint["EndpointConfigName"], endpoint["EndpointStatus"]
    previous = data.get("PreviousConfig")
    parked = parking_config_name(endpoint_name, previous, expected) if previous else None
    pending = (endpoint.get("PendingDeploymentSummary") or {}).get("EndpointConfigName")
    if parked is not None and parked in (live, pending):  # a failure parked it: finish that
        reason = f"{endpoint_name} failed the post-deploy check of {expected}"
        return _fail(clients, props, data, endpoint, reason, now)
    # Still Updating on the previous config (the deploy's update not yet switched over, SageMaker
    # rolling it back, autoscaling's held-back scale-out or patching): nothing can be judged, and
    # parking needs an InService endpoint ("Cannot update in-progress endpoint"). Wait as for this
    # deploy's config, and judge the state it settles in.
    settling = live != expected and live == previous and status in WAITING_STATES
    if settling and now - datetime.fromisoformat(data["StartedAt"]) < UPDATING_WAIT:
        LOG.info("%s is %s on the previous %s (pending %s): waiting", endpoint_name, status, live, pending)
        return {"IsComplete": False}
    if live != expected:
        reason = endpoint.get("FailureReason") or "no FailureReason given"
        if live != previous:
            raise PostDeployCheckError(
                f"{endpoint_name} runs endpoint config {live}, neither this deploy's {expected} nor the "
                f"previous {previous} (status {status}; {reason}): changed outside the stack"
            )
        return _fail(
            clients,
            props,
            data,
            endpoint,
            f"SageMaker rolled the update back: {endpoint_name} runs endpoint config {live}, not this "
            f"deploy's {expected} (status {status}; {reason}), so this deploy fails and CloudFormation "
            "rolls the stack back too",
            now,
        )
    if status in WAITING_STATES:  # autoscaling's held-back scale-out, or patching, on this config
        if now - datetime.fromisoformat(data["StartedAt"]) < UPDATING_WAIT:
            LOG.info("%s is %s on %s: waiting", endpoint_name, status, live)
            return {"IsComplete": False}
        raise PostDeployCheckError(f"{endpoint_name} is still {status} on {live} after {UPDATING_WAIT}")
    if status != "InService":
        raise PostDeployCheckError(f"{endpoint_name} is {status}, not InService")
    if props.get("Invocation") == "async":  # an async endpoint refuses InvokeEndpoint: no smoke calls
        return {
            "IsComplete": True,
            "Data": {"Result": f"{endpoint_name} runs {live} (async: no smoke calls)"},
        }
    results = smoke.run_smoke(clients["sagemaker-runtime"], endpoint_name, smoke_gate(time_left))
    summary = "; ".join(f"{r.name}: {'ok' if r.ok else 'FAIL'} ({r.detail})" for r in results)
    if all(r.ok for r in results):
        LOG.info("post-deploy check passed: %s", summary)
        return {"IsComplete": True, "Data": {"Result": summary[:1000]}}
    started = datetime.fromisoformat(data["StartedAt"])
    if now - started < SMOKE_RETRY_WINDOW:
        LOG.warning("smoke calls failed, retrying: %s", summary)
        return {"IsComplete": False}
    return _fail(
        clients,
        props,
        data,
        endpoint,
        f"smoke calls on {endpoint_name} failed for {SMOKE_RETRY_WINDOW}: {summary}",
        now,
    )
