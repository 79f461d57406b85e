"""What the engine keeps across requests: decision states as sequences, exact repeats as label scores.

Both live on the engine thread only (the scheduler owns them), so neither takes a lock.

States (`StateCache`). When a decision state's prefill reaches its canonical boundary (the prompt
head plus the state, before any question's tokens), the state's sequence is copied into an entry
(`llama_memory_seq_cp`: the cells are shared, nothing is recomputed). A later request whose prefix
starts with an entry's tokens copies that entry's sequence and decodes only what follows. Entries
are reference-counted: a running request that copied one pins it (its own reservation leaves the
entry's cells out), and only unpinned entries are evicted, least recently used first. Eviction is
on demand, before anything waits: the sequence pool reclaims an entry's sequence when its free list
is empty, and a unit that cannot find its cells evicts entries until it can (`Step.try_start`). So
the cache only ever holds what nobody else wants right now.

Two kinds of hits:
- exact: the entry's tokens are a prefix of the request's prefix. The whole sequence is copied and
  nothing is truncated, which is what recurrent and hybrid models (Qwen3.5) allow;
- partial (attention-only models without a sliding window): the longest common prefix with any
  entry, at least `MIN_PARTIAL_HIT` tokens; the copy's tail is removed (`llama_memory_seq_rm`).
  That serves growing states (a transcript appended to between calls). A sliding-window cache may
  have dropped the cells a truncated copy would need, and a recurrent state cannot be cut, so
  those models take exact hits only.

Exact repeats (`RepeatCache`). The raw label readouts (logits, log-normalizers) of one prompt, keyed
by a digest of the model, the prompt version, the whole prompt's tokens, the label tokens and the
readout spec. A request asking the same question on the same state again reads them back and
decodes nothing for it; temperature and permutation averaging are applied afterwards, as always.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

MIN_PARTIAL_HIT = 16  # a shorter common prefix saves less than the copy and the bookkeeping cost


class CacheMemory(Protocol):
    """The memory operations the state cache needs (LlamaRuntime, or a fake in tests)."""

    def seq_copy(self, src: int, dst: int) -> None: ...

    def seq_remove(self, seq_id: int) -> None: ...

    def seq_truncate(self, seq_id: int, position: int) -> None: ...


class Pool(Protocol):
    """The sequence pool's side the cache uses (decider.engine.steps.SeqPool)."""

    def take_free(self) -> int | None: ...

    def release(self, memory: Any, seq: int) -> None: ...


@dataclass(eq=False)
class Caches:
    """The scheduler's caches, as works see them (`Step.caches`). `namespace` names the model file
    and the prompt version: repeats are keyed under it."""

    states: StateCache | None
    repeats: RepeatCache | None
    namespace: str = ""


@dataclass(eq=False)
class CachedState:
    """One kept state: `tokens` follow the prompt head; `seq` holds the head and them."""

    tokens: tuple[int, ...]
    seq: int
    pins: int = 0

    @property
    def cells(self) -> int:
        """Cells it holds beyond the head (the head's cells are the head sequence's)."""
        return len(self.tokens)


@dataclass(frozen=True)
class StateHit:
    entry: CachedState
    length: int  # tokens of the request's prefix it covers (less than the entry's: truncated)


