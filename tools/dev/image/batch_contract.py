"""The Batch Transform part of `make image-test`: what the service asks of the container.

Against a running server (the image's container, or a local `serve`):
- `GET /execution-parameters` answers MULTI_RECORD, MaxConcurrentTransforms × MaxPayloadInMB ≤ 100;
- JSON Lines in and out through the local stand-in of the service (`decider_cli.batch.standin`): good
  records answered in order, a bad record among them answered with its own error line, the
  invocation itself 200, the output joined to the input (`JoinSource=Input`).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import httpx

from decider_cli.batch.standin import TransformFailedError, run_local_transform

RECORDS: list[dict[str, Any]] = [
    {
        "id": "good-1",
        "state": "I was charged twice.",
        "questions": {"refund": {"type": "noul", "instructions": "Refund?"}},
    },
    {"id": "bad", "state": "no questions at all"},
    {
        "id": "good-2",
        "state": "The app crashes.",
        "questions": {"bug": {"type": "noul", "instructions": "A bug?"}},
    },
]


class Checks(Protocol):
    def check(self, name: str, ok: bool, detail: str = "") -> bool: ...


def check_batch_transform(report: Checks, base_url: str) -> None:
    response = httpx.get(f"{base_url}/execution-parameters", timeout=10)
    params: dict[str, Any] = response.json() if response.status_code == 200 else {}
    report.check(
        "Batch Transform: GET /execution-parameters (MULTI_RECORD, concurrency × payload MB ≤ 100)",
        params.get("BatchStrategy") == "MULTI_RECORD"
        and 1 <= int(params.get("MaxConcurrentTransforms", 0)) * int(params.get("MaxPayloadInMB", 0)) <= 100,
        json.dumps(params, sort_keys=True) if params else f"{response.status_code} {response.text[:200]}",
    )
    data = b"".join(json.dumps(record).encode() + b"\n" for record in RECORDS)
    try:
        result = run_local_transform(base_url, data, timeout_seconds=120, max_retries=0)
    except (TransformFailedError, httpx.HTTPError) as exc:
        report.check("Batch Transform: JSON Lines in and out, one bad line among good ones", False, str(exc))
        return
    lines = [json.loads(line) for line in result.lines]
    outputs = [line.get("SageMakerOutput", {}) for line in lines]
    ok = (
        [line.get("id") for line in lines] == [record["id"] for record in RECORDS]
        and "answers" in outputs[0]
        and outputs[1].get("error", {}).get("code") == "missing_field"
        and "answers" in outputs[2]
    )
    report.check(
        "Batch Transform: JSON Lines in and out, one bad line among good ones (joined, in order)",
        ok,
        f"{result.invocations} invocation(s), {len(lines)} lines; bad line: {json.dumps(outputs[1])[:160]}",
    )
