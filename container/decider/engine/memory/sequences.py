"""The sequences of the one llama.cpp context, and the one owner of what is done to their cells.

Every copy, cut, removal, save and restore of a sequence goes through `SeqPool`: works and the
state cache ask it for a sequence (`acquire`, `fork`), share cells between two (`share`), and give
sequences back (`release`); nothing else calls llama.cpp's `seq_cp`/`seq_rm`. Which sequences a
unit needs before it may start is `Step.has_sequences`'s rule (decider.engine.scheduling.steps).

Memory epochs (batch-invariant mode). llama.cpp's CPU attention visits a query's cells in cell
order, so a token's result depends on where its context's cells lie, and llama.cpp puts new tokens
into the lowest free cells, including holes that removed sequences left below a live prefix. To
keep every sequence's cells in position order, nothing is freed while decision states are live:
the cells of every row are also owned by two graveyard sequences (`keep`), so removing a sequence
frees no cell, and memory only grows. When no decision state is live, the graveyards are dropped
(`compact`) and the dead cells are freed at once. Two owners, not one: a sliding-window cache
reuses a cell owned by a single sequence once that sequence has moved past its window. (A state
too large for one epoch runs alone and frees each question's cells when it is read: its rows are
not kept.)
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from typing import Protocol

from decider.invariance import HEAD_SEQ

# A sequence's saved cells: a mapping of their own from llama.cpp (native.LlamaRuntime.seq_save),
# or bytes from a test double.
StateBytes = bytes | bytearray | mmap.mmap


class Memory(Protocol):
    """llama.cpp's memory operations on sequences (LlamaRuntime, or a fake in tests)."""

    def seq_copy(self, src: int, dst: int) -> None: ...

    def seq_remove(self, seq_id: int) -> None: ...

    def seq_truncate(self, seq_id: int, position: int) -> None: ...

    def seq_remove_before(self, seq_id: int, position: int) -> None: ...

    def seq_save(self, seq_id: int) -> StateBytes: ...

    def seq_restore(self, seq_id: int, data: StateBytes) -> bool: ...


class Reclaimer(Protocol):
    """Something that holds sequences nobody needs right now and gives them back on demand (the
    state cache: decider.engine.memory.prefix_cache)."""

    @property
    def spare_seqs(self) -> int: ...

    def evict_one(self) -> int | None: ...


class SeqPool:
    """Sequence ids of the one context, reserved ones (head, pad, graveyards) and a free list, and
    the operations on their cells.

    With a `reclaimer`, the sequences it could give back count as available, and `acquire` takes
    one from it when the free list is empty: a cache never makes running work wait."""

    def __init__(
        self, memory: Memory, n_seq_max: int, reserved: Iterable[int], graveyards: tuple[int, ...] = ()
    ) -> None:
        self._memory = memory
        self.graveyards = graveyards
        self.reserved = frozenset(reserved) | frozenset(graveyards)
        self._all = [seq for seq in range(n_seq_max - 1, -1, -1) if seq not in self.reserved]
        self._free = list(self._all)
        self.reclaimer: Reclaimer | None = None

    # --- which sequences are free ----------------------------------------------------------------
    @property
    def free(self) -> int:
        """Sequences nobody holds, the cache's left out."""
        return len(self._free)

    @property
    def available(self) -> int:
        spare = self.reclaimer.spare_seqs if self.reclaimer is not None else 0
        return len(self._free) + spare

    @property
    def epochs(self) -> bool:
        return bool(self.graveyards)

    def take_free(self) -> int | None:
        """A sequence from the free list only (what the cache itself takes: it never evicts for it)."""
        return self._free.pop() if self._free else None

    def acquire(self) -> int | None:
        """An empty sequence, from the free list, else one the reclaimer gives back."""
        if not self._free and self.reclaimer is not None:
            self.reclaimer.evict_one()  # gives its sequence back through `release`
        return self._free.pop() if self._free else None

    def fork(self, src: int) -> int:
        """A new sequence sharing every cell of `src` (callers check `available` first)."""
        seq = self.acquire()
        assert seq is not None, "callers check the pool's available sequences first"
        self._memory.seq_copy(src, seq)
        return seq

    def share(self, src: int, dst: int, *, end: int | None = None) -> None:
        """Give `dst` every cell of `src` (nothing is copied in a unified KV cache), those at `end`
        and after left out (attention-only models: a recurrent state cannot be cut)."""
        self._memory.seq_copy(src, dst)
        if end is not None:
            self._memory.seq_truncate(dst, end)

    def release(self, seq: int) -> None:
        """Remove a sequence whole. Its kept cells stay, owned by the graveyards, until `compact`."""
        self._memory.seq_remove(seq)
        self._free.append(seq)

    # --- memory epochs (batch-invariant mode) ----------------------------------------------------
    def keep(self, seq: int) -> None:
        """Give the graveyards a share in every cell of `seq` (new cells after a decode)."""
        for graveyard in self.graveyards:
            self._memory.seq_copy(seq, graveyard)

    def compact(self, live: Iterable[int]) -> None:
        """Free every dead cell; the cells of the `live` sequences stay kept."""
        for graveyard in self.graveyards:
            self._memory.seq_remove(graveyard)
        for seq in live:
            self.keep(seq)

    def reset(self) -> None:
        """Every sequence is free again (after the memory was cleared)."""
        self._free = list(self._all)

    # --- host memory (decider.engine.memory.host_cache) ------------------------------------------
    def save(self, seq: int) -> StateBytes:
        """Every cell of `seq` as bytes (K/V, and the recurrent state on hybrid models)."""
        return self._memory.seq_save(seq)

    def restore(self, seq: int, data: StateBytes, *, head: int = 0) -> bool:
        """Put saved cells back into `seq`; False (and `seq` released) when llama.cpp cannot place
        them. With `head`, the restored positions below it are dropped and the head sequence's
        cells shared in their place (what a kept state held before it was saved)."""
        if not self._memory.seq_restore(seq, data):
            self.release(seq)
            return False
        if head:
            self._memory.seq_remove_before(seq, head)
            self._memory.seq_copy(HEAD_SEQ, seq)
        return True
