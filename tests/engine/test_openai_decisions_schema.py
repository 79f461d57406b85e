"""`/v1/decisions` (OpenAI's Decisions API): validation, translation to the internal request, and the
response parsed by the openai SDK's own `Decision` model. No model needed."""

from __future__ import annotations

import json

import pytest
from openai.types import Decision

from decider.errors import RequestError
from decider.schemas.decision import (
    ChoiceAnswer,
    DecisionResponse,
    NoulAnswer,
    ScoreAnswer,
    Usage,
    loads_strict,
    parse_decision_request,
)
from decider.schemas.openai_decisions import parse_openai_decision_request

LIMITS = {"max_questions": 64, "max_options": 64, "max_permutations": 8}
QUESTIONS = [
    {"type": "predicate", "name": "refund", "instructions": "Does the customer ask for a refund?"},
    {
        "type": "choice",
        "name": "team",
        "instructions": "Which team?",
        "choices": [{"value": "billing", "description": "Payments and refunds"}, {"value": "sales"}],
    },
    {"type": "score", "instructions": "How upset?", "levels": [{"label": "calm"}, {"label": "furious"}]},
]
SYSTEMONE = {
    "state": "I was charged twice.",
    "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "team": {
            "type": "choice",
            "instructions": "Which team?",
            "criteria": {"billing": "Payments and refunds", "sales": None},
        },
        "anger": {"type": "score", "instructions": "How upset?", "criteria": ["calm", "furious"]},
    },
}


def parse(body, **limits):
    return parse_openai_decision_request(loads_strict(json.dumps(body)), **{**LIMITS, **limits})


def refused(body, **limits) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(body, **limits)
    return info.value


def shown(request):
    """What the model sees of each question: type, instructions and option texts in order."""
    return [(q.type, q.instructions, [o.description for o in q.options]) for q in request.questions]


def test_the_same_question_gives_the_same_prompt_as_systemone():
    openai_request = parse(
        {"input": SYSTEMONE["state"], "model": "gpt-6-luna", "questions": QUESTIONS}
    ).request
    jev_request = parse_decision_request(SYSTEMONE)
    assert openai_request.state == jev_request.state
    assert shown(openai_request) == shown(jev_request)


def test_choice_values_are_typed_and_booleans_show_as_text():
    plan = parse(
        {
            "input": "x",
            "questions": [
                {
                    "type": "choice",
                    "instructions": "?",
                    "choices": [{"value": True}, {"value": "true"}, {"value": False, "description": "No"}],
                }
            ],
        }
    )
    assert plan.questions[0].values == (True, "true", False)
    assert shown(plan.request)[0][2] == ["true", "true", "No"]
    with pytest.raises(RequestError) as info:
        parse({"input": "x", "questions": [{**QUESTIONS[1], "choices": [{"value": True}, {"value": True}]}]})
    assert (info.value.code, info.value.param) == ("duplicate_option", "questions.0.choices.1")


