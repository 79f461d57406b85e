"""What a chat request asks beyond text (issue 18), onto its plan: the grammar of its
`response_format` and its `logprobs` / `top_logprobs` (decider.engine.chat_options).

Runs in the handler's planning step (a worker thread): the grammar is compiled once against the
model's vocabulary there, so a schema llama.cpp cannot use is a 422 `invalid_response_format`
naming the field before the request takes a place in the queue.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from decider.engine import chat_options
from decider.engine.chat import ChatPlan
from decider.engine.schema_limits import GrammarLimitError
from decider.errors import RequestError
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
    engine: Any, chat: ChatCompletionRequest, plan: ChatPlan, limits: GrammarLimits | None = None
) -> ChatPlan:
    spec = chat.output_schema()
    grammar: str | None = None
    if spec is not None:
        kind, schema = spec
        param = ".".join(SCHEMA_PARAM) if kind == "json_schema" else "response_format"
        try:
            grammar = (
                chat_options.schema_grammar(schema or {}, limits)
                if kind == "json_schema"
                else (chat_options.json_object_grammar())
            )
            chat_options.check_grammar(engine.runtime.vocab, grammar)
        except GrammarLimitError as exc:
            raise RequestError(
                str(exc), code="response_format_too_complex", param=(*SCHEMA_PARAM, *exc.path)
            ) from None
        except chat_options.GrammarError as exc:
            raise RequestError(str(exc), code="invalid_response_format", param=param) from None
    top_logprobs = chat.logprobs_count()
    if grammar is None and top_logprobs is None:
        return plan
    return dataclasses.replace(plan, grammar=grammar, top_logprobs=top_logprobs)


def logprobs_of(plan: ChatPlan, entries: list[chat_options.TokenLogprob]) -> dict[str, Any] | None:
    """`choices[].logprobs` when the request asked for them, else None."""
    return chat_options.logprobs_wire(entries) if plan.top_logprobs is not None else None
