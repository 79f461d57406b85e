"""OpenAI's Decisions API (`POST /v1/decisions`, the openai SDK's `client.decisions.create`).

The request is checked against the shapes of the pinned openai SDK (`openai/types/
decision_create_params.py`, `openai/types/decision.py`), translated into the same internal
`DecisionRequest` that `/v1/systemone` builds, so the same question gets the same prompt and the
same probabilities on both routes, and the internal answers are translated back in question order.

Translation (deterministic, documented in docs/engine.md):

- `input` becomes the state. A string stays that string. An array becomes a JSON array with one
  object per item, in order: messages as `{"role", "content"}`, calls and their outputs as
  `{"type", "call_id", "name", "arguments" | "input"}` and `{"type", "call_id", "output"}`. A content
  or output made of parts is the text of a single text part, else an array of the parts' texts and
  JSON data (a refusal as `{"refusal": text}`). The state leads every prompt, so all questions share
  one true token prefix.
- Question `i` gets the internal key `"i"`; option `j` of a choice or score gets `"j"`. The model is
  shown the option's `description`, or the choice `value` (`true` as the text `true`) / the level
  `label` when there is none; values come back exactly as sent, typed (`true` and `"true"` differ).
- `predicate` is a noul question (A = true, B = false, the frozen texts), `choice` a choice,
  `score` a score over its levels in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from decider.errors import DeciderError, Loc, RequestError
from decider.schemas.decision import DecisionRequest, DecisionResponse, json_kind, parse_decision_request

OPENAI_MAX_QUESTIONS = 400  # "Ask 1–400 questions" (the SDK's docstring)
OPENAI_MIN_CHOICES, OPENAI_MAX_OPTIONS = 2, 255  # "Provide between 2 and 255 choices"
PASSED_THROUGH = ("model", "extensions", "permutations", "mode")  # validated by the internal parser
OPTIONAL_STRINGS = ("prompt_cache_key", "safety_identifier")  # accepted, no effect here
MESSAGE_ROLES = ("user", "developer", "system", "assistant")
PART_TYPES: dict[str, frozenset[str]] = {
    "user": frozenset({"input_text", "input_image", "input_json"}),
    "developer": frozenset({"input_text"}),
    "system": frozenset({"input_text"}),
    "assistant": frozenset({"output_text", "refusal"}),
    "output": frozenset({"input_text", "input_image"}),
    "instructions": frozenset({"input_text", "input_image", "input_json"}),
}
CALLS = {"function_call": "function_call_output", "custom_tool_call": "custom_tool_call_output"}
QUESTION_FIELDS: dict[str, frozenset[str]] = {
    "predicate": frozenset({"type", "name", "instructions"}),
    "choice": frozenset({"type", "name", "instructions", "choices"}),
    "score": frozenset({"type", "name", "instructions", "levels"}),
}
OpenAIType = Literal["predicate", "choice", "score"]
INTERNAL_TYPES: dict[str, str] = {"predicate": "noul", "choice": "choice", "score": "score"}


def _error(message: str, code: str, *loc: str | int) -> RequestError:
    return RequestError(message, code=code, param=loc or None)


def _object(value: Any, what: str, *loc: str | int) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _error(f"{what} must be an object, not {json_kind(value)}.", "invalid_parameter", *loc)
    if duplicates := list(getattr(value, "duplicate_keys", [])):
        raise _error(f"Field {duplicates[0]!r} appears more than once.", "invalid_parameter", *loc)
    return value


def _string(obj: dict[str, Any], field: str, *loc: str | int, required: bool = True) -> str | None:
    if field not in obj or obj[field] is None:
        if required:
            raise _error(f"`{field}` is required.", "missing_field", *loc, field)
        return None
    value = obj[field]
    if not isinstance(value, str):
        raise _error(f"`{field}` must be a string, not {json_kind(value)}.", "invalid_parameter", *loc, field)
    return value


def _tag(value: Any) -> str | None:
    """A `type` or `role` discriminator: a string, else None (never an unhashable value)."""
    return value if isinstance(value, str) else None


def _image(*loc: str | int) -> RequestError:
    return _error("Images are not supported: this endpoint serves a text model.", "image_not_supported", *loc)


def _parts(value: Any, allowed: frozenset[str], *loc: str | int) -> Any:
    """A string, or an array of typed parts rendered as one text or an array of texts and data."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise _error(
            f"Expected a string or a non-empty array of parts, not {json_kind(value)}.",
            "invalid_parameter",
            *loc,
        )
    rendered: list[Any] = []
    for index, raw in enumerate(value):
        part = _object(raw, "A content part", *loc, index)
        kind = _tag(part.get("type"))
        if kind in ("input_image", "image", "image_url"):
            raise _image(*loc, index)
        if kind not in allowed:
            raise _error(
                f"Part type {part.get('type')!r} is not allowed here; "
                f"use one of {', '.join(sorted(allowed))}.",
                "invalid_parameter",
                *loc,
                index,
                "type",
            )
        if kind in ("input_text", "output_text"):
            rendered.append(_string(part, "text", *loc, index))
        elif kind == "refusal":
            rendered.append({"refusal": _string(part, "refusal", *loc, index)})
        else:  # input_json: an object or an array of objects, kept as JSON
            data = part.get("data")
            if not isinstance(data, dict | list):
                raise _error(
                    "`data` must be an object or an array.", "invalid_parameter", *loc, index, "data"
                )
            rendered.append(data)
    return rendered[0] if len(rendered) == 1 and isinstance(rendered[0], str) else rendered


