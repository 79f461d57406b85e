"""The decision and chat handlers: validate and tokenize, admit, run on the engine thread, answer.

Validation and tokenization run on a worker thread before admission, so an invalid request never
takes a place in the queue and a large body never holds up `/ping`. Admission then knows the
request's token count, which is what its wait and its own cost are estimated from.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from decider.engine.scheduling.jobs import ClientGoneError, Job, deadline_error
from decider.engine.works.chat import ChatPlan
from decider.engine.works.generation import GenerationEvent
from decider.errors import DeciderError, RequestError, internal_error
from decider.schemas.cache_salt import cache_space
from decider.schemas.chat import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    Usage,
    chat_chunk,
    new_completion_id,
    now_seconds,
    parse_chat_request,
)
from decider.schemas.decision import parse_batch_request, parse_decision_request
from decider.schemas.openai_decisions import parse_openai_decision_request
from decider.server.answers import decision_response
from decider.server.chat_parity import check_stop, deadline_of, logprobs_of, with_chat_options
from decider.server.intake import release_intake
from decider.server.runtime import Engine, ServerRuntime

log = logging.getLogger("decider.server")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnectedError(Exception):
    """The client went away before its answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def admit(runtime: ServerRuntime, request: Request, kind: str, work: Any) -> Job:
    """Price the request's work against the caches on its intake thread (a cache peek scans every
    kept key: never on the event loop, and at most DECIDER_PARSE_CONCURRENCY at once), release its
    intake place, then admit and submit it in one call (nothing can cancel the handler in between),
    its deadline counted from the request's arrival."""
    priced = await runtime.intake.run(lambda: runtime.scheduler.price(work))
    release_intake(request)
    arrived_at = getattr(request.state, "arrived_at", None)  # set by RequestContextMiddleware
    return runtime.scheduler.enqueue(
        kind, request.state.request_id, work, arrived_at=arrived_at, priced=priced
    )


