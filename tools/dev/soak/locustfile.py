"""The mixed-traffic soak's users (issue 23 §4), for `locust -f tools/dev/soak/locustfile.py`.

Decisions, batches, chats with `response_format`, streams cancelled after their first tokens, and
invalid bodies (bad JSON, too many questions, a schema beyond the response_format size limit), all at once.
The decisions are JevBench-240 cases (Apache-2.0, Copyright 2026 Chen Feng): half of them one of a few
hot cases asked again (agents, coherence runs: the caches answer), half the next case of all 240 (a
state the server has not seen, until the run wraps: a prefill, and a kept state that evicts another),
so both the engine and the caches' eviction run for the whole soak, not a cached answer alone.
Everything goes to `POST /invocations`, as SageMaker sends it: decisions and invalid bodies routed by
their body, batches and chats by the `X-Amzn-SageMaker-Custom-Attributes` route a client sets.
Each request is counted by (route, status, code), streamed ones too: a refusal before the first
token and an error event inside a stream by their typed code (tools/dev/soak/accounting.py); each
stream's largest gap between two chunks is kept. At exit the counts and the gap go to $SOAK_RESULTS
(JSON), which decider_dev.soak.run reports.
Runs in locust's own process (it patches the standard library with gevent): never imported by tests.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import random
from pathlib import Path
from typing import Any

from locust import HttpUser, between, events, task

from decider_cli.evaluate.jevbench import JEVBENCH_240_CASES
from decider_dev.bench.common import load_cases, request_body
from decider_dev.soak.accounting import count_key, failure, read_stream

COUNTS: collections.Counter[str] = collections.Counter()
GAPS: dict[str, float] = {"largest_gap_seconds": 0.0}
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this?",
        "criteria": {"billing": "Payments", "technical": "Bugs", "sales": None},
    },
}
STATE = "I was charged twice for order 1182 and I want my money back today."
CASES = load_cases(JEVBENCH_240_CASES)
HOT_CASES = CASES[:8]  # asked again and again
NEXT_CASE = itertools.cycle(CASES)  # every case in turn: states not seen before, until it wraps
PICK = random.Random(23)
INVOCATIONS = "/invocations"
ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
BATCH = {ATTRIBUTES: "route=/v1/systemone/batch"}
CHAT = {ATTRIBUTES: "route=/v1/chat/completions"}
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"type": "string", "enum": ["red", "green"]}, "sure": {"type": "boolean"}},
    "required": ["colour", "sure"],
}
# past DECIDER_MAX_SCHEMA_BYTES (65536): 422 response_format_too_complex before anything is compiled
TOO_COMPLEX = {"enum": ["x" * 70_000]}


@events.request.add_listener
def _count(name: str, response: Any, exception: Any, **_: Any) -> None:
    COUNTS[count_key(name, response, exception)] += 1


@events.quitting.add_listener
def _write(environment: Any, **_: Any) -> None:
    path = os.environ.get("SOAK_RESULTS")
    if path:
        Path(path).write_text(json.dumps({"counts": dict(COUNTS), **GAPS}, indent=1))


class Caller(HttpUser):
    wait_time = between(0.05, 0.3)

    def _post(self, path: str, name: str, **kwargs: Any) -> None:
        with self.client.post(path, name=name, catch_response=True, timeout=70, **kwargs) as response:
            try:
                body = response.json()
            except ValueError:
                body = None
            problem = failure(response.status_code, body)
            if problem:
                response.failure(problem)
            else:
                response.success()

    @task(4)
    def decision(self) -> None:
        case = PICK.choice(HOT_CASES) if PICK.random() < 0.5 else next(NEXT_CASE)
        self._post(INVOCATIONS, "decision", json=request_body(case))

    @task(2)
    def batch(self) -> None:
        states = [STATE, next(NEXT_CASE)["state"]]
        body = {"states": states, "questions": QUESTIONS}
        self._post(INVOCATIONS, "batch", json=body, headers=BATCH)

    @task(2)
    def chat_with_schema(self) -> None:
        body = {
            "messages": [{"role": "user", "content": "Pick a colour, in JSON."}],
            "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        }
        self._post(INVOCATIONS, "chat+schema", json=body, headers=CHAT)

    @task(2)
    def cancelled_stream(self) -> None:
        body = {
            "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 64,
            "stream": True,
        }
        with self.client.post(
            INVOCATIONS,
            name="stream (cancelled)",
            json=body,
            headers=CHAT,
            stream=True,
            catch_response=True,
            timeout=70,
        ) as response:
            read = read_stream(response, max_chunks=6)  # the client leaves after 6 chunks
            GAPS["largest_gap_seconds"] = max(GAPS["largest_gap_seconds"], read.largest_gap_seconds)
            if read.failure:
                response.failure(read.failure)
            else:
                response.success()
        GAPS["streams"] = GAPS.get("streams", 0.0) + 1

    @task(2)
    def invalid_bodies(self) -> None:
        self._post(
            INVOCATIONS, "invalid: json", data=b'{"state": ', headers={"Content-Type": "application/json"}
        )
        many = {f"q{i}": {"type": "noul", "instructions": "?"} for i in range(100)}
        self._post(INVOCATIONS, "invalid: too many questions", json={"state": STATE, "questions": many})
        schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": TOO_COMPLEX}}
        body = {"messages": [{"role": "user", "content": "x"}], "response_format": schema}
        self._post(INVOCATIONS, "invalid: schema", json=body)
