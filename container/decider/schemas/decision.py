"""The decision request (`POST /v1/systemone`, Jev/SemIf shape) and its response, as pydantic models.

Validation is explicit rather than left to pydantic's generic messages, because every invalid
request must get its own machine-readable code and the path of the offending parameter
(`questions.team.criteria`), as `decider.errors.RequestError`. All validation happens before the
model is touched, so a request either fails as a whole or is answered as a whole.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from decider.errors import RequestError
from decider.settings import QuestionType, Settings

QUESTION_TYPES: tuple[str, ...] = get_args(QuestionType)
JSONContent = str | dict[str, Any] | list[Any]

# Frozen texts (part of every prompt version: changing one changes every prompt hash). The default
# texts of noul's two options belong to the prompt version (decider.engine.model.prompt.PROMPT_FORMATS).
DEFAULT_INSTRUCTIONS: dict[str, str] = {
    "noul": "Decide which of the two options is true.",
    "choice": "Choose the option that best applies.",
    "score": "Choose the level that best applies.",
}

QUESTION_FIELDS = frozenset({"type", "instructions", "criteria"})
_DEFAULT_LIMITS = {
    name: Settings.model_fields[name].default
    for name in ("max_questions", "max_options", "max_permutations", "max_batch_states")
}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Option(_Frozen):
    """One answer option as shown to the model: `key` is what the answer reports.

    `description` None: the prompt version's default text (a noul side the caller left out)."""

    key: str
    description: JSONContent | None


class Question(_Frozen):
    key: str
    type: QuestionType
    instructions: JSONContent = Field(
        description="Caller's instructions, or the frozen default for the type."
    )
    options: tuple[Option, ...]


class DecisionOptions(_Frozen):
    """What a decision request asks besides its state(s): the questions and the optional fields."""

    model: str | None = None
    questions: tuple[Question, ...]
    extensions: bool = False
    permutations: int = 1
    mode: Literal["shared", "fresh"] | None = None


class DecisionRequest(DecisionOptions):
    """`POST /v1/systemone`: one state."""

    state: JSONContent


class BatchDecisionRequest(DecisionOptions):
    """`POST /v1/systemone/batch`: many states, the same questions for each."""

    states: tuple[JSONContent, ...]

    def for_state(self, index: int) -> DecisionRequest:
        fields = self.model_dump(exclude={"states"})
        return DecisionRequest(**fields, state=self.states[index])


# --- answers ------------------------------------------------------------------------------------
class NoulAnswer(_Frozen):
    type: Literal["noul"] = "noul"
    noul: float
    extensions: dict[str, Any] | None = None


class ChoiceAnswer(_Frozen):
    type: Literal["choice"] = "choice"
    choice: str
    probabilities: dict[str, float]
    confidence: float
    extensions: dict[str, Any] | None = None


class ScoreAnswer(_Frozen):
    type: Literal["score"] = "score"
    score: float
    legend: dict[str, JSONContent]
    probabilities: dict[str, float]
    confidence: float
    extensions: dict[str, Any] | None = None


Answer = NoulAnswer | ChoiceAnswer | ScoreAnswer


class Usage(_Frozen):
    input_tokens: int
    output_tokens: int = 0
    # Of input_tokens, those read from what earlier requests left (kept states, exact repeats), not
    # decoded again. Not part of the Jev body (strict clients): it is reported in `extensions`, and
    # as `input_tokens_details.cached_tokens` on /v1/decisions.
    cached_tokens: int = Field(0, exclude=True)


def _without_empty_extensions(body: dict[str, Any]) -> dict[str, Any]:
    for answer in body["answers"].values():
        if answer.get("extensions") is None:
            answer.pop("extensions", None)
    if body.get("extensions") is None:
        body.pop("extensions", None)
    return body


