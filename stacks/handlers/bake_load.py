"""Synthetic load while a blue/green update bakes, so that the rollback alarms can judge a quiet canary.

The rollback alarms compute error *rates*, and count a minute with fewer than
`alarms.error_rate_min_invocations` invocations as 0 %: on an endpoint without traffic a broken canary
would always pass. `Custom::BakeLoad` starts beside the endpoint's update (it depends on the new
endpoint config, as the Endpoint does, not on the Endpoint): while the endpoint is `Updating`, each
poll of the provider sends small decision requests (the smoke test's request: a few hundred tokens)
through sagemaker-runtime, which SageMaker spreads over the old fleet and the canary. It never fails the
deploy: failed calls are what the alarms are for, and it gives up quietly before the provider's limit.

Every calendar minute (CloudWatch's 1-minute periods) gets at least `LoadPerMinute` requests: a poll
sends each minute's quota at the start of that minute, sleeps to the next one, and ends only right
after it met a minute's quota once it has run `POLL_BUDGET_S`. The provider's next poll starts about
30 s later, so it still finds the rest of that minute, or the start of the next, to send the next
quota in. (Sending half a minute's worth per poll gave ~8.5 a minute: each poll's own ~12 s added to
the 30 s wait.) Each request's state starts with a different tag, so that PREFIX_AWARE routing, which
sends equal body prefixes to one instance, spreads the load over the fleet and the canary.

A canary that hangs (every call a 60-70 s timeout) must still get its minutes' floor: the requests go
out `PACE_S` apart on a thread pool, none waiting for the one before, through a client with one
attempt per request and the 70 s read timeout (runtime_client.py). A request starts only while the
polling Lambda's time left (`context.get_remaining_time_in_millis()`) holds it with its attempt
hanging, and the poll waits for those in flight before it returns: never a Lambda timeout, which the
CDK provider would report as FAILED at once.

- Create (first deploy: no blue/green) and a stack rollback send nothing.
- It waits up to `START_GRACE` for the update to begin (CloudFormation may start it first), and is done
  once the endpoint has left `Updating`.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

try:  # package import (tools, tests)
    from . import post_deploy_check, runtime_client, smoke
except ImportError:  # the Lambda asset's root
    import post_deploy_check  # type: ignore[no-redef]
    import runtime_client  # type: ignore[no-redef]
    import smoke  # type: ignore[no-redef]

LOG = logging.getLogger(__name__)

START_GRACE = timedelta(minutes=5)  # for the endpoint to turn Updating
GIVE_UP_AFTER = timedelta(minutes=50)  # the provider fails a resource at 55 min
POLL_BUDGET_S = 120.0  # a poll ends after this, right after meeting a minute's quota
POLL_LIMIT_S = 240.0  # and never later than this (the polling Lambda times out at 300 s)
# The polling Lambda's timeout (stacks/image_stack.py, IsComplete; a test keeps them equal): the bound
# when no Lambda context says how much is left.
LAMBDA_TIMEOUT_S = 300.0
RETURN_RESERVE_S = 10.0  # what a poll keeps after its last call, to log and return
# A request starts only while the Lambda's time left holds it with every attempt hanging.
CALL_NEED_S = runtime_client.call_budget_s(runtime_client.LOAD_MAX_ATTEMPTS) + RETURN_RESERVE_S
PACE_S = 2.0  # between two synthetic requests: a minute's quota spread over ~2 x LoadPerMinute s
# Requests in flight at most: with every call hanging (80 s at most) and PACE_S between starts, ~40.
MAX_IN_FLIGHT = 48


def start(clients: Any, event: dict[str, Any], now: datetime | None = None) -> dict[str, Any]:
    """onEvent: nothing to do on a first deploy (no blue/green) or while the stack rolls back."""
    if event["RequestType"] != "Update":
        return {"Skipped": "no blue/green update on create"}
    old = (event.get("OldResourceProperties") or {}).get("EndpointName")
    if old not in (None, event["ResourceProperties"]["EndpointName"]):
        return {"Skipped": f"renamed from {old}: a new endpoint, no blue/green"}
    if post_deploy_check.rolling_back(clients["cloudformation"], event["StackId"]):
        return {"Skipped": "rollback"}
    return {"StartedAt": (now or datetime.now(UTC)).isoformat()}


@dataclass
class LoadReport:
    sent: int = 0
    failed: int = 0
    per_minute: Counter[int] = field(default_factory=Counter)  # calendar minute -> requests sent
    stopped_for_time: bool = False  # the Lambda's time left could not hold one more request

    def fewest_in_a_full_minute(self) -> int | None:
        """The fewest requests in a minute the poll spanned whole (None: it spanned none)."""
        minutes = sorted(self.per_minute)
        inner = minutes[1:-1]
        return min(self.per_minute[m] for m in inner) if inner else None


def synthetic_body(sequence: int, nonce: str) -> bytes:
    """The smoke decision request, its state led by a tag unique to this request (the body's first
    bytes differ, so PREFIX_AWARE routing does not send every synthetic request to one instance)."""
    request = dict(smoke.DECISION_REQUEST)
    request["state"] = f"[load {nonce}-{sequence}] {request['state']}"
    return json.dumps(request).encode()


def send_load(
    runtime: Any, endpoint: str, per_minute: int, time_left: runtime_client.TimeLeft | None = None
) -> LoadReport:
    """At least `per_minute` requests in every calendar minute, for about `POLL_BUDGET_S`.

    Requests go out `PACE_S` apart on worker threads, each without waiting for the one before: a canary
    that hangs (every call a 60-70 s timeout) must still see the alarms' invocation floor every minute,
    which one request after the other cannot give it. A request starts only while `time_left()` (this
    Lambda's seconds left) holds it with every attempt hanging; the poll then waits for the ones in
    flight, which end within that bound."""
    report, nonce = LoadReport(), secrets.token_hex(4)
    started = time.time()
    if time_left is None:
        time_left = lambda: LAMBDA_TIMEOUT_S - (time.time() - started)  # noqa: E731
    lock = threading.Lock()

    def invoke(sequence: int) -> None:
        try:
            runtime.invoke_endpoint(
                EndpointName=endpoint,
                ContentType="application/json",
                Accept="application/json",
                CustomAttributes=smoke.DECISION_ROUTE,
                Body=synthetic_body(sequence, nonce),
            )["Body"].read()
        except (ClientError, BotoCoreError) as error:
            with lock:
                report.failed += 1
            LOG.info("synthetic request failed (the rollback alarms count it): %s", error)

    pool = ThreadPoolExecutor(max_workers=MAX_IN_FLIGHT, thread_name_prefix="bake-load")
    in_flight: list[Future[None]] = []
    try:
        while True:
            now = time.time()
            minute = int(now // 60)
            if time_left() < CALL_NEED_S:
                report.stopped_for_time = True
                break
            in_flight = [f for f in in_flight if not f.done()]
            if (
                report.per_minute[minute] < per_minute
                and now - started < POLL_LIMIT_S
                and len(in_flight) < MAX_IN_FLIGHT
            ):
                report.per_minute[minute] += 1
                report.sent += 1
                in_flight.append(pool.submit(invoke, report.sent))
                time.sleep(PACE_S)
                continue
            if now - started >= POLL_BUDGET_S or now - started >= POLL_LIMIT_S:
                break
            time.sleep(max(PACE_S, 60 * (minute + 1) - now))  # this minute's quota is sent: the next one
        while True:  # the ones in flight: each ends within CALL_NEED_S of its start
            _, pending = wait(in_flight, timeout=0.01)
            if not pending:
                break
            time.sleep(1.0)
    finally:
        pool.shutdown(wait=True)
    return report


def check(
    clients: Any,
    props: dict[str, Any],
    data: dict[str, Any],
    now: datetime | None = None,
    *,
    time_left: runtime_client.TimeLeft | None = None,
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
    report = send_load(clients["sagemaker-runtime-load"], endpoint, int(props["LoadPerMinute"]), time_left)
    fewest = report.fewest_in_a_full_minute()
    LOG.info(
        "%s updating: sent %d synthetic requests, %d failed, at least %s in each full minute",
        endpoint,
        report.sent,
        report.failed,
        "?" if fewest is None else fewest,
    )
    if fewest is not None and fewest < int(props["LoadPerMinute"]):
        LOG.warning(
            "%s: only %d requests in a minute (slow answers): the alarms may not judge it", endpoint, fewest
        )
    return {"IsComplete": False}
