"""Decision request validation and response serialization: no model needed."""

import json
import math

import pytest
from engine_helpers import EXAMPLE
from typesafe_sdk import Choice, Noul, Score
from typesafe_sdk._core.json import serialize
from typesafe_sdk._core.questions import normalize_questions
from typesafe_sdk._core.response_types import SystemOneResponse

from decider.errors import RequestError
from decider.schemas.decision import (
    ChoiceAnswer,
    DecisionResponse,
    NoulAnswer,
    ScoreAnswer,
    Usage,
    parse_decision_request,
    parse_decision_request_bytes,
)


def with_question(question, key="q", **top):
    return {"state": "Some evidence.", "questions": {key: question}, **top}


def test_example_parses_in_order_with_defaults():
    req = parse_decision_request(EXAMPLE)
    assert [q.key for q in req.questions] == ["team", "anger", "refund"]
    team, anger, refund = req.questions
    assert [(o.key, o.description) for o in team.options] == [
        ("billing", "Payments, refunds"),
        ("technical", "Bugs, outages"),
        ("sales", "sales"),
    ]
    assert [o.key for o in anger.options] == ["0", "1", "2"]
    assert [o.description for o in refund.options] == [None, None]  # the prompt version's defaults
    assert req.permutations == 1 and req.extensions is False and req.mode is None


def test_structured_state_keeps_key_order_and_noul_sides_default_independently():
    req = parse_decision_request(
        {
            "state": {"z": 1, "a": [1, 2]},
            "questions": {
                "q": {
                    "type": "noul",
                    "instructions": {"task": "x"},
                    "criteria": {"true": "Yes it is", "false": None},
                }
            },
        }
    )
    assert list(req.state) == ["z", "a"]
    assert [o.description for o in req.questions[0].options] == ["Yes it is", None]
    assert req.questions[0].instructions == {"task": "x"}


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ([], "invalid_body", None),
        ({"questions": {"q": {"type": "noul"}}}, "missing_field", "state"),
        ({"state": "", "questions": {"q": {"type": "noul"}}}, "invalid_state", "state"),
        ({"state": "  ", "questions": {"q": {"type": "noul"}}}, "invalid_state", "state"),
        ({"state": 3, "questions": {"q": {"type": "noul"}}}, "invalid_state", "state"),
        ({"state": {}, "questions": {"q": {"type": "noul"}}}, "invalid_state", "state"),
        ({"state": {"x": math.nan}, "questions": {"q": {"type": "noul"}}}, "invalid_state", "state"),
        ({"state": [{1, 2}], "questions": {"q": {"type": "noul"}}}, "invalid_state", "state"),
        ({"state": "x"}, "missing_field", "questions"),
        ({"state": "x", "questions": {}}, "invalid_questions", "questions"),
        ({"state": "x", "questions": [{"type": "noul"}]}, "invalid_questions", "questions"),
        (with_question({"type": "box"}), "invalid_question_type", "questions.q.type"),
        (with_question({"instructions": "x"}), "missing_field", "questions.q.type"),
        (with_question("noul"), "invalid_question", "questions.q"),
        (with_question({"type": "noul", "instructions": ""}), "empty_text", "questions.q.instructions"),
        (with_question({"type": "noul", "instructions": []}), "empty_text", "questions.q.instructions"),
        (with_question({"type": "noul", "instructions": 5}), "invalid_text", "questions.q.instructions"),
        (
            with_question({"type": "noul", "instructions": {"a": math.inf}}),
            "invalid_text",
            "questions.q.instructions",
        ),
        (with_question({"type": "noul", "criteria": "yes"}), "invalid_criteria", "questions.q.criteria"),
        (
            with_question({"type": "noul", "criteria": {"maybe": "x"}}),
            "invalid_criteria",
            "questions.q.criteria.maybe",
        ),
        (
            with_question({"type": "noul", "criteria": {"true": ""}}),
            "empty_text",
            "questions.q.criteria.true",
        ),
        (with_question({"type": "choice"}), "missing_field", "questions.q.criteria"),
        (
            with_question({"type": "choice", "criteria": ["a", "b"]}),
            "invalid_criteria",
            "questions.q.criteria",
        ),
        (with_question({"type": "choice", "criteria": {}}), "invalid_criteria", "questions.q.criteria"),
        (
            with_question({"type": "choice", "criteria": {" ": "x", "b": "y"}}),
            "empty_text",
            "questions.q.criteria. ",
        ),
        (
            with_question({"type": "choice", "criteria": {"a": 1, "b": "y"}}),
            "invalid_text",
            "questions.q.criteria.a",
        ),
        (
            with_question({"type": "score", "criteria": {"a": "x"}}),
            "invalid_criteria",
            "questions.q.criteria",
        ),
        (with_question({"type": "score", "criteria": ["low", ""]}), "empty_text", "questions.q.criteria.1"),
        (
            with_question({"type": "score", "criteria": ["low", None]}),
            "invalid_criteria",
            "questions.q.criteria.1",
        ),
        (
            with_question({"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}),
            "option_count_unsupported",
            "questions.q.criteria",
        ),
        (with_question({"type": "noul", "weight": 2}), "unknown_field", "questions.q.weight"),
        (with_question({"type": "noul"}, assets={"a": {}}), "unsupported_field", "assets"),
        (with_question({"type": "noul"}, permutations=0), "invalid_permutations", "permutations"),
        (with_question({"type": "noul"}, permutations=9), "invalid_permutations", "permutations"),
        (with_question({"type": "noul"}, permutations=True), "invalid_permutations", "permutations"),
        (with_question({"type": "noul"}, permutations=2.5), "invalid_permutations", "permutations"),
        # strict as the chat model is (`"n": 1.0` is refused there): an integer is written as one
        (with_question({"type": "noul"}, permutations=2.0), "invalid_permutations", "permutations"),
        (with_question({"type": "noul"}, mode="turbo"), "invalid_mode", "mode"),
        (with_question({"type": "noul"}, extensions="yes"), "invalid_extensions", "extensions"),
        (with_question({"type": "noul"}, model=3), "invalid_model", "model"),
        (with_question({"type": "noul"}, key=" "), "invalid_question", "questions. "),
        ({"state": "bad \ud800", "questions": {"q": {"type": "noul"}}}, "invalid_state", "state"),
        (
            with_question({"type": "noul", "instructions": "x\udfff"}),
            "invalid_text",
            "questions.q.instructions",
        ),
        (
            with_question({"type": "choice", "criteria": {"\ud800": None}}),
            "invalid_text",
            "questions.q.criteria.\ud800",
        ),
        (
            {"state": "x", "questions": {f"q{i}": {"type": "noul"} for i in range(65)}},
            "too_many_questions",
            "questions",
        ),
    ],
)
def test_each_invalid_request_gets_its_code_and_param(body, code, param):
    with pytest.raises(RequestError) as info:
        parse_decision_request(body)
    assert (info.value.code, info.value.param) == (code, param)
    assert info.value.status == 422
    assert info.value.to_wire()["error"]["code"] == code