class DecisionResponse(_Frozen):
    model: str
    answers: dict[str, Answer]
    usage: Usage
    extensions: dict[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        """JSON-ready body. Without extensions it matches strict Jev clients (floats stay floats)."""
        return _without_empty_extensions(self.model_dump(mode="json"))


class BatchDecisionResponse(_Frozen):
    results: tuple[DecisionResponse, ...]
    usage: Usage

    def to_wire(self) -> dict[str, Any]:
        return {
            "results": [result.to_wire() for result in self.results],
            "usage": self.usage.model_dump(mode="json"),
        }


# --- parsing ------------------------------------------------------------------------------------
class _DuplicateKeyDict(dict):
    """A JSON object in which some key appeared more than once (the last value kept, as json does)."""

    duplicate_keys: list[str]


def _object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    duplicates: list[str] = []
    for key, value in pairs:
        if key in result:
            duplicates.append(key)
        result[key] = value
    if duplicates:
        marked = _DuplicateKeyDict(result)
        marked.duplicate_keys = duplicates
        return marked
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads_strict(body: bytes | str) -> Any:
    """`json.loads` refusing NaN/Infinity and marking objects with duplicate keys (refused later)."""
    return json.loads(body, object_pairs_hook=_object_pairs, parse_constant=_reject_constant)


def parse_decision_request_bytes(body: bytes | str, **limits: int) -> DecisionRequest:
    """Parse a raw body: also rejects duplicate keys and NaN/Infinity, which `json.loads` would accept."""
    try:
        obj = loads_strict(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"The body is not valid JSON: {exc}", code="invalid_json", param=None) from exc
    return parse_decision_request(obj, **limits)


def _duplicates(value: Any) -> list[str]:
    return list(getattr(value, "duplicate_keys", []))


def _check_json(value: Any, *, code: str, param: str, depth: int = 0) -> None:
    """Finite, JSON-representable, no duplicate keys (recursively)."""
    if depth > 64:
        raise RequestError("The value is nested too deeply (more than 64 levels).", code=code, param=param)
    if isinstance(value, str):
        _check_unicode(value, code=code, param=param)
        return
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RequestError(
                f"{value!r} is not a JSON number (NaN and Infinity are not allowed).", code=code, param=param
            )
        return
    if isinstance(value, dict):
        if dupes := _duplicates(value):
            raise RequestError(f"Duplicate key {dupes[0]!r} in an object.", code=code, param=param)
        for key, item in value.items():
            if not isinstance(key, str):
                raise RequestError("Object keys must be strings.", code=code, param=param)
            _check_unicode(key, code=code, param=param)
            _check_json(item, code=code, param=param, depth=depth + 1)
        return
    if isinstance(value, list):
        for item in value:
            _check_json(item, code=code, param=param, depth=depth + 1)
        return
    raise RequestError(f"A value of type {type(value).__name__} is not JSON.", code=code, param=param)


def _check_unicode(text: str, *, code: str, param: str | None) -> None:
    """JSON can carry unpaired surrogates (`"\\ud800"`); they are not text and cannot be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            "The text contains an unpaired surrogate code point.", code=code, param=param
        ) from exc


def _content(value: Any, *, param: str, what: str, empty_code: str = "empty_text") -> JSONContent:
    """A text, object or array that must not be empty."""
    if isinstance(value, str):
        if not value.strip():
            raise RequestError(f"{what} is empty.", code=empty_code, param=param)
        _check_unicode(value, code="invalid_text", param=param)
        return value
    if isinstance(value, dict | list):
        if not value:
            raise RequestError(
                f"{what} is an empty {'object' if isinstance(value, dict) else 'array'}.",
                code=empty_code,
                param=param,
            )
        _check_json(value, code="invalid_text", param=param)
        return value
    raise RequestError(
        f"{what} must be a string, an object or an array, not {json_kind(value)}.",
        code="invalid_text",
        param=param,
    )


def json_kind(value: Any) -> str:
    """How a JSON value is named in an error message ("a string", "null", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _state(state: Any, param: str = "state") -> JSONContent:
    if not isinstance(state, str | dict | list):
        raise RequestError(
            f"`{param}` must be a non-empty string, object or array, not {json_kind(state)}.",
            code="invalid_state",
            param=param,
        )
    if (isinstance(state, str) and not state.strip()) or not state:
        raise RequestError(f"`{param}` is empty.", code="invalid_state", param=param)
    _check_json(state, code="invalid_state", param=param)
    return state


def _options(key: str, qtype: str, raw: dict[str, Any], max_options: int) -> tuple[Option, ...]:
    param = f"questions.{key}.criteria"
    present = "criteria" in raw
    criteria = raw.get("criteria")
    if qtype == "noul":
        if criteria is None:
            criteria = {}
        if not isinstance(criteria, dict):
            raise RequestError(
                'Noul `criteria` must be an object {"true": text, "false": text} or null.',
                code="invalid_criteria",
                param=param,
            )
        if dupes := _duplicates(criteria):
            raise RequestError(
                f"Duplicate key {dupes[0]!r} in noul criteria.", code="duplicate_option", param=param
            )
        extra = sorted(set(criteria) - {"true", "false"})
        if extra:
            raise RequestError(
                f"Noul criteria accept only `true` and `false`, not {extra[0]!r}.",
                code="invalid_criteria",
                param=f"{param}.{extra[0]}",
            )
        sides = []
        for side in ("true", "false"):
            value = criteria.get(side)
            text = (
                None
                if value is None
                else _content(value, param=f"{param}.{side}", what=f"Noul `{side}` text")
            )
            sides.append(Option(key=side, description=text))
        return tuple(sides)
    if not present or criteria is None:
        raise RequestError(f"A {qtype} question needs `criteria`.", code="missing_field", param=param)
    if qtype == "choice":
        if not isinstance(criteria, dict):
            raise RequestError(
                "Choice `criteria` must be an object {option_key: description or null}.",
                code="invalid_criteria",
                param=param,
            )
        if dupes := _duplicates(criteria):
            raise RequestError(
                f"Option key {dupes[0]!r} appears more than once.",
                code="duplicate_option",
                param=f"{param}.{dupes[0]}",
            )
        items = list(criteria.items())
        labels = "options"
    else:
        if not isinstance(criteria, list):
            raise RequestError(
                "Score `criteria` must be an array of level texts, low to high.",
                code="invalid_criteria",
                param=param,
            )
        items = [(str(i), level) for i, level in enumerate(criteria)]
        labels = "levels"
    if not items:
        raise RequestError(
            f"A {qtype} question needs at least one option in `criteria`.",
            code="invalid_criteria",
            param=param,
        )
    if len(items) > max_options:
        raise RequestError(
            f"The question has {len(items)} {labels}; at most {max_options} are supported.",
            code="option_count_unsupported",
            param=param,
        )
    options = []
    for option_key, value in items:
        option_param = f"{param}.{option_key}"
        if qtype == "choice":
            if not option_key.strip():
                raise RequestError("An option key is empty.", code="empty_text", param=option_param)
            _check_unicode(option_key, code="invalid_text", param=option_param)
            if value is None or (isinstance(value, str) and not value.strip()):
                value = option_key
        elif value is None:
            raise RequestError("A score level is null.", code="invalid_criteria", param=option_param)
        options.append(
            Option(key=option_key, description=_content(value, param=option_param, what="The option text"))
        )
    return tuple(options)


def _question(key: str, raw: Any, max_options: int) -> Question:
    param = f"questions.{key}"
    if not key.strip():
        raise RequestError("A question key is empty.", code="invalid_question", param=param)
    if not isinstance(raw, dict):
        raise RequestError(
            f"Each question must be an object, not {json_kind(raw)}.", code="invalid_question", param=param
        )
    if dupes := _duplicates(raw):
        raise RequestError(
            f"Field {dupes[0]!r} appears more than once.", code="invalid_question", param=param
        )
    extra = sorted(set(raw) - QUESTION_FIELDS)
    if extra:
        raise RequestError(
            f"Unknown field {extra[0]!r}; a question has `type`, `instructions` and `criteria`.",
            code="unknown_field",
            param=f"{param}.{extra[0]}",
        )
    if "type" not in raw:
        raise RequestError("`type` is required.", code="missing_field", param=f"{param}.type")
    qtype = raw["type"]
    if qtype not in QUESTION_TYPES:
        raise RequestError(
            f"`type` must be one of noul, choice, score; got {qtype!r}.",
            code="invalid_question_type",
            param=f"{param}.type",
        )
    instructions = raw.get("instructions")
    if instructions is None:
        instructions = DEFAULT_INSTRUCTIONS[qtype]
    else:
        instructions = _content(instructions, param=f"{param}.instructions", what="`instructions`")
    return Question(
        key=key, type=qtype, instructions=instructions, options=_options(key, qtype, raw, max_options)
    )


def _body_object(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise RequestError(
            f"The body must be a JSON object, not {json_kind(obj)}.", code="invalid_body", param=None
        )
    if dupes := _duplicates(obj):
        raise RequestError(f"Field {dupes[0]!r} appears more than once.", code="invalid_body", param=dupes[0])
    # Unknown top-level fields are ignored (clients add metadata), except image assets: ignoring those
    # would silently answer a different question.
    if "assets" in obj:
        raise RequestError(
            "Image assets are not supported by this text model.", code="unsupported_field", param="assets"
        )
    return obj


def _decision_options(
    obj: dict[str, Any], *, max_questions: int, max_options: int, max_permutations: int
) -> dict[str, Any]:
    """The fields every decision request shares, validated, as DecisionOptions keyword arguments."""
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("`model` must be a string.", code="invalid_model", param="model")
    if "questions" not in obj:
        raise RequestError("`questions` is required.", code="missing_field", param="questions")
    raw_questions = obj["questions"]
    if not isinstance(raw_questions, dict) or not raw_questions:
        raise RequestError(
            "`questions` must be a non-empty object {key: question}.",
            code="invalid_questions",
            param="questions",
        )
    if dupes := _duplicates(raw_questions):
        raise RequestError(
            f"Question key {dupes[0]!r} appears more than once.",
            code="duplicate_question",
            param=f"questions.{dupes[0]}",
        )
    if len(raw_questions) > max_questions:
        raise RequestError(
            f"The request has {len(raw_questions)} questions; at most {max_questions} are allowed.",
            code="too_many_questions",
            param="questions",
        )
    questions = tuple(_question(key, raw, max_options) for key, raw in raw_questions.items())
    extensions = obj.get("extensions", False)
    if extensions is None:
        extensions = False
    if not isinstance(extensions, bool):
        raise RequestError(
            "`extensions` must be true or false.", code="invalid_extensions", param="extensions"
        )
    permutations = obj.get("permutations", 1)
    if permutations is None:
        permutations = 1
    if (
        isinstance(permutations, bool)
        or not isinstance(permutations, int)
        or not 1 <= permutations <= max_permutations
    ):
        raise RequestError(
            f"`permutations` must be an integer from 1 to {max_permutations}.",
            code="invalid_permutations",
            param="permutations",
        )
    mode = obj.get("mode")
    if mode is not None and mode not in ("shared", "fresh"):
        raise RequestError('`mode` must be "shared" or "fresh".', code="invalid_mode", param="mode")
    return {
        "model": model,
        "questions": questions,
        "extensions": extensions,
        "permutations": permutations,
        "mode": mode,
    }


def parse_decision_request(
    obj: Any,
    *,
    max_questions: int = _DEFAULT_LIMITS["max_questions"],
    max_options: int = _DEFAULT_LIMITS["max_options"],
    max_permutations: int = _DEFAULT_LIMITS["max_permutations"],
) -> DecisionRequest:
    """Validate a parsed JSON body. Raises `RequestError(code=…, param=…)` on the first problem."""
    obj = _body_object(obj)
    if "state" not in obj:
        raise RequestError("`state` is required.", code="missing_field", param="state")
    state = _state(obj["state"])
    options = _decision_options(
        obj, max_questions=max_questions, max_options=max_options, max_permutations=max_permutations
    )
    return DecisionRequest(state=state, **options)


def parse_batch_request(
    obj: Any,
    *,
    max_states: int = _DEFAULT_LIMITS["max_batch_states"],
    max_questions: int = _DEFAULT_LIMITS["max_questions"],
    max_options: int = _DEFAULT_LIMITS["max_options"],
    max_permutations: int = _DEFAULT_LIMITS["max_permutations"],
) -> BatchDecisionRequest:
    """Validate a `/v1/systemone/batch` body: `states` (1..max_states) plus the usual fields."""
    obj = _body_object(obj)
    if "states" not in obj:
        raise RequestError("`states` is required.", code="missing_field", param="states")
    raw_states = obj["states"]
    if not isinstance(raw_states, list) or not raw_states:
        raise RequestError(
            "`states` must be a non-empty array of states.", code="invalid_states", param="states"
        )
    if len(raw_states) > max_states:
        raise RequestError(
            f"The request has {len(raw_states)} states; at most {max_states} are allowed "
            "(DECIDER_MAX_BATCH_STATES).",
            code="too_many_states",
            param="states",
        )
    states = tuple(_state(state, f"states.{i}") for i, state in enumerate(raw_states))
    options = _decision_options(
        obj, max_questions=max_questions, max_options=max_options, max_permutations=max_permutations
    )
    return BatchDecisionRequest(states=states, **options)
