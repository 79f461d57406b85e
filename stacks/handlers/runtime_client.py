"""The one sagemaker-runtime client of the deploy-time handlers and of `promote`, and what one call may
cost, so that a loop in a Lambda can stop starting calls before its time runs out.

- InvokeEndpoint: "A customer's model containers must respond to requests within 60 seconds. [...] If
  your model is going to take 50-60 seconds of processing time, the SDK socket timeout should be set to
  be 70 seconds" (SageMaker Runtime API reference, InvokeEndpoint,
  https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_runtime_InvokeEndpoint.html). botocore's
  default is 60 s.
- Attempts are bounded: botocore's standard retry mode retries a read timeout (a canary that answers
  `/ping` but hangs on `/invocations`) up to `max_attempts` in all, sleeping rand(0, 1) x
  min(2 ** (attempt - 1), 20) s before each retry (Boto3 guide, "Retries",
  https://docs.aws.amazon.com/boto3/latest/guide/retries.html; botocore.retries.standard). Without a
  Config a Lambda's client uses legacy mode, 5 attempts of 60 s: one hanging call outlasts a 5-minute
  Lambda.
- The Lambda's time left is `context.get_remaining_time_in_millis()` ("the number of milliseconds left
  before the execution times out", https://docs.aws.amazon.com/lambda/latest/dg/python-context.html).

Stdlib and boto3 only: this module is part of the handlers' Lambda asset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import boto3
from botocore.config import Config

READ_TIMEOUT_S = 70
CONNECT_TIMEOUT_S = 10
# The deploy-time handlers' attempts: two calls' worth of a hang (2 x 80 s + 1 s) still leaves a
# 5-minute Lambda the time to park the endpoint. `promote` (no Lambda around it) passes 3.
DEPLOY_MAX_ATTEMPTS = 2
# The bake load's synthetic requests are not retried: the rollback alarms count every invocation, and
# the next request is due seconds later. One attempt (80 s at most) lets a poll keep sending until
# 210 s into its 5 minutes. They run in parallel (a hanging one must not hold up the next): a
# connection each.
LOAD_MAX_ATTEMPTS = 1
LOAD_MAX_CONNECTIONS = 50
MAX_BACKOFF_S = 20  # botocore.retries.standard's cap on one retry's sleep


def runtime_config(
    max_attempts: int = DEPLOY_MAX_ATTEMPTS,
    user_agent_extra: str | None = None,
    max_pool_connections: int = 10,
) -> Config:
    options: dict[str, Any] = {
        "max_pool_connections": max_pool_connections,  # botocore's default is 10
        # total_max_attempts counts the first attempt; botocore's `max_attempts` counts only retries.
        "retries": {"mode": "standard", "total_max_attempts": max_attempts},
        "connect_timeout": CONNECT_TIMEOUT_S,
        "read_timeout": READ_TIMEOUT_S,
    }
    if user_agent_extra:
        options["user_agent_extra"] = user_agent_extra
    return Config(**options)


def runtime_client(
    session: Any = None,
    *,
    max_attempts: int = DEPLOY_MAX_ATTEMPTS,
    user_agent_extra: str | None = None,
    max_pool_connections: int = 10,
) -> Any:
    """A sagemaker-runtime client with the 70 s read timeout and bounded attempts (from `session`, a
    boto3.Session, or boto3's default one); `max_pool_connections` for callers with calls in parallel."""
    config = runtime_config(max_attempts, user_agent_extra, max_pool_connections)
    return (session or boto3).client("sagemaker-runtime", config=config)


def call_budget_s(max_attempts: int = DEPLOY_MAX_ATTEMPTS) -> float:
    """The longest one InvokeEndpoint call can take: every attempt connecting and reading up to its
    timeouts, plus the longest backoff before each retry."""
    backoff = sum(min(2 ** (attempt - 1), MAX_BACKOFF_S) for attempt in range(1, max_attempts))
    return max_attempts * (CONNECT_TIMEOUT_S + READ_TIMEOUT_S) + backoff


TimeLeft = Callable[[], float]


def time_left(context: Any) -> TimeLeft | None:
    """Seconds left before the Lambda that got `context` times out (None without a Lambda context)."""
    remaining = getattr(context, "get_remaining_time_in_millis", None)
    if remaining is None:
        return None
    return lambda: remaining() / 1000.0
