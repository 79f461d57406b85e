"""Decision requests as plans of prompts to read, and plans read back as typed answers.

`DecisionPlanner.plan` runs before admission (on a worker thread, never on the engine thread): it
serializes and tokenizes each state once and each question's tail once per option order, checks
every limit that needs the tokenizer, and counts the tokens the request will cost. The scheduler's
`DecisionWork` then fills each item's readouts, and `DecisionPlanner.respond` turns them into the
response with the pure functions of `readout`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from decider.engine.cost import Cost, span_attended
from decider.engine.labels import READOUT_CHAIN, Label, LabelTable, LabelTrie
from decider.engine.native import RowOutput
from decider.engine.prompt import PromptBuilder, StatePrompt
from decider.engine.readout import (
    CONFIDENCE_FORMULA,
    align_to_options,
    allowed_token_mass,
    argmax,
    average_logits,
    logsumexp,
    normalized_peak,
    option_orders,
    score_expectation,
    softmax,
)
from decider.errors import RequestError
from decider.schemas.decision import (
    Answer,
    BatchDecisionRequest,
    BatchDecisionResponse,
    ChoiceAnswer,
    DecisionOptions,
    DecisionRequest,
    DecisionResponse,
    NoulAnswer,
    Question,
    ScoreAnswer,
    Usage,
)
from decider.settings import Settings

PERMUTATION_SEED = 20240601  # frozen: the same request always sees the same option orders
Mode = Literal["shared", "fresh"]
Prefix = tuple[int, ...]


@dataclass(eq=False)
class Item:
    """One prompt to read: a question shown in one option order.

    `tokens` follow the state's shared prefix. `outputs[prefix]` is the readout after the prompt
    plus that many label tokens (the empty prefix: at the prompt's last position).
    """

    question: Question
    order: tuple[int, ...]
    labels: tuple[Label, ...]
    trie: LabelTrie
    tokens: list[int]
    text: str | None = None  # the exact prompt text, kept only when extensions are on
    outputs: dict[Prefix, RowOutput] = field(default_factory=dict, repr=False)

    @property
    def readout(self) -> str:
        return LabelTable.readout_for(self.labels)


@dataclass(eq=False)
class StatePlan:
    """One state of a request and every item read on it."""

    index: int
    prompt: StatePrompt
    prefix: list[int]  # tokens after the head, shared by every item of this state
    items: list[Item]


@dataclass(eq=False)
class DecisionPlan:
    options: DecisionOptions
    states: list[StatePlan]
    mode: Mode
    head_tokens: int
    batch: bool = False

    @property
    def cost_tokens(self) -> int:
        """Tokens the engine will decode for this request (shared mode: the cached head excluded;
        fresh mode: every branch decodes it again)."""
        return sum(_state_cost(state, state.items, self.mode, self.head_tokens) for state in self.states)

    @property
    def cost(self) -> Cost:
        """What the engine does for this request: decodes (at least the prefix, the branches and the
        label positions), tokens, attended positions."""
        return self.cost_given()

    def cost_given(self, cached: Sequence[int] = (), repeated: Sequence[Collection[int]] = ()) -> Cost:
        """`cost` less what the caches hold: state i's first `cached[i]` prefix tokens kept, and its
        items whose index is in `repeated[i]` answered from exact repeats (admission's estimate)."""
        tokens, attended = 0, 0.0
        for index, state in enumerate(self.states):
            kept = cached[index] if index < len(cached) else 0
            skip = repeated[index] if index < len(repeated) else ()
            items = [item for number, item in enumerate(state.items) if number not in skip]
            tokens += _state_cost(state, items, self.mode, self.head_tokens, kept)
            attended += _state_attention(state, items, self.mode, self.head_tokens, kept)
        return Cost(3 if tokens else 0, tokens, attended)


def _state_attention(
    state: StatePlan, items: Sequence[Item], mode: Mode, head: int, cached: int = 0
) -> float:
    """Attended positions of one state's decodes: its prefix after the head (less the `cached`
    tokens a kept state holds), then each of `items`' branches (fresh mode: each branch's whole
    prompt), label positions included."""
    attended = 0.0
    base = head + len(state.prefix)
    if mode == "shared" and items:
        attended += span_attended(head + cached, len(state.prefix) - cached)
    for item in items:
        tail = len(item.tokens) + len(item.trie.nodes) - 1
        attended += span_attended(0, base + tail) if mode == "fresh" else span_attended(base, tail)
    return attended


def _state_cost(state: StatePlan, items: Sequence[Item], mode: Mode, head: int, cached: int = 0) -> int:
    positions = sum(len(item.trie.nodes) - 1 for item in items)
    tails = sum(len(item.tokens) for item in items)
    if mode == "fresh":
        return len(items) * (head + len(state.prefix)) + tails + positions
    return (len(state.prefix) - cached if items else 0) + tails + positions


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Longest common token prefix, capped so every sequence keeps at least one token to decode."""
    if not sequences:
        return 0
    limit = min(len(seq) for seq in sequences) - 1
    # Every sequence lies between the lexicographic min and max, so it shares their common prefix.
    low, high = min(sequences), max(sequences)
    length = 0
    while length < limit and low[length] == high[length]:
        length += 1
    return length


class DecisionPlanner:
    """Plans and answers decisions for one loaded model (thread-safe: it only reads)."""

    def __init__(
        self,
        settings: Settings,
        builder: PromptBuilder,
        labels: LabelTable,
        *,
        n_ctx: int,
        max_token_bytes: int,
        piece: Callable[[int], bytes],
        model_id: str,
    ) -> None:
        self.settings = settings
        self.builder = builder
        self.labels = labels
        self.n_ctx = n_ctx
        self.max_token_bytes = max(1, max_token_bytes)
        self._piece = piece
        self.model_id = model_id

    @property
    def room(self) -> int:
        """Cells running work may use: the context less the cached prompt head and the invariance pad."""
        return self.n_ctx - len(self.builder.head_tokens) - self.settings.batch_policy.reserved_cells

    # --- planning ----------------------------------------------------------------------------------
    def plan(self, request: DecisionRequest) -> DecisionPlan:
        mode = self._mode(request)
        state = self._state_plan(0, request.state, request, mode, param="state")
        return DecisionPlan(request, [state], mode, len(self.builder.head_tokens))

    def plan_batch(self, request: BatchDecisionRequest) -> DecisionPlan:
        mode = self._mode(request)
        states = [
            self._state_plan(i, state, request, mode, param=f"states.{i}")
            for i, state in enumerate(request.states)
        ]
        return DecisionPlan(request, states, mode, len(self.builder.head_tokens), batch=True)

    def _mode(self, request: DecisionOptions) -> Mode:
        self._check_limits(request)
        return request.mode or self.settings.decision_mode

    def _check_limits(self, request: DecisionOptions) -> None:
        if len(request.questions) > self.settings.max_questions:
            raise RequestError(
                f"The request has {len(request.questions)} questions; "
                f"at most {self.settings.max_questions} are allowed.",
                code="too_many_questions",
                param="questions",
            )
        if request.permutations > self.settings.max_permutations:
            raise RequestError(
                f"`permutations` must be at most {self.settings.max_permutations}.",
                code="invalid_permutations",
                param="permutations",
            )
        for question in request.questions:
            if len(question.options) > len(self.labels):
                raise RequestError(
                    f"The question has {len(question.options)} options; this model supports at most "
                    f"{len(self.labels)} (DECIDER_MAX_OPTIONS, and the labels its tokenizer verifies).",
                    code="option_count_unsupported",
                    param=f"questions.{question.key}.criteria",
                )

    def _state_plan(
        self, index: int, state: Any, request: DecisionOptions, mode: Mode, *, param: str
    ) -> StatePlan:
        fmt = self.builder.format
        shown_for = {
            question.key: [
                (order, self.labels.for_count(len(question.options)))
                for order in self._orders(question, request)
            ]
            for question in request.questions
        }

        def shown(
            question: Question, order: tuple[int, ...], labels: Sequence[Label]
        ) -> list[tuple[str, Any]]:
            return [
                (labels[slot].text, self._description(question, index_, fmt))
                for slot, index_ in enumerate(order)
            ]

        probe = next(
            (
                fmt.tail_segment(q.instructions, shown(q, *shown_for[q.key][0]))
                for q in request.questions
                if shown_for[q.key]
            ),
            None,
        )
        state_json = json.dumps(state, ensure_ascii=False)
        self._check_state_bytes(state_json, param)
        prompt = self.builder.for_state(state_json, probe or "")
        if len(prompt.tokens) > self.settings.max_state_tokens:
            raise RequestError(
                f"The state is {len(prompt.tokens)} tokens; at most {self.settings.max_state_tokens} are "
                f"allowed ({self.settings.env_name('max_state_tokens')}). It is never truncated.",
                code="context_length_exceeded",
                param=param,
            )
        items: list[Item] = []
        for question in request.questions:
            for order, labels in shown_for[question.key]:
                options = shown(question, order, labels)
                item = Item(
                    question=question,
                    order=order,
                    labels=tuple(labels),
                    trie=LabelTrie.of(labels),
                    tokens=self.builder.tail(prompt, question.instructions, options),
                    text=self.builder.text(prompt, question.instructions, options)
                    if request.extensions
                    else None,
                )
                items.append(item)
        # The prefix is the state's prompt (or, where the segments tokenize differently together, no
        # canonical cut exists), then every token all the items' tails begin with (` "criterion": "`
        # at least): decoded once, as a prompt cache shares them, where each branch would decode them.
        prefix = list(prompt.tokens) if prompt.canonical else []
        if len(items) > 1 or (items and not prompt.canonical):
            cut = common_prefix_length([item.tokens for item in items])
            prefix += items[0].tokens[:cut]
            for item in items:
                item.tokens = item.tokens[cut:]
        head = len(self.builder.head_tokens)
        for item in items:
            depth = max(len(label.tokens) for label in item.labels)
            needed = head + len(prefix) + len(item.tokens) + depth
            if needed - head > self.room:
                raise RequestError(
                    f"The prompt for question {item.question.key!r} is {needed - depth} tokens; the context "
                    f"holds {self.n_ctx} ({self.settings.env_name('n_ctx')}). It is never truncated.",
                    code="context_length_exceeded",
                    param=f"questions.{item.question.key}" if not param.startswith("states") else param,
                )
        return StatePlan(index=index, prompt=prompt, prefix=prefix, items=items)

    def _orders(self, question: Question, request: DecisionOptions) -> list[tuple[int, ...]]:
        if len(question.options) < 2:
            return []  # one candidate: p = 1.0 without the model
        return option_orders(len(question.options), request.permutations, PERMUTATION_SEED)

    @staticmethod
    def _description(question: Question, index: int, fmt: Any) -> Any:
        option = question.options[index]
        if option.description is not None:
            return option.description
        return fmt.noul_true if option.key == "true" else fmt.noul_false

    def _check_state_bytes(self, state_json: str, param: str) -> None:
        """Refuse a state that cannot fit before tokenizing it: no token is longer than the vocabulary's
        longest piece, so a state of B bytes has at least B / that many tokens."""
        size = len(state_json.encode("utf-8"))
        floor = size // self.max_token_bytes
        if floor > self.settings.max_state_tokens:
            raise RequestError(
                f"The state is at least {floor} tokens ({size} bytes); at most "
                f"{self.settings.max_state_tokens} are allowed "
                f"({self.settings.env_name('max_state_tokens')}). It is never truncated.",
                code="context_length_exceeded",
                param=param,
            )

    # --- answers -----------------------------------------------------------------------------------
    def respond(
        self, plan: DecisionPlan, stats: dict[str, Any], *, cached: Sequence[int] = ()
    ) -> DecisionResponse | BatchDecisionResponse:
        """The response; `cached[i]`: prompt tokens of state i read from the caches, not decoded."""
        responses = [
            self._state_response(plan, state, stats, cached[i] if i < len(cached) else 0)
            for i, state in enumerate(plan.states)
        ]
        if not plan.batch:
            return responses[0]
        total = sum(response.usage.input_tokens for response in responses)
        reused = sum(response.usage.cached_tokens for response in responses)
        return BatchDecisionResponse(
            results=tuple(responses), usage=Usage(input_tokens=total, output_tokens=0, cached_tokens=reused)
        )

    def _state_response(
        self, plan: DecisionPlan, state: StatePlan, stats: dict[str, Any], cached: int = 0
    ) -> DecisionResponse:
        request = plan.options
        by_question: dict[str, list[Item]] = {}
        for item in state.items:
            by_question.setdefault(item.question.key, []).append(item)
        head = plan.head_tokens
        before = head + len(state.prefix)  # prompt tokens ahead of each item's own
        answers: dict[str, Answer] = {
            question.key: self._answer(
                question, by_question.get(question.key, []), request.extensions, before
            )
            for question in request.questions
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
                "model": self.model_id,
                "prompt_version": self.builder.version,
                "permutations": request.permutations,
                "prefix_boundary": "state" if state.prompt.canonical else "common-prefix",
                "head_tokens": head,
                "prefix_tokens": (head + len(state.prefix)) if plan.mode == "shared" else 0,
                "suffix_tokens": sum(len(item.tokens) for item in state.items),
                "branches": len(state.items),
                "cached_tokens": cached,
                **stats,
            }
        return DecisionResponse(
            model=self.model_id,
            answers=answers,
            usage=Usage(input_tokens=input_tokens, output_tokens=0, cached_tokens=cached),
            extensions=extensions,
        )

    def _answer(self, question: Question, items: list[Item], with_extensions: bool, before: int) -> Answer:
        keys = [option.key for option in question.options]
        temperature = self.settings.temperature_for(question.type)
        if not items:  # a single candidate: certain, without running the model
            scores, probs = [0.0] * len(keys), [1.0] * len(keys)
        else:
            per_order = [align_to_options(item.order, label_scores(item)) for item in items]
            scores = average_logits(per_order)
            probs = softmax(scores, temperature)
        extensions = None
        if with_extensions:
            extensions = self._answer_extensions(question, items, keys, scores, temperature, before)
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
            legend={o.key: o.description for o in question.options},  # type: ignore[misc]
            probabilities=probabilities,
            confidence=normalized_peak(probs),
            extensions=extensions,
        )

    def _answer_extensions(
        self,
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
            "prompt_version": self.builder.version,
            "input_tokens": before + len(first.tokens),
            "temperature": temperature,
            "full_vocab_argmax_id": argmax_id,
            "full_vocab_argmax_text": self._piece(argmax_id).decode("utf-8", errors="replace")
            if argmax_id >= 0
            else "",
            "permutations": [list(item.order) for item in items],
        }
        if question.type != "noul":
            extensions["confidence_formula"] = CONFIDENCE_FORMULA
        return extensions


def label_scores(item: Item) -> list[float]:
    """One score per shown label: its logit (single-token labels, where the normalizer cancels) or
    its exact log-probability by the chain rule (any multi-token label in the set)."""
    root = item.outputs[()]
    if item.readout != READOUT_CHAIN:
        return [float(v) for v in root.logits]
    scores = []
    for label in item.labels:
        total = 0.0
        for cut, token in enumerate(label.tokens):
            node = item.outputs[label.tokens[:cut]]
            position = item.trie.nodes[label.tokens[:cut]].index(token)
            assert node.logsumexp is not None
            total += float(node.logits[position]) - node.logsumexp
        scores.append(total)
    return scores


def allowed_mass(item: Item) -> float:
    """Share of the model's full-vocabulary probability (T = 1) that falls on the shown labels."""
    root = item.outputs[()]
    if item.readout == READOUT_CHAIN:
        return float(min(1.0, np.exp(logsumexp(np.asarray(label_scores(item))))))
    assert root.logsumexp is not None
    return allowed_token_mass(root.logits, root.logsumexp)
