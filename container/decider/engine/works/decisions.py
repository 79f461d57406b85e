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
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from decider.engine.model.labels import READOUT_CHAIN, Label, LabelTable, LabelTrie
from decider.engine.model.native import RowOutput
from decider.engine.model.prompt import PromptBuilder, StatePrompt
from decider.engine.scheduling.cost import Cost, span_attended
from decider.engine.works.readout import (
    align_to_options,
    allowed_token_mass,
    average_logits,
    logsumexp,
    option_orders,
)
from decider.engine.works.request_size import QuestionText, TextBytes, TokenBudget, too_large
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
    planned_tokens: int = 0  # tokens planning tokenized and holds (decider.engine.works.request_size)
    space: str = ""  # the request's cache space: kept states serve only their own (prefix_cache)

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
        states, planned = self._plan_states(request, [request.state], mode, batch=False)
        return DecisionPlan(request, states, mode, len(self.builder.head_tokens), planned_tokens=planned)

    def plan_batch(self, request: BatchDecisionRequest) -> DecisionPlan:
        mode = self._mode(request)
        states, planned = self._plan_states(request, list(request.states), mode, batch=True)
        head = len(self.builder.head_tokens)
        return DecisionPlan(request, states, mode, head, batch=True, planned_tokens=planned)

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

    def _plan_states(
        self, request: DecisionOptions, states: list[Any], mode: Mode, *, batch: bool
    ) -> tuple[list[StatePlan], int]:
        """Every limit a byte bound can tell first, for every state, before a tokenizer call; then
        each state tokenized, the planned tokens counted as they come (decider.engine.works.request_size).
        Returns the states' plans and the tokens planned."""
        params = [f"states.{i}" for i in range(len(states))] if batch else ["state"]
        state_jsons = [json.dumps(state, ensure_ascii=False) for state in states]
        shown_for = self._shown_for(request)
        text = self._text_bytes(request, state_jsons, shown_for)
        for state_json, state_bytes, param in zip(state_jsons, text.states, params, strict=True):
            self._check_state_bytes(state_json, param)
            self._check_prompt_bytes(state_bytes, text, shown_for, param=param if batch else None)
        self._check_request_bytes(text, state_param="states" if batch else "state")
        budget = TokenBudget(self.settings.request_token_limit, self.settings.env_name("max_request_tokens"))
        plans = [
            self._state_plan(i, state_json, request, mode, shown_for, budget, param=param)
            for i, (state_json, param) in enumerate(zip(state_jsons, params, strict=True))
        ]
        return plans, budget.used

    def _shown_for(
        self, request: DecisionOptions
    ) -> dict[str, list[tuple[tuple[int, ...], Sequence[Label]]]]:
        """Each question's option orders and the labels they are shown with (the same on every state)."""
        return {
            question.key: [
                (order, self.labels.for_count(len(question.options)))
                for order in self._orders(question, request)
            ]
            for question in request.questions
        }

    def _shown(
        self, question: Question, order: tuple[int, ...], labels: Sequence[Label]
    ) -> list[tuple[str, Any]]:
        fmt = self.builder.format
        return [
            (labels[slot].text, self._description(question, index, fmt)) for slot, index in enumerate(order)
        ]

    def _text_bytes(
        self, request: DecisionOptions, state_jsons: Sequence[str], shown_for: dict[str, Any]
    ) -> TextBytes:
        """The bytes planning will tokenize, from one tail per question (every order of it is as long)."""
        fmt = self.builder.format
        questions = tuple(
            QuestionText(
                question.key,
                len(shown_for[question.key]),
                len(
                    fmt.tail_segment(
                        question.instructions, self._shown(question, *shown_for[question.key][0])
                    ).encode()
                )
                if shown_for[question.key]
                else 0,
            )
            for question in request.questions
        )
        states = tuple(len(fmt.state_segment(state_json).encode()) for state_json in state_jsons)
        return TextBytes(states, questions)

    def text_bytes(self, request: DecisionRequest | BatchDecisionRequest) -> TextBytes:
        """What `plan` would tokenize, in bytes, with no tokenizer call (tests, audits)."""
        states = list(request.states) if hasattr(request, "states") else [request.state]  # type: ignore[union-attr]
        state_jsons = [json.dumps(state, ensure_ascii=False) for state in states]
        return self._text_bytes(request, state_jsons, self._shown_for(request))

    @property
    def tokens_per_text(self) -> int:
        """Tokens a tokenized text may hold beyond one per byte: the template's own after a tail, and one
        (SPM's space prefix); `TextBytes.most_tokens` takes it."""
        return len(self.builder.tail_template_tokens) + 1

    def _check_prompt_bytes(
        self, state_bytes: int, text: TextBytes, shown_for: dict[str, Any], *, param: str | None
    ) -> None:
        """Refuse a question whose prompt cannot fit the context before tokenizing it: its state's
        segment and its tail are at least their bytes / the longest piece in tokens, together (they
        are one text where the cut is not canonical)."""
        for question in text.questions:
            if not question.orders:
                continue
            _, labels = shown_for[question.key][0]
            depth = max(len(label.tokens) for label in labels)
            size = state_bytes + question.tail_bytes
            floor = math.ceil(size / self.max_token_bytes)
            if floor + depth > self.room:
                raise RequestError(
                    f"The prompt for question {question.key!r} is at least {floor} tokens ({size} bytes); "
                    f"the context holds {self.n_ctx} ({self.settings.env_name('n_ctx')}). "
                    "It is never truncated.",
                    code="context_length_exceeded",
                    param=param or f"questions.{question.key}",
                )

    def _check_request_bytes(self, text: TextBytes, *, state_param: str) -> None:
        """Refuse, before tokenizing, a request whose planned tokens are over the limit even at the
        fewest tokens its bytes can make (decider.engine.works.request_size)."""
        states, questions = text.least_tokens(self.max_token_bytes)
        limit = self.settings.request_token_limit
        if states + questions > limit:
            param = "questions" if questions >= states else state_param
            raise too_large(
                states + questions, limit, self.settings.env_name("max_request_tokens"), param, least=True
            )

    def _state_plan(
        self,
        index: int,
        state_json: str,
        request: DecisionOptions,
        mode: Mode,
        shown_for: dict[str, list[tuple[tuple[int, ...], Sequence[Label]]]],
        budget: TokenBudget,
        *,
        param: str,
    ) -> StatePlan:
        fmt = self.builder.format
        probe = next(
            (
                fmt.tail_segment(q.instructions, self._shown(q, *shown_for[q.key][0]))
                for q in request.questions
                if shown_for[q.key]
            ),
            None,
        )
        prompt = self.builder.for_state(state_json, probe or "")
        if len(prompt.tokens) > self.settings.max_state_tokens:
            raise RequestError(
                f"The state is {len(prompt.tokens)} tokens; at most {self.settings.max_state_tokens} are "
                f"allowed ({self.settings.env_name('max_state_tokens')}). It is never truncated.",
                code="context_length_exceeded",
                param=param,
            )
        budget.take(len(prompt.tokens), param)
        head = len(self.builder.head_tokens)
        before = len(prompt.tokens) if prompt.canonical else 0  # tokens ahead of each tail, after the head
        items: list[Item] = []
        for question in request.questions:
            for n, (order, labels) in enumerate(shown_for[question.key]):
                options = self._shown(question, order, labels)
                tokens = self.builder.tail(prompt, question.instructions, options)
                trie = LabelTrie.of(labels)
                # What the work reserves for this question beside its state's prefix, at the least (a
                # streaming state: the prefix and its largest question; works.decision_work): the tail
                # and every label position, and in fresh mode the head again (each branch decodes its
                # whole prompt). Checked as each is tokenized, so a request that cannot run is refused
                # here, before admission, not after it has waited for everything else to drain.
                cells = (head if mode == "fresh" else 0) + before + len(tokens) + len(trie.nodes) - 1
                if cells > self.room:
                    again = ", the head again in fresh mode" if mode == "fresh" else ""
                    raise RequestError(
                        f"The prompt for question {question.key!r} is {head + before + len(tokens)} tokens "
                        f"and needs {cells} cells beside the cached head (its label positions{again}); "
                        f"the context holds {self.n_ctx} ({self.settings.env_name('n_ctx')}). "
                        "It is never truncated.",
                        code="context_length_exceeded",
                        param=f"questions.{question.key}" if not param.startswith("states") else param,
                    )
                budget.take(len(tokens), "questions")
                item = Item(
                    question=question,
                    order=order,
                    labels=tuple(labels),
                    trie=trie,
                    tokens=tokens,
                    # only the first order's text is hashed (prompt_sha256): the others are not kept
                    text=self.builder.text(prompt, question.instructions, options)
                    if request.extensions and n == 0
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