def test_input_items_become_a_json_state_in_order():
    items = [
        {"type": "message", "role": "developer", "content": "Be strict."},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_json", "data": {"a": 1}}],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "Calling."}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"id": 7}'},
        {"type": "function_call_output", "call_id": "c1", "output": "found"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "sql", "input": "select 1", "namespace": "db"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "1"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
    ]
    state = parse({"input": items, "questions": QUESTIONS[:1]}).request.state
    assert state == [
        {"role": "developer", "content": "Be strict."},
        {"role": "user", "content": ["Hi", {"a": 1}]},
        {"role": "assistant", "content": "Calling."},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"id": 7}'},
        {"type": "function_call_output", "call_id": "c1", "output": "found"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "sql", "namespace": "db", "input": "select 1"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "1"},
        {"role": "assistant", "content": [{"refusal": "No."}]},
    ]


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"questions": QUESTIONS}, "missing_field", "input"),
        ({"input": "", "questions": QUESTIONS}, "invalid_input", "input"),
        ({"input": [], "questions": QUESTIONS}, "invalid_input", "input"),
        ({"input": "x"}, "missing_field", "questions"),
        ({"input": "x", "questions": []}, "invalid_questions", "questions"),
        (
            {"input": "x", "questions": [{"type": "box", "instructions": "?"}]},
            "invalid_question_type",
            "questions.0.type",
        ),
        ({"input": "x", "questions": [{"type": "predicate"}]}, "missing_field", "questions.0.instructions"),
        (
            {"input": "x", "questions": [{"type": "predicate", "instructions": "?", "weight": 2}]},
            "unknown_field",
            "questions.0.weight",
        ),
        (
            {"input": "x", "questions": [{**QUESTIONS[1], "choices": [{"value": "a"}]}]},
            "invalid_choices",
            "questions.0.choices",
        ),
        (
            {"input": "x", "questions": [{**QUESTIONS[1], "choices": [{"value": 1}, {"value": "b"}]}]},
            "invalid_parameter",
            "questions.0.choices.0.value",
        ),
        (
            {"input": "x", "questions": [{**QUESTIONS[1], "choices": [{"value": ""}, {"value": "b"}]}]},
            "empty_text",
            "questions.0.choices.0.value",
        ),
        (
            {"input": "x", "questions": [{**QUESTIONS[2], "levels": [{"label": " "}]}]},
            "empty_text",
            "questions.0.levels.0.label",
        ),
        (
            {
                "input": "x",
                "questions": [{**QUESTIONS[1], "choices": [{"value": str(i)} for i in range(256)]}],
            },
            "option_count_unsupported",
            "questions.0.choices",
        ),
        (
            {"input": "x", "questions": [{"type": "predicate", "instructions": "   "}]},
            "empty_text",
            "questions.0.instructions",
        ),
        ({"input": "x", "questions": QUESTIONS, "permutations": 99}, "invalid_permutations", "permutations"),
        (
            {"input": "x", "questions": QUESTIONS, "safety_identifier": 5},
            "invalid_parameter",
            "safety_identifier",
        ),
        (
            {"input": [{"role": "tool", "content": "x"}], "questions": QUESTIONS},
            "invalid_input",
            "input.0.role",
        ),
        (
            {
                "input": [{"role": "system", "content": [{"type": "output_text", "text": "x"}]}],
                "questions": QUESTIONS,
            },
            "invalid_parameter",
            "input.0.content.0.type",
        ),
        (
            {
                "input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}],
                "questions": QUESTIONS,
            },
            "unmatched_call_id",
            "input.0.call_id",
        ),
        (
            {"input": [{"type": "reasoning", "summary": []}], "questions": QUESTIONS},
            "invalid_input",
            "input.0.type",
        ),
        ({"input": {"a": 1}, "questions": QUESTIONS}, "invalid_input", "input"),
    ],
)
def test_bad_requests_name_the_openai_field(body, code, param):
    error = refused(body)
    assert (error.code, error.param) == (code, param), error.message
    detail = error.to_wire()["detail"]
    assert detail[0]["loc"] == ["body", *[int(p) if p.isdigit() else p for p in param.split(".")]]


@pytest.mark.parametrize(
    "body",
    [
        {"input": [{"type": ["message"], "role": "user", "content": "x"}], "questions": QUESTIONS},
        {"input": [{"role": {"r": 1}, "content": "x"}], "questions": QUESTIONS},
        {"input": [{"role": "user", "content": [{"type": {}, "text": "x"}]}], "questions": QUESTIONS},
        {"input": "x", "questions": [{"type": ["predicate"], "instructions": "?"}]},
        {
            "input": "x",
            "questions": [{"type": "choice", "instructions": "?", "choices": [{"value": ["a"]}] * 2}],
        },
    ],
)
def test_unhashable_discriminators_are_a_422_not_a_crash(body):
    assert refused(body).status == 422


def test_repeated_keys_and_bad_json_inside_input_are_refused():
    raw = '{"input": "x", "questions": [{"type": "predicate", "instructions": "a", "instructions": "b"}]}'
    with pytest.raises(RequestError) as info:
        parse_openai_decision_request(loads_strict(raw), **LIMITS)
    assert (info.value.code, info.value.param) == ("invalid_parameter", "questions.0")
    raw = '{"input": [{"role": "user", "content": [{"type": "input_json", "data": {"k": 1, "k": 2}}]}],'
    raw += ' "questions": [{"type": "predicate", "instructions": "?"}]}'
    with pytest.raises(RequestError) as info:
        parse_openai_decision_request(loads_strict(raw), **LIMITS)
    assert (info.value.code, info.value.param) == ("invalid_state", "input")


