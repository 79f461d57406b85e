"""The decision and chat handlers: validate, admit, run on the engine thread, answer.

Validation (and every limit but the state's token count, which needs the tokenizer) happens on
the event loop before admission, so an invalid request never takes a place in the queue.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from decider.errors import DeciderError, RequestError, UnavailableError
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
from decider.schemas.decision import DecisionRequest, DecisionResponse, parse_decision_request
from decider.schemas.openai_decisions import parse_openai_decision_request
from decider.server.admission import Job, deadline_error
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


async def run_until_disconnect(runtime: ServerRuntime, request: Request, job: Job, fn: Any) -> Any:
    """`scheduler.run`, but drop the job as soon as the client disconnects."""
    work = asyncio.ensure_future(runtime.scheduler.run(job, fn))
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        job.cancel()
        work.cancel()
        watcher.cancel()
        raise
    if work in done:
        watcher.cancel()
        return work.result()
    job.cancel()
    work.cancel()
    raise ClientDisconnectedError


# --- decisions -----------------------------------------------------------------------------------


async def execute_decision(
    runtime: ServerRuntime, request: Request, decision: DecisionRequest
) -> DecisionResponse:
    """The one decision path behind every decision route: admit, run on the engine, count tokens.

    The engine enforces the per-model limits (state tokens, options per question) itself and polls
    `should_stop` between decodes, so a decision past its deadline or whose client left stops early.
    """
    engine = runtime.require_engine()
    job = runtime.scheduler.admit("decision", request.state.request_id)
    response: DecisionResponse = await run_until_disconnect(
        runtime, request, job, lambda job: engine.decide(decision, should_stop=job.should_stop)
    )
    runtime.metrics.tokens.labels("decision_input").inc(response.usage.input_tokens)
    return response


def _limits(runtime: ServerRuntime) -> dict[str, int]:
    settings = runtime.settings
    return {
        "max_questions": settings.max_questions,
        "max_options": settings.max_options,
        "max_permutations": settings.max_permutations,
    }


async def handle_decision(runtime: ServerRuntime, request: Request, body: Any) -> Response:
    """`POST /v1/systemone` (Jev / SemIf)."""
    runtime.require_engine()
    decision = parse_decision_request(body, **_limits(runtime))
    response = await execute_decision(runtime, request, decision)
    return JSONResponse(response.to_wire())


async def handle_openai_decision(runtime: ServerRuntime, request: Request, body: Any) -> Response:
    """`POST /v1/decisions` (OpenAI's Decisions API, `client.decisions.create`)."""
    runtime.require_engine()
    plan = parse_openai_decision_request(body, **_limits(runtime))
    try:
        response = await execute_decision(runtime, request, plan.request)
    except RequestError as exc:  # engine limits name internal fields: point them at the OpenAI ones
        raise plan.relocate(exc) from None
    return JSONResponse(plan.response(response))


# --- chat ----------------------------------------------------------------------------------------


def _max_tokens(runtime: ServerRuntime, chat: ChatCompletionRequest) -> int:
    limit = runtime.settings.max_chat_tokens
    requested = chat.requested_max_tokens()
    if requested is None:
        return limit
    if requested > limit:
        param = "max_completion_tokens" if chat.max_completion_tokens is not None else "max_tokens"
        raise RequestError(
            f"{param} is {requested}; at most {limit} are allowed (DECIDER_MAX_CHAT_TOKENS)",
            code="max_tokens_too_large",
            param=param,
        )
    return requested


def _generation(engine: Engine, chat: ChatCompletionRequest, max_tokens: int, job: Job) -> Iterator[Any]:
    messages = chat.engine_messages()
    if chat.requested_max_tokens() is None:
        # No max_tokens: as in OpenAI's API, generate up to what the context has left (capped).
        room = engine.model_info.n_ctx - len(engine.render_chat(messages))
        max_tokens = max(1, min(max_tokens, room))
    return iter(
        engine.generate(
            messages,
            max_tokens=max_tokens,
            temperature=chat.temperature,
            top_p=chat.top_p,
            stop=chat.stop_list(),
            seed=chat.seed,
            should_stop=job.should_stop,
        )
    )


def _finish_reason(event: Any, job: Job, deadline_seconds: float) -> str:
    reason = event.finish_reason
    if reason == "cancelled":
        if job.expired():
            raise deadline_error(job, deadline_seconds)
        raise ClientDisconnectedError
    return "length" if reason == "length" else "stop"


def _complete(engine: Engine, runtime: ServerRuntime, chat: ChatCompletionRequest, max_tokens: int, job: Job):
    parts: list[str] = []
    for event in _generation(engine, chat, max_tokens, job):
        if event.finish_reason is None:
            parts.append(event.text)
            continue
        finish = _finish_reason(event, job, runtime.settings.deadline_seconds)
        return "".join(parts), finish, event.usage
    raise RuntimeError("the engine ended a generation without a final event")


async def handle_chat(runtime: ServerRuntime, request: Request, body: Any) -> Response:
    engine = runtime.require_engine()
    chat = parse_chat_request(body)
    max_tokens = _max_tokens(runtime, chat)
    job = runtime.scheduler.admit("chat", request.state.request_id)
    if chat.stream:
        return await _stream_chat(runtime, request, engine, chat, max_tokens, job)
    text, finish, usage = await run_until_disconnect(
        runtime, request, job, lambda job: _complete(engine, runtime, chat, max_tokens, job)
    )
    _count_chat_tokens(runtime, usage)
    completion = ChatCompletion(
        id=new_completion_id(),
        created=now_seconds(),
        model=engine.model_info.id,
        choices=[Choice(message=AssistantMessage(content=text), finish_reason=finish)],
        usage=Usage.of(usage.prompt_tokens, usage.completion_tokens),
    )
    return JSONResponse(completion.model_dump(mode="json"))


def _count_chat_tokens(runtime: ServerRuntime, usage: Any) -> None:
    runtime.metrics.tokens.labels("prompt").inc(usage.prompt_tokens)
    runtime.metrics.tokens.labels("completion").inc(usage.completion_tokens)


# --- chat streaming ------------------------------------------------------------------------------

_END = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def _stream_chat(
    runtime: ServerRuntime,
    request: Request,
    engine: Engine,
    chat: ChatCompletionRequest,
    max_tokens: int,
    job: Job,
) -> Response:
    """Generate on the engine thread, relay events through a queue, and send SSE.

    The HTTP status is decided by the first event: an error before the first token (deadline while
    queued, prompt too long) is an ordinary JSON error response. Later errors become an SSE event
    with the usual error body, followed by `[DONE]`.
    """
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Any] = asyncio.Queue()

    def produce(job: Job) -> None:
        try:
            for event in _generation(engine, chat, max_tokens, job):
                loop.call_soon_threadsafe(events.put_nowait, event)
        except BaseException as exc:
            loop.call_soon_threadsafe(events.put_nowait, _Failure(exc))
        finally:
            loop.call_soon_threadsafe(events.put_nowait, _END)

    def relay_outcome(future: asyncio.Future[None]) -> None:
        """Work that never ran (deadline passed in the queue, server stopping) has no events."""
        if future.cancelled():
            events.put_nowait(_Failure(UnavailableError("the server is shutting down", code="shutting_down")))
        elif (exc := future.exception()) is not None:
            events.put_nowait(_Failure(exc))

    work = runtime.scheduler.start(job, produce)
    work.add_done_callback(relay_outcome)
    deadline_seconds = runtime.settings.deadline_seconds

    async def next_event() -> Any:
        try:
            return await asyncio.wait_for(events.get(), timeout=job.remaining() + 1.0)
        except TimeoutError:
            job.cancel()
            return _Failure(deadline_error(job, deadline_seconds))

    try:
        first = await next_event()
    except asyncio.CancelledError:
        job.cancel()
        raise
    if isinstance(first, _Failure):
        job.cancel()
        raise first.exc
    if first is _END:
        job.cancel()
        raise RuntimeError("the engine produced no events")

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
                if event is _END:
                    raise RuntimeError("the engine ended a generation without a final event")
                if isinstance(event, _Failure):
                    raise event.exc
                if event.finish_reason is None:
                    if event.text:
                        yield sse_chunk({"content": event.text})
                else:
                    finish = _finish_reason(event, job, deadline_seconds)
                    _count_chat_tokens(runtime, event.usage)
                    yield sse_chunk({}, finish_reason=finish)
                    if include_usage:
                        usage = Usage.of(event.usage.prompt_tokens, event.usage.completion_tokens)
                        yield sse_chunk({}, usage=usage, usage_only=True)
                    break
                event = await next_event()
        except ClientDisconnectedError:
            return
        except DeciderError as exc:
            yield _sse_data(exc.to_wire())
        except Exception as exc:
            log.exception("stream %s failed", job.request_id)
            yield _sse_data(internal_error(exc).to_wire())
        finally:
            job.cancel()  # stops generation if the client went away mid-stream
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream", headers=SSE_HEADERS)


def _sse_data(body: dict[str, Any]) -> str:
    return "data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def internal_error(exc: BaseException) -> DeciderError:
    """What a client sees of a bug: the usual error body, no traceback (that goes to the log)."""
    return DeciderError(f"internal error ({type(exc).__name__}); see the server log", code="internal_error")
