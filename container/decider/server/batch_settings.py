"""What SageMaker Batch Transform changes in the settings and the body limits: `SAGEMAKER_BATCH`'s
deadline, `GET /execution-parameters`' answer, and the largest payload an invocation may carry.
Apart from decider.server.batch_transform (the JSON Lines handler) so that the front process
(decider.server.supervisor) and `serve` read them without importing the engine."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from decider.settings import Settings

log = logging.getLogger("decider.server")

JSONLINES_TYPES = frozenset(
    {"application/jsonlines", "application/jsonl", "application/x-jsonlines", "application/json-lines"}
)
MIB = 1024 * 1024
BATCH_ENV = "SAGEMAKER_BATCH"
INVOCATION_TIMEOUT_ENV = "DECIDER_BATCH_INVOCATION_TIMEOUT_SECONDS"
DEFAULT_INVOCATION_TIMEOUT_SECONDS = 600  # Batch Transform's default InvocationsTimeoutInSeconds
MAX_INVOCATION_TIMEOUT_SECONDS = 3600
ANSWER_MARGIN_SECONDS = 5.0  # the deadline is the timeout less this: time to send the answer
MAX_PAYLOAD_LIMIT_MB = 100  # Batch Transform's ceiling for MaxPayloadInMB
CPU_PAYLOAD_MB = 1  # ~480 JevBench records: ~30 min at 4 s a record on 2 cores
GPU_PAYLOAD_MB = 6


def is_batch_environment(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(BATCH_ENV, "").strip().lower() == "true"


def invocation_timeout_seconds(environ: Mapping[str, str] | None = None) -> float:
    env = os.environ if environ is None else environ
    raw = env.get(INVOCATION_TIMEOUT_ENV, "").strip()
    if not raw:
        return float(DEFAULT_INVOCATION_TIMEOUT_SECONDS)
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{INVOCATION_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not 1 <= value <= MAX_INVOCATION_TIMEOUT_SECONDS:
        raise ValueError(f"{INVOCATION_TIMEOUT_ENV}={raw!r} must be 1-{MAX_INVOCATION_TIMEOUT_SECONDS}")
    return value


def batch_settings(settings: Settings, environ: Mapping[str, str] | None = None) -> Settings:
    """Under Batch Transform (`SAGEMAKER_BATCH=true`), the deadline follows the invocation timeout,
    unless `DECIDER_DEADLINE_SECONDS` is set explicitly."""
    env = os.environ if environ is None else environ
    if not is_batch_environment(env) or "deadline_seconds" in settings.model_fields_set:
        return settings
    timeout = invocation_timeout_seconds(env)
    deadline = max(1.0, timeout - ANSWER_MARGIN_SECONDS) if timeout > 2 * ANSWER_MARGIN_SECONDS else timeout
    log.info("Batch Transform: the deadline is %g s (invocation timeout %g s)", deadline, timeout)
    return settings.model_copy(update={"deadline_seconds": deadline})


# --- GET /execution-parameters --------------------------------------------------------------------


def execution_parameters(settings: Settings) -> dict[str, Any]:
    """What Batch Transform should send: two invocations at a time (one decoding, the next one in
    transit: they share one engine), MultiRecord, and payloads small enough to finish within the
    invocation timeout (1 MB on CPU, 6 MB with GPU offload)."""
    concurrent = 2 if settings.queue_size >= 2 else 1
    payload_mb = GPU_PAYLOAD_MB if settings.n_gpu_layers != 0 else CPU_PAYLOAD_MB
    payload_mb = max(1, min(payload_mb, MAX_PAYLOAD_LIMIT_MB // concurrent))
    return {
        "MaxConcurrentTransforms": concurrent,
        "BatchStrategy": "MULTI_RECORD",
        "MaxPayloadInMB": payload_mb,
    }


def is_jsonlines(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() in JSONLINES_TYPES


def payload_limit(settings: Settings, environ: Mapping[str, str] | None = None) -> int:
    """The job's `SAGEMAKER_MAX_PAYLOAD_IN_MB` when the service set one, else what we asked for,
    never below the real-time body cap."""
    env = os.environ if environ is None else environ
    raw = env.get("SAGEMAKER_MAX_PAYLOAD_IN_MB", "").strip()
    megabytes = (
        int(raw) if raw.isdigit() and int(raw) > 0 else execution_parameters(settings)["MaxPayloadInMB"]
    )
    return max(settings.max_body_bytes, min(megabytes, MAX_PAYLOAD_LIMIT_MB) * MIB)
