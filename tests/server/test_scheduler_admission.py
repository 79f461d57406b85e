"""Admission that tells the truth, and failures that stay with their own request.

The scheduler, planner and works are real; the model is `FakeRuntime`, whose decodes take a fixed
time plus time per token and per attended position, like llama.cpp's.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from decider.engine.cost import Cost, CostModel, span_attended
from decider.engine.scheduler import Job, Scheduler
from decider.engine.steps import SeqPool, Step
from decider.engine.work import ChatPlan, ChatWork
from decider.errors import DeciderError, RequestExceedsDeadlineError, UnavailableError
from decider.schemas.decision import parse_decision_request
from decider.server.handlers import _JobStream, run_until_disconnect
from decider.server.metrics import ServerMetrics
from server_fakes import FakeEngine

QUESTIONS = {"billing": {"type": "noul", "instructions": "Is this about billing?"}}


def _scheduler(engine: FakeEngine, deadline: float = 5.0) -> Scheduler:
    scheduler = Scheduler(queue_size=8, deadline_seconds=deadline, metrics=ServerMetrics())
    scheduler.submit_unscheduled(lambda: scheduler.attach(engine.runtime, engine.head_tokens)).result(5)
    return scheduler


def _work(engine: FakeEngine, state_chars: int = 40) -> Any:
    body = {"state": "x" * state_chars, "questions": QUESTIONS}
    return engine.decision_work(engine.plan_decision(parse_decision_request(body)))


def _timed(scheduler: Scheduler, work: Any) -> float:
    started = time.monotonic()
    scheduler.enqueue("decision", "timed", work).future.result(30)  # type: ignore[union-attr]
    return time.monotonic() - started


def test_the_cost_model_fits_steps_tokens_and_attention_exactly() -> None:
    model = CostModel()
    truth = (0.002, 0.0001, 0.00005)  # per step, per token, per thousand attended positions
    for steps, tokens, start in [(1, 10, 0), (1, 500, 100), (1, 2000, 0), (1, 64, 3000), (1, 1, 4000)]:
        cost = Cost(steps, tokens, span_attended(start, tokens))
        model.observe(cost, float(cost.features() @ truth))
    big = Cost(3, 4500, span_attended(0, 4500))
    assert model.predict(big) == pytest.approx(float(big.features() @ truth), rel=1e-6)


def test_admission_estimates_follow_attention_on_500_2000_and_4500_token_requests() -> None:
    """Long requests cost more than their token count says: the estimate must say so too."""
    # Long enough that scheduling jitter on a loaded machine (a parallel test worker) stays small.
    engine = FakeEngine(token_seconds=0.00015, attention_seconds=0.00000009)
    scheduler = _scheduler(engine, deadline=60)
    for size in (50, 300, 900, 120):  # what the engine sees before: mixed sizes
        _timed(scheduler, _work(engine, size))
    predictions = {}
    for size in (500, 2000, 4500):
        work = _work(engine, size)
        predictions[size] = scheduler.costs.predict(work.cost)
        measured = _timed(scheduler, work)
        assert predictions[size] == pytest.approx(measured, rel=0.35), size
    assert predictions[4500] / predictions[500] > 1.3 * 4500 / 500  # not proportional to tokens
    scheduler.close()


def test_idle_server_tries_a_request_near_the_deadline_and_refuses_only_the_hopeless() -> None:
    engine = FakeEngine(token_seconds=0.001)
    scheduler = _scheduler(engine, deadline=1.0)
    for size in (50, 400, 120):
        _timed(scheduler, _work(engine, size))
    per_token = scheduler.costs.predict(Cost(0, 1000)) / 1000  # type: ignore[operator]
    assert per_token == pytest.approx(0.001, rel=0.5)
    near = Cost(3, round(1.1 / per_token))  # just over the deadline: an estimate, so it is tried
    scheduler.withdraw(scheduler.admit("decision", "near", near))
    with pytest.raises(RequestExceedsDeadlineError) as hopeless:
        scheduler.admit("decision", "big", Cost(3, round(5 / per_token)))
    assert hopeless.value.status == 422 and hopeless.value.retryable is False
    gate = threading.Event()
    engine.runtime.gate = gate
    ahead = scheduler.enqueue("decision", "a", _work(engine, 300))
    with pytest.raises(UnavailableError) as refused:  # fits alone, not behind "a": a retry can succeed
        scheduler.admit("decision", "b", Cost(3, round(0.9 / per_token)))
    assert refused.value.code == "deadline_unreachable" and refused.value.retryable
    gate.set()
    ahead.future.result(5)  # type: ignore[union-attr]
    scheduler.close()


def test_the_deadline_runs_from_the_request_s_arrival() -> None:
    scheduler = Scheduler(queue_size=8, deadline_seconds=55.0, metrics=ServerMetrics())
    arrived = time.monotonic() - 20.0  # the body took 20 s to arrive and parse
    job = scheduler.admit("decision", "slow-body", Cost(3, 10), arrived_at=arrived)
    assert job.deadline == pytest.approx(arrived + 55.0) and job.remaining() < 36
    scheduler.close()


def _gated_chat_scheduler() -> tuple[Scheduler, threading.Event]:
    """A 1 s deadline, 10 ms decodes, a cost model fitted on three decisions, and a gate that holds
    the next decode until it is set."""
    engine = FakeEngine(decode_seconds=0.01, chat_tokens=1000)
    scheduler = _scheduler(engine, deadline=1.0)
    for size in (50, 400, 120):
        _timed(scheduler, _work(engine, size))
    gate = threading.Event()
    engine.runtime.gate = gate
    return scheduler, gate


def test_a_chat_costs_a_step_per_generated_token() -> None:
    """A chat may stop at any token, so it is tried; the work behind it waits for all of them."""
    plan = ChatPlan(prompt=[1] * 10, max_tokens=200)
    assert plan.cost.steps == 201 and plan.cost.tokens == 210 and plan.least_cost.steps == 1
    scheduler, gate = _gated_chat_scheduler()
    chat = scheduler.enqueue("chat", "long", ChatWork(plan))  # 200 decodes of 10 ms at most: 2 s
    with pytest.raises(UnavailableError) as refused:  # 10 decodes, behind up to 200 of the chat
        scheduler.admit("decision", "behind", Cost(10, 50))
    assert refused.value.code == "deadline_unreachable" and refused.value.retryable
    gate.set()
    chat.future.exception(5)  # type: ignore[union-attr]  # the 1 s deadline ends the generation
    scheduler.close()


def test_work_ahead_counts_only_until_its_own_deadline() -> None:
    """A job is stopped at its deadline: behind it a request waits at most that long, and behind a
    job already past it (answered 504, its work not yet dropped) or cancelled, not at all."""
    scheduler, gate = _gated_chat_scheduler()
    long_chat = ChatPlan(prompt=[1] * 10, max_tokens=5000)  # ~50 s of decodes, stopped at 1 s
    chat = scheduler.enqueue("chat", "long", ChatWork(long_chat), arrived_at=time.monotonic() - 0.6)
    scheduler.withdraw(scheduler.admit("decision", "behind", Cost(3, 20)))  # ~0.03 s after its 0.4 s
    with pytest.raises(UnavailableError):  # ~0.8 s of its own does not fit behind it
        scheduler.admit("decision", "larger", Cost(80, 400))
    gate.set()
    chat.future.exception(5)  # type: ignore[union-attr]

    stale = scheduler.admit("decision", "stale", Cost(80, 400), arrived_at=time.monotonic() - 0.9)
    time.sleep(0.15)
    assert stale.expired()  # still admitted: its handler has not withdrawn it yet
    scheduler.withdraw(scheduler.admit("decision", "after-stale", Cost(80, 400)))
    gone = scheduler.admit("decision", "gone", Cost(80, 400))
    gone.cancel()  # its caller left
    scheduler.withdraw(scheduler.admit("decision", "after-gone", Cost(80, 400)))
    for job in (stale, gone):
        scheduler.withdraw(job)
    scheduler.close()


class _BrokenError(Exception):
    pass


def _breaking(work: Any, where: str) -> Any:
    """`work`, with its first row callback (or its planning) raising."""
    plan_step = work.plan_step

    def broken_plan(step: Step) -> None:
        if where == "plan":
            raise _BrokenError("planning")
        before = len(step.rows)
        plan_step(step)
        for planned in step.rows[before:]:
            planned.on_done = lambda _row: (_ for _ in ()).throw(_BrokenError("callback"))

    work.plan_step = broken_plan
    return work


@pytest.mark.parametrize("where", ["callback", "plan"])
def test_one_work_s_exception_fails_that_work_alone(where: str) -> None:
    engine = FakeEngine(decode_seconds=0.01)
    scheduler = _scheduler(engine)
    good = [scheduler.enqueue("decision", f"good{i}", _work(engine)) for i in range(2)]
    bad = scheduler.enqueue("decision", "bad", _breaking(_work(engine), where))
    error = bad.future.exception(5)  # type: ignore[union-attr]
    assert isinstance(error, DeciderError) and error.code == "internal_error" and error.status == 500
    assert all(job.future.result(5).answers for job in good)  # type: ignore[union-attr]
    assert scheduler.enqueue("decision", "after", _work(engine)).future.result(5).answers  # type: ignore[union-attr]
    scheduler.close()


def test_a_chat_does_not_take_the_sequences_a_started_prefix_needs_for_its_branches() -> None:
    seqs = SeqPool(5, (0,))  # four free
    step = Step(memory=_NoMemory(), seqs=seqs, tokens_left=100, cells_left=10_000)
    step.prefix_holders = 3  # three prefixes wait to open a branch each: one spare sequence only
    chat = ChatWork(ChatPlan(prompt=[1, 2, 3], max_tokens=4))
    chat.plan_step(step)
    assert not chat.started and seqs.available == 4 and not step.rows
    step.prefix_holders = 2
    chat.plan_step(step)
    assert chat.started and seqs.available == 3


class _NoMemory:
    def seq_copy(self, src: int, dst: int) -> None: ...

    def seq_remove(self, seq_id: int) -> None: ...


class _Request:
    """What the handlers read of a Starlette request, with a client that never disconnects."""

    def __init__(self) -> None:
        self.state = type("State", (), {"request_id": "r1", "arrived_at": time.monotonic()})()

    async def receive(self) -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}


def test_a_handler_cancelled_at_once_leaves_nothing_admitted() -> None:
    engine = FakeEngine(decode_seconds=0.05)
    scheduler = _scheduler(engine)
    runtime = type("Runtime", (), {"scheduler": scheduler})()

    async def cancel_at_once() -> None:
        task = asyncio.ensure_future(run_until_disconnect(runtime, _Request(), "decision", _work(engine)))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the handler is waiting for the engine now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_at_once())
    deadline = time.monotonic() + 5
    while scheduler._admitted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not scheduler._admitted  # not counted as waiting: no phantom 429/503, no Retry-After drift
    scheduler.close()


def test_an_sse_response_that_never_starts_still_stops_its_job() -> None:
    job = Job("chat", "r1", time.monotonic() + 60, time.monotonic())

    async def never_iterated() -> Any:
        yield "data: x\n\n"

    async def gone() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def refuse(message: dict[str, Any]) -> None:
        raise OSError("the client is gone")

    with pytest.raises(OSError):
        asyncio.run(_JobStream(job, never_iterated())({"type": "http"}, gone, refuse))
    assert job.cancelled
