"""The runner with an in-memory target: order, warm-up, interrupts and the transport-error stop."""

import json

import pytest

from decider_cli.evaluate.cases import EvalItem, QuestionSpec
from decider_cli.evaluate.results import RUN_FILE, load_run
from decider_cli.evaluate.runner import new_meta, run_evaluation
from decider_cli.evaluate.targets import Reply

SPEC = QuestionSpec("q", "noul", ("true", "false"))


class ScriptedTarget:
    """Answers every request with p(true)=0.8; raises or fails on chosen calls (1-based)."""

    description = "scripted"

    def __init__(self, interrupt_on: int | None = None, fail_from: int | None = None):
        self.calls: list[dict] = []
        self.interrupt_on = interrupt_on
        self.fail_from = fail_from

    def send(self, body: dict) -> Reply:
        self.calls.append(body)
        if len(self.calls) == self.interrupt_on:
            raise KeyboardInterrupt
        if self.fail_from is not None and len(self.calls) >= self.fail_from:
            return Reply(0.01, None, None, "connection_error", "refused", transport_error=True)
        return Reply(0.01, 200, {"model": "m", "answers": {"q": {"type": "noul", "noul": 0.8}}})

    def close(self) -> None:
        pass


@pytest.fixture
def items():
    return [
        EvalItem(
            f"c{i}", "d", {"state": f"s{i}", "questions": {"q": {"type": "noul"}}}, [SPEC], {"q": "true"}
        )
        for i in range(6)
    ]


@pytest.fixture
def meta(tmp_path):
    cases = tmp_path / "cases.jsonl"
    cases.write_text("{}\n")
    return new_meta(target="t", description="scripted", cases_path=cases, gold_path=None, args={})


def test_warm_up_then_items_in_order(items, meta, tmp_path):
    target = ScriptedTarget()
    meta, rows = run_evaluation(target, items, out_dir=tmp_path / "run", meta=meta, warmup=2)
    assert [b["state"] for b in target.calls] == ["s0", "s1"] + [f"s{i}" for i in range(6)]
    assert all(b["extensions"] is True for b in target.calls)
    assert [r.case_id for r in meta.warmup] == ["c0", "c1"]
    assert [r.case_id for r in rows] == [f"c{i}" for i in range(6)] and all(r.correct for r in rows)


def test_interrupt_writes_what_was_measured(items, meta, tmp_path):
    target = ScriptedTarget(interrupt_on=4)  # warm-up is call 1, so 2 items are answered first
    with pytest.raises(KeyboardInterrupt):
        run_evaluation(target, items, out_dir=tmp_path / "run", meta=meta, warmup=1)
    saved, rows = load_run(tmp_path / "run")
    assert [r.case_id for r in saved.requests] == ["c0", "c1"] and len(rows) == 2
    assert "interrupted" in json.loads((tmp_path / "run" / RUN_FILE).read_text())["aborted"]


def test_transport_errors_stop_the_run_after_the_limit(items, meta, tmp_path):
    target = ScriptedTarget(fail_from=2)
    meta, rows = run_evaluation(
        target, items, out_dir=tmp_path / "run", meta=meta, warmup=0, max_transport_errors=2
    )
    assert len(target.calls) == 3 and "2 transport failures in a row" in meta.aborted
    assert [r.status for r in rows] == ["ok", "error", "error"]


def test_concurrent_run_keeps_item_order_in_results(items, meta, tmp_path):
    meta, rows = run_evaluation(
        ScriptedTarget(), items, out_dir=tmp_path / "run", meta=meta, warmup=0, concurrency=3
    )
    assert [r.index for r in rows] == list(range(6)) and meta.concurrency == 3