def _input(value: Any) -> Any:
    """The state: the input text, or one JSON object per input item (see the module docstring)."""
    if isinstance(value, str):
        if not value.strip():
            raise _error("`input` is empty.", "invalid_input", "input")
        return value
    if not isinstance(value, list) or not value:
        raise _error(
            f"`input` must be a non-empty string or array of items, not {json_kind(value)}.",
            "invalid_input",
            "input",
        )
    calls: dict[str, set[str]] = {kind: set() for kind in CALLS}
    state: list[dict[str, Any]] = []
    for index, raw in enumerate(value):
        item = _object(raw, "An input item", "input", index)
        kind = _tag(item.get("type", "message"))
        loc = ("input", index)
        if kind == "message":
            role = _tag(item.get("role"))
            if role not in MESSAGE_ROLES:
                raise _error(
                    f"`role` must be one of {', '.join(MESSAGE_ROLES)}; got {item.get('role')!r}.",
                    "invalid_input",
                    *loc,
                    "role",
                )
            if "content" not in item:
                raise _error("`content` is required.", "missing_field", *loc, "content")
            state.append(
                {"role": role, "content": _parts(item["content"], PART_TYPES[role], *loc, "content")}
            )
        elif kind in CALLS:
            call_id = _string(item, "call_id", *loc)
            rendered = {"type": kind, "call_id": call_id, "name": _string(item, "name", *loc)}
            if namespace := _string(item, "namespace", *loc, required=False):
                rendered["namespace"] = namespace
            field = "arguments" if kind == "function_call" else "input"
            rendered[field] = _string(item, field, *loc)
            calls[kind].add(str(call_id))
            state.append(rendered)
        elif kind in CALLS.values():
            call_id = _string(item, "call_id", *loc)
            call_kind = next(call for call, output in CALLS.items() if output == kind)
            if call_id not in calls[call_kind]:
                raise _error(
                    f"No earlier {call_kind} has call_id {call_id!r}; each output must follow its call.",
                    "unmatched_call_id",
                    *loc,
                    "call_id",
                )
            if "output" not in item:
                raise _error("`output` is required.", "missing_field", *loc, "output")
            output = _parts(item["output"], PART_TYPES["output"], *loc, "output")
            state.append({"type": kind, "call_id": call_id, "output": output})
        else:
            raise _error(
                f"Input item type {item.get('type')!r} is not supported; use message, function_call, "
                "function_call_output, custom_tool_call or custom_tool_call_output.",
                "invalid_input",
                *loc,
                "type",
            )
    return state


@dataclass(frozen=True)
class QuestionPlan:
    """How one OpenAI question maps to the internal one (key `str(index)`) and back."""

    index: int
    name: str | None
    type: OpenAIType
    values: tuple[str | bool, ...] = ()  # choice values, typed, in order
    labels: tuple[str, ...] = ()  # score labels, in order
    shown_fields: tuple[str, ...] = ()  # per option: the field shown to the model

    @property
    def options_field(self) -> str:
        return "choices" if self.type == "choice" else "levels"


@dataclass(frozen=True)
class _Options:
    shown: tuple[str, ...]  # the text the model sees per option
    fields: tuple[str, ...]  # which field that text came from, per option
    values: tuple[str | bool, ...]
    labels: tuple[str, ...]


