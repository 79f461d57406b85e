"""The server's OpenAPI 3.1 document (`GET /openapi.json`, and docs/openapi.json), built from the
pydantic models.

The chat request and every response body are the models the server validates and answers with
(`ChatCompletionRequest`, `DecisionResponse`, `BatchDecisionResponse`, `ChatCompletion`). The
decision requests are parsed by hand-written validators (decider.schemas.decision,
decider.schemas.openai_decisions: typed error codes, duplicate keys, per-field limits), so their
wire shapes are described here by `JevDecisionBody`, `JevBatchBody` and `OpenAIDecisionBody`;
tests/server/test_openapi.py sends what the document allows to the live server (schemathesis), so
the two cannot drift apart unnoticed.

    python -m decider.schemas.openapi > docs/openapi.json
"""

from __future__ import annotations

import json
from functools import cache
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel, StringConstraints
from pydantic.json_schema import models_json_schema

from decider import __version__
from decider.schemas.cache_salt import SALT_FIELD_SCHEMA
from decider.schemas.chat import ChatCompletion, ChatCompletionRequest
from decider.schemas.decision import BatchDecisionResponse, DecisionResponse
from decider.schemas.openai_decisions import (
    OPENAI_MAX_OPTIONS,
    OPENAI_MAX_QUESTIONS,
    OPENAI_MIN_CHOICES,
    PART_TYPES,
)
from decider.settings import Settings

Json = Any  # any JSON value
CacheSalt = Any  # checked by decider.schemas.cache_salt, documented as SALT_FIELD_SCHEMA
# The Jev routes' texts, as decider.schemas.decision checks them: a state, instructions or option text
# is a string with a non-blank character, a non-empty object or a non-empty array (422 `empty_text`,
# `invalid_state` otherwise); keys of questions and of choice options are not blank (pydantic writes
# such a key as `patternProperties`, which leaves other keys free: `KEYED` closes them).
# "Not blank" is `str.strip()`'s (every `str.isspace()` character), spelled out: JSON Schema's `\s` is
# ECMA-262's, which leaves out U+001C-U+001F and U+0085 and takes in U+FEFF.
WHITESPACE = "\t-\r\u001c- \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
NonBlank = Annotated[str, StringConstraints(pattern=f"[^{WHITESPACE}]")]
NonEmptyObject = Annotated[dict[str, Json], Field(min_length=1)]
NonEmptyArray = Annotated[list[Json], Field(min_length=1)]
Content = NonBlank | NonEmptyObject | NonEmptyArray
KEYED = {"additionalProperties": False}
Permutations = Annotated[
    int,
    Field(
        ge=1,
        description="Option orders averaged, at most DECIDER_MAX_PERMUTATIONS "
        f"(default {Settings.model_fields['max_permutations'].default}).",
    ),
]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoulCriteria(_Closed):
    """The two sides' texts; a side left out or null gets the prompt version's default text."""

    true: Content | None = None
    false: Content | None = None


class NoulQuestion(_Closed):
    type: Literal["noul"]
    instructions: Content | None = None
    criteria: NoulCriteria | None = None


class ChoiceQuestion(_Closed):
    type: Literal["choice"]
    instructions: Content | None = None
    criteria: dict[NonBlank, str | NonEmptyObject | NonEmptyArray | None] = Field(
        min_length=1,
        description="Option key → description (null or a blank string: the key itself), at most "
        "DECIDER_MAX_OPTIONS options.",
        json_schema_extra=KEYED,
    )


class ScoreQuestion(_Closed):
    type: Literal["score"]
    instructions: Content | None = None
    criteria: list[Content] = Field(
        min_length=1, description="Level texts, low to high, at most DECIDER_MAX_OPTIONS."
    )


ByType = Field(discriminator="type")


class JevQuestion(RootModel[Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, ByType]]):
    """One question of the Jev routes, by `type`."""


JevQuestions = Annotated[
    dict[NonBlank, JevQuestion],
    Field(
        min_length=1,
        description="Question key → question, at most DECIDER_MAX_QUESTIONS.",
        json_schema_extra=KEYED,
    ),
]


class _DecisionFields(_Open):
    """What every decision route takes beside its state(s) and questions (decider.schemas.decision's
    DecisionOptions; /v1/decisions passes them through)."""

    model: str | None = None
    extensions: bool | None = False
    permutations: Permutations | None = 1
    mode: Literal["shared", "fresh"] | None = None
    cache_salt: CacheSalt = Field(None, json_schema_extra=SALT_FIELD_SCHEMA)


class JevDecisionBody(_DecisionFields):
    """`POST /v1/systemone` (Jev / SemIf): one state, typed questions by key. Other top-level fields
    are ignored (clients add metadata), except `assets` (422 `unsupported_field`)."""

    state: Content
    questions: JevQuestions


