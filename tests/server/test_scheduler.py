"""The scheduler in isolation: admission, cross-request batching, deadlines, cancellation, failures.

The works and their planning are real; the model is `FakeRuntime` (decodes by sleeping, honours
the abort callback). Timing assertions are loose upper bounds; every ordering the tests rely on
is forced with gates, never left to sleeps.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

import pytest
from server_fakes import FakeEngine, FakeRuntime, chars

from decider.engine.model.labels import build_label_table
from decider.engine.model.native import KvCacheFullError, NativeError, Row
from decider.engine.scheduling.chat_pace import ChatPace
from decider.engine.scheduling.jobs import Job
from decider.engine.scheduling.loop import STALL_SECONDS
from decider.engine.scheduling.scheduler import Scheduler
from decider.engine.works.chat import ChatPlan, ChatWork
from decider.errors import (
    DeadlineExceededError,
    DeciderError,
    OverloadedError,
    RequestError,
    UnavailableError,
)
from decider.schemas.decision import parse_batch_request, parse_decision_request
from decider.server.answers import decision_response
from decider.server.metrics import ServerMetrics

DECISION = {
    "state": "I was charged twice for one order.",
    "questions": {
        "billing": {"type": "noul", "instructions": "Is this about billing?"},
        "tone": {"type": "choice", "instructions": "Tone?", "criteria": {"calm": None, "angry": "Upset"}},
    },
}


def _scheduler(
    engine: FakeEngine,
    queue_size: int = 8,
    deadline: float = 5.0,
    epoch_cells: int | None = None,
    chat_share: float = 0.0,
) -> Scheduler:
    scheduler = Scheduler(
        queue_size=queue_size,
        deadline_seconds=deadline,
        metrics=ServerMetrics(),
        epoch_cells=epoch_cells,
        chat_share=chat_share,
    )
    scheduler.submit_unscheduled(lambda: scheduler.attach(engine.runtime, engine.head_tokens)).result(5)
    return scheduler


def _work(engine: FakeEngine, body: dict[str, Any] = DECISION) -> Any:
    return engine.decision_work(engine.plan_decision(parse_decision_request(body)))


def _job(deadline: float = 60.0, kind: str = "decision") -> Job:
    now = time.monotonic()
    return Job(kind, uuid.uuid4().hex, now + deadline, now)


def test_queue_full_is_refused_at_once_with_retry_after() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    scheduler = _scheduler(engine, queue_size=1)
    running = scheduler.submit(scheduler.admit("decision", "a"), _work(engine))
    deadline = time.monotonic() + 5
    while not engine.calls and time.monotonic() < deadline:  # "a" is in its first decode
        time.sleep(0.005)
    queued = scheduler.submit(scheduler.admit("decision", "b"), _work(engine))
    started = time.monotonic()
    with pytest.raises(OverloadedError) as refused:
        scheduler.admit("decision", "c")
    assert time.monotonic() - started < 0.1
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    assert int(refused.value.headers["Retry-After"]) >= 1
    gate.set()
    running.result(5), queued.result(5)
    scheduler.admit("decision", "d")  # room again
    scheduler.close()


def test_queue_size_zero_allows_only_what_is_running() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    scheduler = _scheduler(engine, queue_size=0)
    running = scheduler.submit(scheduler.admit("decision", "a"), _work(engine))
    with pytest.raises(OverloadedError):
        scheduler.admit("decision", "b")
    gate.set()
    running.result(5)
    scheduler.close()


def test_several_requests_share_each_decode() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    scheduler = _scheduler(engine)
    blocker = scheduler.submit(_job(), _work(engine))  # holds the engine while the others arrive
    futures = [scheduler.submit(_job(), _work(engine)) for _ in range(4)]
    gate.set()
    blocker.result(5)
    answers = [decision_response(future.result(5)) for future in futures]
    alone = FakeEngine()
    serial_scheduler = _scheduler(alone)
    serial = decision_response(serial_scheduler.submit(_job(), _work(alone)).result(5))
    assert all(answer.to_wire() == serial.to_wire() for answer in answers)
    # Alone a request takes its prefill and its branches (2 decodes); four together share them.
    assert len(alone.calls) == 2 and len(engine.calls) < 1 + 2 * 4
    scheduler.close()
    serial_scheduler.close()


LONG_QUESTIONS = {
    "state": "I was charged twice for one order.",
    "questions": {
        f"q{i}": {"type": "noul", "instructions": f"{i}: is this about billing? " * 4} for i in range(3)
    },
}


def test_a_request_starts_only_when_the_started_ones_leave_less_than_a_micro_batch() -> None:
    """Each request has more than n_ubatch tokens of questions after its state: the second's prefill
    waits for the first's branches (not for its end), so about two states are resident, not all."""
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    scheduler = _scheduler(engine)
    works = [_work(engine, LONG_QUESTIONS) for _ in range(3)]
    state = works[0].states[0]
    prefix = len(state.plan.prefix)
    branches = state.need - prefix
    assert branches > engine.runtime.policy.n_ubatch > prefix
    futures = [scheduler.submit(_job(), work) for work in works]
    gate.set()
    answers = [decision_response(future.result(5)).to_wire() for future in futures]
    assert answers[0] == answers[1] == answers[2]
    calls = engine.calls
    assert calls[0] == prefix  # the first state alone: the others would wait for its branches anyway
    assert calls[1] >= branches and calls[1] <= branches + prefix  # its branches and the next prefill
    assert len(calls) < 2 * len(works)  # still shared: fewer decodes than one request at a time
    scheduler.close()


