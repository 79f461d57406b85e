"""The host-memory tier behind the kept states (decider.engine.memory.host_cache, `StateCache._restore`).

First the bookkeeping on fakes (what is saved when, the byte budget, the cells a restored entry
holds with and without its own head, failed and refused restores, admission's peek), then on the
models with a device budget of one kept sequence: SmolLM2 (attention only: a restored state gives
its head back to the head sequence) and the tiny Qwen3.5 (hybrid: it keeps its own head), a state
and a chat turn evicted, saved and restored. After every model test nothing runs, no entry is
pinned, and only the prompt head and the kept states hold memory.
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import EXAMPLE
from test_state_cache import (
    OTHER_QUESTIONS,
    FakeMemory,
    assert_agree,
    assert_released,
    converse,
    decide,
    distributions,
    kept,
    load,
    opening,
    state_tokens,
    unique,
)

from decider.engine import DecisionEngine
from decider.engine.memory.prefix_cache import CHAT, STATE, Caches, StateCache
from decider.engine.memory.sequences import SeqPool
from decider.engine.model.native import Row
from decider.engine.scheduling.steps import Step
from decider.invariance import HEAD_SEQ
from decider.schemas.decision import parse_decision_request
from decider.server.metrics import ServerMetrics
from decider.settings import Settings


# --- bookkeeping, on fakes ---------------------------------------------------------------------------
def tiered(
    *, partial: bool, host_bytes: int = 1000, max_seqs: int = 1, seqs: int = 6
) -> tuple[StateCache, SeqPool, FakeMemory, ServerMetrics]:
    metrics = ServerMetrics()
    cache, pool, memory = kept(
        partial=partial, seqs=seqs, max_seqs=max_seqs, host_bytes=host_bytes, metrics=metrics
    )
    return cache, pool, memory, metrics


def step_of(cache: StateCache, pool: SeqPool, memory: FakeMemory, cells_left: int = 100) -> Step:
    return Step(pool, tokens_left=64, cells_left=cells_left, runtime=memory, caches=Caches(cache, None))


def count(metrics: ServerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def saves(metrics: ServerMetrics, kind: str = STATE) -> float:
    return count(metrics, "decider_cache_host_saves_total", cache=kind)


def test_an_evicted_state_is_saved_and_restored_with_its_own_head_where_copies_cannot_be_cut() -> None:
    cache, pool, memory, metrics = tiered(partial=False)
    a, b = [1] * 20, [2] * 20
    cache.store(a, seq=5)
    saved_seq = cache._entries[(STATE, "", tuple(a))].seq
    cache.store(b, seq=5)  # one kept sequence: `a` gives way to `b`, saved first
    assert ("save", saved_seq) in memory.ops and (STATE, "", tuple(a)) in cache.host and len(cache) == 1
    assert saves(metrics) == 1 and count(metrics, "decider_cache_host_bytes") == 100
    assert cache.lookup([*a, 9], boundary=20) is None  # no step to restore it in: the kept entries only
    assert cache.peek([*a, 9], boundary=20) == 20  # admission counts it as a hit: it decodes nothing

    step = step_of(cache, pool, memory, cells_left=100)
    hit = cache.lookup([*a, 9], boundary=20, room=step, then=35)
    assert hit is not None and hit.length == 20
    entry = hit.entry
    assert memory.ops[-1] == ("restore", entry.seq, saved_seq)
    # Its sequence holds every position from 0: the head's 10 cells are its own, not the head's.
    assert entry.head_cells == 10 and entry.cells == cache.cells == 30 and step.cells_left == 70
    assert list(cache._entries) == [(STATE, "", tuple(a))] and saves(metrics) == 2  # `b` went, saved
    assert count(metrics, "decider_cache_host_restores_total", cache="state", outcome="hit") == 1
    assert count(metrics, "decider_cache_stores_total", cache="state") == 2  # a restore is no store

    cache.take(hit, 3)  # the caller copies it as any kept hit: whole, never cut
    assert memory.ops[-1] == ("cp", entry.seq, 3) and entry.pins == 1
    assert cache.evict_one() is None  # pinned
    cache.unpin(entry)
    assert cache.evict_one() == 30  # its head's cells go with it
    assert saves(metrics) == 2 and len(cache.host) == 2  # its copy is there already: only touched
    assert pool.free == pool.available == 5


def test_where_copies_can_be_cut_a_restored_state_shares_the_head_again() -> None:
    """Attention-only models: the restored copy of the head is removed and the head sequence's cells
    shared, so the entry holds what it held before it was evicted. A partial hit restores it too."""
    cache, pool, memory, _metrics = tiered(partial=True)
    a = list(range(20))
    cache.store(a, seq=5)
    saved_seq = cache._entries[(STATE, "", tuple(a))].seq
    cache.store(list(range(100, 120)), seq=5)
    step = step_of(cache, pool, memory, cells_left=100)
    grown = [*a[:18], 7, 7]
    hit = cache.lookup(grown, boundary=None, room=step, then=25)
    assert hit is not None and hit.length == 18
    seq = hit.entry.seq
    assert memory.ops[-3:] == [("restore", seq, saved_seq), ("cut below", seq, 10), ("cp", HEAD_SEQ, seq)]
    assert hit.entry.head_cells == 0 and cache.cells == 20 and step.cells_left == 80
    cache.take(hit, 3)
    assert memory.ops[-2:] == [("cp", seq, 3), ("cut", 3, 10 + 18)]


def test_a_kept_hit_that_covers_as_much_is_used_as_it_is() -> None:
    cache, pool, memory, _metrics = tiered(partial=True, max_seqs=2)
    a = list(range(20))
    cache.store(a, seq=5)
    cache.store(list(range(100, 120)), seq=5)
    cache.store(list(range(200, 220)), seq=5)  # `a` saved
    cache.store(a, seq=5)  # and kept again
    step = step_of(cache, pool, memory)
    hit = cache.lookup([*a, 1], boundary=None, room=step, then=25)
    assert hit is not None and hit.entry.head_cells == 0 and not any(op[0] == "restore" for op in memory.ops)
    assert step.cells_left == 100


def test_host_memory_is_a_byte_budget_least_recently_used() -> None:
    cache, pool, memory, metrics = tiered(partial=False, host_bytes=250)
    states = [[i] * 20 for i in range(1, 5)]
    for tokens in states:
        cache.store(tokens, seq=5)  # each evicts the one before it: three saved, 100 bytes each
    host = cache.host
    assert host is not None
    assert [saved.tokens for saved in host.saved()] == [tuple(states[1]), tuple(states[2])]
    assert host.bytes == count(metrics, "decider_cache_host_bytes") == 200
    assert count(metrics, "decider_cache_host_evictions_total", cache="state") == 1

    memory.saved_bytes = 300  # larger than the whole budget: not saved, nothing else evicted for it
    cache.store([9] * 20, seq=5)
    assert (STATE, "", tuple(states[3])) not in host and host.bytes == 200 and saves(metrics) == 3

    memory.saved_bytes = 100
    step = step_of(cache, pool, memory)
    assert cache.lookup([*states[1], 0], boundary=20, room=step, then=30) is not None  # used again
    assert [saved.tokens for saved in host.saved()] == [tuple(states[1]), (9,) * 20]  # states[2] went


def test_an_entry_with_no_host_memory_for_it_is_evicted_unsaved(caplog: pytest.LogCaptureFixture) -> None:
    """No memory (or no mapping) for a save is a MemoryError from the runtime: the eviction it served
    still frees the entry's cells and nothing is saved (the error used to reach the engine loop, which
    failed the request whose start or answer needed the cells with a 500); the next save works."""
    cache, _pool, memory, metrics = tiered(partial=False)
    cache.store([1] * 20, seq=5)
    real = memory.seq_save

    def no_memory(seq_id: int) -> bytes:
        raise MemoryError("no host memory for it")

    memory.seq_save = no_memory  # type: ignore[method-assign]
    cache.store([2] * 20, seq=5)  # evicts [1] * 20, whose save fails
    host = cache.host
    assert host is not None and len(host) == 0 and saves(metrics) == 0
    assert [entry.tokens for entry in cache._entries.values()] == [(2,) * 20]
    assert "a kept state of 20 tokens was evicted unsaved: no host memory for it" in caplog.text
    memory.seq_save = real  # type: ignore[method-assign]
    cache.store([3] * 20, seq=5)
    assert [saved.tokens for saved in host.saved()] == [(2,) * 20] and saves(metrics) == 1


def test_a_failed_restore_is_a_miss_that_leaves_nothing_held() -> None:
    cache, pool, memory, metrics = tiered(partial=False)
    a = [1] * 20
    cache.store(a, seq=5)
    cache.store([2] * 20, seq=5)
    step = step_of(cache, pool, memory, cells_left=100)
    memory.restores_fail = True
    assert cache.lookup([*a, 9], boundary=20, room=step, then=35) is None
    tried = next(op[1] for op in reversed(memory.ops) if op[0] == "restore")
    assert memory.ops[-1] == ("rm", tried) and len(cache) == 0 and cache.cells == 0
    assert pool.free == pool.available == 5 and step.cells_left == 100  # its sequence and cells are back
    assert count(metrics, "decider_cache_host_restores_total", cache="state", outcome="failed") == 1
    memory.restores_fail = False
    assert cache.lookup([*a, 9], boundary=20, room=step, then=35) is not None  # still saved


def test_a_restore_that_would_make_the_unit_wait_is_a_miss() -> None:
    """The restored entry's cells and the cells the unit still needs beside it must be free (kept
    states evicted for them), and a sequence must stay for the unit; else nothing is restored (and
    nothing evicted for it), and the unit starts as on a miss."""
    cache, pool, memory, _metrics = tiered(partial=False)
    a, b = [1] * 20, [2] * 20
    cache.store(a, seq=5)
    cache.store(b, seq=5)  # kept: 20 cells the step may evict
    step = step_of(cache, pool, memory, cells_left=40)
    assert cache.lookup([*a, 9], boundary=20, room=step, then=51) is None  # 30 + 31 > 40 + 20
    assert list(cache._entries) == [(STATE, "", tuple(b))] and step.cells_left == 40
    step.starts_allowed = False  # the gate is closed: nothing starts in this step
    assert cache.lookup([*a, 9], boundary=20, room=step, then=0) is None
    step.starts_allowed = True
    step.branch_reserve = pool.available - 3  # the entry's sequence taken, and a unit could wait for one
    assert cache.lookup([*a, 9], boundary=20, room=step, then=0) is None
    assert not any(op[0] == "restore" for op in memory.ops)
    step.branch_reserve = 0
    assert cache.lookup([*a, 9], boundary=20, room=step, then=50) is not None  # evicts `b` for it
    assert step.cells_left == 30


def test_a_chat_turn_its_next_turn_replaces_is_not_saved() -> None:
    """A conversation keeps one entry: the turn its next turn replaces goes unsaved, and so does its
    copy in host memory when the turn had been restored from there."""
    cache, pool, memory, metrics = tiered(partial=True, max_seqs=2)
    first = list(range(100, 140))
    cache.adopt([*first, 7], 2, prompt_tokens=40)
    hit = cache.lookup([*first, 7, 8, 9], boundary=None, kind=CHAT)
    cache.take(hit, 3)
    cache.unpin(hit.entry)
    assert cache.adopt([*first, 7, 8, 9, 10], 3, prompt_tokens=43, replaces=hit.entry)
    assert saves(metrics, CHAT) == 0 and not any(op[0] == "save" for op in memory.ops)

    turn = next(iter(cache._entries.values()))
    cache.store([1] * 20, seq=5)
    cache.store([2] * 20, seq=5)  # the turn is evicted for these: saved
    assert turn.key in cache.host and saves(metrics, CHAT) == 1
    step = step_of(cache, pool, memory)
    hit = cache.lookup([*turn.tokens, 11, 12], boundary=None, kind=CHAT, room=step, then=46)
    assert hit is not None and hit.length == len(turn.tokens) and hit.entry.head_cells == 0
    cache.take(hit, 4)
    cache.unpin(hit.entry)
    assert cache.adopt([*turn.tokens, 11, 12, 13], 4, prompt_tokens=46, replaces=hit.entry)
    assert turn.key not in cache.host and cache.peek([*turn.tokens, 11], boundary=None, kind=CHAT) == 0


def test_clearing_the_memory_keeps_what_host_memory_holds() -> None:
    cache, pool, memory, _metrics = tiered(partial=False)
    cache.store([1] * 20, seq=5)
    cache.store([2] * 20, seq=5)
    cache.clear()
    pool.reset()
    assert len(cache) == 0 and cache.peek([1] * 21, boundary=20) == 20
    assert cache.lookup([1] * 21, boundary=20, room=step_of(cache, pool, memory), then=30) is not None


# --- on the models ------------------------------------------------------------------------------------
ONE_KEPT = {"state_cache_seqs": 1}  # every new kept entry evicts the one before it


@pytest.fixture(scope="module")
def smollm2_one(smollm2_path: Path) -> Iterator[DecisionEngine]:
    yield from load(smollm2_path, **ONE_KEPT)


@pytest.fixture(scope="module")
def qwen35_one(qwen35_path: Path) -> Iterator[DecisionEngine]:
    yield from load(qwen35_path, n_ctx=4096, n_batch=512, max_state_tokens=2048, **ONE_KEPT)


@pytest.fixture
def one_kept(request: pytest.FixtureRequest) -> Iterator[DecisionEngine]:
    """The engine named by the test's parameter; after the test, nothing is left held."""
    engine = request.getfixturevalue(request.param)
    yield engine
    assert_released(engine)


