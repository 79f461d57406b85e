"""OpenAI-compatible chat completion request and response models.

The request model accepts what the `openai` SDK sends, `logprobs` / `top_logprobs` and
`response_format` (`text`, `json_object`, `json_schema`: constrained with llguidance, see
`decider.engine.structured.constraints`) included. Parameters that would change the meaning of the answer and
that we cannot honour (`n > 1`, tools, other response formats, non-text content parts) are refused
with a clear `unsupported_parameter` error naming the field instead of being silently ignored;
purely informational fields (`user`, `metadata`, `store`, …) are ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from decider.errors import RequestError
from decider.schemas.cache_salt import SALT_FIELD_SCHEMA

Role = Literal["system", "developer", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length"]
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class ChatMessage(BaseModel):
    """One message; `content` is a string or a list of text parts (joined with no separator)."""

    model_config = ConfigDict(extra="ignore", strict=True)  # as documented: 0 is no boolean

    role: Role
    content: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        texts: list[str] = []
        for part in value:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise _unsupported("messages.content", "only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)

    def text(self) -> str:
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # as documented: 0 is no boolean

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """`POST /v1/chat/completions` body. `model` is optional and any value is accepted."""

    model_config = ConfigDict(extra="ignore", strict=True)  # as documented: 0 is no boolean

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # checked where the cache space is read (decider.schemas.cache_salt: one error code on every route)
    cache_salt: Any = Field(None, json_schema_extra=SALT_FIELD_SCHEMA)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # null means the default for these (clients send it), hence `| None` in the documented schema
    temperature: float | None = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _none_is_default(cls, value: Any, info: Any) -> Any:
        if value is None:
            return cls.model_fields[info.field_name].default
        return value

    @field_validator("stream", mode="before")
    @classmethod
    def _stream_none_is_false(cls, value: Any) -> Any:
        return False if value is None else value

    @field_validator("n", mode="before")
    @classmethod
    def _n_none_is_one(cls, value: Any) -> Any:
        return 1 if value is None else value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if len(items) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(item == "" for item in items):
            raise ValueError("stop sequences must not be empty")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> ChatCompletionRequest:
        if self.n != 1:
            raise _unsupported("n", "only n=1 is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise _unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        if self.tools or self.functions:
            raise _unsupported("tools", "tool and function calling are not supported")
        if self.logit_bias:
            raise _unsupported("logit_bias", "logit_bias is not supported")
        if self.response_format is not None:
            kind = self.response_format.get("type", "text")
            if kind not in RESPONSE_FORMATS:
                raise _unsupported(
                    "response_format.type",
                    f"response_format type {kind!r} is not supported; "
                    f"use one of {', '.join(RESPONSE_FORMATS)}",
                )
            if kind == "json_schema":
                spec = self.response_format.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise _unsupported(
                        "response_format.json_schema.schema",
                        "response_format json_schema needs json_schema.schema: a JSON schema object",
                    )
                if spec.get("strict") not in (None, True, False):
                    raise ValueError("response_format.json_schema.strict must be a boolean")
        return self

    def output_schema(self) -> tuple[str, dict[str, Any] | None, bool] | None:
        """None for plain text, ("json_object", None, False) or ("json_schema", schema, strict)."""
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            return "json_object", None, False
        if kind == "json_schema":
            spec = self.response_format["json_schema"]  # type: ignore[index]
            return "json_schema", spec["schema"], spec.get("strict") is True
        return None

    def logprobs_count(self) -> int | None:
        """None without logprobs, else how many alternatives per token (`top_logprobs`, default 0)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` (newer SDKs) wins over the legacy `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_messages(self) -> list[dict[str, str]]:
        """Messages as the engine takes them; `developer` is the newer name for `system`."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


class _UnsupportedParameterError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _unsupported(param: str, message: str) -> _UnsupportedParameterError:
    return _UnsupportedParameterError(param, message)


def parse_chat_request(obj: Any) -> ChatCompletionRequest:
    """Validate a parsed JSON body; raise `RequestError` with a code and the parameter path."""
    if not isinstance(obj, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_body")
    try:
        return ChatCompletionRequest.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, _UnsupportedParameterError):
            raise RequestError(str(cause), code="unsupported_parameter", param=cause.param) from None
        param = ".".join(str(part) for part in first["loc"]) or None
        code = "missing_field" if first["type"] == "missing" else "invalid_parameter"
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        raise RequestError(message, code=code, param=param) from None


# --- responses -------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens copied from a kept earlier turn instead of decoded


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: dict[str, Any] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


def chat_chunk(
    completion_id: str,
    created: int,
    model: str,
    delta: dict[str, str],
    *,
    finish_reason: FinishReason | None = None,
    usage: Usage | None = None,
    include_usage: bool = False,
    usage_only: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk` as OpenAI streams it (`usage` present only when asked for)."""
    choices = (
        []
        if usage_only
        else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    )
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if include_usage:
        body["usage"] = usage.model_dump() if usage is not None else None
    return body


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def now_seconds() -> int:
    return int(time.time())