def test_every_decode_runs_on_the_one_engine_thread() -> None:
    engine = FakeEngine()
    scheduler = _scheduler(engine)
    for future in [scheduler.submit(_job(), _work(engine)) for _ in range(3)]:
        future.result(5)
    assert engine.runtime.threads == {"engine"}
    scheduler.close()


def test_a_chat_gets_a_token_in_every_decode_while_decisions_run() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate=gate, chat_tokens=6)
    scheduler = _scheduler(engine)
    rows_per_decode: list[list[int]] = []
    decode = engine.runtime.decode

    def spying(rows: list[Row], **kwargs: Any) -> None:
        rows_per_decode.append([row.seq_id for row in rows])
        decode(rows, **kwargs)

    engine.runtime.decode = spying  # type: ignore[method-assign]
    chat = ChatWork(engine.chat_plan([{"role": "user", "content": "hi"}], max_tokens=6, max_tokens_cap=6))
    chat_future = scheduler.submit(_job(kind="chat"), chat)
    decisions = [scheduler.submit(_job(), _work(engine)) for _ in range(3)]
    gate.set()
    text, finish, usage = chat_future.result(5)
    assert (text, finish, usage.completion_tokens) == ("t0 t1 t2 t3 t4 t5 ", "length", 6)
    for future in decisions:
        future.result(5)
    chat_seq = rows_per_decode[0][0]
    with_chat = [seqs for seqs in rows_per_decode if chat_seq in seqs]
    assert len(with_chat) == 6  # the prompt (its logits give token 1), then tokens 1-5 one per decode
    assert any(len(seqs) > 1 for seqs in with_chat)  # ... in decodes shared with the decisions
    scheduler.close()


def test_starts_are_first_come_first_served_so_a_large_request_is_not_overtaken() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate=gate, n_ctx=2000)
    scheduler = _scheduler(engine)
    small, big = _work(engine), _work(engine, {**DECISION, "state": "long " * 250})
    streams = any(state.streaming for state in big.states)
    assert small.plan.cost_tokens + big.plan.cost_tokens > 2000 and not streams  # fits alone only
    jobs = [_job(), _job(), _job()]
    first = scheduler.submit(jobs[0], small)  # holds memory, gated in its first decode
    deadline = time.monotonic() + 5
    while not engine.calls and time.monotonic() < deadline:
        time.sleep(0.005)
    waiting = scheduler.submit(jobs[1], big)  # does not fit beside the first
    later = scheduler.submit(jobs[2], _work(engine))  # would fit, but must not overtake
    gate.set()
    for future in (first, waiting, later):
        future.result(5)
    assert jobs[1].started_at is not None and jobs[2].started_at is not None
    assert jobs[1].started_at <= jobs[2].started_at
    scheduler.close()


def _chat(max_tokens: int) -> ChatWork:
    return ChatWork(ChatPlan(prompt=[1, 2, 3], max_tokens=max_tokens))


def test_chats_take_cells_as_they_generate_so_they_never_lock_decisions_out() -> None:
    """Four chats allowed 900 tokens each in 2,000 cells: reserved up front, two would fill the
    context and every later request would wait behind the third. They generate 50 tokens each."""
    engine = FakeEngine(n_ctx=2000, decode_seconds=0.002, chat_tokens=50)
    scheduler = _scheduler(engine)
    chats = [scheduler.submit(_job(kind="chat"), _chat(900)) for _ in range(4)]
    finished: list[float] = []
    for chat in chats:
        chat.add_done_callback(lambda _: finished.append(time.monotonic()))
    decision_job = _job()
    decision = scheduler.submit(decision_job, _work(engine))
    assert decision_response(decision.result(5)).answers
    assert all(chat.result(5)[1] == "stop" for chat in chats)
    assert decision_job.started_at is not None and decision_job.started_at < min(finished)
    scheduler.close()