@pytest.mark.parametrize(
    "body",
    [
        {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}],
                }
            ]
        },
        {
            "input": [
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c",
                    "output": [{"type": "input_image", "image_url": "x"}],
                },
            ]
        },
        {
            "input": "x",
            "questions": [{"type": "predicate", "instructions": [{"type": "input_image", "image_url": "x"}]}],
        },
    ],
)
def test_images_are_refused_clearly(body):
    error = refused({"questions": QUESTIONS, **body})
    assert error.code == "image_not_supported" and error.status == 422 and "text model" in error.message


def test_question_limits_openai_400_and_the_server_setting():
    many = [QUESTIONS[0]] * 401
    error = refused({"input": "x", "questions": many}, max_questions=1024)
    assert error.code == "too_many_questions" and "at most 400" in error.message
    error = refused({"input": "x", "questions": many[:65]})
    assert error.code == "too_many_questions" and "DECIDER_MAX_QUESTIONS" in error.message


def test_more_options_than_the_server_supports_points_at_the_choices():
    choices = [{"value": f"v{i}"} for i in range(65)]  # 2–255 is valid shape; 64 is the server limit here
    error = refused({"input": "x", "questions": [QUESTIONS[0], {**QUESTIONS[1], "choices": choices}]})
    assert (error.code, error.param) == ("option_count_unsupported", "questions.1.choices")


def test_engine_errors_are_relocated_to_openai_fields():
    plan = parse({"input": "x", "questions": QUESTIONS})
    for internal, expected in [
        ("state", "input"),
        ("questions.1.criteria", "questions.1.choices"),
        ("questions.1.criteria.0", "questions.1.choices.0.description"),
        ("questions.1.criteria.1", "questions.1.choices.1.value"),
        ("questions.2.criteria.1", "questions.2.levels.1.label"),
        ("questions.0", "questions.0"),
        ("permutations", "permutations"),
    ]:
        error = plan.relocate(RequestError("m", code="c", param=internal))
        assert error.param == expected


def test_the_response_parses_as_the_openai_sdk_decision():
    plan = parse(
        {
            "input": "x",
            "questions": [*QUESTIONS, {**QUESTIONS[1], "choices": [{"value": True}, {"value": "true"}]}],
        }
    )
    internal = DecisionResponse(
        model="m@0+Q4",
        answers={
            "0": NoulAnswer(noul=0.25),
            "1": ChoiceAnswer(choice="1", probabilities={"0": 0.4, "1": 0.6}, confidence=0.2),
            "2": ScoreAnswer(
                score=0.9,
                legend={"0": "calm", "1": "furious"},
                probabilities={"0": 0.1, "1": 0.9},
                confidence=0.8,
            ),
            "3": ChoiceAnswer(choice="0", probabilities={"0": 0.7, "1": 0.3}, confidence=0.4),
        },
        usage=Usage(input_tokens=42),
    )
    body = plan.response(internal)
    decision = Decision.model_validate(body)
    predicate, choice, score, typed = decision.answers
    assert (predicate.type, predicate.name, predicate.probability) == ("predicate", "refund", 0.25)
    assert choice.choice == "sales" and [p.value for p in choice.probabilities] == ["billing", "sales"]
    assert score.name is None and [(p.value, p.label) for p in score.probabilities] == [
        (0, "calm"),
        (1, "furious"),
    ]
    assert typed.choice is True and [p.value for p in typed.probabilities] == [True, "true"]
    assert (
        decision.usage.total_tokens == decision.usage.input_tokens == 42 and decision.usage.output_tokens == 0
    )
    assert decision.usage.input_tokens_details.cached_tokens == 0
    assert decision.usage.output_tokens_details.reasoning_tokens == 0
    assert json.loads(json.dumps(body))["answers"][3]["choice"] is True