def _options(question: dict[str, Any], qtype: OpenAIType, loc: Loc) -> _Options:
    """The options of a choice or score question."""
    field = "choices" if qtype == "choice" else "levels"
    raw = question.get(field)
    if raw is None:
        raise _error(f"A {qtype} question needs `{field}`.", "missing_field", *loc, field)
    if not isinstance(raw, list):
        raise _error(f"`{field}` must be an array, not {json_kind(raw)}.", "invalid_parameter", *loc, field)
    low = OPENAI_MIN_CHOICES if qtype == "choice" else 1
    if len(raw) < low:
        raise _error(
            f"Provide between {low} and {OPENAI_MAX_OPTIONS} {field}.", f"invalid_{field}", *loc, field
        )
    if len(raw) > OPENAI_MAX_OPTIONS:
        raise _error(
            f"The question has {len(raw)} {field}; at most {OPENAI_MAX_OPTIONS} are allowed.",
            "option_count_unsupported",
            *loc,
            field,
        )
    shown: list[Any] = []
    values: list[str | bool] = []
    labels: list[str] = []
    fields: list[str] = []
    seen: set[tuple[bool, str | bool]] = set()
    for j, entry in enumerate(raw):
        option = _object(entry, f"Each of `{field}`", *loc, field, j)
        description = _string(option, "description", *loc, field, j, required=False)
        if qtype == "choice":
            if "value" not in option:
                raise _error("`value` is required.", "missing_field", *loc, field, j, "value")
            value = option["value"]
            if not isinstance(value, str | bool):
                raise _error(
                    f"`value` must be a string or a boolean, not {json_kind(value)}.",
                    "invalid_parameter",
                    *loc,
                    field,
                    j,
                    "value",
                )
            typed = (isinstance(value, bool), value)  # true and "true" are different choices
            if typed in seen:
                raise _error(
                    f"The choice {value!r} appears more than once.", "duplicate_option", *loc, field, j
                )
            seen.add(typed)
            values.append(value)
            fallback, fallback_field = (
                ("true" if value else "false") if isinstance(value, bool) else value,
                "value",
            )
        else:
            label = _string(option, "label", *loc, field, j)
            if not label.strip():
                raise _error("`label` is empty.", "empty_text", *loc, field, j, "label")
            labels.append(label)
            fallback, fallback_field = label, "label"
        if description is not None and description.strip():
            shown.append(description)
            fields.append("description")
        else:
            if not fallback.strip():
                raise _error(
                    "The choice has no text to show: its `value` is empty and it has no `description`.",
                    "empty_text",
                    *loc,
                    field,
                    j,
                    fallback_field,
                )
            shown.append(fallback)
            fields.append(fallback_field)
    return _Options(shown=tuple(shown), fields=tuple(fields), values=tuple(values), labels=tuple(labels))


def _question(raw: Any, index: int) -> tuple[dict[str, Any], QuestionPlan]:
    loc: Loc = ("questions", index)
    question = _object(raw, "Each question", *loc)
    qtype = _tag(question.get("type"))
    if qtype not in QUESTION_FIELDS:
        raise _error(
            f"`type` must be one of predicate, choice, score; got {question.get('type')!r}.",
            "invalid_question_type",
            *loc,
            "type",
        )
    if extra := sorted(set(question) - QUESTION_FIELDS[qtype]):
        raise _error(f"Unknown field {extra[0]!r} for a {qtype} question.", "unknown_field", *loc, extra[0])
    name = _string(question, "name", *loc, required=False)
    if "instructions" not in question or question["instructions"] is None:
        raise _error("`instructions` is required.", "missing_field", *loc, "instructions")
    instructions = _parts(question["instructions"], PART_TYPES["instructions"], *loc, "instructions")
    internal: dict[str, Any] = {"type": INTERNAL_TYPES[qtype], "instructions": instructions}
    if qtype == "predicate":
        return internal, QuestionPlan(index=index, name=name, type=qtype)
    options = _options(question, qtype, loc)
    shown = options.shown
    internal["criteria"] = (
        {str(j): text for j, text in enumerate(shown)} if qtype == "choice" else list(shown)
    )
    plan = QuestionPlan(
        index=index,
        name=name,
        type=qtype,
        values=options.values,
        labels=options.labels,
        shown_fields=options.fields,
    )
    return internal, plan