def test_unknown_top_level_fields_are_ignored():
    req = parse_decision_request(with_question({"type": "noul"}, id="case-1", metadata={"a": 1}))
    assert req.questions[0].key == "q"


def test_limits_can_be_passed_explicitly():
    body = with_question({"type": "choice", "criteria": {"a": None, "b": None, "c": None}})
    with pytest.raises(RequestError) as info:
        parse_decision_request(body, max_options=2)
    assert info.value.code == "option_count_unsupported"
    assert parse_decision_request(body, max_options=3).questions[0].options[2].key == "c"


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        (
            b'{"state": "x", "questions": {"q": {"type": "choice", "criteria": {"a": "1", "a": "2"}}}}',
            "duplicate_option",
            "questions.q.criteria.a",
        ),
        (
            b'{"state": "x", "questions": {"q": {"type": "noul"}, "q": {"type": "noul"}}}',
            "duplicate_question",
            "questions.q",
        ),
        (b'{"state": {"k": 1, "k": 2}, "questions": {"q": {"type": "noul"}}}', "invalid_state", "state"),
        (b'{"state": {"k": NaN}, "questions": {"q": {"type": "noul"}}}', "invalid_json", None),
        (
            b'{"state": "x", "questions": {"q": {"type": "noul", "instructions": Infinity}}}',
            "invalid_json",
            None,
        ),
        (b'{"state": "x", ', "invalid_json", None),
        (b"\xff\xfe", "invalid_json", None),
    ],
)
def test_raw_body_parsing_catches_what_json_loads_hides(raw, code, param):
    with pytest.raises(RequestError) as info:
        parse_decision_request_bytes(raw)
    assert (info.value.code, info.value.param) == (code, param)


def test_what_the_typesafe_sdk_sends_is_accepted():
    questions = {
        "spam": Noul(instructions="Is this spam?"),
        "spam2": Noul(criteria={"true": "Unsolicited advertising"}),
        "tone": Choice(criteria={"angry": "Upset", "calm": None}),
        "urgency": Score(instructions={"task": "rate"}, criteria=["Can wait", {"level": "today"}]),
    }
    body = {
        "state": {"message": "Buy now!"},
        "model": "jev-latest",
        "questions": normalize_questions(questions),
    }
    req = parse_decision_request_bytes(serialize(body))
    assert [q.type for q in req.questions] == ["noul", "noul", "choice", "score"]
    assert req.questions[1].options[0].description == "Unsolicited advertising"
    assert req.questions[2].options[1].description == "calm"


def test_response_wire_form_is_strict_sdk_safe():
    response = DecisionResponse(
        model="m@0123456789ab+Q4_1",
        answers={
            "n": NoulAnswer(noul=1),
            "c": ChoiceAnswer(choice="a", probabilities={"a": 1, "b": 0}, confidence=1),
            "s": ScoreAnswer(
                score=0, legend={"0": "low", "1": {"x": 1}}, probabilities={"0": 1, "1": 0}, confidence=1
            ),
        },
        usage=Usage(input_tokens=12),
    )
    wire = response.to_wire()
    text = json.dumps(wire)
    assert '"noul": 1.0' in text and '"score": 0.0' in text and '"1": 0.0' in text
    assert "extensions" not in text
    assert wire["usage"] == {"input_tokens": 12, "output_tokens": 0}
    parsed = SystemOneResponse.model_validate_json(text)
    assert parsed.scores["s"].probabilities == {0: 1.0, 1: 0.0}
    assert parsed.choices["c"].choice == "a"