class JevBatchBody(_DecisionFields):
    """`POST /v1/systemone/batch`: many states (at most DECIDER_MAX_BATCH_STATES), the same questions
    for each."""

    states: list[Content] = Field(min_length=1)
    questions: JevQuestions


# /v1/decisions as decider.schemas.openai_decisions checks it. What a schema cannot say is looser here
# (a choice's text, duplicate values, a call output's call id): such bodies get a typed 422. Image
# parts are left out: the server refuses them (`image_not_supported`).
class InputTextPart(_Open):
    type: Literal["input_text"]
    text: str


class InputJsonPart(_Open):
    type: Literal["input_json"]
    data: dict[str, Json] | list[Json]


class OutputTextPart(_Open):
    type: Literal["output_text"]
    text: str


class RefusalPart(_Open):
    type: Literal["refusal"]
    refusal: str


PART_MODELS: dict[str, type[BaseModel]] = {
    "input_text": InputTextPart,
    "input_json": InputJsonPart,
    "output_text": OutputTextPart,
    "refusal": RefusalPart,
}  # and `input_image`, which the parser names only to refuse


def _parts(where: str) -> Any:
    """A non-empty array of the part types the parser takes `where` (its PART_TYPES), by `type`."""
    names = sorted(PART_TYPES[where] - {"input_image"})
    kinds = tuple(PART_MODELS[name] for name in names)
    part = Annotated[kinds[0] if len(kinds) == 1 else Union[kinds], ByType]  # noqa: UP007
    return Annotated[list[part], Field(min_length=1)]  # type: ignore[valid-type]


Instructions = NonBlank | _parts("instructions")


class InputUserMessage(_Open):
    type: Literal["message"] = "message"
    role: Literal["user"]
    content: str | _parts("user")  # type: ignore[valid-type]


class InputInstructionMessage(_Open):
    type: Literal["message"] = "message"
    role: Literal["developer", "system"]
    content: str | _parts("developer")  # type: ignore[valid-type]  # the same parts as "system"


class InputAssistantMessage(_Open):
    type: Literal["message"] = "message"
    role: Literal["assistant"]
    content: str | _parts("assistant")  # type: ignore[valid-type]


class _Call(_Open):
    call_id: str
    name: str
    namespace: str | None = None


class FunctionCall(_Call):
    type: Literal["function_call"]
    arguments: str


class CustomToolCall(_Call):
    type: Literal["custom_tool_call"]
    input: str


class CallOutput(_Open):
    """Follows the call with the same `call_id` (422 `unmatched_call_id` otherwise)."""

    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | _parts("output")  # type: ignore[valid-type]


InputMessage = InputUserMessage | InputInstructionMessage | InputAssistantMessage
InputItem = InputMessage | FunctionCall | CustomToolCall | CallOutput


class DecisionChoice(_Open):
    value: str | bool
    description: str | None = None


class DecisionLevel(_Open):
    label: NonBlank
    description: str | None = None


class Predicate(_Closed):
    type: Literal["predicate"]
    name: str | None = None
    instructions: Instructions


class ChoiceOf(_Closed):
    type: Literal["choice"]
    name: str | None = None
    instructions: Instructions
    choices: list[DecisionChoice] = Field(min_length=OPENAI_MIN_CHOICES, max_length=OPENAI_MAX_OPTIONS)


class ScoreOf(_Closed):
    type: Literal["score"]
    name: str | None = None
    instructions: Instructions
    levels: list[DecisionLevel] = Field(min_length=1, max_length=OPENAI_MAX_OPTIONS)


class OpenAIQuestion(RootModel[Annotated[Predicate | ChoiceOf | ScoreOf, ByType]]):
    """One question of `/v1/decisions`, by `type`."""


class OpenAIDecisionBody(_DecisionFields):
    """`POST /v1/decisions` (OpenAI's Decisions API, `client.decisions.create`)."""

    input: NonBlank | Annotated[list[InputItem], Field(min_length=1)]
    questions: list[OpenAIQuestion] = Field(
        min_length=1,
        max_length=OPENAI_MAX_QUESTIONS,
        description="At most DECIDER_MAX_QUESTIONS where that is lower.",
    )
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prompt_cache_options: dict[str, Json] | None = None


class OpenAIDecision(_Open):
    """The Decisions API's answer: one typed answer per question, in question order."""

    model: str
    answers: list[dict[str, Json]]
    usage: dict[str, Json]


class ErrorFields(BaseModel):
    type: str
    code: str = Field(description="Stable, machine-readable (docs/engine.md and docs/server.md list them).")
    message: str
    param: str | None
    retryable: bool = Field(description="Whether the same request can succeed later (also `x-should-retry`).")


class ErrorBody(BaseModel):
    """Every error, from any layer: OpenAI's `error` and FastAPI's `detail` saying the same thing."""

    error: ErrorFields
    detail: list[dict[str, Json]] | dict[str, str]