def decoded_tokens(engine: DecisionEngine, run: Callable[[], Any]) -> tuple[Any, int]:
    """What `run` returns, and the tokens every decode it caused carried."""
    runtime, real, tokens = engine.runtime, engine.runtime.decode, [0]

    def counting(rows: list[Row], **kwargs: Any) -> None:
        tokens[0] += sum(len(row.tokens) for row in rows)
        real(rows, **kwargs)

    runtime.decode = counting  # type: ignore[method-assign]
    try:
        return run(), tokens[0]
    finally:
        runtime.decode = real  # type: ignore[method-assign]


@pytest.mark.model
@pytest.mark.parametrize("one_kept", ["smollm2_one", "qwen35_one"], indirect=True)
def test_an_evicted_state_comes_back_from_host_memory(one_kept: DecisionEngine) -> None:
    engine = one_kept
    states = engine._local.loop.caches.states
    # on by default, sized at load from the memory left (this machine leaves gigabytes)
    assert engine.settings.state_cache_host_mib is None and states.host is not None
    assert states.host.max_bytes == engine.cache_budget.host_bytes >= 1024**3
    body = unique(EXAMPLE)
    decide(engine, body)
    plan = engine.plan_decision(parse_decision_request(body))
    key = (STATE, "", tuple(plan.states[0].prompt.tokens))
    decide(engine, unique(EXAMPLE))  # the one kept sequence goes to this state: `body`'s is saved
    assert key not in states._entries and key in states.host
    # Saved into a mapping of its own (not the C heap, which keeps what it frees in blocks of a few
    # MiB), released with the entry.
    saved = states.host.get(key)
    assert saved is not None and isinstance(saved.data, mmap.mmap)
    assert 0 < len(saved.data) <= states.host.bytes
    mapping = weakref.ref(saved.data)
    del saved

    again = {**body, "questions": OTHER_QUESTIONS}
    miss_tokens = engine.plan_decision(parse_decision_request({**again, "extensions": True})).cost_tokens
    restored, tokens = decoded_tokens(engine, lambda: decide(engine, again))
    boundary = state_tokens(engine, body)
    assert restored.usage.cached_tokens == boundary and tokens == miss_tokens - boundary
    assert mapping() is not None  # still saved (kept in both tiers: not saved again when evicted)
    states.host.discard(key)
    assert mapping() is None  # dropped: nothing else held it, and its pages went back at once
    entry = states._entries[key]
    own_head = 0 if engine.runtime.partial_reuse else len(engine.head_tokens)  # the hybrid keeps its own
    assert entry.head_cells == own_head and states.cells == boundary + own_head
    # Default kernels: the restored cells lie elsewhere than a prefill's, so not bitwise (fresh mode,
    # one prefill per question, is the reference: it uses no kept state).
    reference = decide(engine, {**again, "mode": "fresh"})
    assert_agree(distributions(restored), distributions(reference))