@dataclass(frozen=True)
class OpenAIDecision:
    """A validated `/v1/decisions` request: the internal request plus how to answer in OpenAI's shape."""

    request: DecisionRequest
    questions: tuple[QuestionPlan, ...]

    def relocate(self, exc: DeciderError) -> DeciderError:
        """Point an error raised on the internal request (by the engine) at the OpenAI field."""
        return _relocate(exc, self.questions)

    def response(self, internal: DecisionResponse) -> dict[str, Any]:
        """The `openai.types.Decision` body: answers in question order, typed values, usage."""
        answers = [self._answer(plan, internal.answers[str(plan.index)]) for plan in self.questions]
        tokens = internal.usage.input_tokens
        body: dict[str, Any] = {
            "answers": answers,
            "model": internal.model,
            "usage": {
                "input_tokens": tokens,
                # Read from kept states and exact repeats (decider.engine.memory.prefix_cache); what a
                # request leaves in the cache is not counted as written.
                "input_tokens_details": {
                    "cached_tokens": internal.usage.cached_tokens,
                    "cache_write_tokens": 0,
                },
                "output_tokens": 0,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": tokens,
            },
        }
        if internal.extensions is not None:
            body["extensions"] = internal.extensions
        return body

    @staticmethod
    def _answer(plan: QuestionPlan, answer: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"type": plan.type, "name": plan.name}
        if plan.type == "predicate":
            out["probability"] = answer.noul
        elif plan.type == "choice":
            out["choice"] = plan.values[int(answer.choice)]
            out["confidence"] = answer.confidence
            out["probabilities"] = [
                {"value": value, "probability": answer.probabilities[str(j)]}
                for j, value in enumerate(plan.values)
            ]
        else:
            out["score"] = answer.score
            out["confidence"] = answer.confidence
            out["probabilities"] = [
                {"value": j, "label": label, "probability": answer.probabilities[str(j)]}
                for j, label in enumerate(plan.labels)
            ]
        if answer.extensions is not None:
            out["extensions"] = answer.extensions
        return out


def _relocate(exc: DeciderError, plans: tuple[QuestionPlan, ...]) -> DeciderError:
    """Internal paths → OpenAI ones: `state` → `input`, `questions.3.criteria.1` →
    `questions.3.choices.1.value` (or `.description`, whichever the model was shown)."""
    loc = exc.loc
    if loc[:1] == ("state",):
        return exc.relocated(("input", *loc[1:]))
    if loc[:1] != ("questions",) or len(loc) < 2 or not str(loc[1]).isdigit():
        return exc
    plan = plans[int(loc[1])]
    new: Loc = ("questions", plan.index)
    rest = loc[2:]
    if rest[:1] == ("criteria",):
        if plan.type != "predicate":
            new += (plan.options_field,)
            if len(rest) >= 2 and str(rest[1]).isdigit():
                option = int(rest[1])
                new += (option, plan.shown_fields[option])
    else:
        new += tuple(rest)
    return exc.relocated(new)


def parse_openai_decision_request(
    obj: Any, *, max_questions: int, max_options: int, max_permutations: int
) -> OpenAIDecision:
    """Validate a parsed `/v1/decisions` body; every error is a `RequestError` naming the OpenAI field."""
    if not isinstance(obj, dict):
        raise RequestError(f"The body must be a JSON object, not {json_kind(obj)}.", code="invalid_body")
    body = _object(obj, "The body")
    if "input" not in body:
        raise _error("`input` is required.", "missing_field", "input")
    state = _input(body["input"])
    if "questions" not in body:
        raise _error("`questions` is required.", "missing_field", "questions")
    raw_questions = body["questions"]
    if not isinstance(raw_questions, list) or not raw_questions:
        raise _error("`questions` must be a non-empty array of questions.", "invalid_questions", "questions")
    limit = min(OPENAI_MAX_QUESTIONS, max_questions)
    if len(raw_questions) > limit:
        why = (
            "the Decisions API allows"
            if limit == OPENAI_MAX_QUESTIONS
            else "this server allows (DECIDER_MAX_QUESTIONS)"
        )
        raise _error(
            f"The request has {len(raw_questions)} questions; {why} at most {limit}.",
            "too_many_questions",
            "questions",
        )
    for field in OPTIONAL_STRINGS:
        _string(body, field, required=False)
    if body.get("prompt_cache_options") is not None:
        _object(body["prompt_cache_options"], "`prompt_cache_options`", "prompt_cache_options")
    internal_questions: dict[str, Any] = {}
    plans: list[QuestionPlan] = []
    for index, raw in enumerate(raw_questions):
        question, plan = _question(raw, index)
        internal_questions[str(index)] = question
        plans.append(plan)
    internal = {"state": state, "questions": internal_questions}
    internal.update({field: body[field] for field in PASSED_THROUGH if field in body})
    try:
        request = parse_decision_request(
            internal, max_questions=max_questions, max_options=max_options, max_permutations=max_permutations
        )
    except RequestError as exc:
        raise _relocate(exc, tuple(plans)) from None
    return OpenAIDecision(request=request, questions=tuple(plans))
