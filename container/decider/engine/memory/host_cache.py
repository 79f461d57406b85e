"""Kept states and chat turns saved to host memory: the second tier behind
decider.engine.memory.prefix_cache.StateCache (llama-server's `--cache-ram`).

An entry the state cache evicts for running work or for its budget is first saved here
(`llama_state_seq_get_data`: every cell of its sequence, K/V and recurrent state, as bytes). A later
request it serves restores it into a free sequence (`llama_state_seq_set_data`) instead of decoding
it again: under a millisecond against seconds of prefill (`make bench-host-tier`). This module is
only the bounded store; when to save and to restore is the state cache's rule, and so is what
admission sees of it (the state cache publishes its keys with its own). Everything here runs on the
engine thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from decider.engine.memory.sequences import StateBytes

# (kind, space, tokens), as decider.engine.memory.prefix_cache keys its entries
Key = tuple[str, str, tuple[int, ...]]


@dataclass(frozen=True, eq=False)
class SavedState:
    """One evicted entry as bytes, and what the state cache needs to keep it again once restored."""

    kind: str
    tokens: tuple[int, ...]
    data: StateBytes  # as llama.cpp wrote it (native.LlamaRuntime.seq_save): never copied
    start: int  # the position of tokens[0] (a state's follow the prompt head)
    prompt_tokens: int
    space: str = ""  # the cache space of the requests that kept it (decider.engine.memory.prefix_cache)

    @property
    def key(self) -> Key:
        return (self.kind, self.space, self.tokens)

    @property
    def cells(self) -> int:
        """Cells its sequence takes when restored: every position from 0, a state's head included
        (the saved sequence held the head's cells too, shared with the head sequence then)."""
        return self.start + len(self.tokens)


class HostCache:
    """Saved entries, least recently used first, within `max_bytes`."""

    def __init__(self, max_bytes: int, *, metrics: Any) -> None:
        self.max_bytes = max_bytes
        self._metrics = metrics
        metrics.cache_host_budget_bytes.set(max_bytes)
        self._entries: OrderedDict[Key, SavedState] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def saved(self) -> tuple[SavedState, ...]:
        return tuple(self._entries.values())

    def get(self, key: Key) -> SavedState | None:
        """The saved entry, now the most recently used; None if it is not held."""
        saved = self._entries.get(key)
        if saved is not None:
            self._entries.move_to_end(key)
        return saved

    def put(self, saved: SavedState) -> bool:
        """Hold `saved`, evicting the least recently used until it fits; False (nothing held or
        evicted) when it is larger than the whole budget."""
        size = len(saved.data)
        if size > self.max_bytes:
            return False
        old = self._entries.pop(saved.key, None)
        if old is not None:
            self.bytes -= len(old.data)
        while self.bytes + size > self.max_bytes:
            self.discard(next(iter(self._entries)))
        self._entries[saved.key] = saved
        self.bytes += size
        self._metrics.cache_host_saves.labels(saved.kind).inc()
        self._metrics.cache_host_bytes.set(self.bytes)
        return True

    def discard(self, key: Key) -> None:
        """Forget the entry of `key` if it is held (beyond the budget, or of no use any more)."""
        saved = self._entries.pop(key, None)
        if saved is not None:
            self.bytes -= len(saved.data)
            self._metrics.cache_host_evictions.labels(saved.kind).inc()
            self._metrics.cache_host_bytes.set(self.bytes)