class StateCache:
    """Kept decision states, least recently used first (see the module docstring)."""

    def __init__(
        self,
        memory: CacheMemory,
        pool: Pool,
        *,
        head: int,
        max_cells: int,
        max_seqs: int,
        partial: bool,
        metrics: Any,
    ) -> None:
        self._memory = memory
        self._pool = pool
        self.head = head
        self.max_cells = max_cells
        self.max_seqs = max_seqs
        self.partial = partial
        self._metrics = metrics
        self._entries: OrderedDict[tuple[int, ...], CachedState] = OrderedDict()

    # --- what it holds ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cells(self) -> int:
        return sum(entry.cells for entry in self._entries.values())

    @property
    def spare_seqs(self) -> int:
        """Sequences it gives back on demand (its unpinned entries')."""
        return sum(1 for entry in self._entries.values() if not entry.pins)

    @property
    def spare_cells(self) -> int:
        return sum(entry.cells for entry in self._entries.values() if not entry.pins)

    @property
    def seqs(self) -> tuple[int, ...]:
        return tuple(entry.seq for entry in self._entries.values())

    def _touch(self, entry: CachedState) -> None:
        self._entries.move_to_end(entry.tokens)

    # --- hits ------------------------------------------------------------------------------------
    def lookup(self, prefix: Sequence[int], boundary: int | None) -> StateHit | None:
        """The entry that covers the most of `prefix` (tokens after the head), or None.

        Exact hits need an entry whose tokens begin `prefix`: the request's own boundary first (one
        dictionary look-up), then, on models that allow partial hits, any entry's common prefix."""
        best: StateHit | None = None
        if boundary is not None:
            entry = self._entries.get(tuple(prefix[:boundary]))
            if entry is not None:
                best = StateHit(entry, boundary)
        if self.partial and best is None:
            for entry in self._entries.values():
                # At least one token of the prefix is left to decode: the state's last position
                # must be computed again where the copy is cut, and a whole prefix is never all cached
                # unless it ends exactly at an entry.
                length = min(_common_prefix(entry.tokens, prefix), len(prefix) - 1)
                if length >= MIN_PARTIAL_HIT and (best is None or length > best.length):
                    best = StateHit(entry, length)
        return best

    def take(self, hit: StateHit, seq: int) -> None:
        """Copy a hit into `seq` (cut to the hit's length if it is shorter than the entry) and pin it."""
        self._memory.seq_copy(hit.entry.seq, seq)
        if hit.length < hit.entry.cells:
            self._memory.seq_truncate(seq, self.head + hit.length)
        hit.entry.pins += 1
        self._touch(hit.entry)
        self._metrics.cache_lookups.labels("state", "hit").inc()
        self._metrics.cache_tokens.labels("state").inc(hit.length)

    def missed(self) -> None:
        self._metrics.cache_lookups.labels("state", "miss").inc()

    def unpin(self, entry: CachedState) -> None:
        entry.pins -= 1
        assert entry.pins >= 0, "an entry was unpinned more often than pinned"

    # --- keeping ---------------------------------------------------------------------------------
    def store(self, tokens: Sequence[int], seq: int, *, longer: bool = False) -> bool:
        """Keep a copy of `seq`, which holds the head and `tokens` (and more after them if `longer`:
        the copy is cut, on models that allow it). False when it did not fit (or is already kept):
        a cache never takes what running work needs."""
        key = tuple(tokens)
        if not key or key in self._entries:
            return False
        if len(key) > self.max_cells:
            return False
        while len(self._entries) >= self.max_seqs or self.cells + len(key) > self.max_cells:
            if self.evict_one() is None:
                return False
        copy = self._pool.take_free()
        if copy is None:
            return False
        self._memory.seq_copy(seq, copy)
        if longer:
            assert self.partial, "only a model that allows partial hits may cut a copy"
            self._memory.seq_truncate(copy, self.head + len(key))
        self._entries[key] = CachedState(key, copy)
        self._metrics.cache_stores.labels("state").inc()
        return True

    def evict_one(self) -> int | None:
        """Drop the least recently used unpinned entry; the cells it held, or None if none can go."""
        for key, entry in self._entries.items():
            if not entry.pins:
                del self._entries[key]
                self._pool.release(self._memory, entry.seq)
                self._metrics.cache_evictions.labels("state").inc()
                return entry.cells
        return None

    def clear(self) -> None:
        """Forget every entry without touching memory (it was cleared, the pool reset)."""
        self._entries.clear()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    limit = min(len(a), len(b))
    length = 0
    while length < limit and a[length] == b[length]:
        length += 1
    return length


class RepeatCache:
    """Raw readouts of prompts already answered, bounded, least recently used first."""

    def __init__(self, max_entries: int, *, metrics: Any) -> None:
        self.max_entries = max_entries
        self._metrics = metrics
        self._entries: OrderedDict[bytes, dict[Any, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> dict[Any, Any] | None:
        outputs = self._entries.get(key)
        self._metrics.cache_lookups.labels("repeat", "miss" if outputs is None else "hit").inc()
        if outputs is None:
            return None
        self._entries.move_to_end(key)
        return dict(outputs)

    def put(self, key: bytes, outputs: dict[Any, Any]) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = dict(outputs)
        self._metrics.cache_stores.labels("repeat").inc()
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self._metrics.cache_evictions.labels("repeat").inc()


def prompt_digest(namespace: str, tokens: Sequence[int]) -> hashlib.blake2b:
    """A running digest of a prompt's tokens under `namespace` (model, prompt version, readout)."""
    digest = hashlib.blake2b(namespace.encode("utf-8"), digest_size=32)
    digest.update(b"\0")
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest


def repeat_key(
    prefix: hashlib.blake2b, tail: Sequence[int], labels: Sequence[Sequence[int]], spec: str
) -> bytes:
    """The key of one item: the prefix's digest extended by its tail, its label tokens and its spec."""
    digest = prefix.copy()
    digest.update(np.asarray(tail, dtype=np.int64).tobytes())
    digest.update(b"\0")  # no token id has a zero byte in every position: the tail ends here
    digest.update(repr((tuple(tuple(label) for label in labels), spec)).encode("utf-8"))
    return digest.digest()