def test_when_cells_run_out_the_youngest_chat_stops_with_finish_reason_length() -> None:
    """Three chats that never stop, 250 tokens allowed each, in 300 cells: each fits alone, not
    together. The youngest stops first, then the next; the oldest reaches its max_tokens."""
    gate = threading.Event()
    engine = FakeEngine(n_ctx=300, chat_tokens=100_000, gate=gate)
    scheduler = _scheduler(engine)
    blocker = scheduler.submit(_job(kind="chat"), _chat(1))  # holds the engine: the three start together
    deadline = time.monotonic() + 5
    while not engine.calls and time.monotonic() < deadline:
        time.sleep(0.005)
    works = [_chat(250) for _ in range(3)]
    futures = [scheduler.submit(_job(kind="chat"), work) for work in works]
    gate.set()
    assert blocker.result(5)[2].completion_tokens == 1
    outcomes = [future.result(10) for future in futures]
    assert [finish for _, finish, _ in outcomes] == ["length"] * 3
    # A chat that has produced n tokens holds its prompt and n - 1 of them: the youngest stops when
    # three hold 3 + 97 cells each (all 300), the next when two hold 3 + 147 each.
    assert [usage.completion_tokens for _, _, usage in outcomes] == [250, 148, 98]
    scheduler.close()


def test_a_chat_short_of_cells_pauses_while_a_decision_holds_them() -> None:
    """A decision's cells come back when it ends: a chat with no cell for its next token waits for
    them rather than stopping. Decodes of 4 tokens: the decision takes a step for every 3 of its
    tokens, and the chat, allowed the whole context, runs out of cells before it ends."""
    engine = FakeEngine(n_ctx=700, n_batch=4, chat_tokens=100_000)
    scheduler = _scheduler(engine)
    work = _work(engine, {**DECISION, "state": "long " * 40})
    need = work.states[0].need
    assert 700 - 3 - need < need / 3 - 20  # the chat's free cells run out while the decision runs
    chat = scheduler.submit(_job(kind="chat"), _chat(700 - 3))
    decision = scheduler.submit(_job(), work)
    done: list[str] = []
    decision.add_done_callback(lambda _: done.append("decision"))
    chat.add_done_callback(lambda _: done.append("chat"))
    assert decision_response(decision.result(10)).answers
    _, finish, usage = chat.result(10)
    assert finish == "length" and usage.completion_tokens == 700 - 3  # its max_tokens, not cut
    assert done == ["decision", "chat"]
    scheduler.close()


def test_a_chat_never_waits_on_a_decision_that_holds_cells_and_cannot_plan_a_row() -> None:
    """The decision holds its cells but plans no row while the chat runs (as one did when the
    chats held the sequences it needed). The chat, short of cells, paused beside it, nothing moved,
    and after 5 s both failed with a 500. Chats pause only while the engine moves: after a step
    with no row the chat stops with finish_reason "length", and the decision goes on."""
    engine = FakeEngine(n_ctx=700, n_batch=4, chat_tokens=100_000)
    scheduler = _scheduler(engine)
    work = _work(engine, {**DECISION, "state": "long " * 40})
    chat_work = _chat(700 - 3)
    plan_step = work.plan_step

    def blocked_beside_the_chat(step: Any) -> None:
        if not (work.started and not chat_work.finished):
            plan_step(step)

    work.plan_step = blocked_beside_the_chat  # type: ignore[method-assign]
    chat = scheduler.submit(_job(kind="chat"), chat_work)
    submitted = time.monotonic()
    decision = scheduler.submit(_job(), work)
    _, finish, usage = chat.result(10)
    assert finish == "length" and usage.completion_tokens < 700 - 3  # stopped for cells, not paused
    assert decision_response(decision.result(10)).answers
    assert time.monotonic() - submitted < STALL_SECONDS
    scheduler.close()


