"""Decision requests as plans of prompts to read, and the readouts those plans come back with.

`DecisionPlanner.plan` runs before admission (on a worker thread, never on the engine thread): it
serializes and tokenizes each state once and each question's tail once per option order, checks
every limit that needs the tokenizer, and counts the tokens the request will cost. The scheduler's
`DecisionWork` then fills each item's readouts and hands back a `DecisionOutcome`; the server makes
the response from it off the engine thread (decider.server.answers), with `option_scores` and
`allowed_mass` here and the pure functions of `readout`.

The engine reads requests through the protocols below, never the wire schemas: the pydantic models
of decider.schemas.decision have these fields, and the engine never imports them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from decider.engine.cost import Cost, span_attended
from decider.engine.labels import READOUT_CHAIN, Label, LabelTable, LabelTrie
from decider.engine.native import RowOutput
from decider.engine.prompt import PromptBuilder, StatePrompt
from decider.engine.readout import (
    align_to_options,
    allowed_token_mass,
    average_logits,
    logsumexp,
    option_orders,
)
from decider.errors import RequestError
from decider.settings import QuestionType, Settings

PERMUTATION_SEED = 20240601  # frozen: the same request always sees the same option orders
Mode = Literal["shared", "fresh"]
Prefix = tuple[int, ...]


class Option(Protocol):
    """One answer option as shown to the model (None description: the prompt version's default)."""

    @property
    def key(self) -> str: ...

    @property
    def description(self) -> Any: ...


class Question(Protocol):
    @property
    def key(self) -> str: ...

    @property
    def type(self) -> QuestionType: ...

    @property
    def instructions(self) -> Any: ...

    @property
    def options(self) -> Sequence[Option]: ...


class DecisionOptions(Protocol):
    """What a decision request asks besides its state(s): the questions and the optional fields."""

    @property
    def questions(self) -> Sequence[Question]: ...

    @property
    def extensions(self) -> bool: ...

    @property
    def permutations(self) -> int: ...

    @property
    def mode(self) -> Mode | None: ...


class DecisionRequest(DecisionOptions, Protocol):
    """One state (`POST /v1/systemone`)."""

    @property
    def state(self) -> Any: ...


class BatchDecisionRequest(DecisionOptions, Protocol):
    """Many states, the same questions for each (`POST /v1/systemone/batch`)."""

    @property
    def states(self) -> Sequence[Any]: ...


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
        return sum(_state_cost(state, self.mode, self.head_tokens) for state in self.states)

    @property
    def cost(self) -> Cost:
        """What the engine does for this request: decodes (at least the prefix, the branches and the
        label positions), tokens, attended positions."""
        total = sum((_state_attention(state, self.mode, self.head_tokens) for state in self.states), Cost())
        tokens = self.cost_tokens
        return Cost(3 if tokens else 0, tokens, total.attended)


def _state_attention(state: StatePlan, mode: Mode, head: int) -> Cost:
    """Attended positions of one state's decodes: its prefix after the head, then each branch
    (fresh mode: each branch's whole prompt), label positions included."""
    attended = 0.0
    base = head + len(state.prefix)
    if mode == "shared" and state.items:
        attended += span_attended(head, len(state.prefix))
    for item in state.items:
        tail = len(item.tokens) + len(item.trie.nodes) - 1
        attended += span_attended(0, base + tail) if mode == "fresh" else span_attended(base, tail)
    return Cost(attended=attended)


def _state_cost(state: StatePlan, mode: Mode, head: int) -> int:
    positions = sum(len(item.trie.nodes) - 1 for item in state.items)
    tails = sum(len(item.tokens) for item in state.items)
    if mode == "fresh":
        return len(state.items) * (head + len(state.prefix)) + tails + positions
    return (len(state.prefix) if state.items else 0) + tails + positions


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

    # --- outcomes -----------------------------------------------------------------------------------
    def outcome(self, plan: DecisionPlan, stats: dict[str, Any], cached: Sequence[int]) -> DecisionOutcome:
        """What a finished plan hands back (cheap: the answer itself is made off the engine thread)."""
        return DecisionOutcome(
            plan=plan,
            stats=stats,
            cached=tuple(cached),
            model_id=self.model_id,
            prompt_version=self.builder.version,
            temperatures={q.key: self.settings.temperature_for(q.type) for q in plan.options.questions},
            piece=self._piece,
        )


@dataclass(frozen=True, eq=False)
class DecisionOutcome:
    """A decision the engine has finished: the plan with every item's readouts, and what its answer
    needs besides (decider.server.answers makes the response from it)."""

    plan: DecisionPlan
    stats: dict[str, Any]  # decodes, rows, timing (the scheduler's)
    cached: tuple[int, ...]  # per state: prompt tokens read from the caches, not decoded
    model_id: str
    prompt_version: str
    temperatures: dict[str, float]  # per question key
    piece: Callable[[int], bytes]  # a token's text (the full-vocabulary argmax, with extensions)


def option_scores(items: Sequence[Item]) -> list[float]:
    """One score per option of a question, in its own order: each option order's label scores
    mapped back to the options, averaged over the orders."""
    return average_logits([align_to_options(item.order, label_scores(item)) for item in items])


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
