"""How long admitted work takes on the batched engine: the estimates admission decides on.

The engine runs every admitted work in the same decode steps (decider.engine.scheduler), so the
work ahead of a request does not run before it: it runs beside it. What a request waits for is
the steps that run until it is done, each carrying its own rows and its neighbours'. `finish_cost`
says what those steps are: a window of S steps, S the steps the request needs itself (more when the
tokens in the window exceed what a step carries), and each piece of work ahead contributing the
share of its tokens that it decodes in S of its steps (all of them when it needs fewer). The cost
model (decider.engine.cost) turns that into seconds.

A chat is counted at the length chats have been generating (`ChatLengths`), never more than its
`max_tokens`: a generation usually stops long before it, and a chat that runs longer than the
others is expected to stop soon after. Before any chat has finished, a chat counts at `max_tokens`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from decider.engine.cost import Cost, CostModel

CHAT_LENGTH_WINDOW = 64  # finished chats whose generated lengths the estimate remembers
MIN_CHAT_LENGTHS = 3  # below this many, a chat counts at its max_tokens
WINDOW_ROUNDS = 8  # fixed-point rounds for the window's length (it converges in two or three)


@dataclass(frozen=True)
class Ahead:
    """A piece of admitted work not done yet: what is left of it, and the seconds it may still run
    (a job is stopped at its deadline)."""

    cost: Cost
    seconds_left: float


class ChatLengths:
    """Generated tokens of the chats that finished recently: stopped by the model, or cut off at
    their max_tokens (which says only that the chat would have run at least that long)."""

    def __init__(self, window: int = CHAT_LENGTH_WINDOW) -> None:
        self._ends: deque[tuple[int, bool]] = deque(maxlen=window)  # (generated, stopped by itself)

    def record(self, generated: int, *, stopped: bool = True) -> None:
        self._ends.append((max(0, generated), stopped))

    def expected_total(self, max_tokens: int, produced: int = 0) -> int:
        """Tokens a chat that has produced `produced` so far is expected to generate in all.

        The mean length, at most `max_tokens`, of the recent chats that ran longer than `produced`
        (a chat that is still going is one of those); a chat cut off at a max_tokens smaller than
        this one's says nothing of how long it would have run, and is left out. A chat that has
        outlived them all is expected to run as long again. Never more than `max_tokens`, never
        less than one more token; `max_tokens` itself until three chats tell."""
        ceiling = max(max_tokens, produced)
        lengths = [min(n, ceiling) for n, stopped in self._ends if stopped or n >= ceiling]
        if len(lengths) < MIN_CHAT_LENGTHS:
            return ceiling
        longer = [length for length in lengths if length > produced]
        expected = sum(longer) / len(longer) if longer else 2 * produced
        return min(ceiling, max(produced + 1, math.ceil(expected)))


def effective_steps(cost: Cost, step_tokens: int) -> int:
    """Decodes a piece of work needs: its own count, or more when its tokens exceed what steps carry."""
    if cost.tokens <= 0:
        return cost.steps
    return max(cost.steps, math.ceil(cost.tokens / max(1, step_tokens)))


def finish_cost(new: Cost | None, ahead: Sequence[Ahead], costs: CostModel, step_tokens: int) -> Cost:
    """The decode steps that run until `new` is done, beside the work `ahead` (its rows share them).

    With `new` None: the steps until everything ahead is done (how long the engine stays busy).
    Work ahead counts only up to its deadline."""
    pieces = [_until_deadline(piece, costs) for piece in ahead]
    pieces = [(cost, effective_steps(cost, step_tokens)) for cost in pieces if cost.tokens or cost.steps]
    own = new or Cost()
    own_steps = (
        effective_steps(own, step_tokens) if new is not None else max((s for _, s in pieces), default=0)
    )
    window = own_steps
    total = own
    for _ in range(WINDOW_ROUNDS):
        total = own
        for cost, steps in pieces:
            total = total + (cost if steps <= window else cost.scaled(window / steps))
        needed = max(own_steps, math.ceil(total.tokens / max(1, step_tokens)))
        if needed <= window:
            break
        window = needed
    return Cost(window, total.tokens, total.attended)


def _until_deadline(piece: Ahead, costs: CostModel) -> Cost:
    alone = costs.predict(piece.cost) if piece.cost.tokens else None
    if not alone or alone <= piece.seconds_left:
        return piece.cost
    return piece.cost.scaled(piece.seconds_left / alone)
