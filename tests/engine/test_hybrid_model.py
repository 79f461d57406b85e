"""The decision paths on the production model's architecture: Qwen3.5 (`qwen35`), a hybrid of gated
delta-net recurrent layers and attention, as a tiny random-weight GGUF built at test time
(tools/dev/qwen35_gguf.py). Mechanics, not answers: every decode succeeds, every sequence is released, and
shared and fresh answers agree as far as the architecture allows.

Batch invariance does not hold there: llama.cpp splits a hybrid model's decodes into micro-batches
of equal tokens per sequence, not into n_ubatch runs, so a row can end alone in one (isolated in
`test_why_invariance_cannot_hold_there_...`). With the batch-invariant kernels and the pad forced on,
fresh and shared answers differed on 2 of 8 JevBench cases (max |Δp| 5e-4; alone, in case and
concurrently they matched there). So the engine refuses DECIDER_BATCH_INVARIANT=true on such a
model and leaves it off by default.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest
from engine_helpers import EXAMPLE

from decider.engine import DecisionEngine
from decider.engine.model.labels import READOUT_CHAIN, build_label_table
from decider.engine.model.native import (
    ContextConfig,
    DecodeAbortedError,
    KvCacheFullError,
    LlamaRuntime,
    OutputSpec,
    Row,
)
from decider.engine.works.chat import ChatWork
from decider.engine.works.decision_work import DecisionWork
from decider.errors import StartupError, UnavailableError
from decider.invariance import HEAD_SEQ, BatchPolicy
from decider.schemas.decision import DecisionResponse, parse_batch_request, parse_decision_request
from decider.server.answers import decision_response
from decider.settings import Settings
from decider_dev.qwen35_gguf import ARCH

pytestmark = pytest.mark.model

REPO_ROOT = Path(__file__).resolve().parents[2]
# Without batch invariance a question's probabilities move with what shares its micro-batches:
# measured up to 2.6e-3 on JevBench states with this model (and 0.05 on SmolLM2 before invariance).
AGREE = 1e-2
CASE = {
    "state": "Order 1182 arrived broken. I asked for a refund twice and nobody answered.",
    "questions": {
        "team": {
            "type": "choice",
            "instructions": "Which team owns this?",
            "criteria": {"billing": "Payments, refunds", "shipping": "Deliveries", "sales": None},
        },
        "refund": {"type": "noul", "instructions": "Is money back requested?"},
        "anger": {"type": "score", "instructions": "How frustrated?", "criteria": ["Calm", "Civil", "Angry"]},
    },
}


class DecodeLog:
    """Wraps the runtime's decode: records every call's outcome; `fault` may refuse a call first."""

    def __init__(self, runtime: LlamaRuntime) -> None:
        self.runtime = runtime
        self.real = runtime.decode
        self.outcomes: list[str] = []
        self.fault: Callable[[list[Row]], None] | None = None
        runtime.decode = self.decode  # type: ignore[method-assign]

    def decode(self, rows: list[Row], **kwargs: Any) -> None:
        try:
            if self.fault is not None:
                self.fault(rows)
            self.real(rows, **kwargs)
        except Exception as exc:
            self.outcomes.append(type(exc).__name__)
            raise
        self.outcomes.append("ok")


@pytest.fixture(scope="session")
def hybrid(qwen35_path: Path) -> Iterator[tuple[DecisionEngine, DecodeLog]]:
    """One engine on the tiny Qwen3.5 for the session (load: about 0.3 s). `n_batch` 512: a
    state of more than 512 tokens is prefilled over several steps. Nothing is kept across requests
    here: these tests are about the decodes themselves (tests/engine/test_state_cache.py has the
    caches on this model)."""
    settings = Settings(
        model_path=qwen35_path,
        n_ctx=4096,
        n_batch=512,
        max_state_tokens=2048,
        state_cache_seqs=0,
        repeat_cache_entries=0,
    )
    engine = DecisionEngine.load(settings)
    engine.decide(parse_decision_request(EXAMPLE))  # starts the private scheduler
    log = DecodeLog(engine.runtime)
    yield engine, log
    engine.close()


@pytest.fixture
def engine(hybrid: tuple[DecisionEngine, DecodeLog]) -> Iterator[DecisionEngine]:
    """The hybrid engine (in this module, in place of tests/conftest.py's SmolLM2 `engine`); after each
    test every decode has succeeded and every sequence is free."""
    engine, log = hybrid
    log.outcomes.clear()
    yield engine
    log.fault = None
    assert set(log.outcomes) <= {"ok"}, log.outcomes
    assert_released(engine)


def assert_released(engine: DecisionEngine) -> None:
    """Nothing runs, and only the prompt head and the kept states hold memory (unpinned)."""
    scheduler = engine._local
    pool = scheduler.loop.seqs
    assert not scheduler.loop.works and not scheduler.admission.admitted
    assert pool.available == engine.runtime.n_seq_max - len(pool.reserved)
    states = scheduler.loop.caches.states
    kept = sorted(states.seqs) if states is not None else []
    assert states is None or states.spare_seqs == len(states)  # no entry is pinned any more
    assert pool.free + len(kept) == pool.available
    memory = engine.runtime._mem
    # On hybrid memory pos_max is the smaller of the two caches' answers and pos_min the larger: a
    # sequence left in either one (KV cells or a recurrent state) has pos_min >= 0.
    held = [s for s in range(engine.runtime.n_seq_max) if llama_cpp.llama_memory_seq_pos_min(memory, s) >= 0]
    assert held == sorted([HEAD_SEQ, *kept])  # the cached prompt head, and the kept states


def context(n_ctx: int, n_batch: int, n_ubatch: int, *, invariant: bool = False) -> ContextConfig:
    """A context of 8 sequences and 2 threads (the one place that knows ContextConfig's fields)."""
    policy = BatchPolicy(invariant, n_batch, n_ubatch, n_seq_max=8)
    return ContextConfig(n_ctx=n_ctx, policy=policy, n_threads=2, n_gpu_layers=0, flash_attn=True)


def force_invariance(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a batch-invariant context load on the hybrid (the runtime refuses it), without touching the
    process-wide kernel choice (the tiny model's Q4_1 matmuls have no K-quant tiled path anyway)."""
    monkeypatch.setattr(LlamaRuntime, "recurrent", property(lambda self: False))
    monkeypatch.setattr(BatchPolicy, "select_kernels", lambda self: None)


def decide(engine: DecisionEngine, body: dict[str, Any], **extra: Any) -> DecisionResponse:
    return decision_response(engine.decide(parse_decision_request({**body, **extra})))


def distributions(response: Any) -> dict[str, list[float]]:
    return {
        key: [answer.noul] if answer.type == "noul" else list(answer.probabilities.values())
        for key, answer in response.answers.items()
    }


def assert_agree(got: dict[str, list[float]], expected: dict[str, list[float]]) -> None:
    assert got.keys() == expected.keys()
    for key, probs in got.items():
        assert probs == pytest.approx(expected[key], abs=AGREE), key


def submit(engine: DecisionEngine, work: Any, kind: str = "decision") -> Any:
    job = engine._local.admit(kind, uuid.uuid4().hex)
    return job, engine._local.submit(job, work)


def test_the_tiny_model_is_the_production_architecture_and_invariance_is_off(
    engine: DecisionEngine, qwen35_path: Path
) -> None:
    production = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]["model"]
    assert "Qwen3.5" in production["file"]  # what the stacks deploy by default
    info = engine.model_info
    assert (info.architecture, info.quantization, info.chat_template_source) == (ARCH, "Q4_1", "gguf")
    assert engine.runtime.recurrent and qwen35_path.stat().st_size < 5_000_000
    assert not info.batch_invariant and engine.runtime.policy.pad_seq is None and info.n_ubatch == 512


def test_batch_invariance_is_refused_on_a_hybrid_model(qwen35_path: Path) -> None:
    with pytest.raises(StartupError) as refused:
        DecisionEngine.load(Settings(model_path=qwen35_path, batch_invariant=True))
    message = str(refused.value)
    assert message.startswith("DECIDER_BATCH_INVARIANT=true: ") and "recurrent" in message
    assert "\n" not in message


def test_why_invariance_cannot_hold_there_a_row_beside_another_sequence_changes(
    qwen35_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch-invariant configuration forced onto the hybrid (micro-batches of at most 63 tokens,
    the pad, no repacking): sequence B's logits change when A is decoded beside it. llama.cpp splits
    a hybrid decode into micro-batches of equal tokens per sequence, so B's 601st token is left alone
    in one, over 512 cells: the split-KV attention path. (On SmolLM2 the same is bitwise equal.) If
    this starts to pass bitwise, llama.cpp changed its split and the refusal can be revisited."""
    force_invariance(monkeypatch)
    config = context(2048, 2048, 63, invariant=True)
    runtime = LlamaRuntime(qwen35_path, config)
    tokens = runtime.tokenize("Some words about the sea, the wind and the ships. " * 120, special=False)
    a, b = tokens[:600], tokens[700:1301]
    spec = OutputSpec(token_ids=tuple(range(256)))

    def logits(rows: list[Row]) -> list[np.ndarray]:
        runtime.clear()
        runtime.decode(rows)
        return [row.result.logits.copy() for row in rows if row.result is not None]

    try:
        (b_alone,) = logits([Row(2, b, 0, spec)])
        a_beside, b_beside = logits([Row(1, a, 0, spec), Row(2, b, 0, spec)])
        (a_alone,) = logits([Row(1, a, 0, spec)])
    finally:
        runtime.close()
    assert np.array_equal(a_alone, a_beside)  # A's micro-batches hold 2 to 63 rows either way
    assert not np.array_equal(b_alone, b_beside), "llama.cpp no longer leaves B's last token alone"


def test_shared_fan_out_and_fresh_mode_agree(engine: DecisionEngine) -> None:
    shared = decide(engine, CASE, extensions=True)
    fresh = decide(engine, CASE, mode="fresh", extensions=True)
    assert (shared.extensions["mode"], shared.extensions["branches"]) == ("shared", 3)
    # The state's prefill, then the branches: rows of one length per decode (test_the_rows_of_...)
    assert shared.extensions["decodes"] >= 2
    assert fresh.extensions["mode"] == "fresh" and fresh.extensions["decodes"] >= 1  # one length a decode
    assert_agree(distributions(fresh), distributions(shared))
    assert distributions(decide(engine, CASE)) == distributions(shared)  # same batches: same bits


def test_multi_token_labels_read_by_the_chain_rule_agree_across_modes(engine: DecisionEngine) -> None:
    """Two-letter labels past 64 options: each label prefix is one more position in a copy of the
    branch (a copied recurrent state), in shared mode and in fresh mode alike."""
    runtime = engine.runtime
    planner = copy.copy(engine.planner)
    planner.labels = build_label_table(
        planner.builder,
        lambda text: runtime.tokenize(text, special=False),
        runtime.piece,
        255,
        single_limit=64,
    )
    criteria = {f"option {i}": f"Description {i}." for i in range(70)}
    body = {"state": "Evidence.", "questions": {"pick": {"type": "choice", "criteria": criteria}}}
    answers = {}
    for mode in ("shared", "fresh"):
        plan = planner.plan(parse_decision_request({**body, "mode": mode, "extensions": True}))
        outcome = submit(engine, DecisionWork(plan, planner))[1].result(30)
        answers[mode] = decision_response(outcome).answers["pick"]
    assert answers["shared"].extensions["readout"] == READOUT_CHAIN
    assert list(answers["fresh"].probabilities.values()) == pytest.approx(
        list(answers["shared"].probabilities.values()), abs=AGREE
    )


def test_a_long_state_and_more_branches_than_sequences(engine: DecisionEngine) -> None:
    """A state prefilled over two steps, then 36 branches (12 questions in 3 option orders) for 31
    free sequences: branches wait for sequences, each copying the state's recurrent state."""
    state = " ".join(f"Line {i}: the customer wrote again about order {1000 + i}." for i in range(45))
    criteria = {"a": "Yes", "b": "No", "c": None}
    questions = {
        f"q{i}": {"type": "choice", "instructions": f"Topic {i}?", "criteria": criteria} for i in range(12)
    }
    body = {"state": state, "questions": questions, "extensions": True}
    permuted = decide(engine, body, permutations=3)
    assert permuted.extensions["prefix_tokens"] > 512 and permuted.extensions["branches"] == 36
    assert permuted.extensions["decodes"] > 3
    assert_agree(distributions(decide(engine, body, mode="fresh")), distributions(decide(engine, body)))


def test_the_batch_route_answers_every_state_as_alone(engine: DecisionEngine) -> None:
    states = [CASE["state"], EXAMPLE["state"], "Nothing happened."]
    batch = decision_response(
        engine.decide(parse_batch_request({"states": states, "questions": CASE["questions"]}))
    )
    assert len(batch.results) == len(states)
    for state, result in zip(states, batch.results, strict=True):
        assert_agree(distributions(result), distributions(decide(engine, {**CASE, "state": state})))


def test_a_chat_generates_and_leaves_the_decisions_as_they_were(engine: DecisionEngine) -> None:
    before = distributions(decide(engine, CASE))
    messages = [{"role": "user", "content": "Say something."}]
    params = {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "stop": [], "seed": None}
    text, finish, usage = engine.generate(messages, **params)
    assert (finish, usage.completion_tokens) == ("length", 8) and text
    assert engine.generate(messages, **params)[0] == text
    assert distributions(decide(engine, CASE)) == before


def test_concurrent_requests_and_a_chat_share_decodes(engine: DecisionEngine) -> None:
    bodies = [CASE, EXAMPLE, {**CASE, "state": "Nothing happened."}]
    alone = [distributions(decide(engine, body)) for body in bodies]
    chat = engine.chat_plan(
        [{"role": "user", "content": "Hello"}], max_tokens=6, max_tokens_cap=16, temperature=0.0
    )
    futures = [submit(engine, ChatWork(chat), "chat")[1]]
    futures += [
        submit(engine, engine.decision_work(engine.plan_decision(parse_decision_request(b))))[1]
        for b in bodies
    ]
    _, finish, usage = futures[0].result(30)
    assert (finish, usage.completion_tokens) == ("length", 6)
    for future, expected in zip(futures[1:], alone, strict=True):
        assert_agree(distributions(decision_response(future.result(30))), expected)


def test_a_full_memory_splits_the_decode_and_a_row_that_never_fits_fails_alone(
    engine: DecisionEngine, hybrid: tuple[DecisionEngine, DecodeLog]
) -> None:
    """llama.cpp finds no slot for a multi-row decode: the scheduler halves it until the rows fit;
    a request whose prefix never fits fails alone (503 kv_cache_full), its sequences released."""
    log = hybrid[1]
    expected = [distributions(decide(engine, body)) for body in (CASE, EXAMPLE)]
    doomed = {**CASE, "state": "§§§§"}  # no other prompt has this token
    marker = engine.caller_text.tokenize(doomed["state"])[0]
    refused = []

    def no_slot(rows: list[Row]) -> None:
        if any(marker in row.tokens for row in rows) or (len(rows) > 1 and len(refused) < 4):
            refused.append(len(rows))
            raise KvCacheFullError("no memory slot")

    log.fault = no_slot
    bodies = (CASE, doomed, EXAMPLE)
    futures = [
        submit(engine, engine.decision_work(engine.plan_decision(parse_decision_request(b))))[1]
        for b in bodies
    ]
    error = futures[1].exception(30)
    assert isinstance(error, UnavailableError) and error.code == "kv_cache_full"
    got = [distributions(decision_response(futures[i].result(30))) for i in (0, 2)]
    assert 1 in refused and any(n > 1 for n in refused)
    assert log.outcomes.count("KvCacheFullError") == len(refused)
    log.outcomes = [outcome for outcome in log.outcomes if outcome != "KvCacheFullError"]
    for answers, alone in zip(got, expected, strict=True):
        assert_agree(answers, alone)


def test_a_refused_decode_leaves_the_recurrent_state_untouched(qwen35_path: Path) -> None:
    """A real `llama_decode` == 1 on hybrid memory: nothing moves, not even a recurrent state."""
    config = context(256, 256, 256)
    runtime = LlamaRuntime(qwen35_path, config)
    tokens = runtime.tokenize("The quick brown fox jumps over the lazy dog. " * 30, special=False)[:200]
    spec = OutputSpec(token_ids=tuple(range(64)))
    assert len(tokens) == 200 and runtime.n_ctx == 256

    def next_logits(refuse_first: bool) -> np.ndarray:
        runtime.clear()
        runtime.decode([Row(1, tokens, 0)])
        if refuse_first:
            with pytest.raises(KvCacheFullError):
                runtime.decode([Row(2, tokens[:100], 0)])  # 200 + 100 cells > 256
        row = Row(1, [tokens[0]], len(tokens), spec)
        runtime.decode([row])
        assert row.result is not None
        return row.result.logits

    try:
        assert np.array_equal(next_logits(refuse_first=True), next_logits(refuse_first=False))
    finally:
        runtime.close()


def test_a_cancelled_decode_stops_inside_llama_decode_and_leaves_the_engine_clean(
    engine: DecisionEngine, hybrid: tuple[DecisionEngine, DecodeLog]
) -> None:
    """The caller goes away while its decode runs: llama.cpp's (native) abort flag stops the decode
    between graph nodes (halfway through the work's checks, which its watcher makes every few
    milliseconds while a decode runs), the work's sequences go whole, recurrent states with them,
    and the same request then answers as before, bitwise."""
    log = hybrid[1]
    fresh = {**CASE, "mode": "fresh"}
    real = log.real
    checks: list[int] = []
    cancel: dict[str, Any] = {}

    def counting(rows: list[Row], *, should_abort: Callable[[], bool] | None = None) -> None:
        def abort() -> bool:
            checks.append(1)
            if len(checks) == cancel.get("at"):
                cancel["job"].cancel()
            return should_abort is not None and should_abort()

        real(rows, should_abort=abort)

    log.real = counting  # type: ignore[assignment]
    try:
        before = decide(engine, fresh).to_wire()
        total, checks[:] = len(checks), []
        cancel["job"], cancel["at"] = engine._local.admit("decision", uuid.uuid4().hex), max(1, total // 2)
        started = time.monotonic()
        work = engine.decision_work(engine.plan_decision(parse_decision_request(fresh)))
        future = engine._local.submit(cancel["job"], work)
        assert type(future.exception(30)).__name__ == "ClientGoneError"
        assert time.monotonic() - started < 5
    finally:
        log.real = real  # type: ignore[assignment]
    assert total >= 2 and cancel["at"] <= len(checks) < total  # stopped soon after it was cancelled
    assert log.outcomes[-1] == DecodeAbortedError.__name__
    log.outcomes.pop()
    assert decide(engine, fresh).to_wire() == before


def test_the_rows_of_a_decode_share_one_length_so_it_takes_few_forward_passes(
    qwen35_path: Path, jevbench_cases: list[dict[str, Any]]
) -> None:
    """llama.cpp cuts a hybrid model's decode into micro-batches of equal tokens per sequence, one
    more for each distinct row length: 12 branches of 12 lengths in one decode took 11 passes for
    815 tokens. The scheduler gives the rows of a decode one length (one-token rows aside), so each
    decode takes at most 2 x ceil(tokens / n_ubatch) forward passes, counted inside llama.cpp."""
    settings = Settings(model_path=qwen35_path, state_cache_seqs=0, repeat_cache_entries=0)
    engine = DecisionEngine.load(settings, count_passes=True)
    runtime = engine.runtime
    decodes: list[tuple[int, int, set[int]]] = []
    real = runtime.decode

    def counted(rows: list[Row], **kwargs: Any) -> None:
        before = runtime.passes
        real(rows, **kwargs)
        decodes.append(
            (sum(len(r.tokens) for r in rows), runtime.passes - before, {len(r.tokens) for r in rows})
        )

    runtime.decode = counted  # type: ignore[method-assign]
    try:
        case = max(jevbench_cases[:20], key=lambda c: len(c["questions"]))
        engine.decide(parse_decision_request({"state": case["state"], "questions": case["questions"]}))
    finally:
        engine.close()
    n_ubatch = settings.micro_batch
    assert len(case["questions"]) >= 10 and decodes
    for tokens, passes, lengths in decodes:
        assert len(lengths - {1}) <= 1, lengths
        assert 1 <= passes <= 2 * -(-tokens // n_ubatch), (tokens, passes)
