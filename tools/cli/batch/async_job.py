"""`decide-batch async`: one request file through an async endpoint (`invocation: async`), and its answer.

The body goes to `s3://<artifacts bucket>/async/<endpoint>/input/<uuid>.json` (the prefix the
execution role may read), then `InvokeEndpointAsync` with the route in `CustomAttributes` and the
variant's invocation timeout; with `--wait`, the output (or failure) object is polled for and printed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from decider_cli.batch.jobs import BatchError, split_s3_uri

POLL_SECONDS = 5.0


def artifacts_bucket(project: str, account: str, region: str) -> str:
    """The stacks' artifacts bucket (decider_stacks.image_stack.artifacts_bucket_name, resolved)."""
    return f"{project}-artifacts-{account}-{region}"


def input_uri(bucket: str, endpoint: str, name: str | None = None) -> str:
    return f"s3://{bucket}/async/{endpoint}/input/{name or uuid.uuid4().hex + '.json'}"


@dataclass(frozen=True)
class AsyncInvocation:
    inference_id: str
    input_location: str
    output_location: str
    failure_location: str | None


def submit(
    runtime: Any,
    s3: Any,
    *,
    endpoint: str,
    body: bytes,
    location: str,
    route: str,
    timeout_seconds: int,
) -> AsyncInvocation:
    bucket, key = split_s3_uri(location)
    s3.put_object(Bucket=bucket, Key=key, Body=body, ContentType="application/json")
    response = runtime.invoke_endpoint_async(
        EndpointName=endpoint,
        InputLocation=location,
        ContentType="application/json",
        Accept="application/json",
        CustomAttributes=f"route={route}",
        InvocationTimeoutSeconds=timeout_seconds,
    )
    return AsyncInvocation(
        response.get("InferenceId", ""), location, response["OutputLocation"], response.get("FailureLocation")
    )


def _read(s3: Any, uri: str) -> bytes | None:
    bucket, key = split_s3_uri(uri)
    try:
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except s3.exceptions.NoSuchKey:
        return None
    except s3.exceptions.ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in {"404", "NoSuchKey"}:
            return None
        raise


def wait_for_answer(
    s3: Any,
    invocation: AsyncInvocation,
    *,
    timeout_seconds: float,
    poll_seconds: float = POLL_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[bool, bytes]:
    """(succeeded, body) once the output or the failure object exists."""
    deadline = clock() + timeout_seconds
    while True:
        output = _read(s3, invocation.output_location)
        if output is not None:
            return True, output
        if invocation.failure_location:
            failure = _read(s3, invocation.failure_location)
            if failure is not None:
                return False, failure
        if clock() > deadline:
            raise BatchError(
                f"no answer at {invocation.output_location} after {timeout_seconds:.0f} s "
                f"(inference {invocation.inference_id}); it may still come"
            )
        sleep(poll_seconds)