class Ping(_Open):
    status: str
    model: str | None = None


MODELS: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
    (JevDecisionBody, "validation"),
    (JevBatchBody, "validation"),
    (OpenAIDecisionBody, "validation"),
    (ChatCompletionRequest, "validation"),
    (DecisionResponse, "serialization"),
    (BatchDecisionResponse, "serialization"),
    (OpenAIDecision, "serialization"),
    (ChatCompletion, "serialization"),
    (ErrorBody, "serialization"),
    (Ping, "serialization"),
]
ERROR_STATUSES = {
    "400": "Bad request",
    "401": "A configured API key is missing or wrong",
    "404": "Unknown route (also `unknown_route` in the custom attributes)",
    "413": "Body too large (DECIDER_MAX_BODY_BYTES)",
    "415": "Unsupported Content-Type or Content-Encoding",
    "422": "Invalid request, with the field in `error.param`",
    "429": "Queue full (`queue_full`, Retry-After)",
    "503": "Model loading, shutting down, deadline unreachable, engine failed (Retry-After)",
    "504": "The request passed its deadline",
}


# OpenAPI 3.1 has a `text/event-stream` schema describe each event (3.2 adds `itemSchema` for that).
SSE_EVENT = {
    "type": "object",
    "description": "One server-sent event: `data` is a `chat.completion.chunk` (JSON), an `ErrorBody` for an "
    "error after the first chunk, or `[DONE]`, the last event.",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(*statuses: str) -> dict[str, Any]:
    return {
        status: {"description": ERROR_STATUSES[status], "content": _json(_ref("ErrorBody"))}
        for status in statuses
    }


def _post(summary: str, body: dict[str, Any], ok: dict[str, Any], *, stream: bool = False) -> dict[str, Any]:
    content = _json(ok)
    if stream:
        content["text/event-stream"] = {"schema": SSE_EVENT}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(body)},
            "responses": {
                "200": {"description": "The answer", "content": content},
                **_errors("400", "401", "404", "413", "415", "422", "429", "503", "504"),
            },
        }
    }


def _get(summary: str, ok: dict[str, Any], media: str = "application/json", **extra: Any) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "responses": {"200": {"description": "OK", "content": {media: {"schema": ok}}}, **extra},
        }
    }


@cache
def openapi_document() -> dict[str, Any]:
    """The whole document, OpenAPI 3.1 (its schemas are JSON Schema 2020-12, as pydantic writes them)."""
    _, defs = models_json_schema(MODELS, ref_template="#/components/schemas/{model}")
    schemas = defs.get("$defs", {})
    decision, batch, openai_decision = (
        _ref("JevDecisionBody"),
        _ref("JevBatchBody"),
        _ref("OpenAIDecisionBody"),
    )
    chat = _ref("ChatCompletionRequest")
    any_answer = {
        "anyOf": [
            _ref("DecisionResponse"),
            _ref("BatchDecisionResponse"),
            _ref("OpenAIDecision"),
            _ref("ChatCompletion"),
        ]
    }
    paths = {
        "/ping": _get(
            "Health: 200 once the model is loaded and verified",
            _ref("Ping"),
            **{"503": {"description": "Loading, failed or stopping", "content": _json(_ref("Ping"))}},
        ),
        "/invocations": _post(
            "SageMaker's route: X-Amzn-SageMaker-Custom-Attributes `route=…`, else the body's shape decides",
            {"anyOf": [decision, batch, openai_decision, chat]},
            any_answer,
            stream=True,
        ),
        "/v1/systemone": _post(
            "A typed decision on one state (Jev / SemIf)", decision, _ref("DecisionResponse")
        ),
        "/v1/systemone/batch": _post(
            "The same questions on many states", batch, _ref("BatchDecisionResponse")
        ),
        "/v1/decisions": _post("OpenAI's Decisions API", openai_decision, _ref("OpenAIDecision")),
        "/v1/chat/completions": _post(
            "OpenAI-compatible chat (SSE with `stream: true`)", chat, _ref("ChatCompletion"), stream=True
        ),
        "/v1/models": _get("The served model, in OpenAI's and Jev's shapes", {"type": "object"}),
        "/metrics": _get("Prometheus metrics", {"type": "string"}, "text/plain"),
        "/execution-parameters": _get("SageMaker Batch Transform's parameters", {"type": "object"}),
        "/openapi.json": _get("This document", {"type": "object"}),
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "decider",
            "version": __version__,
            "description": "Typed decisions and OpenAI-compatible chat from one GGUF model (SageMaker AI "
            "hosting contract). Every error is `ErrorBody`.",
        },
        "paths": paths,
        "components": {"schemas": schemas},
    }


def render() -> str:
    return json.dumps(openapi_document(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(render(), end="")