def test_chats_growing_into_freed_cells_never_starve_a_waiting_decision() -> None:
    """Four chats that never stop fill most of 1,000 cells; a decision needing more than any one
    chat holds arrives. Chats leave its cells free: the youngest stop with `length` at once and it
    starts, rather than waiting while the chats refill every cell a stopped one gave back."""
    probe = _work(FakeEngine(), {**DECISION, "state": "long " * 60})
    need = probe.states[0].need
    engine = FakeEngine(n_ctx=1000, decode_seconds=0.001, chat_tokens=100_000)
    scheduler = _scheduler(engine)
    chats = [scheduler.submit(_job(kind="chat"), _chat(990)) for _ in range(4)]
    deadline = time.monotonic() + 10
    while len(engine.calls) < 180 and time.monotonic() < deadline:  # ~180 tokens each: 270 free
        time.sleep(0.001)
    assert need > 1000 - 4 * (3 + 180) and need > 250, need  # waits, and more than one chat holds
    work = _work(engine, {**DECISION, "state": "long " * 60})
    started_at: list[int] = []
    plan_step = work.plan_step

    def recording(step: Any) -> None:
        plan_step(step)
        if work.started and not started_at:
            started_at.append(len(engine.calls))

    work.plan_step = recording  # type: ignore[method-assign]
    submitted = len(engine.calls)
    decision = scheduler.submit(_job(), work)
    assert decision_response(decision.result(10)).answers
    assert started_at[0] - submitted <= 5, (submitted, started_at)
    ends = [chat.result(10) for chat in chats]
    assert [finish for _, finish, _ in ends] == ["length"] * 4
    scheduler.close()


def test_a_batch_larger_than_one_memory_epoch_runs_its_states_in_several() -> None:
    engine = FakeEngine(n_ctx=2000, invariant=True)  # batch-invariant memory: cells freed between epochs
    scheduler = _scheduler(engine)
    body = {"states": [f"{DECISION['state']} ({i})" for i in range(8)], "questions": DECISION["questions"]}
    plan = engine.plan_batch(parse_batch_request(body))
    assert plan.cost_tokens > 1.5 * 2000  # two epochs at least
    response = decision_response(scheduler.submit(_job(), engine.decision_work(plan)).result(10))
    assert len(response.results) == 8
    scheduler.close()


def _start_and_finish_times(epoch_cells: int | None, chat_first: bool = False) -> tuple[float, float]:
    """(when the second decision started, when the first work finished) on batch-invariant memory."""
    gate = threading.Event()
    engine = FakeEngine(gate=gate, invariant=True)
    scheduler = _scheduler(engine, epoch_cells=epoch_cells)
    if chat_first:
        plan = engine.chat_plan([{"role": "user", "content": "hi"}], max_tokens=6, max_tokens_cap=6)
        first = scheduler.submit(_job(kind="chat"), ChatWork(plan))
    else:
        first = scheduler.submit(_job(), _work(engine))
    deadline = time.monotonic() + 5
    while not engine.calls and time.monotonic() < deadline:  # the first work is in its first decode
        time.sleep(0.005)
    finished: list[float] = []
    first.add_done_callback(lambda _: finished.append(time.monotonic()))
    second_job = _job()
    second = scheduler.submit(second_job, _work(engine))
    gate.set()
    first.result(5), second.result(5)
    scheduler.close()
    assert second_job.started_at is not None
    return second_job.started_at, finished[0]


def test_a_full_memory_epoch_starts_no_decision_until_its_own_have_finished() -> None:
    started, first_done = _start_and_finish_times(epoch_cells=1)
    assert started > first_done
    started, first_done = _start_and_finish_times(epoch_cells=None)  # unbounded: they overlap
    assert started < first_done


def test_a_chat_s_cells_never_hold_decisions_back_at_the_epoch_limit() -> None:
    started, chat_done = _start_and_finish_times(epoch_cells=1, chat_first=True)
    assert started < chat_done


@pytest.mark.parametrize("invariant", [True, False], ids=["epochs", "no-epochs"])
@pytest.mark.parametrize("mode", ["shared", "fresh"])
def test_a_state_larger_than_the_context_streams_its_questions_one_by_one(mode: str, invariant: bool) -> None:
    """Its prefix and its largest question fit; all its questions together do not."""
    engine = FakeEngine(n_ctx=2000, invariant=invariant)
    scheduler = _scheduler(engine)
    questions = {
        f"q{i}": {
            "type": "choice",
            "instructions": f"{i} " + "long question " * 20,
            "criteria": {"a": None, "b": None},
        }
        for i in range(3)
    }
    # fresh mode: each branch decodes the head again beside the cached one, and must fit beside it
    body = {"state": "evidence " * 128, "questions": questions, "mode": mode}
    work = _work(engine, body)
    assert [state.streaming for state in work.states] == [True]
    beside = scheduler.submit(_job(), _work(engine))  # an ordinary request, admitted first
    response = decision_response(scheduler.submit(_job(), work).result(10))
    assert sorted(response.answers) == ["q0", "q1", "q2"]
    assert decision_response(beside.result(5)).answers
    scheduler.close()


