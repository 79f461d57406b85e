"""A local stand-in of SageMaker Batch Transform, run against a real container (or `serve`).

It does what the service documents for `SplitType=Line`, `BatchStrategy=MultiRecord`,
`AssembleWith=Line` (AWS docs: https://docs.aws.amazon.com/sagemaker/latest/dg/your-algorithms-batch-code.html
and the CreateTransformJob API reference):

1. asks the container's `GET /execution-parameters` (the job's own values win, then the container's,
   then the service defaults: 1 transform at a time, 6 MB);
2. packs as many whole lines as fit under `MaxPayloadInMB` into each `POST /invocations`
   (`Content-Type` and `Accept`: `application/jsonlines`), `MaxConcurrentTransforms` at a time;
3. retries a failed invocation `InvocationsMaxRetries` times, then fails the job, as the service
   does (a line bigger than the payload limit fails it too);
4. checks each answer has one line per record, and assembles the output in input order, with
   `JoinSource=Input` adding `SageMakerOutput` to each input object (a line that is not a JSON
   object cannot be joined: the job fails, the conservative reading of the service's join).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from decider_cli.batch.jobs import JSONLINES, OUTPUT_KEY

MIB = 1024 * 1024
SERVICE_DEFAULTS = {"MaxConcurrentTransforms": 1, "BatchStrategy": "MULTI_RECORD", "MaxPayloadInMB": 6}


class TransformFailedError(Exception):
    """The job would be Failed on SageMaker."""


@dataclass
class LocalTransform:
    lines: list[bytes]  # the assembled output, one per input record
    invocations: int
    seconds: float
    parameters: dict[str, Any]
    payload_sizes: list[int] = field(default_factory=list)

    @property
    def output(self) -> bytes:
        return b"".join(line + b"\n" for line in self.lines)


def execution_parameters(client: httpx.Client) -> dict[str, Any]:
    try:
        response = client.get("/execution-parameters")
    except httpx.HTTPError:
        return dict(SERVICE_DEFAULTS)
    if response.status_code != 200:
        return dict(SERVICE_DEFAULTS)
    return {**SERVICE_DEFAULTS, **response.json()}


def split_lines(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def pack(records: list[bytes], limit_bytes: int) -> list[list[int]]:
    """Indices of consecutive records per payload: whole lines, at most `limit_bytes` joined."""
    batches: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, record in enumerate(records):
        need = len(record) + 1  # the newline that ends it
        if need > limit_bytes:
            raise TransformFailedError(
                f"record {index + 1} is {need} bytes, more than MaxPayloadInMB ({limit_bytes} bytes)"
            )
        if current and size + need > limit_bytes:
            batches.append(current)
            current, size = [], 0
        current.append(index)
        size += need
    if current:
        batches.append(current)
    return batches


def _join(record: bytes, output: bytes, index: int) -> bytes:
    try:
        source = json.loads(record)
    except ValueError:
        source = None
    if not isinstance(source, dict):
        raise TransformFailedError(f"JoinSource=Input: input line {index + 1} is not a JSON object")
    return json.dumps({**source, OUTPUT_KEY: json.loads(output)}, ensure_ascii=False).encode()


def run_local_transform(
    base_url: str,
    data: bytes,
    *,
    join_input: bool = True,
    max_payload_mb: int | None = None,
    max_concurrent: int | None = None,
    timeout_seconds: float = 600,
    max_retries: int = 1,
) -> LocalTransform:
    started = time.monotonic()
    with httpx.Client(base_url=base_url, timeout=timeout_seconds) as client:
        parameters = execution_parameters(client)
        if max_payload_mb is not None:
            parameters["MaxPayloadInMB"] = max_payload_mb
        if max_concurrent is not None:
            parameters["MaxConcurrentTransforms"] = max_concurrent
        if parameters["BatchStrategy"] != "MULTI_RECORD":
            raise TransformFailedError(
                f"the stand-in runs MULTI_RECORD only, not {parameters['BatchStrategy']}"
            )
        records = split_lines(data)
        batches = pack(records, int(parameters["MaxPayloadInMB"]) * MIB)

        def invoke(batch: list[int]) -> list[bytes]:
            payload = b"".join(records[i] + b"\n" for i in batch)
            for attempt in range(max_retries + 1):
                try:
                    response = client.post(
                        "/invocations",
                        content=payload,
                        headers={"Content-Type": JSONLINES, "Accept": JSONLINES},
                    )
                except httpx.HTTPError as exc:
                    failure = f"{type(exc).__name__}: {exc}"
                else:
                    if response.status_code == 200:
                        lines = split_lines(response.content)
                        if len(lines) != len(batch):
                            raise TransformFailedError(
                                f"{len(batch)} records sent, {len(lines)} lines answered "
                                f"(records {batch[0] + 1}-)"
                            )
                        return lines
                    failure = f"{response.status_code} {response.text[:300]}"
                if attempt == max_retries:
                    raise TransformFailedError(
                        f"invocation of records {batch[0] + 1}-{batch[-1] + 1} failed: {failure}"
                    )
            raise AssertionError("unreachable")

        workers = max(1, int(parameters["MaxConcurrentTransforms"]))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            answers = list(pool.map(invoke, batches))
    lines: list[bytes] = []
    for batch, outputs in zip(batches, answers, strict=True):
        for index, output in zip(batch, outputs, strict=True):
            lines.append(_join(records[index], output, index) if join_input else output)
    return LocalTransform(
        lines,
        invocations=len(batches),
        seconds=time.monotonic() - started,
        parameters=parameters,
        payload_sizes=[sum(len(records[i]) + 1 for i in batch) for batch in batches],
    )
