"""What a chat request asks beyond text (issue 18), onto its plan: the constraint of its
`response_format` and its `logprobs` / `top_logprobs` (decider.engine.structured.constraints, chat_options).

Runs in the handler's planning step (a worker thread): the schema is checked, compiled against the
model's vocabulary and its first mask computed there, all before the request's deadline, so a
schema that cannot be used is a 422 naming the field before the request takes a place in the
queue: `response_format_too_complex` past a bound, `invalid_response_format` for a schema the
engine refuses (a keyword it does not implement is named), `response_format_unsatisfiable` when no
output can start.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from decider.engine.structured import constraints
from decider.engine.works import chat_options
from decider.engine.works.chat import ChatPlan
from decider.errors import DeadlineExceededError, RequestError
from decider.schemas.chat import ChatCompletionRequest
from decider.settings import GrammarLimits

SCHEMA_PARAM = ("response_format", "json_schema", "schema")


def check_stop(chat: ChatCompletionRequest, max_chars: int) -> None:
    """Each stop string is searched for after every generated token: bound its length."""
    for index, stop in enumerate(chat.stop_list()):
        if len(stop) > max_chars:
            param: tuple[str | int, ...] = ("stop",) if isinstance(chat.stop, str) else ("stop", index)
            raise RequestError(
                f"a stop string is {len(stop)} characters; at most {max_chars} are allowed "
                "(DECIDER_MAX_STOP_CHARS)",
                code="stop_too_long",
                param=param,
            )


def with_chat_options(
    engine: Any,
    chat: ChatCompletionRequest,
    plan: ChatPlan,
    limits: GrammarLimits | None = None,
    *,
    deadline: float | None = None,
) -> ChatPlan:
    """`plan` with the request's constraint and logprobs. `deadline` (time.monotonic): past it,
    while the schema is compiled, a 504 deadline_exceeded."""
    spec = chat.output_schema()
    constraint: constraints.Constraint | None = None
    if spec is not None:
        kind, schema, strict = spec
        base = SCHEMA_PARAM if kind == "json_schema" else ("response_format",)
        try:
            constraint = constraints.compile_constraint(
                constraints.vocabulary(engine.runtime),
                (schema or {}) if kind == "json_schema" else None,
                limits,
                deadline=deadline,
                strict=strict,
            )
        except constraints.ConstraintError as exc:
            raise RequestError(str(exc), code=exc.code, param=(*base, *exc.path)) from None
        except TimeoutError as exc:
            raise DeadlineExceededError(
                f"{exc} (DECIDER_DEADLINE_SECONDS)", code="deadline_exceeded", retryable=False
            ) from None
    top_logprobs = chat.logprobs_count()
    if constraint is None and top_logprobs is None:
        return plan
    return dataclasses.replace(plan, constraint=constraint, top_logprobs=top_logprobs)


def deadline_of(arrived_at: float | None, deadline_seconds: float) -> float:
    """The request's deadline on time.monotonic's clock, from its arrival (now if unknown)."""
    return (arrived_at if arrived_at is not None else time.monotonic()) + deadline_seconds


def logprobs_of(plan: ChatPlan, entries: list[chat_options.TokenLogprob]) -> dict[str, Any] | None:
    """`choices[].logprobs` when the request asked for them, else None."""
    return chat_options.logprobs_wire(entries) if plan.top_logprobs is not None else None