def test_branches_leave_a_sequence_for_their_label_positions() -> None:
    """Two-letter labels are read in child sequences: with the fewest sequences allowed, three such
    questions still finish (each branch opens only while a sequence stays free for its children)."""
    engine = FakeEngine(n_seq_max=7, invariant=True)
    planner = engine.planner
    planner.labels = build_label_table(planner.builder, chars, lambda t: chr(t).encode(), 255, single_limit=4)
    criteria = {f"o{i}": None for i in range(12)}
    questions = {f"q{i}": {"type": "choice", "criteria": criteria} for i in range(3)}
    work = _work(engine, {"state": "evidence", "questions": questions})
    assert all(item.trie.children(()) for item in work.plan.states[0].items)
    scheduler = _scheduler(engine)
    response = decision_response(scheduler.submit(_job(), work).result(5))
    assert all(len(answer.probabilities) == 12 for answer in response.answers.values())
    scheduler.close()


def test_work_completed_after_its_deadline_is_a_504_whatever_the_event_loop_does() -> None:
    """The engine decides: a result that arrives late is late (the old flaky test's race)."""
    engine = FakeEngine(decode_seconds=0.3)
    engine.runtime.decode = _ignoring_abort(engine.runtime)  # type: ignore[method-assign]
    scheduler = _scheduler(engine)
    future = scheduler.submit(_job(deadline=0.1), _work(engine))
    assert isinstance(future.exception(5), DeadlineExceededError)
    scheduler.close()


def test_work_completed_in_time_is_answered_even_when_the_event_loop_looks_late() -> None:
    engine = FakeEngine(decode_seconds=0.05)
    scheduler = _scheduler(engine)

    async def scenario() -> Any:
        job = _job(deadline=0.5)
        future = scheduler.submit(job, _work(engine))
        future.result(5)
        time.sleep(0.6)  # the loop is blocked past the deadline; the work was done long before
        return await scheduler.wait(job, future)

    assert decision_response(asyncio.run(scenario())).answers
    scheduler.close()


def test_running_work_past_its_deadline_is_aborted_inside_the_decode() -> None:
    engine = FakeEngine(decode_seconds=30)
    scheduler = _scheduler(engine)

    async def scenario() -> None:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError) as late:
            await scheduler.run(scheduler.admit("decision", "a"), _work(engine))
        assert late.value.status == 504 and "while the model was working" in late.value.message
        assert time.monotonic() - started < 1.5

    scheduler.admission.deadline_seconds = 0.3
    asyncio.run(scenario())
    engine.runtime.decode_seconds = 0
    again = scheduler.submit(_job(), _work(engine))  # the engine is free again
    assert decision_response(again.result(5)).answers
    scheduler.close()


def test_queued_work_past_its_deadline_never_runs() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    scheduler = _scheduler(engine, queue_size=4)
    first = scheduler.submit(_job(deadline=10), _work(engine))
    deadline = time.monotonic() + 5
    while not engine.calls and time.monotonic() < deadline:
        time.sleep(0.005)
    decodes = len(engine.calls)

    async def wait_in_the_queue() -> None:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError) as late:
            await scheduler.run(_job(deadline=0.2), _work(engine))
        assert "waiting for the model" in late.value.message and time.monotonic() - started < 1.0

    asyncio.run(wait_in_the_queue())
    gate.set()
    first.result(5)
    assert len(engine.calls) == decodes + 1  # only the first request's branches were decoded after
    scheduler.close()


def test_a_cancelled_request_stops_and_its_neighbour_finishes() -> None:
    engine = FakeEngine(decode_seconds=0.2)
    scheduler = _scheduler(engine)
    gone_job = _job()
    gone = scheduler.submit(gone_job, _work(engine))
    kept = scheduler.submit(_job(), _work(engine))
    gone_job.cancel()
    assert decision_response(kept.result(5)).answers
    assert gone.exception(5) is not None
    scheduler.close()


