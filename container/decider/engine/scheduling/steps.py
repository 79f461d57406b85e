"""One decode step being assembled, and the rules for what may start in it.

The scheduler builds a `Step` for every `llama_decode` and lets each running `Work` add rows to it.
A row is appended tokens for one sequence; its `on_done` callback runs on the engine thread right
after the decode that carried it, while its logits are still in the context. The sequences
themselves, and every operation on their cells, are the pool's (decider.engine.memory.sequences).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from decider.engine.memory.sequences import SeqPool
from decider.engine.model.native import Row
from decider.invariance import MIN_WORK_SEQS


@dataclass(eq=False)
class PlannedRow:
    row: Row
    work: Any
    on_done: Callable[[Row], None]
    keep: bool = True  # its cells stay until the epoch ends (batch-invariant mode)


class Unit(Enum):
    """What a work starts: the units whose cells are reserved whole when they start."""

    STATE = "state"  # a decision state and all its branches
    STREAMING_STATE = "streaming state"  # a state too large for one memory epoch: its prefix and largest item
    CHAT = "chat"  # a generation: its prompt (each generated token takes a cell as it is decoded)


@dataclass(eq=False)
class Step:
    """The rows of one decode, within a token budget (n_batch) and a memory-cell budget.

    Works reserve the cells of a whole unit of work when it starts (`try_start`), so a started unit
    never waits for memory; a chat reserves its prompt and takes a cell per generated token as it
    goes (`take_cells`). `cells_left` is what is still unreserved. The rules for what may start
    are this class's alone: works ask, and never read the scheduler's state.
    """

    seqs: SeqPool
    tokens_left: int
    cells_left: int
    runtime: Any = None  # what a row's reader samples from after the decode (a chat's logits)
    running: Sequence[Any] = ()  # every work the scheduler runs, the asking one included
    # Sequences the started prefixes still need to open their next branch (each: one, or two for
    # an item whose labels span several tokens: its branch and their label positions; set by the
    # scheduler from the works' footprints). A new unit starts only while its own need stays free
    # beside them (`has_sequences`): started work never waits for a sequence.
    branch_reserve: int = 0
    # The scheduler's gate, set before each work plans: false behind a unit that could not start
    # (first come, first served) and while the memory epoch is full.
    starts_allowed: bool = True
    # A new unit starts only while the started ones have fewer tokens than this left to decode
    # after this step (`outstanding`; 0: no limit). See `may_start`.
    start_below_tokens: int = 0
    # Cells that growing units (chats) leave free for the first unit waiting for cells to start
    # (set by the scheduler), and what the first unit refused for lack of cells needs (read by it).
    growth_floor: int = 0
    waiting_for_cells: int = 0
    # Set when a unit could not start for want of cells or sequences (not the gate, not the start
    # rule): the scheduler closes the first-come gate behind it, so it is not starved.
    refused_for_memory: bool = False
    caches: Any = None  # the scheduler's kept states and repeats (decider.engine.memory.prefix_cache.Caches)
    # Recurrent and hybrid models: llama.cpp cuts a decode into micro-batches of equal tokens per
    # sequence (split_equal), about one per distinct row length, so the rows of a step share one
    # length (`take`). `row_tokens` is that length once a row of several tokens has set it.
    equal_rows: bool = False
    row_tokens: int | None = None
    long_row: int = 0  # a row alone of this many tokens may keep its own length (n_ubatch / 2)
    rows: list[PlannedRow] = field(default_factory=list)

    @property
    def may_start(self) -> bool:
        """The gate is open, and the started units leave less than `start_below_tokens` (n_ubatch)
        to decode after this step.

        Starting more gains nothing: llama.cpp runs a decode as micro-batches of n_ubatch tokens
        one after another, so work already started keeps the next steps full, while a unit started
        early holds its cells until its rows' turn, and every decode's attention visits every cell
        up to the highest one in use, masked or not (8 clients had 3-8 states resident and paid
        12-19 % more per token than one). So a request's prefill joins the last step of the one
        before it, and about two run at a time."""
        if not self.starts_allowed:
            return False
        return not self.start_below_tokens or self.outstanding < self.start_below_tokens

    @property
    def outstanding(self) -> int:
        """Tokens the started units still have to decode after this step: their reserved cells not
        decoded yet, less the rows planned into it."""
        return sum(work.footprint().future for work in self.running) - self.token_count

    def has_sequences(self, sequences: int) -> bool:
        """`sequences` free beyond what the started prefixes still need (`branch_reserve`). The one
        reserve rule: a chat needs one; a state its prefix and its first branch, plus one for label
        positions when any of its items has labels of several tokens (decider.engine.works.decision_work)."""
        return self.seqs.available >= self.branch_reserve + sequences

    def try_start(self, unit: Unit, cells: int, *, sequences: int) -> bool:
        """Reserve `cells` for a new `unit` if it may start in this step, and say whether it did.

        - Nothing starts while the gate is closed, nor while started units have a micro-batch of
          tokens left after this step (`may_start`).
        - A state too large for one epoch holds cells alone: it waits until no state holds any.
        - No other state starts while such a state runs.
        - The unit's cells must all be free (kept states are evicted for them first), and the
          `sequences` it needs to make progress must be free beside the started ones' (`has_sequences`).
        """
        if not self.may_start:
            return False
        held = [work.footprint() for work in self.running] if unit is not Unit.CHAT else []
        if unit is Unit.STREAMING_STATE and any(footprint.holds_epoch_cells for footprint in held):
            return False
        if unit is Unit.STATE and any(footprint.streams_alone for footprint in held):
            return False
        self._reclaim_cells(cells)
        if self.cells_left < cells:
            self.waiting_for_cells = self.waiting_for_cells or cells
            self.refused_for_memory = True
            return False
        if not self.has_sequences(sequences):
            self.refused_for_memory = True
            return False
        self.cells_left -= cells
        return True

    def lend_cells(self, cells: int, *, then: int) -> bool:
        """Reserve `cells` for a kept state the cache restores from host memory for a unit about to
        start (decider.engine.memory.prefix_cache), only where the unit could start after it: the gate is
        open, `then` more cells stay free beside them (kept states are evicted for both first), and
        a sequence stays for the unit once the restored entry holds one. So a restore never makes
        that unit wait, nor any other; refused, the unit starts as on a miss."""
        if not self.may_start or not self.has_sequences(1 + MIN_WORK_SEQS):  # the entry's, and a unit's most
            return False
        self._reclaim_cells(cells + then)
        if self.cells_left < cells + then:
            return False
        self.cells_left -= cells
        return True

    def return_cells(self, cells: int) -> None:
        """Give back cells `lend_cells` reserved (the restore failed, or needed fewer)."""
        self.cells_left += cells

    def take_cells(self, cells: int) -> bool:
        """Take `cells` free cells for a row of a started unit that grows as it goes (a chat's next
        token), if they are free beyond `growth_floor` (kept states are evicted for them first); the
        gate does not apply: it has started."""
        self._reclaim_cells(cells + self.growth_floor)
        if self.cells_left - self.growth_floor < cells:
            return False
        self.cells_left -= cells
        return True

    def _reclaim_cells(self, cells: int) -> None:
        """Evict kept states (least recently used, unpinned) until `cells` are free, or none is left."""
        states = self.caches.states if self.caches is not None else None
        if states is not None and self.cells_left < cells:
            self.cells_left += states.reclaim(cells - self.cells_left)

    def take(self, remaining: int, *, alone: bool = False) -> int:
        """How many of a row's `remaining` tokens it decodes in this step (0: none, it waits a step).

        Without equal rows: as many as the token budget allows. With them, one-token rows (a chat's
        next token, a label position) always go (they cost the step one micro-batch at most), and
        every longer row takes the step's row length: the first row sets it (all it can take) unless
        `settle_row_tokens` chose it for a group of rows; a row shorter than it waits a step. A row
        that has no siblings (`alone`: a state's prefix, a chat's prompt) and takes at least
        `long_row` tokens keeps its own length: its one more micro-batch is paid by its tokens, and
        the other rows do not wait for it."""
        budget = min(remaining, self.tokens_left)
        if not self.equal_rows or budget <= 1:
            return max(0, budget)
        if alone and self.long_row and budget >= self.long_row:
            return budget
        if self.row_tokens is None:
            self.row_tokens = budget
        return self.row_tokens if budget >= self.row_tokens else 0

    def settle_row_tokens(self, remaining: Sequence[int]) -> None:
        """With equal rows, a group of rows about to be planned (a state's question branches, which
        differ in length) chooses the step's row length, if no row has set it: the length that
        decodes the most of their tokens in this step, among their own lengths, the powers of two
        below them and the budget split evenly (rows of many lengths meet on a few that way: a
        12-question JevBench state took 9-11 passes in place of 10-13, and no decode more than
        2 x ceil(tokens / n_ubatch))."""
        if not self.equal_rows or self.row_tokens is not None:
            return
        lengths = [r for r in remaining if r > 1]
        if not lengths:
            return

        def decoded(length: int) -> tuple[int, int]:
            rows = sum(1 for r in lengths if r >= length)
            return min(rows, self.tokens_left // length) * length, length

        own = {min(r, self.tokens_left) for r in lengths}
        powers = {1 << (r.bit_length() - 1) for r in lengths}
        shared = {min(min(lengths), self.tokens_left // len(lengths))}  # the budget split evenly
        candidates = [c for c in own | powers | shared if 1 < c <= self.tokens_left]
        self.row_tokens = max(candidates, key=decoded, default=None)

    def add(self, work: Any, row: Row, on_done: Callable[[Row], None], *, keep: bool = True) -> None:
        """Carry `row` in this decode (its cells were reserved when its unit of work started)."""
        n = len(row.tokens)
        if n <= 0 or n > self.tokens_left:
            raise ValueError("a row must fit the step's token budget")
        self.tokens_left -= n
        self.rows.append(PlannedRow(row, work, on_done, keep))

    @property
    def token_count(self) -> int:
        return sum(len(planned.row.tokens) for planned in self.rows)

    @property
    def works(self) -> list[Any]:
        seen: dict[int, Any] = {}
        for planned in self.rows:
            seen.setdefault(id(planned.work), planned.work)
        return list(seen.values())
