"""Synthetic load while a blue/green update bakes, so that the rollback alarms can judge a quiet canary.

The rollback alarms compute error *rates*, and count a minute with fewer than
`alarms.error_rate_min_invocations` invocations as 0 %: on an endpoint without traffic a broken canary
would always pass. `Custom::BakeLoad` starts beside the endpoint's update (it depends on the new
endpoint config, as the Endpoint does, not on the Endpoint): while the endpoint is `Updating`, each
poll of the provider (every 30 s) sends half a minute's worth of `LoadPerMinute` small decision
requests (the smoke test's request: a few hundred tokens) through sagemaker-runtime, which SageMaker
spreads over the old fleet and the canary. It never fails the deploy: failed calls are what the alarms
are for, and it gives up quietly before the provider's limit.

- Create (first deploy: no blue/green) and a stack rollback send nothing.
- It waits up to `START_GRACE` for the update to begin (CloudFormation may start it first), and is done
  once the endpoint has left `Updating`.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

try:  # package import (tools, tests)
    from . import post_deploy_check, smoke
except ImportError:  # the Lambda asset's root
    import post_deploy_check  # type: ignore[no-redef]
    import smoke  # type: ignore[no-redef]

LOG = logging.getLogger(__name__)

START_GRACE = timedelta(minutes=5)  # for the endpoint to turn Updating
GIVE_UP_AFTER = timedelta(minutes=50)  # the provider fails a resource at 55 min
BUDGET_S = 25.0  # seconds of requests per poll (the provider polls every 30 s)


def start(clients: Any, event: dict[str, Any], now: datetime | None = None) -> dict[str, Any]:
    """onEvent: nothing to do on a first deploy (no blue/green) or while the stack rolls back."""
    if event["RequestType"] != "Update":
        return {"Skipped": "no blue/green update on create"}
    if post_deploy_check.rolling_back(clients["cloudformation"], event["StackId"]):
        return {"Skipped": "rollback"}
    return {"StartedAt": (now or datetime.now(UTC)).isoformat()}


def _send(runtime: Any, endpoint: str, count: int, budget_s: float) -> tuple[int, int]:
    """Up to `count` decision requests within `budget_s`: (sent, failed)."""
    started, sent, failed = time.monotonic(), 0, 0
    body = json.dumps(smoke.DECISION_REQUEST).encode()
    while sent < count and time.monotonic() - started < budget_s:
        sent += 1
        try:
            runtime.invoke_endpoint(
                EndpointName=endpoint,
                ContentType="application/json",
                Accept="application/json",
                CustomAttributes=smoke.DECISION_ROUTE,
                Body=body,
            )["Body"].read()
        except (ClientError, BotoCoreError) as error:
            failed += 1
            LOG.info("synthetic request failed (the rollback alarms count it): %s", error)
    return sent, failed


def check(
    clients: Any, props: dict[str, Any], data: dict[str, Any], now: datetime | None = None
) -> dict[str, Any]:
    """isComplete: load while Updating; done once the update is over (or never began)."""
    if data.get("Skipped"):
        return {"IsComplete": True, "Data": {"Result": f"skipped ({data['Skipped']})"}}
    now = now or datetime.now(UTC)
    waited = now - datetime.fromisoformat(data["StartedAt"])
    endpoint = props["EndpointName"]
    try:
        status = clients["sagemaker"].describe_endpoint(EndpointName=endpoint)["EndpointStatus"]
    except (ClientError, BotoCoreError) as error:
        LOG.warning("cannot see %s (%s): no synthetic load", endpoint, error)
        return {"IsComplete": True, "Data": {"Result": "endpoint not readable"}}
    if status != "Updating":
        if waited < START_GRACE and status == "InService":
            return {"IsComplete": False}  # the update may not have begun yet
        return {"IsComplete": True, "Data": {"Result": f"endpoint {status}"}}
    if waited > GIVE_UP_AFTER:
        LOG.warning("%s still updating after %s: stopping the synthetic load", endpoint, waited)
        return {"IsComplete": True, "Data": {"Result": "gave up (update still running)"}}
    per_poll = max(1, -(-int(props["LoadPerMinute"]) // 2))  # half a minute's worth, rounded up
    sent, failed = _send(clients["sagemaker-runtime"], endpoint, per_poll, BUDGET_S)
    LOG.info("%s updating: sent %d synthetic requests, %d failed", endpoint, sent, failed)
    return {"IsComplete": False}