@pytest.mark.model
def test_a_chat_turn_comes_back_from_host_memory(smollm2_one: DecisionEngine) -> None:
    engine = smollm2_one
    states = engine._local.loop.caches.states
    _usages, messages = converse(engine, [opening()])
    first = engine.chat_plan(messages[:1], max_tokens=6, max_tokens_cap=6)
    (turn,) = states._entries.values()
    assert turn.kind == CHAT
    decide(engine, unique(EXAMPLE))  # the turn is evicted for this state, saved
    assert turn.key in states.host and turn.key not in states._entries
    messages.append({"role": "user", "content": "What should I do now?"})
    _text, finish, usage = engine.generate(messages, max_tokens=6, temperature=0.0)
    assert finish in ("stop", "length") and usage.cached_tokens >= len(first.prompt) > 0
    # It replaced the turn it continued: neither the turn nor its saved copy is kept any more.
    assert turn.key not in states._entries and turn.key not in states.host
    assert [entry.kind for entry in states._entries.values()] == [CHAT]
    assert_released(engine)


def test_the_host_tier_is_off_with_its_setting_at_zero_and_with_batch_invariance() -> None:
    """The budget comes from the settings only; the engine keeps no state at all with batch
    invariance (memory epochs), so no host tier either (tests/engine/test_state_cache.py)."""
    assert Settings(model_path="/m.gguf", state_cache_host_mib=64).cache_budget.host
    assert Settings(model_path="/m.gguf").cache_budget.host_bytes is None  # sized by the loaded engine
    assert not Settings(model_path="/m.gguf", state_cache_host_mib=0).cache_budget.host
    assert not Settings(model_path="/m.gguf", state_cache_seqs=0, state_cache_host_mib=64).cache_budget.host


def test_a_saved_entry_keeps_its_cache_space() -> None:
    """A state saved to host memory and restored still serves only the space that kept it."""
    cache, pool, memory, _metrics = tiered(partial=False)
    a = [1] * 20
    cache.store(a, seq=5, space="tenant-a")
    cache.store([2] * 20, seq=5)  # one kept sequence: `a` is saved
    assert (STATE, "tenant-a", tuple(a)) in cache.host
    step = step_of(cache, pool, memory)
    assert cache.peek([*a, 9], boundary=20) == 0
    assert cache.lookup([*a, 9], boundary=20, room=step, then=25) is None
    hit = cache.lookup([*a, 9], boundary=20, space="tenant-a", room=step, then=25)
    assert hit is not None and hit.length == 20 and hit.entry.space == "tenant-a"
