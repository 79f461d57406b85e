"""Memory epochs (batch-invariant mode only): when dead cells are freed, when an epoch is full.

With batch invariance, nothing is freed while a decision state is live (decider.engine.scheduling.steps says
why): removed sequences leave dead cells behind, and memory only grows. This module counts those
cells, ends the epoch when no decision state is live (every dead cell is freed at once), and says
when the epoch is full (`epoch_cells`): its decisions finish, and no new one starts until it ends.
Without epochs (the default policy) there are no dead cells and every check here is a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence

from decider.engine.memory.sequences import SeqPool
from decider.engine.scheduling.jobs import Running
from decider.invariance import HEAD_SEQ


class MemoryEpochs:
    """The dead cells of the current epoch, and the cap on its decisions."""

    def __init__(self, epoch_cells: int | None) -> None:
        self.epoch_cells = epoch_cells  # None: no cap on the decision starts of a memory epoch
        self._removed = 0  # dead cells of works already gone, since the last compaction

    def dead_cells(self, works: Sequence[Running]) -> int:
        """Cells released into the graveyards since the last compaction (works count theirs
        cumulatively; `dead_at_epoch_start` is what a work had released before the epoch began)."""
        return self._removed + sum(r.work.footprint().dead - r.dead_at_epoch_start for r in works)

    def leave(self, running: Running) -> None:
        """A work leaves the engine: the cells it released stay dead until the epoch ends."""
        self._removed += running.work.footprint().dead - running.dead_at_epoch_start

    def maybe_compact(self, seqs: SeqPool, works: Sequence[Running]) -> None:
        """End the memory epoch when no decision state is live: free every dead cell at once."""
        if not seqs.epochs or not self.dead_cells(works):
            return
        if any(r.work.footprint().holds_epoch_cells for r in works):  # a started state keeps its cells
            return
        live = [HEAD_SEQ, *(seq for r in works for seq in r.work.footprint().seqs)]
        seqs.compact(live)
        self._removed = 0
        for running in works:
            running.dead_at_epoch_start = running.work.footprint().dead

    def full(self, seqs: SeqPool, works: Sequence[Running]) -> bool:
        """The memory epoch has grown to `epoch_cells`: let its decisions finish, start nothing new.

        Counted: the decisions' cells and every released cell not yet freed. Not counted: a running
        chat's own cells, so a long generation never holds decisions back."""
        if self.epoch_cells is None or not seqs.epochs:
            return False
        decisions = (r.work for r in works if r.work.kind == "decision")
        used = sum(work.footprint().held for work in decisions) + self.dead_cells(works)
        return used >= self.epoch_cells

    def reset(self) -> None:
        """The memory was cleared (a failed context): no dead cell is left."""
        self._removed = 0
