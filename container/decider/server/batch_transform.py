"""SageMaker Batch Transform: `GET /execution-parameters` and JSON Lines on `POST /invocations`.

With `SplitType=Line` and `BatchStrategy=MultiRecord`, Batch Transform packs as many whole input
lines as fit under `MaxPayloadInMB` into one `POST /invocations` whose `Content-Type` is the job's
(`application/jsonlines`). Each line is one decision request (`/v1/systemone`, or by its shape an
OpenAI decision or a `/v1/systemone/batch` body). The answer has one line per input line, in the
same order: the route's response, or the usual error body for that record alone. The invocation
itself answers 200 unless the payload as a whole cannot be read (too large, bad encoding): Batch
Transform fails the whole job on a failed invocation, so one malformed ticket must never do that.
A record is one request, so it has a real-time request's size cap (`DECIDER_MAX_BODY_BYTES`),
checked before it is parsed: a larger one gets a `record_too_large` line (413). The payload is read,
and each record parsed and planned, in the server's intake
(decider.server.intake): on its low-priority threads, within `DECIDER_PARSE_CONCURRENCY` places
shared with every other request.

`SAGEMAKER_BATCH=true` (set by the service) makes the deadline of every request the job's
invocation timeout, less a margin to answer in: `DECIDER_BATCH_INVOCATION_TIMEOUT_SECONDS`, which
`decide-batch` sets to the job's `InvocationsTimeoutInSeconds` (Batch Transform's default, 600 s,
when unset), instead of the real-time 55 s. Records that cannot start before the invocation's
deadline get a `deadline_exceeded` line each, and the invocation still answers in time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from decider.errors import (
    DeadlineExceededError,
    DeciderError,
    OverloadedError,
    PayloadTooLargeError,
    RequestError,
    UnavailableError,
)
from decider.schemas.cache_salt import cache_space
from decider.schemas.decision import parse_batch_request, parse_decision_request
from decider.schemas.openai_decisions import parse_openai_decision_request
from decider.server.answers import decision_response
from decider.server.batch_settings import (  # noqa: F401 - is_jsonlines, batch_settings: this module's API
    CPU_PAYLOAD_MB,
    GPU_PAYLOAD_MB,
    MAX_PAYLOAD_LIMIT_MB,
    batch_settings,
    execution_parameters,
    is_jsonlines,
    payload_limit,
)
from decider.server.body import decode_content, parse_json, read_body
from decider.server.handlers import ClientDisconnectedError, internal_error
from decider.server.routing import target_from_body
from decider.settings import Settings

log = logging.getLogger("decider.server")

JSONLINES_MEDIA_TYPE = "application/jsonlines"
RETRY_PAUSE_SECONDS = 0.5  # a record refused as overloaded waits this long (doubling) and retries


async def handle_execution_parameters(settings: Settings) -> Response:
    return JSONResponse(execution_parameters(settings))


# --- POST /invocations, application/jsonlines ------------------------------------------------------


def split_records(data: bytes) -> list[bytes]:
    """One record per line (`\\n` or `\\r\\n`); a final newline does not start a record."""
    if not data:
        return []
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


def records_in_flight(settings: Settings) -> int:
    """Records of one invocation admitted at once: its share of the queue, so that the invocations
    Batch Transform sends together never fill it."""
    concurrent = execution_parameters(settings)["MaxConcurrentTransforms"]
    return max(1, settings.queue_size // concurrent)


def _line(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _record_target(body: Any) -> str:
    """By shape, as `/invocations` routes; a record that looks like nothing is a `/v1/systemone`
    request (so its error names what is missing)."""
    if isinstance(body, dict) and "questions" not in body and "messages" not in body:
        return "decision"
    return target_from_body(body)


class _Invocation:
    """The records of one JSON Lines invocation, decided concurrently, answered in order."""

    def __init__(self, runtime: Any, request_id: str, arrived_at: float | None) -> None:
        self.runtime = runtime
        self.request_id = request_id
        self.settings: Settings = runtime.settings
        self.arrived_at = time.monotonic() if arrived_at is None else arrived_at  # every record's clock
        self.deadline = self.arrived_at + self.settings.deadline_seconds
        self.jobs: set[Any] = set()

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    async def decide(self, index: int, record: bytes, slots: asyncio.Semaphore) -> bytes:
        try:
            async with slots:
                return _line(await self._decide(index, record))
        except DeciderError as exc:
            return _line(exc.to_wire())
        except Exception as exc:  # a bug: the record's line says so, the others are answered
            log.exception("record %d of %s failed", index, self.request_id)
            return _line(internal_error(exc).to_wire())

    async def _decide(self, index: int, record: bytes) -> dict[str, Any]:
        if not record.strip():
            raise RequestError(
                f"line {index + 1} is empty; send one JSON request per line", code="empty_record"
            )
        if len(record) > self.settings.max_body_bytes:  # before any parsing: a record is one request
            raise PayloadTooLargeError(
                f"line {index + 1} is {len(record)} bytes, larger than one request may be "
                f"({self.settings.max_body_bytes} bytes, DECIDER_MAX_BODY_BYTES); split it into smaller "
                "records",
                code="record_too_large",
            )
        engine = self.runtime.require_engine()
        limits = {
            "max_questions": self.settings.max_questions,
            "max_options": self.settings.max_options,
            "max_permutations": self.settings.max_permutations,
        }
        translated: Any = None

        def prepare() -> Any:  # on an intake thread, in an intake place, like any request body
            nonlocal translated
            body = parse_json(record)
            target = _record_target(body)
            if target not in {"decision", "batch", "openai_decision"}:
                raise RequestError(
                    "a Batch Transform record must be a decision request (`/v1/systemone`, "
                    "`/v1/systemone/batch` or `/v1/decisions`); chat is not served in bulk",
                    code="unsupported_record",
                )
            if target == "batch":
                parsed = parse_batch_request(body, max_states=self.settings.max_batch_states, **limits)
                plan = engine.plan_batch(parsed)
            elif target == "openai_decision":
                translated = parse_openai_decision_request(body, **limits)
                try:
                    plan = engine.plan_decision(translated.request)
                except RequestError as exc:
                    raise translated.relocate(exc) from None
            else:
                plan = engine.plan_decision(parse_decision_request(body, **limits))
            plan.space = cache_space(body)  # a record's own cache_salt (Batch Transform sends no header)
            return plan

        async with self.runtime.intake.slot(refuse=False):
            plan = await self.runtime.intake.run(prepare)
        outcome = await self._run(f"{self.request_id}-{index}", plan, engine)
        response = await asyncio.to_thread(decision_response, outcome)  # off the engine thread
        self.runtime.metrics.tokens.labels("decision_input").inc(response.usage.input_tokens)
        return translated.response(response) if translated is not None else response.to_wire()

    async def _run(self, record_id: str, plan: Any, engine: Any) -> Any:
        pause = RETRY_PAUSE_SECONDS
        while True:
            if self.remaining() <= 0:
                raise DeadlineExceededError(
                    f"the invocation's {self.settings.deadline_seconds:g} s deadline passed before this "
                    "record could start; send fewer records per payload (MaxPayloadInMB) or raise "
                    "InvocationsTimeoutInSeconds",
                    code="deadline_exceeded",
                    retryable=True,
                )
            work = engine.decision_work(plan)
            priced = await self.runtime.intake.run(lambda work=work: self.runtime.scheduler.price(work))
            try:  # admitted and submitted at once, its deadline the invocation's
                job = self.runtime.scheduler.enqueue(
                    "decision", record_id, work, arrived_at=self.arrived_at, priced=priced
                )
            except (OverloadedError, UnavailableError) as exc:
                if not exc.retryable or self.remaining() <= pause or exc.code == "shutting_down":
                    raise
                await asyncio.sleep(pause)
                pause = min(pause * 2, 8.0)
                continue
            break
        self.jobs.add(job)
        try:
            return await self.runtime.scheduler.wait(job, job.future)
        finally:
            self.jobs.discard(job)

    def cancel(self) -> None:
        for job in list(self.jobs):
            job.cancel()


async def handle_jsonlines(runtime: Any, request: Request) -> Response:
    """`POST /invocations` with `Content-Type: application/jsonlines`: one answer line per record."""
    settings: Settings = runtime.settings
    runtime.require_engine()  # not ready (loading, stopping): 503 for the whole invocation, which is retried
    limit = payload_limit(settings)
    encoding = request.headers.get("content-encoding")
    async with runtime.intake.slot(refuse=False):  # the payload is read and decoded in an intake place
        raw = await read_body(request, limit)
        data = await runtime.intake.run(lambda: decode_content(raw, encoding, limit))
    records = split_records(data)
    invocation = _Invocation(runtime, request.state.request_id, getattr(request.state, "arrived_at", None))
    slots = asyncio.Semaphore(records_in_flight(settings))
    tasks = [asyncio.ensure_future(invocation.decide(i, record, slots)) for i, record in enumerate(records)]
    gathered = asyncio.ensure_future(asyncio.gather(*tasks))
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        done = set()
        watcher.cancel()
        _stop(invocation, tasks, gathered)
        raise
    watcher.cancel()
    if gathered not in done:  # the caller went away (Batch Transform gave up): stop its records
        _stop(invocation, tasks, gathered)
        raise ClientDisconnectedError
    lines = gathered.result()
    request.state.invocation_target = "jsonlines"
    content = b"".join(line + b"\n" for line in lines)
    return Response(content, media_type=JSONLINES_MEDIA_TYPE)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _stop(invocation: _Invocation, tasks: list[asyncio.Future[bytes]], gathered: asyncio.Future[Any]) -> None:
    invocation.cancel()
    for task in tasks:
        task.cancel()
    gathered.cancel()
