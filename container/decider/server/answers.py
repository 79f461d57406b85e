"""Decision answers as wire responses, made from the engine's readouts off the engine thread.

The engine hands back a `DecisionOutcome` (decider.engine.works.decisions): the plan with every prompt's
readouts, and what the answer needs besides. Here, on the handler's worker thread, the readouts
become probabilities (the option orders averaged, the question type's temperature) and the Jev/SemIf
response of decider.schemas.decision; `/v1/decisions` translates that on to OpenAI's shape.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

from decider.engine.model.labels import READOUT_CHAIN
from decider.engine.works.decisions import (
    DecisionOutcome,
    Item,
    Question,
    StatePlan,
    allowed_mass,
    option_scores,
)
from decider.engine.works.readout import (
    CONFIDENCE_FORMULA,
    argmax,
    normalized_peak,
    score_expectation,
    softmax,
)
from decider.schemas.decision import (
    Answer,
    BatchDecisionRequest,
    BatchDecisionResponse,
    ChoiceAnswer,
    DecisionRequest,
    DecisionResponse,
    NoulAnswer,
    ScoreAnswer,
    Usage,
)

if TYPE_CHECKING:
    from decider.engine.engine import DecisionEngine


def decide(
    engine: DecisionEngine, request: DecisionRequest | BatchDecisionRequest
) -> DecisionResponse | BatchDecisionResponse:
    """Answer one request in-process, synchronously (`DecisionEngine.decide`; tests, benchmarks)."""
    return decision_response(engine.decide(request))


def decision_response(outcome: DecisionOutcome) -> DecisionResponse | BatchDecisionResponse:
    """The response to a finished decision (a batch response for a batch request)."""
    plan = outcome.plan
    cached = outcome.cached
    responses = [
        _state_response(outcome, state, cached[i] if i < len(cached) else 0)
        for i, state in enumerate(plan.states)
    ]
    if not plan.batch:
        return responses[0]
    total = sum(response.usage.input_tokens for response in responses)
    reused = sum(response.usage.cached_tokens for response in responses)
    return BatchDecisionResponse(
        results=tuple(responses), usage=Usage(input_tokens=total, output_tokens=0, cached_tokens=reused)
    )


def _state_response(outcome: DecisionOutcome, state: StatePlan, cached: int) -> DecisionResponse:
    plan = outcome.plan
    request = plan.options
    by_question: dict[str, list[Item]] = {}
    for item in state.items:
        by_question.setdefault(item.question.key, []).append(item)
    head = plan.head_tokens
    before = head + len(state.prefix)  # prompt tokens ahead of each item's own
    answers: dict[str, Answer] = {
        q.key: _answer(outcome, q, by_question.get(q.key, []), request.extensions, before)
        for q in request.questions
    }
    if plan.mode == "fresh":
        input_tokens = sum(head + len(state.prefix) + len(item.tokens) for item in state.items)
    else:
        input_tokens = (head + len(state.prefix) if state.items else 0) + sum(
            len(i.tokens) for i in state.items
        )
    extensions = None
    if request.extensions:
        extensions = {
            "mode": plan.mode,
            "model": outcome.model_id,
            "prompt_version": outcome.prompt_version,
            "permutations": request.permutations,
            "prefix_boundary": "state" if state.prompt.canonical else "common-prefix",
            "head_tokens": head,
            "prefix_tokens": (head + len(state.prefix)) if plan.mode == "shared" else 0,
            "suffix_tokens": sum(len(item.tokens) for item in state.items),
            "branches": len(state.items),
            "cached_tokens": cached,
            **outcome.stats,
        }
    return DecisionResponse(
        model=outcome.model_id,
        answers=answers,
        usage=Usage(input_tokens=input_tokens, output_tokens=0, cached_tokens=cached),
        extensions=extensions,
    )


def _answer(
    outcome: DecisionOutcome, question: Question, items: list[Item], with_extensions: bool, before: int
) -> Answer:
    keys = [option.key for option in question.options]
    temperature = outcome.temperatures[question.key]
    if not items:  # a single candidate: certain, without running the model
        scores, probs = [0.0] * len(keys), [1.0] * len(keys)
    else:
        scores = option_scores(items)
        probs = softmax(scores, temperature)
    extensions = None
    if with_extensions:
        extensions = _answer_extensions(outcome, question, items, keys, scores, temperature, before)
    if question.type == "noul":
        return NoulAnswer(noul=probs[0], extensions=extensions)
    probabilities = dict(zip(keys, probs, strict=True))
    if question.type == "choice":
        return ChoiceAnswer(
            choice=keys[argmax(probs)],
            probabilities=probabilities,
            confidence=normalized_peak(probs),
            extensions=extensions,
        )
    return ScoreAnswer(
        score=score_expectation(probs),
        legend={o.key: o.description for o in question.options},
        probabilities=probabilities,
        confidence=normalized_peak(probs),
        extensions=extensions,
    )


def _answer_extensions(
    outcome: DecisionOutcome,
    question: Question,
    items: list[Item],
    keys: list[str],
    scores: list[float],
    temperature: float,
    before: int,
) -> dict[str, Any]:
    if not items:
        return {"readout": "single-candidate", "temperature": temperature, "input_tokens": 0}
    first = items[0]
    root = first.outputs[()]
    argmax_id = root.argmax if root.argmax is not None else -1
    readout = first.readout
    extensions: dict[str, Any] = {
        "readout": readout,
        "option_ids": [
            list(label.tokens) if len(label.tokens) > 1 else label.tokens[0] for label in first.labels
        ],
        "option_labels": [label.text for label in first.labels],
        ("option_logprobs" if readout == READOUT_CHAIN else "option_logits"): dict(
            zip(keys, scores, strict=True)
        ),
        "allowed_token_mass": float(np.mean([allowed_mass(item) for item in items])),
        "prompt_sha256": hashlib.sha256((first.text or "").encode("utf-8")).hexdigest(),
        "prompt_version": outcome.prompt_version,
        "input_tokens": before + len(first.tokens),
        "temperature": temperature,
        "full_vocab_argmax_id": argmax_id,
        "full_vocab_argmax_text": outcome.piece(argmax_id).decode("utf-8", errors="replace")
        if argmax_id >= 0
        else "",
        "permutations": [list(item.order) for item in items],
    }
    if question.type != "noul":
        extensions["confidence_formula"] = CONFIDENCE_FORMULA
    return extensions