def test_a_full_memory_halves_the_decode_and_one_unplaceable_row_fails_alone() -> None:
    engine = FakeEngine()
    decode = engine.runtime.decode

    def small_memory(rows: list[Row], **kwargs: Any) -> None:
        if sum(len(row.tokens) for row in rows) > 1200 and len(rows) > 1:
            raise KvCacheFullError("no slot")  # several rows at once never fit: halve
        if any(ord("§") in row.tokens for row in rows):
            raise KvCacheFullError("no slot")  # this request's prefix never fits
        decode(rows, **kwargs)

    engine.runtime.decode = small_memory  # type: ignore[method-assign]
    scheduler = _scheduler(engine)
    huge = {"state": "§ cannot be placed", "questions": {"q": {"type": "noul"}}}
    ok = [scheduler.submit(_job(), _work(engine)) for _ in range(3)]
    bad = scheduler.submit(_job(), _work(engine, huge))
    assert all(decision_response(future.result(5)).answers for future in ok)
    error = bad.exception(5)
    assert isinstance(error, UnavailableError) and error.code == "kv_cache_full" and error.retryable
    scheduler.close()


def test_after_a_row_fails_its_request_the_request_s_other_rows_are_not_decoded() -> None:
    """Halving a full decode: once a request fails on one row, its rows in the other half are dropped
    (their sequences went back to the pool) rather than decoded into sequence ids others may take."""
    engine = FakeEngine()
    decode = engine.runtime.decode
    decoded: list[list[int]] = []

    def one_row_at_a_time(rows: list[Row], **kwargs: Any) -> None:
        if len(rows) > 1 or any(ord("§") in row.tokens for row in rows):
            raise KvCacheFullError("no slot")
        decode(rows, **kwargs)
        decoded.extend(list(row.tokens) for row in rows)

    engine.runtime.decode = one_row_at_a_time  # type: ignore[method-assign]
    scheduler = _scheduler(engine)
    body = {"states": ["§ cannot be placed", "¤ would fit"], "questions": {"q": {"type": "noul"}}}
    work = engine.decision_work(engine.plan_batch(parse_batch_request(body)))
    error = scheduler.submit(_job(), work).exception(5)
    assert isinstance(error, UnavailableError) and error.code == "kv_cache_full"
    assert not any(ord("¤") in tokens for tokens in decoded)
    assert decision_response(scheduler.submit(_job(), _work(engine)).result(5)).answers  # still serving
    scheduler.close()


def test_a_backend_failure_fails_the_running_requests_and_the_server_recovers() -> None:
    engine = FakeEngine()
    decode = engine.runtime.decode
    failures = {"left": 1}

    def flaky(rows: list[Row], **kwargs: Any) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise NativeError("llama_decode returned -1")
        decode(rows, **kwargs)

    engine.runtime.decode = flaky  # type: ignore[method-assign]
    scheduler = _scheduler(engine)
    error = scheduler.submit(_job(), _work(engine)).exception(5)
    assert isinstance(error, DeciderError) and error.code == "backend_failed" and error.status == 500
    assert decision_response(scheduler.submit(_job(), _work(engine)).result(5)).answers
    scheduler.close()


def test_closed_scheduler_refuses_new_work_and_stops_what_runs() -> None:
    engine = FakeEngine(decode_seconds=30)
    scheduler = _scheduler(engine)
    running = scheduler.submit(_job(), _work(engine))
    time.sleep(0.05)
    started = time.monotonic()
    scheduler.close()
    assert isinstance(running.exception(5), UnavailableError)
    assert time.monotonic() - started < 1.0  # the decode in flight was aborted
    with pytest.raises(UnavailableError) as refused:
        scheduler.admit("decision", "a")
    assert refused.value.code == "shutting_down"


def _ignoring_abort(runtime: FakeRuntime) -> Any:
    decode = runtime.decode

    def decode_to_the_end(rows: list[Row], **kwargs: Any) -> None:
        decode(rows)

    return decode_to_the_end


def test_a_decision_with_two_letter_labels_waits_for_its_sequences_beside_generating_chats() -> None:
    """Two chats generate while a decision whose labels span two tokens arrives, with two sequences
    left: its prefix and one branch, not its label positions. Started then (the old rule asked a
    state for two), it held its cells and decoded nothing; the chats, short of cells, paused beside
    it, and after 5 s every started request failed with a 500. It waits now, and all finish."""
    engine = FakeEngine(n_seq_max=5, n_ctx=3000, chat_tokens=100_000)  # head + 4 free sequences
    planner = engine.planner
    planner.labels = build_label_table(planner.builder, chars, lambda t: chr(t).encode(), 255, single_limit=4)
    criteria = {f"o{i}": None for i in range(12)}
    work = _work(engine, {"state": "evidence", "questions": {"q": {"type": "choice", "criteria": criteria}}})
    assert work.states[0].branch_seqs == 2
    scheduler = _scheduler(engine, deadline=30.0)
    assert work.states[0].need < 1400  # it fits once a chat has stopped
    chats = [scheduler.submit(_job(30.0, kind="chat"), _chat(2990)) for _ in range(2)]
    deadline = time.monotonic() + 5
    while len(engine.calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.002)  # both chats generate, each holding a sequence
    decision = scheduler.submit(_job(30.0), work)
    response = decision_response(decision.result(20))
    assert len(response.answers["q"].probabilities) == 12
    assert {chat.result(20)[1] for chat in chats} <= {"length", "stop"}
    scheduler.close()


