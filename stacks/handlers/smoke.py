"""Smoke tests through `sagemaker-runtime`: one decision call and one chat call.

Used by the stacks' post-deploy check (a Lambda: stdlib and boto3 only) and by `promote smoke`.
The container routes `/invocations` by `CustomAttributes: route=…` (SageMaker forwards it as
`X-Amzn-SageMaker-Custom-Attributes`; notes/sagemaker.md §2, §8).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

DECISION_ROUTE = "route=/v1/systemone"
CHAT_ROUTE = "route=/v1/chat/completions"

DECISION_REQUEST = {
    "state": "Customer: I was charged twice for my subscription, please give me my money back.",
    "questions": {"refund": {"type": "noul", "instructions": "Is money back requested?"}},
}
CHAT_REQUEST = {
    "messages": [{"role": "user", "content": "Reply with the single word OK."}],
    "max_tokens": 8,
    "temperature": 0.0,
}


@dataclass(frozen=True)
class SmokeResult:
    name: str
    ok: bool
    seconds: float
    detail: str


def _check_decision(body: Any) -> str:
    answer = body["answers"]["refund"]
    probability = answer["noul"]
    if not isinstance(probability, float) or not 0.0 <= probability <= 1.0:
        raise ValueError(f"answers.refund.noul is not a probability: {probability!r}")
    return f"model {body.get('model', '?')}, p(refund)={probability:.3f}"


def _check_chat(body: Any) -> str:
    content = body["choices"][0]["message"]["content"]
    if not isinstance(content, str):
        raise ValueError("choices[0].message.content is not a string")
    return f"model {body.get('model', '?')}, reply {content.strip()[:40]!r}"


def _invoke(runtime: Any, endpoint: str, route: str, payload: dict[str, Any]) -> Any:
    response = runtime.invoke_endpoint(
        EndpointName=endpoint,
        ContentType="application/json",
        Accept="application/json",
        CustomAttributes=route,
        Body=json.dumps(payload).encode(),
    )
    return json.loads(response["Body"].read())


def _one(name: str, call: Callable[[], Any], check: Callable[[Any], str]) -> SmokeResult:
    started = time.monotonic()
    try:
        detail = check(call())
        ok = True
    except (ClientError, BotoCoreError) as exc:
        ok, detail = False, f"invoke failed: {exc}"
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        ok, detail = False, f"unexpected response: {type(exc).__name__}: {exc}"
    return SmokeResult(name, ok, time.monotonic() - started, detail)


def run_smoke(
    runtime: Any, endpoint: str, may_start: Callable[[], str | None] | None = None
) -> list[SmokeResult]:
    """Both calls, in order; never raises for a failing endpoint (the results say why).

    `may_start` (a Lambda's time check) is asked before each call: a reason means the call is not
    started, and it counts as failed with that reason."""
    calls = (
        ("decision " + DECISION_ROUTE, DECISION_ROUTE, DECISION_REQUEST, _check_decision),
        ("chat " + CHAT_ROUTE, CHAT_ROUTE, CHAT_REQUEST, _check_chat),
    )
    results = []
    for name, route, payload, check in calls:
        refusal = may_start() if may_start is not None else None
        if refusal:
            results.append(SmokeResult(name, False, 0.0, f"not started: {refusal}"))
            continue
        results.append(
            _one(name, lambda route=route, payload=payload: _invoke(runtime, endpoint, route, payload), check)
        )
    return results