async def run_until_disconnect(runtime: ServerRuntime, request: Request, kind: str, work: Any) -> Any:
    """Admit `work` and wait for it, but drop the job as soon as the client disconnects."""
    job = await admit(runtime, request, kind, work)
    assert job.future is not None
    run = asyncio.ensure_future(runtime.scheduler.wait(job, job.future))
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({run, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        job.cancel()
        run.cancel()
        watcher.cancel()
        raise
    if run in done:
        watcher.cancel()
        try:
            return run.result()
        except ClientGoneError:
            raise ClientDisconnectedError from None
    job.cancel()
    run.cancel()
    raise ClientDisconnectedError


# --- decisions -----------------------------------------------------------------------------------


def _limits(runtime: ServerRuntime) -> dict[str, int]:
    settings = runtime.settings
    return {
        "max_questions": settings.max_questions,
        "max_options": settings.max_options,
        "max_permutations": settings.max_permutations,
    }


async def handle_decision(runtime: ServerRuntime, request: Request, body: Any) -> Response:
    engine = runtime.require_engine()

    def prepare() -> Any:
        plan = engine.plan_decision(parse_decision_request(body, **_limits(runtime)))
        plan.space = cache_space(body, request.headers)
        return plan

    return await _decide(runtime, request, engine, prepare)


async def handle_batch(runtime: ServerRuntime, request: Request, body: Any) -> Response:
    engine = runtime.require_engine()
    max_states = runtime.settings.max_batch_states

    def prepare() -> Any:
        plan = engine.plan_batch(parse_batch_request(body, max_states=max_states, **_limits(runtime)))
        plan.space = cache_space(body, request.headers)
        return plan

    return await _decide(runtime, request, engine, prepare)


async def handle_openai_decision(runtime: ServerRuntime, request: Request, body: Any) -> Response:
    """`POST /v1/decisions` (OpenAI's Decisions API, `client.decisions.create`): translated to the
    same decision request, planned, batched and answered the same way."""
    engine = runtime.require_engine()
    translated: Any = None

    def prepare() -> Any:
        nonlocal translated
        translated = parse_openai_decision_request(body, **_limits(runtime))
        try:
            plan = engine.plan_decision(translated.request)
        except RequestError as exc:  # engine limits name internal fields: point them at OpenAI's
            raise translated.relocate(exc) from None
        plan.space = cache_space(body, request.headers)
        return plan

    response = await execute_decision(runtime, request, engine, prepare)
    return JSONResponse(translated.response(response))


async def _decide(
    runtime: ServerRuntime, request: Request, engine: Engine, prepare: Callable[[], Any]
) -> Response:
    return JSONResponse((await execute_decision(runtime, request, engine, prepare)).to_wire())


async def execute_decision(
    runtime: ServerRuntime, request: Request, engine: Engine, prepare: Callable[[], Any]
) -> Any:
    """The one decision path behind every decision route: plan (validate and tokenize) on a worker
    thread, admit by token count, run batched on the engine thread, make the response on a worker
    thread from the readouts the engine hands back, count tokens."""
    plan = await runtime.intake.run(prepare)  # parsing and tokenizing never block the event loop
    outcome = await run_until_disconnect(runtime, request, "decision", engine.decision_work(plan))
    response = await asyncio.to_thread(decision_response, outcome)
    runtime.metrics.tokens.labels("decision_input").inc(response.usage.input_tokens)
    return response


# --- chat ----------------------------------------------------------------------------------------


def _max_tokens(runtime: ServerRuntime, chat: ChatCompletionRequest) -> int | None:
    limit = runtime.settings.max_chat_tokens
    requested = chat.requested_max_tokens()
    if requested is not None and requested > limit:
        param = "max_completion_tokens" if chat.max_completion_tokens is not None else "max_tokens"
        raise RequestError(
            f"{param} is {requested}; at most {limit} are allowed (DECIDER_MAX_CHAT_TOKENS)",
            code="max_tokens_too_large",
            param=param,
        )
    return requested


async def handle_chat(runtime: ServerRuntime, request: Request, body: Any) -> Response:
    engine = runtime.require_engine()

    deadline = deadline_of(getattr(request.state, "arrived_at", None), runtime.settings.deadline_seconds)

    def prepare() -> tuple[ChatCompletionRequest, ChatPlan]:
        chat = parse_chat_request(body)
        check_stop(chat, runtime.settings.max_stop_chars)
        plan = engine.chat_plan(
            chat.engine_messages(),
            max_tokens=_max_tokens(runtime, chat),
            max_tokens_cap=runtime.settings.max_chat_tokens,
            temperature=chat.temperature,
            top_p=chat.top_p,
            stop=chat.stop_list(),
            seed=chat.seed,
        )
        plan = dataclasses.replace(plan, space=cache_space(body, request.headers))
        # response_format constraint (checked, compiled, its first mask: before the deadline), logprobs
        return chat, with_chat_options(engine, chat, plan, runtime.settings.grammar_limits, deadline=deadline)

    chat, plan = await runtime.intake.run(prepare)
    if chat.stream:
        return await _stream_chat(runtime, request, engine, chat, plan)
    work = engine.chat_work(plan)
    text, finish, usage = await run_until_disconnect(runtime, request, "chat", work)
    _count_chat_tokens(runtime, usage)
    choice = Choice(
        message=AssistantMessage(content=text),
        finish_reason=_wire_finish(finish),
        logprobs=logprobs_of(plan, work.logprobs),
    )
    completion = ChatCompletion(
        id=new_completion_id(),
        created=now_seconds(),
        model=engine.model_info.id,
        choices=[choice],
        usage=Usage.of(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens),
    )
    return JSONResponse(completion.model_dump(mode="json"))


def _wire_finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _count_chat_tokens(runtime: ServerRuntime, usage: Any) -> None:
    runtime.metrics.tokens.labels("prompt").inc(usage.prompt_tokens)
    runtime.metrics.tokens.labels("completion").inc(usage.completion_tokens)


# --- chat streaming ------------------------------------------------------------------------------


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _JobStream(StreamingResponse):
    """An SSE response that stops its job however it ends: finished, client gone, or never sent
    (an async generator that never started runs no `finally`)."""

    def __init__(self, job: Job, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


async def _stream_chat(
    runtime: ServerRuntime, request: Request, engine: Engine, chat: ChatCompletionRequest, plan: ChatPlan
) -> Response:
    """Generate on the engine thread, relay its events through a queue, and send SSE.

    The HTTP status is decided by the first event: an error before the first token (deadline while
    queued, server stopping) is an ordinary JSON error response. Later errors become an SSE event
    with the usual error body, followed by `[DONE]`.
    """
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Any] = asyncio.Queue()

    def emit(event: GenerationEvent) -> None:  # called on the engine thread
        loop.call_soon_threadsafe(events.put_nowait, event)

    def relay_failure(future: Future[Any]) -> None:
        if (exc := future.exception()) is not None:
            loop.call_soon_threadsafe(events.put_nowait, _Failure(exc))

    work = engine.chat_work(plan, emit)
    job = await admit(runtime, request, "chat", work)
    assert job.future is not None
    job.future.add_done_callback(relay_failure)
    logprobs_sent = 0

    def new_logprobs() -> dict[str, Any] | None:
        """The logprobs of the tokens generated since the last chunk (with `logprobs` asked for)."""
        nonlocal logprobs_sent
        entries = work.logprobs[logprobs_sent:]
        logprobs_sent += len(entries)
        return logprobs_of(plan, entries)

    deadline_seconds = runtime.settings.deadline_seconds

    async def next_event() -> Any:
        try:
            return await asyncio.wait_for(events.get(), timeout=job.remaining() + 1.0)
        except TimeoutError:
            job.cancel()
            return _Failure(deadline_error(job, deadline_seconds))

    first = await _first_event_or_disconnect(request, job, next_event())
    if isinstance(first, _Failure):
        job.cancel()
        if isinstance(first.exc, ClientGoneError):
            raise ClientDisconnectedError
        raise first.exc

    completion_id, created, model_id = new_completion_id(), now_seconds(), engine.model_info.id
    include_usage = bool(chat.stream_options and chat.stream_options.include_usage)

    def sse_chunk(delta: dict[str, str], **fields: Any) -> str:
        body = chat_chunk(completion_id, created, model_id, delta, include_usage=include_usage, **fields)
        return _sse_data(body)

    async def sse() -> AsyncIterator[str]:
        event: Any = first
        try:
            yield sse_chunk({"role": "assistant", "content": ""})
            while True:
                if isinstance(event, _Failure):
                    raise event.exc
                if event.finish_reason is None:
                    if event.text:
                        yield sse_chunk({"content": event.text}, logprobs=new_logprobs())
                else:
                    _count_chat_tokens(runtime, event.usage)
                    finish = _wire_finish(event.finish_reason)
                    yield sse_chunk({}, finish_reason=finish, logprobs=new_logprobs())
                    if include_usage:
                        done = event.usage
                        usage = Usage.of(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
                        yield sse_chunk({}, usage=usage, usage_only=True)
                    break
                event = await next_event()
        except ClientGoneError:
            return
        except DeciderError as exc:
            yield _sse_data(exc.to_wire())
        except Exception as exc:
            log.exception("stream %s failed", job.request_id)
            yield _sse_data(internal_error(exc).to_wire())
        finally:
            job.cancel()  # stops generation if the client went away mid-stream
        yield "data: [DONE]\n\n"

    return _JobStream(job, sse())


async def _first_event_or_disconnect(request: Request, job: Job, first: Any) -> Any:
    """The stream's first event; while it is awaited (queued, prefilling) nothing is sent yet, so
    only the connection says whether the client is still there: one that leaves cancels its job."""
    event = asyncio.ensure_future(first)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({event, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        job.cancel()
        event.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if event in done:
        return event.result()
    job.cancel()
    event.cancel()
    raise ClientDisconnectedError


def _sse_data(body: dict[str, Any]) -> str:
    return "data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n\n"