@pytest.mark.parametrize("mode", ["shared", "fresh"])
def test_a_question_the_work_could_not_reserve_is_refused_when_planned(mode: str) -> None:
    """The planner checked prompt + tail + the deepest label against the context; the work reserves
    every label position, and in fresh mode the head again. A request between the two was admitted,
    held the gate, and got its 422 only after everything else had drained. Now planning refuses it."""
    engine = FakeEngine(n_ctx=100_000)
    planner = engine.planner
    planner.labels = build_label_table(planner.builder, chars, lambda t: chr(t).encode(), 255, single_limit=4)
    planner.builder.head_tokens = [7] * 40  # a cached head, as a real template has
    criteria = {f"o{i}": None for i in range(120)}  # two-letter labels under several first letters
    body = {"state": "evidence", "questions": {"q": {"type": "choice", "criteria": criteria}}, "mode": mode}
    state = engine.plan_decision(parse_decision_request(body)).states[0]
    item = state.items[0]
    depth = max(len(label.tokens) for label in item.labels)
    reserved = (
        (40 if mode == "fresh" else 0) + len(state.prefix) + len(item.tokens) + len(item.trie.nodes) - 1
    )
    assert reserved > len(state.prefix) + len(item.tokens) + depth  # the two used to disagree
    planner.n_ctx = 40 + reserved - 1  # room: one cell short of what the work reserves
    with pytest.raises(RequestError) as refused:
        engine.plan_decision(parse_decision_request(body))
    assert refused.value.code == "context_length_exceeded" and "label positions" in str(refused.value)
    planner.n_ctx = 40 + reserved
    work = engine.decision_work(engine.plan_decision(parse_decision_request(body)))
    assert work.states[0].need <= planner.room  # what the work reserves is what the planner checked


def test_a_chat_sent_after_a_large_batch_gets_its_first_token_within_a_few_steps() -> None:
    """A 16-state batch starts its states about two at a time (the start rule). The first-come gate
    was per work, so a chat sent just after it got its first token only once the batch's last state
    had started (54 s of a 55 s batch on the real model). A work with started units now yields the
    next start to a work waiting for its first: the chat starts within a few steps."""
    engine = FakeEngine(decode_seconds=0.01, token_seconds=0.00002)
    scheduler = _scheduler(engine, deadline=60.0)
    states = [f"Ticket {i}: the payout failed again and the customer is upset. " * 6 for i in range(16)]
    batch_body = {"states": states, "questions": DECISION["questions"]}
    batch_work = engine.decision_work(engine.plan_batch(parse_batch_request(batch_body)))
    batch_done: list[float] = []
    started = time.monotonic()
    batch = scheduler.submit(_job(60.0), batch_work)
    batch.add_done_callback(lambda _: batch_done.append(time.monotonic()))
    deadline = time.monotonic() + 5
    while not batch_work.started and time.monotonic() < deadline:
        time.sleep(0.002)
    first_token: list[float] = []
    chat_sent = time.monotonic()
    chat_work = ChatWork(
        ChatPlan(prompt=[1, 2, 3], max_tokens=3), lambda event: first_token.append(time.monotonic())
    )
    chat = scheduler.submit(_job(60.0, kind="chat"), chat_work)
    assert chat.result(30)[1] in {"stop", "length"}
    assert len(decision_response(batch.result(30)).results) == 16
    batch_seconds = batch_done[0] - started
    waited = first_token[0] - chat_sent
    assert waited < batch_seconds / 4, (waited, batch_seconds)
    assert batch_work.started_units == 16
    scheduler.close()


