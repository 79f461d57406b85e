"""A decision state as it runs (`StateRun`), and the branches it opens (`Branch`, `Fill`):
decider.engine.works.decision_work plans their rows; each state keeps its own account of cells,
sequences and what the caches answered for it."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from decider.engine.memory.prefix_cache import CachedState, RepeatCache, prompt_digest, repeat_key
from decider.engine.works.decisions import Item, Prefix, StatePlan


@dataclass(eq=False)
class Branch:
    """A sequence holding one item's prompt plus `prefix` label tokens, up to position `end`."""

    item: Item
    prefix: Prefix
    seq: int
    end: int
    children: deque[Prefix]


@dataclass(eq=False)
class Fill:
    """A branch whose prompt tokens are being decoded, possibly over several steps."""

    item: Item
    seq: int
    tokens: Sequence[int]
    start: int  # position of tokens[0]
    planned: int = 0


@dataclass(eq=False)
class StateRun:
    """One state of a decision request as it runs: its items, cells, sequences and what the caches
    answered for it. The exact repeats are its own to ask and to keep (`answer_repeats`)."""

    plan: StatePlan
    pending: deque[Item]
    open_items: int
    item_cells: dict[int, int]  # id(item) -> cells its branches take (tail + label positions)
    prefix_cells: int  # the shared prefix's cells (0 in fresh mode: every branch holds its whole prompt)
    seq: int | None = None  # the prefix sequence, while branches are still to be copied from it
    # Sequences a branch of this state takes to open: 2 when any item's labels span several tokens
    # (its branch and their label positions, `_fits`), else 1 (Step.has_sequences: the one rule).
    branch_seqs: int = 1
    started: bool = False
    streaming: bool = False  # too large for one epoch: branches are freed as they finish
    prefilled: int = 0
    decoded: int = 0
    released: int = 0
    dead: int = 0
    opened: int = 0  # cells of the items taken from `pending` and not closed yet
    branches: list[Branch] = field(default_factory=list)  # read, with children still to start
    filling: list[Fill] = field(default_factory=list)  # opened, prompt not fully decoded yet
    # Kept across requests (decider.engine.memory.prefix_cache): the canonical boundary in the prefix
    # (None: no state is kept for it), the kept state it started from, how many prefix tokens that
    # covered, and the tail tokens of items answered from exact repeats.
    boundary: int | None = None
    entry: CachedState | None = None
    cached: int = 0
    repeated: int = 0
    repeats_checked: bool = False
    digest: Any = None
    repeats: RepeatCache | None = None  # the scheduler's, once asked (shared mode only)
    following: int = 0  # items another request is decoding now: the state waits for their readouts

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens after the head that this state did not decode thanks to the caches."""
        if not self.started and self.repeated:  # every item was a repeat: no prefix either
            return len(self.plan.prefix) + self.repeated
        return self.cached + self.repeated

    @property
    def need(self) -> int:
        """Cells of the whole state: its prefix and every branch and label position."""
        return self.prefix_cells + sum(self.item_cells.values())

    @property
    def largest_item(self) -> int:
        return max(self.item_cells.values())

    @property
    def future(self) -> int:
        if not self.started or not self.open_items:
            return 0
        if self.streaming:
            # Reserved: the prefix and room for its largest item (more only if several are open);
            # what the open items have decoded already is live, not future.
            prefix_decoded = self.prefilled - self.cached
            open_decoded = self.decoded - prefix_decoded - self.released
            branches = max(self.largest_item, self.opened) - open_decoded
            return self.prefix_cells - prefix_decoded + branches
        return self.need - self.decoded

    # --- exact repeats (decider.engine.memory.prefix_cache.RepeatCache) -----------------------------
    def key(self, item: Item, digest: Any = None) -> bytes:
        prefix = digest if digest is not None else self.digest
        return repeat_key(prefix, item.tokens, [label.tokens for label in item.labels], item.readout)

    def peek_repeats(self, repeats: RepeatCache | None, namespace: str) -> set[int]:
        """The items the repeat cache holds or is decoding now (admission's estimate)."""
        if repeats is None or not self.plan.items:
            return set()
        digest = prompt_digest(namespace, self.plan.prefix)
        return {i for i, item in enumerate(self.plan.items) if repeats.peek(self.key(item, digest))}

    def answer_repeats(self, repeats: RepeatCache | None, namespace: str) -> None:
        """Items already answered on this very prompt take their raw readouts from the repeat cache.
        If every other one is being decoded by another request now, the state waits for those
        readouts and decodes nothing (`RepeatCache.follow`); else it claims what it decodes."""
        self.repeats_checked = True
        if repeats is None or not self.pending:
            return
        self.repeats = repeats
        self.digest = prompt_digest(namespace, self.plan.prefix)
        keys = {id(item): self.key(item) for item in self.pending}
        for item in list(self.pending):
            outputs = repeats.get(keys[id(item)])
            if outputs is not None:
                self._answered(item, outputs)
        if self.pending and all(repeats.claimed_by_other(keys[id(item)], self) for item in self.pending):
            self.following = len(self.pending)
            for item in self.pending:
                repeats.follow(keys[id(item)], self, lambda outputs, item=item: self._followed(item, outputs))
        else:
            for item in self.pending:
                repeats.claim(keys[id(item)], self)

    def _answered(self, item: Item, outputs: dict[Any, Any]) -> None:
        item.outputs.update(outputs)
        self.pending.remove(item)
        del self.item_cells[id(item)]
        self.open_items -= 1
        self.repeated += len(item.tokens)

    def _followed(self, item: Item, outputs: dict[Any, Any] | None) -> None:
        """Another request read `item` (its readouts), or gave up (None: this state decodes it)."""
        self.following -= 1
        if outputs is not None:
            self._answered(item, outputs)

    def remember(self, item: Item) -> None:
        """`item` is fully read: keep its readouts (and hand them to whoever waits for them)."""
        if self.repeats is not None and self.digest is not None:
            self.repeats.put(self.key(item), item.outputs)

    def give_up(self) -> None:
        """Done or abandoned: nobody waits on this state any more, and it waits on nobody."""
        if self.repeats is not None:
            self.repeats.give_up(self)
        self.following = 0
