"""The post-deploy check of an endpoint stack: does the endpoint really run this deploy's config, and
does it answer?

After a blue/green update that SageMaker rolled back on its own, the endpoint can report InService on
the *old* config with an empty FailureReason (hashicorp/terraform-provider-aws#48997), and
CloudFormation counts the update as done. This check runs after the endpoint resource: it compares
the live EndpointConfigName with the stack's, then sends one decision and one chat request through
sagemaker-runtime. A failure fails the custom resource, so CloudFormation rolls the stack back.

During a rollback (the stack is in UPDATE_ROLLBACK_IN_PROGRESS, where CloudFormation sends this
resource its old properties) nothing is checked: a failure there would leave the stack in
UPDATE_ROLLBACK_FAILED.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

try:  # package import (tools, tests)
    from . import smoke
except ImportError:  # the Lambda asset's root
    import smoke  # type: ignore[no-redef]

LOG = logging.getLogger(__name__)

# The first requests after an update may meet a warming instance: retry the smoke calls this long.
SMOKE_RETRY_WINDOW = timedelta(minutes=5)


class PostDeployCheckError(RuntimeError):
    """The endpoint does not run the stack's config, or does not answer correctly."""


def rolling_back(cloudformation: Any, stack_id: str) -> bool:
    stacks = cloudformation.describe_stacks(StackName=stack_id).get("Stacks", [])
    status = stacks[0]["StackStatus"] if stacks else ""
    return status.endswith("ROLLBACK_IN_PROGRESS")


def start(clients: Any, event: dict[str, Any], now: datetime | None = None) -> dict[str, Any]:
    """onEvent: note the start time, or skip the whole check while the stack rolls back."""
    if rolling_back(clients["cloudformation"], event["StackId"]):
        LOG.info("stack is rolling back: not checking %s", event["ResourceProperties"]["EndpointName"])
        return {"Skipped": "rollback"}
    return {"StartedAt": (now or datetime.now(UTC)).isoformat()}


def check(
    clients: Any, props: dict[str, Any], data: dict[str, Any], now: datetime | None = None
) -> dict[str, Any]:
    """isComplete: raise at once on a config mismatch; retry failing smoke calls for a while."""
    if data.get("Skipped"):
        return {"IsComplete": True, "Data": {"Result": f"skipped ({data['Skipped']})"}}
    endpoint_name, expected = props["EndpointName"], props["EndpointConfigName"]
    endpoint = clients["sagemaker"].describe_endpoint(EndpointName=endpoint_name)
    live, status = endpoint["EndpointConfigName"], endpoint["EndpointStatus"]
    if live != expected:
        reason = endpoint.get("FailureReason") or "no FailureReason given"
        raise PostDeployCheckError(
            f"{endpoint_name} runs endpoint config {live}, not this deploy's {expected} (status {status}; "
            f"{reason}): SageMaker rolled the update back, so this deploy fails and CloudFormation rolls "
            "the stack back too"
        )
    if status != "InService":
        raise PostDeployCheckError(f"{endpoint_name} is {status}, not InService")
    if props.get("Invocation") == "async":  # an async endpoint refuses InvokeEndpoint: no smoke calls
        return {
            "IsComplete": True,
            "Data": {"Result": f"{endpoint_name} runs {live} (async: no smoke calls)"},
        }
    results = smoke.run_smoke(clients["sagemaker-runtime"], endpoint_name)
    summary = "; ".join(f"{r.name}: {'ok' if r.ok else 'FAIL'} ({r.detail})" for r in results)
    if all(r.ok for r in results):
        LOG.info("post-deploy check passed: %s", summary)
        return {"IsComplete": True, "Data": {"Result": summary[:1000]}}
    started = datetime.fromisoformat(data["StartedAt"])
    if (now or datetime.now(UTC)) - started < SMOKE_RETRY_WINDOW:
        LOG.warning("smoke calls failed, retrying: %s", summary)
        return {"IsComplete": False}
    raise PostDeployCheckError(f"smoke calls on {endpoint_name} failed for {SMOKE_RETRY_WINDOW}: {summary}")