def _chat_beside_batch(chat_share: float) -> list[tuple[bool, float]]:
    """A 12-token chat sent once a batch of long states has started, each of the batch's decodes
    taking about 0.3-0.6 s: every decode while both ran (whether it carried the chat alone, and its
    seconds)."""
    engine = FakeEngine(decode_seconds=0.005, token_seconds=0.0004, chat_tokens=12)
    scheduler = _scheduler(engine, deadline=60.0, chat_share=chat_share)
    decodes: list[tuple[bool, float]] = []
    chat_running = threading.Event()
    decode = engine.runtime.decode

    def timed(rows: list[Row], **kwargs: Any) -> None:
        began = time.monotonic()
        decode(rows, **kwargs)
        if chat_running.is_set() and not batch_work.finished:
            decodes.append((all(row.seq_id == chat_seq[0] for row in rows), time.monotonic() - began))

    engine.runtime.decode = timed  # type: ignore[method-assign]
    states = [f"Ticket {i}: the payout failed again and the customer is upset. " * 12 for i in range(3)]
    batch_work = engine.decision_work(
        engine.plan_batch(parse_batch_request({"states": states, "questions": DECISION["questions"]}))
    )
    started = time.monotonic()
    batch = scheduler.submit(_job(60.0), batch_work)
    while not batch_work.started and time.monotonic() < started + 5:
        time.sleep(0.002)
    chat_work = ChatWork(ChatPlan(prompt=[1, 2, 3], max_tokens=12))
    chat_seq: list[int | None] = [None]
    chat_running.set()
    chat = scheduler.submit(_job(60.0, kind="chat"), chat_work)
    while chat_work._seq is None and not chat.done():
        time.sleep(0.001)
    chat_seq[0] = chat_work._seq
    assert chat.result(30)[1] == "length"
    chat_running.clear()
    batch.result(30)
    scheduler.close()
    return decodes


def test_a_chat_beside_long_decodes_gets_decodes_of_its_own_within_its_share() -> None:
    """On CPU one decode of a batch's prefill takes seconds, and a chat got one token per decode.
    With a share, the chat streams in decodes of its own (about one pass each), which take at most
    that share of the long decodes' time (plus one: the last may overrun the credit)."""
    decodes = _chat_beside_batch(0.25)
    alone = [seconds for chat_only, seconds in decodes if chat_only]
    shared = [seconds for chat_only, seconds in decodes if not chat_only]
    assert len(alone) >= 6, decodes  # most of its 12 tokens came in decodes of its own
    assert sum(alone) <= 0.25 * sum(shared) + max(alone), decodes
    assert len(shared) <= 2, decodes  # it was done within two of the batch's decodes
    off = _chat_beside_batch(0.0)
    assert not any(chat_only for chat_only, _ in off)  # share 0: a token per shared decode, as before
    assert len(off) > len(shared), off  # ... so it waited on more of the batch's decodes


def test_the_chat_pace_earns_only_from_long_decodes_that_chats_waited_on() -> None:
    pace = ChatPace(0.25)
    pace.decoded(0.1, chats_alone=False, chats_waited=True)  # short: chats were paced well enough
    assert not pace.chats_alone(True)
    pace.decoded(2.0, chats_alone=False, chats_waited=False)  # nobody waited
    assert not pace.chats_alone(True)
    pace.decoded(2.0, chats_alone=False, chats_waited=True)
    assert pace.credit == pytest.approx(0.5)
    assert not pace.chats_alone(False) and pace.credit == 0  # the chats are gone: nothing is banked
    pace.decoded(2.0, chats_alone=False, chats_waited=True)
    for _ in range(2):
        assert pace.chats_alone(True)
        pace.decoded(0.3, chats_alone=True, chats_waited=False)
    assert not pace.chats_alone(True)  # spent: the next decode is shared
    pace.decoded(4.0, chats_alone=False, chats_waited=True)
    assert pace.credit == pytest.approx(1.0)  # earned anew, never banked beyond one decode's share


def test_a_failed_job_s_error_is_read_where_asyncio_sees_it() -> None:
    """The handler awaits an asyncio copy of the job's future: a job that fails (a deadline while
    working, an engine error) must leave asyncio nothing to log as "Future exception was never
    retrieved" when the copy is collected (each such 504 logged it, with a traceback)."""
    scheduler = Scheduler(queue_size=8, deadline_seconds=5.0, metrics=ServerMetrics())
    job = Job("decision", "failing", time.monotonic() + 5.0, time.monotonic())
    logged: list[str] = []

    async def wait_for_the_failure() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: logged.append(context["message"]))
        future: Future[Any] = Future()
        loop.call_later(0.01, future.set_exception, RuntimeError("the work failed"))
        try:
            await scheduler.wait(job, future)
        except RuntimeError:
            pass
        else:
            raise AssertionError("the job's error was not raised")
        del future  # its error's traceback holds the frame that held the asyncio copy
        gc.collect()  # the copy goes here: an error unread in it is logged now
        await asyncio.sleep(0)

    asyncio.run(wait_for_the_failure())
    scheduler.close()
    assert logged == []
