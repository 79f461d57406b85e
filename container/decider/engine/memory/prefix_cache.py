"""What the engine keeps across requests: decision states and chat turns as sequences, exact
repeats as label scores.

Both caches live on the engine thread (the scheduler owns them). Admission, on the event loop, only
peeks: the state cache publishes an immutable tuple of its keys after every change (`peek` reads
that, never the live dictionary), and the repeat cache answers membership under its own lock. A peek
is an estimate: by the time the work starts an entry may have been evicted or a new one kept.

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

Chat turns share the same entries, budget and least-recently-used order (kind `chat`; their tokens
start at position 0, a state's after the head). On models that allow partial hits, a chat that ends
by itself (a stop, or its max_tokens) hands its own sequence to the cache (its prompt and the tokens
it generated, nothing copied), replacing the entry it continued; the next turn of the conversation
takes the longest common prefix, as far as the template re-renders the answer as the tokens
generated. On exact-only models a chat's entry is the conversation before the generation prompt
(`ChatPlan.boundary`): the prefill stops there once and a copy is kept, and the next turn, which
renders the same messages and then more, starts with it (decider.engine.works.chat). A kept turn serves
only a prompt that continues it (`best_hit`).

Host memory (decider.engine.memory.host_cache, llama-server's `--cache-ram`). An entry evicted for running
work or for the budget (`evict_one`) is first saved to host memory, every cell of its sequence as
bytes, unless a copy is there already; a chat turn its conversation's next turn replaces (`drop`) is
not, and its copy goes. A start that finds a saved entry covering more than every kept one restores
it (`lookup` with the step: the one rule of both call sites) into a free sequence, where the step
lends the cells without making any unit wait; it is then kept like the others, and its copy stays.
A restored state's sequence holds the prompt head too: where copies may be cut, that copy is
removed and the head sequence's cells shared again; elsewhere (recurrent and sliding-window models)
the entry keeps its own head and counts its cells (`CachedState.head_cells`). Admission's `peek`
sees the saved entries as hits (they decode nothing).

Cache spaces. Every entry belongs to the space of the request that kept it, and serves only
requests of the same space: the default space `""`, or the one a request names (its `cache_salt`,
decider.server.cache_scope). A kept state serves any request whose prefix it begins, and the response
says how many tokens it covered, so callers that share a space can confirm each other's states (token
by token, where partial hits are on): callers that are not one trust domain use spaces of their own.
Exact repeats are keyed under the space too.

Exact repeats (`RepeatCache`). The raw label readouts (logits, log-normalizers) of one prompt, keyed
by a digest of the model, the prompt version, the whole prompt's tokens, the label tokens and the
readout spec. A request asking the same question on the same state again reads them back and
decodes nothing for it; temperature and permutation averaging are applied afterwards, as always.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from decider.engine.memory.host_cache import HostCache, SavedState
from decider.engine.memory.sequences import SeqPool

log = logging.getLogger(__name__)
MIN_PARTIAL_HIT = 16  # a shorter common prefix saves less than the copy and the bookkeeping cost
STATE = "state"  # a decision state: its tokens follow the prompt head
CHAT = "chat"  # a chat turn: its tokens start at position 0
Key = tuple[str, str, tuple[int, ...]]  # (kind, space, tokens)
Candidate = tuple[Key, int]  # an entry's key and the fewest tokens a hit on it must cover


class Room(Protocol):
    """Where a restored entry's cells come from: the step a unit is about to start in
    (decider.engine.scheduling.steps.Step)."""

    def lend_cells(self, cells: int, *, then: int) -> bool: ...

    def return_cells(self, cells: int) -> None: ...


@dataclass(eq=False)
class Caches:
    """The scheduler's caches, as works see them (`Step.caches`). `namespace` names the model file
    and the prompt version: repeats are keyed under it."""

    states: StateCache | None
    repeats: RepeatCache | None
    namespace: str = ""


@dataclass(eq=False)
class CachedState:
    """One kept sequence. A state (`kind` STATE): `tokens` follow the prompt head, `seq` holds the
    head and them. A chat turn (CHAT): `seq` holds `tokens` from position 0 (`start`)."""

    tokens: tuple[int, ...]
    seq: int
    pins: int = 0
    kind: str = STATE
    start: int = 0  # the position of tokens[0]
    # A chat turn: how many of its tokens were its prompt (the rest it generated). Only a request
    # that reuses all of them, one continuing the conversation, may copy it (`floor`).
    prompt_tokens: int = 0
    # A state restored from host memory on a model whose copies cannot be cut: its sequence holds
    # a copy of the prompt head of its own (the head's cells are not the head sequence's), so it
    # holds these cells too (`StateCache._restore`).
    head_cells: int = 0
    space: str = ""  # the cache space of the request that kept it: it serves only that space

    @property
    def key(self) -> Key:
        return (self.kind, self.space, self.tokens)

    @property
    def floor(self) -> int:
        return floor(self.kind, self.prompt_tokens)

    @property
    def cells(self) -> int:
        """Cells it holds: its tokens' (a state's head is the head sequence's), and its own head's."""
        return len(self.tokens) + self.head_cells


def floor(kind: str, prompt_tokens: int) -> int:
    """The fewest tokens a hit on an entry must cover: a chat turn serves only a prompt that
    continues it (its whole prompt, see `best_hit`); a state serves any hit."""
    return prompt_tokens if kind == CHAT else 0


@dataclass(frozen=True)
class StateHit:
    entry: CachedState
    length: int  # tokens of the request's prefix it covers (less than the entry's: truncated)


class StateCache:
    """Kept decision states and chat turns, least recently used first (see the module docstring)."""

    def __init__(
        self,
        pool: SeqPool,
        *,
        head: int,
        max_cells: int,
        max_seqs: int,
        partial: bool,
        metrics: Any,
        host: HostCache | None = None,
    ) -> None:
        self._pool = pool
        self.head = head
        self.max_cells = max_cells
        self.max_seqs = max_seqs
        self.partial = partial
        self._metrics = metrics
        self.host = host  # the host-memory tier: evicted entries, saved (decider.engine.memory.host_cache)
        self._entries: OrderedDict[Key, CachedState] = OrderedDict()
        self._published: tuple[Candidate, ...] = ()

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
        self._entries.move_to_end(entry.key)

    def _candidates(self) -> tuple[Candidate, ...]:
        return tuple((entry.key, entry.floor) for entry in self._entries.values())

    def _saved_candidates(self) -> tuple[Candidate, ...]:
        saved = self.host.saved() if self.host is not None else ()
        return tuple((entry.key, floor(entry.kind, entry.prompt_tokens)) for entry in saved)

    def _publish(self) -> None:
        """What `peek` reads (the event loop): the entries as they are now, least recently used first,
        then those saved in host memory (a lookup restores one: it costs no decode either)."""
        self._published = self._candidates() + self._saved_candidates()

    # --- hits ------------------------------------------------------------------------------------
    def lookup(
        self,
        prefix: Sequence[int],
        boundary: int | None,
        *,
        kind: str = STATE,
        space: str = "",
        room: Room | None = None,
        then: int = 0,
    ) -> StateHit | None:
        """The entry of `kind` that covers the most of `prefix`, or None (the rules: `best_hit`).
        A state's prefix follows the head; a chat's is its whole prompt.

        With `room`, the step a unit is about to start in: when an entry saved in host memory covers
        more than every kept one, it is restored and kept again (`_restore`), if its cells and, beside
        them, the `then` cells the unit reserves on a miss, less what the entry covers, are free
        (evicting unpinned kept entries), and a sequence too; else the kept entries' hit stands.
        The one rule of both call sites (a decision state's start, a chat's)."""
        hit = self._hit(self._candidates(), prefix, boundary, kind, space)
        if room is None or self.host is None:
            return hit
        found = best_hit(self._saved_candidates(), kind, prefix, boundary, self.partial, space)
        if found is None or (hit is not None and found[1] <= hit.length):
            return hit
        saved = self.host.get(found[0])
        assert saved is not None
        restored = self._restore(saved, room, max(0, then - found[1]))
        if restored is None:  # making room may have evicted the kept hit: look again
            return self._hit(self._candidates(), prefix, boundary, kind, space)
        return StateHit(restored, found[1])

    def _hit(
        self,
        candidates: tuple[Candidate, ...],
        prefix: Sequence[int],
        boundary: int | None,
        kind: str,
        space: str,
    ) -> StateHit | None:
        found = best_hit(candidates, kind, prefix, boundary, self.partial, space)
        return StateHit(self._entries[found[0]], found[1]) if found is not None else None

    def peek(self, prefix: Sequence[int], boundary: int | None, *, kind: str = STATE, space: str = "") -> int:
        """Tokens of `prefix` a lookup would serve now, for admission on the event loop: read from the
        keys published after the last change (an immutable tuple), so it never races the engine
        thread; an estimate (the entry may be gone when the work starts)."""
        found = best_hit(self._published, kind, prefix, boundary, self.partial, space)
        return found[1] if found is not None else 0

    def take(self, hit: StateHit, seq: int) -> None:
        """Copy a hit into `seq` (cut to the hit's length if it is shorter than the entry) and pin it."""
        cut = hit.length < len(hit.entry.tokens)
        self._pool.share(hit.entry.seq, seq, end=hit.entry.start + hit.length if cut else None)
        hit.entry.pins += 1
        self._touch(hit.entry)
        self._metrics.cache_lookups.labels(hit.entry.kind, "hit").inc()
        self._metrics.cache_tokens.labels(hit.entry.kind).inc(hit.length)

    def missed(self, kind: str = STATE) -> None:
        self._metrics.cache_lookups.labels(kind, "miss").inc()

    def unpin(self, entry: CachedState) -> None:
        entry.pins -= 1
        assert entry.pins >= 0, "an entry was unpinned more often than pinned"

    # --- keeping ---------------------------------------------------------------------------------
    def store(
        self, tokens: Sequence[int], seq: int, *, longer: bool = False, kind: str = STATE, space: str = ""
    ) -> bool:
        """Keep a copy of `seq`, which holds `tokens` (after the head, for a state; and more after
        them if `longer`: the copy is cut, on models that allow it). False when it did not fit (or
        is already kept): a cache never takes what running work needs."""
        key = (kind, space, tuple(tokens))
        if not self._make_room(key, len(key[2])):
            return False
        copy = self._pool.take_free()
        if copy is None:
            return False
        start = self.head if kind == STATE else 0
        assert not longer or self.partial, "only a model that allows partial hits may cut a copy"
        self._pool.share(seq, copy, end=start + len(key[2]) if longer else None)
        self._add(CachedState(key[2], copy, kind=kind, start=start, prompt_tokens=len(key[2]), space=space))
        return True

    def adopt(
        self,
        tokens: Sequence[int],
        seq: int,
        *,
        prompt_tokens: int,
        replaces: CachedState | None = None,
        space: str = "",
    ) -> bool:
        """Keep `seq` itself as a chat turn holding `tokens` (its prompt's `prompt_tokens`, then what
        it generated) from position 0: a finished chat hands its sequence over, nothing is copied.
        `replaces`, the turn it continued, goes first if nobody else has it pinned: a conversation
        keeps its latest turn. False when it does not fit: the caller still owns `seq`."""
        if replaces is not None:
            self.drop(replaces)
        key = (CHAT, space, tuple(tokens))
        if not self._make_room(key, len(key[2])):
            return False
        self._add(CachedState(key[2], seq, kind=CHAT, start=0, prompt_tokens=prompt_tokens, space=space))
        return True

    def _make_room(self, key: Key, cells: int) -> bool:
        """Evict least recently used entries until `key`, holding `cells`, fits the budget; False if
        it cannot (or is kept already)."""
        if not cells or key in self._entries or cells > self.max_cells:
            return False
        while len(self._entries) >= self.max_seqs or self.cells + cells > self.max_cells:
            if self.evict_one() is None:
                return False
        return True

    def _add(self, entry: CachedState, *, stored: bool = True) -> None:
        self._entries[entry.key] = entry
        if stored:
            self._metrics.cache_stores.labels(entry.kind).inc()
        self._publish()

    def drop(self, entry: CachedState) -> None:
        """Evict this entry now, if it is still kept and nobody has it pinned: a chat turn that its
        conversation's next turn replaces. It has no use any more, so it is not saved, and a copy in
        host memory goes too (a conversation keeps one entry)."""
        if not entry.pins and self._entries.get(entry.key) is entry:
            if self.host is not None:
                self.host.discard(entry.key)
            self._evict(entry)

    def reclaim(self, cells: int, *, whole: bool = True) -> int:
        """Evict unpinned entries, least recently used first, until `cells` are freed; the cells
        freed. With `whole`, nothing goes when all that could go would not free that many (a unit
        starts only with all its cells). The one way running work takes cells from the cache: a
        unit about to start (`Step`), and generating chats (the engine loop)."""
        if cells <= 0 or (whole and self.spare_cells < cells):
            return 0
        freed = 0
        while freed < cells:
            got = self.evict_one()
            if got is None:
                break
            freed += got
        return freed

    def evict_one(self) -> int | None:
        """Drop the least recently used unpinned entry, saved in host memory first (`_save`); the
        cells it held, or None if none can go."""
        for entry in self._entries.values():
            if not entry.pins:
                self._save(entry)
                self._evict(entry)
                return entry.cells
        return None

    # --- the host-memory tier --------------------------------------------------------------------
    def _save(self, entry: CachedState) -> None:
        """Save an entry evicted for running work or the budget in host memory (all its sequence's
        cells: K/V, and the recurrent state on hybrid models), unless a copy is there already (then
        that copy is used again: the most recently used now). One larger than the budget is not, nor
        one the process has no memory for now (MemoryError): a save only spares a prefill later, so
        the entry is evicted unsaved, and asked again it is a miss."""
        if self.host is None or self.host.get(entry.key) is not None:
            return
        try:
            data = self._pool.save(entry.seq)
        except MemoryError as exc:
            log.warning("a kept %s of %d tokens was evicted unsaved: %s", entry.kind, len(entry.tokens), exc)
            return
        self.host.put(
            SavedState(entry.kind, entry.tokens, data, entry.start, entry.prompt_tokens, space=entry.space)
        )

    def _restore(self, saved: SavedState, room: Room, then: int) -> CachedState | None:
        """Keep `saved` again in a free sequence; None (a miss: nothing is held, nothing leaks) when its
        cells with `then` more, or a sequence, are not free after evicting unpinned entries, or when
        llama.cpp cannot place it (it removes what it had restored).

        Cells: the restored sequence holds every position from 0, a state's head too. Where a copy may
        be cut (attention-only models) a state's head goes back to the head sequence's cells (its own
        copy is removed, the head sequence's shared), so it holds what it held before it was evicted;
        on the other models (a recurrent state cannot be cut) it keeps its own head (`head_cells`)."""
        shares_head = saved.kind == STATE and self.partial
        own_head = 0 if shares_head else saved.start
        if not room.lend_cells(saved.cells, then=then):
            return None
        seq = self._pool.take_free() if self._make_room(saved.key, len(saved.tokens) + own_head) else None
        if seq is None:
            room.return_cells(saved.cells)
            return None
        head = saved.start if shares_head else 0
        if not self._pool.restore(seq, saved.data, head=head):  # released again when it failed
            room.return_cells(saved.cells)
            self._metrics.cache_host_restores.labels(saved.kind, "failed").inc()
            return None
        room.return_cells(head)  # the head sequence's cells, shared
        entry = CachedState(
            saved.tokens,
            seq,
            kind=saved.kind,
            start=saved.start,
            prompt_tokens=saved.prompt_tokens,
            head_cells=own_head,
            space=saved.space,
        )
        self._add(entry, stored=False)
        self._metrics.cache_host_restores.labels(saved.kind, "hit").inc()
        return entry

    def _evict(self, entry: CachedState) -> None:
        del self._entries[entry.key]
        self._pool.release(entry.seq)
        self._metrics.cache_evictions.labels(entry.kind).inc()
        self._publish()

    def clear(self) -> None:
        """Forget every kept entry without touching memory (it was cleared, the pool reset). What
        host memory holds stays: it is bytes, valid for the same model and context."""
        self._entries.clear()
        self._publish()


def best_hit(
    candidates: Iterable[Candidate],
    kind: str,
    prefix: Sequence[int],
    boundary: int | None,
    partial: bool,
    space: str = "",
) -> tuple[Key, int] | None:
    """The key among `candidates` whose entry serves the most of `prefix`, and how many tokens: the
    one rule of `StateCache.lookup` and `StateCache.peek`. Only entries of the request's `kind` and
    cache `space` serve it.

    - exact, a state: the entry is the request's prefix up to its own canonical `boundary`;
    - exact, a chat turn: the entry begins the prompt and leaves one token of it at least to decode
      (the first token is sampled from the prompt's last position);
    - partial (models that allow it): the longest common prefix with an entry, at least
      `MIN_PARTIAL_HIT` tokens, and one token of the prefix left to decode: the last position must
      be computed again where the copy is cut;
    - a chat turn serves only a prompt that continues its conversation: one that covers its whole
      prompt (`floor`). So a first turn, or the same request sent again, is prefilled whole, the
      way it was the first time, and gives the same answer again; conversations that merely share
      a system prompt do not share its cells.
    """
    wanted = tuple(prefix)
    best: tuple[Key, int] | None = None
    for key, floor in candidates:
        entry_kind, entry_space, tokens = key
        if entry_kind != kind or entry_space != space:
            continue
        length = 0
        size = len(tokens)
        # A state's exact hit ends at its own boundary; a chat turn's leaves a token to decode.
        exact_size = boundary == size if kind == STATE else size < len(wanted)
        if exact_size and wanted[:size] == tokens:
            length = size
        elif partial:
            common = min(_common_prefix(tokens, wanted), len(wanted) - 1)
            length = common if common >= MIN_PARTIAL_HIT else 0
        if length < floor:
            length = 0
        if length and (best is None or length > best[1]):
            best = (key, length)
    return best


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix, by bisection over slice comparisons (each one in C)."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while low < high:  # a[:low] == b[:low], a[:high + 1] != b[:high + 1]
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


Answered = Callable[[dict[Any, Any] | None], None]  # a follower's callback: the readouts, or None


class RepeatCache:
    """Raw readouts of prompts already answered, bounded, least recently used first, and the prompts
    being answered now. Its lock lets admission ask `peek` from the event loop while the engine
    thread reads and writes.

    In flight (single flight): a work about to decode items `claim`s their keys. A later work whose
    every open item is claimed by another (the same request sent again while the first runs: an
    agent's retry, a coherence run's parallel asks) `follow`s them instead of decoding them again:
    `put` hands it the readouts; if the claimant goes first (`give_up`: failed, cancelled), it gets
    None and decodes them itself. Everything but `peek` runs on the engine thread."""

    def __init__(self, max_entries: int, *, metrics: Any) -> None:
        self.max_entries = max_entries
        self._metrics = metrics
        self._entries: OrderedDict[bytes, dict[Any, Any]] = OrderedDict()
        self._claims: dict[bytes, object] = {}  # key -> the owner decoding it now
        self._followers: dict[bytes, list[tuple[object, Answered]]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, key: bytes) -> bool:
        """Whether `key` is kept now or being decoded (admission's estimate; no hit is counted)."""
        with self._lock:
            return key in self._entries or key in self._claims

    def get(self, key: bytes) -> dict[Any, Any] | None:
        with self._lock:
            outputs = self._entries.get(key)
            if outputs is not None:
                self._entries.move_to_end(key)
        if outputs is not None:
            self._metrics.cache_lookups.labels("repeat", "hit").inc()
        return None if outputs is None else dict(outputs)

    def claim(self, key: bytes, owner: object) -> None:
        """`owner` decodes `key` (a miss); unless someone else already does."""
        self._metrics.cache_lookups.labels("repeat", "miss").inc()
        with self._lock:
            self._claims.setdefault(key, owner)

    def claimed_by_other(self, key: bytes, owner: object) -> bool:
        with self._lock:
            claimant = self._claims.get(key)
        return claimant is not None and claimant is not owner

    def follow(self, key: bytes, owner: object, then: Answered) -> None:
        """`then` gets `key`'s readouts when its claimant puts them (None if it gives up)."""
        self._metrics.cache_lookups.labels("repeat", "in_flight").inc()
        self._followers.setdefault(key, []).append((owner, then))

    def put(self, key: bytes, outputs: dict[Any, Any]) -> None:
        with self._lock:
            self._claims.pop(key, None)
            stored = key not in self._entries
            if stored:
                self._entries[key] = dict(outputs)
            else:
                self._entries.move_to_end(key)
            evicted = 0
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                evicted += 1
        if stored:
            self._metrics.cache_stores.labels("repeat").inc()
        if evicted:
            self._metrics.cache_evictions.labels("repeat").inc(evicted)
        for _, then in self._followers.pop(key, ()):
            then(dict(outputs))

    def give_up(self, owner: object) -> None:
        """`owner` is gone: its claims' followers decode for themselves, and it follows nothing."""
        with self._lock:
            dropped = [key for key, claimant in self._claims.items() if claimant is owner]
            for key in dropped:
                del self._claims[key]
        for key in list(self._followers):
            kept = [(who, then) for who, then in self._followers[key] if who is not owner]
            if kept:
                self._followers[key] = kept
            else:
                del self._followers[key]
        for key in dropped:
            for _, then in self._followers.pop(key, ()):
                then(None)


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
