"""The benchmarks' pure helpers: answer comparison, workload picking, counters, the last lines."""

from __future__ import annotations

import argparse
import io
import math

import httpx
import pytest
from rich.console import Console

from decider_dev.bench.common import (
    answer_distribution,
    argmax_agreement,
    distributions,
    key_values,
    max_abs_delta,
    model_settings,
    ratio,
    same_questions_group,
    spread,
)
from decider_dev.bench.engine import Timed, last_line, many_options_body, options_run, report
from decider_dev.bench.server import (
    BatchBesideChat,
    Level,
    MixedResult,
    MultiTurn,
    Outcome,
    TrafficLevel,
    Turn,
    concurrency_line,
    counter_delta,
    engine_counters,
    error_code,
)

RESPONSE = {
    "answers": {
        "urgent": {"type": "noul", "noul": 0.75},
        "team": {"type": "choice", "choice": "b", "probabilities": {"a": 0.2, "b": 0.8}, "confidence": 0.6},
    }
}


def test_answers_become_distributions_in_option_order():
    assert answer_distribution(RESPONSE["answers"]["urgent"]) == [0.75, 0.25]
    assert distributions(RESPONSE) == {"urgent": [0.75, 0.25], "team": [0.2, 0.8]}


def test_max_abs_delta_and_argmax_agreement():
    a = {"q": [0.6, 0.4], "r": [0.1, 0.2, 0.7]}
    b = {"q": [0.4, 0.6], "r": [0.1, 0.25, 0.65]}
    assert max_abs_delta(a, b) == pytest.approx(0.2)
    assert max_abs_delta(a, a) == 0.0
    assert argmax_agreement(a, b) == (1, 2)
    with pytest.raises(ValueError, match="different questions"):
        max_abs_delta(a, {"q": [0.5, 0.5]})
    with pytest.raises(ValueError, match="options"):
        max_abs_delta({"q": [1.0]}, {"q": [0.5, 0.5]})


def test_workload_picking_is_deterministic():
    cases = [{"id": str(i), "questions": {"k": i % 3}} for i in range(12)]
    assert [c["id"] for c in spread(cases, 4)] == ["0", "3", "6", "9"]
    assert [c["id"] for c in spread(cases, 100)] == [str(i) for i in range(12)]
    group = same_questions_group(cases, 2)
    assert [c["id"] for c in group] == ["0", "3"]


def test_ratio_and_key_values():
    assert ratio(3, 2) == 1.5
    assert math.isnan(ratio(1, 0)) and math.isnan(ratio(math.nan, 1))
    assert key_values([("a", 1.234), ("b", math.nan), ("c", "x")]) == "a=1.23 b=nan c=x"
    assert key_values([("d", 0.5)], digits=4) == "d=0.5000"


def test_many_options_body_has_distinct_options():
    body = many_options_body({"state": "s"}, 255)
    criteria = body["questions"]["queue"]["criteria"]
    assert len(criteria) == 255 and len(set(criteria.values())) == 255


METRICS = """# HELP decider_engine_decodes_total llama_decode calls.
# TYPE decider_engine_decodes_total counter
decider_engine_decodes_total 12.0
# TYPE decider_engine_decode_rows histogram
decider_engine_decode_rows_bucket{le="1.0"} 2.0
decider_engine_decode_rows_bucket{le="+Inf"} 12.0
decider_engine_decode_rows_sum 60.0
decider_engine_decode_rows_count 12.0
decider_http_requests_total{route="/ping",status="200"} 4.0
"""


def test_engine_counters_from_metrics_text():
    counters = engine_counters(METRICS)
    assert counters["decider_engine_decodes_total"] == 12.0
    assert counters["decider_engine_decode_rows_sum"] == 60.0
    assert counters["decider_engine_decode_tokens_sum"] == 0.0  # absent series
    zero = engine_counters("")
    assert counter_delta(zero, counters)["decider_engine_decode_rows_count"] == 12.0


def _level(clients: int, seconds: list[float], noul: list[float], decodes: float, wall: float) -> Level:
    outcomes = [
        Outcome(i, s, 200, {"answers": {"q": {"noul": p}}})
        for i, (s, p) in enumerate(zip(seconds, noul, strict=True))
    ]
    return Level(clients, outcomes, wall, counters={"decider_engine_decodes_total": decodes})


def test_concurrency_line_ratios_against_one_client():
    serial = _level(1, [1.0, 1.0, 2.0], [0.5, 0.6, 0.7], decodes=6, wall=4.0)
    loaded = _level(8, [3.0, 4.0, 5.0], [0.5, 0.6, 0.72], decodes=3, wall=4.0)
    line = concurrency_line(loaded, serial, serial.answers())
    assert line == (
        "concurrency=8 decodes_per_request_ratio=0.50 throughput_ratio=1.00 p95_over_p50_1=4.90 "
        "max_dp_vs_serial=0.0200"
    )
    loaded.outcomes.append(Outcome(3, 60.0, "503 deadline_unreachable"))
    assert loaded.errors == {"503 deadline_unreachable": 1} and len(loaded.latencies) == 3
    assert loaded.decodes_per_request == 1.0  # per answered request


def test_engine_last_line_has_every_key():
    workload = dict.fromkeys(
        ("shared_vs_fresh", "ideal", "engine_vs_limit", "decision_vs_generation", "invariant_cost"), 1.0
    )
    results = {
        "W1": workload,
        "W2": workload,
        "options_128": {"seconds": 4.0},
        "options_255": {"seconds": 9.0},
        "prompt": {"v2_vs_v1": 1.6, "v2_vs_v1_tokens": 1.7, "v1_max_dp": 0.0, "v2_max_dp": 0.001},
        "admission": [{"ratio": 1.0}, {"ratio": 1.1}, {"ratio": 0.9}],
    }
    line = last_line(results)
    assert line.startswith("W1 shared_vs_fresh=1.00 ")
    for key in (
        "options_128_seconds=4.00",
        "options_255_seconds=9.00",
        "v2_vs_v1=1.60",
        "v2_vs_v1_tokens=1.70",
        "v2_max_dp_shared_fresh=0.0010",
        "v1_max_dp_shared_fresh=0.0000",
        "W2 shared_vs_fresh=1.00",
        "admission_4500=0.90",
    ):
        assert key in line


def test_error_code_from_the_error_body_or_the_reason():
    body = {"error": {"type": "server_error", "code": "deadline_unreachable", "message": "m", "param": None}}
    assert error_code(httpx.Response(503, json=body)) == "deadline_unreachable"
    assert error_code(httpx.Response(502, text="<html>bad gateway</html>")) == "Bad Gateway"


class _Settings:
    batch_invariant = False
    deadline_seconds = 55.0


def _timed(seconds: float, questions: int, tokens: int, answers: dict) -> Timed:
    return Timed(seconds=seconds, questions=questions, tokens=tokens, answers=answers)


def test_engine_report_from_synthetic_runs():
    answers = {"case": {"q": [0.6, 0.4], "r": [0.1, 0.9]}}
    shifted = {"case": {"q": [0.55, 0.45], "r": [0.1, 0.9]}}
    workload = {
        "fresh": _timed(10.0, 2, 600, answers),
        "shared": _timed(4.0, 2, 300, answers),
        "raw": _timed(4.0, 0, 300, {}),
        "text": _timed(12.0, 2, 0, {}),
        "fresh_all": _timed(0.0, 0, 600, {}),
    }
    runs = {
        "W1": {
            **workload,
            "v2_shared": _timed(2.0, 2, 150, shifted),
            "v2_fresh": _timed(8.0, 2, 450, shifted),
        },
        "W2": dict(workload),
    }
    invariant = {name: {"shared": _timed(8.0, 2, 300, shifted)} for name in runs}
    options = [
        {"options": 128, "seconds": 10.0, "tokens": 2000, "readout": "single", "decodes": 2, "top_p": 0.3,
         "sum_p": 1.0, "invariant_seconds": 20.0, "v2_tokens": 1000},
        {"options": 255, "seconds": math.nan, "tokens": 0, "readout": "unsupported (max 64)", "decodes": 0,
         "top_p": math.nan, "sum_p": math.nan},
    ]  # fmt: skip
    console = Console(file=io.StringIO(), width=200)
    admission = [
        {"tokens": 500, "predicted": 1.1, "seconds": 1.0},
        {"tokens": 2000, "predicted": None, "seconds": 2.0},
        {"tokens": 4500, "predicted": 9.0, "seconds": 10.0},
    ]
    results = report(console, runs, invariant, options, admission, _Settings())
    assert results["W1"]["shared_vs_fresh"] == pytest.approx(2.5)
    assert results["W1"]["ideal"] == 2.0 and results["W1"]["engine_vs_limit"] == 1.0
    assert results["W1"]["invariant_cost"] == 2.0
    assert results["W1"]["default_vs_invariant_max_dp"] == pytest.approx(0.05)
    assert results["prompt"]["v2_vs_v1"] == 2.0 and results["prompt"]["v2_max_dp"] == 0.0
    assert results["options_128"]["invariant_cost"] == 2.0
    line = last_line(results)
    assert "options_255_seconds=nan" in line and "invariant_cost=2.00" in line
    assert "admission_500=1.10" in line and "admission_2000=nan" in line and "admission_4500=0.90" in line
    on_gpu = report(Console(file=io.StringIO()), runs, None, options, admission, _Settings())
    assert math.isnan(on_gpu["W2"]["invariant_cost"])


def test_many_options_beyond_the_model_labels_are_not_run():
    class Engine:
        max_options = 64

    row = options_run(Engine(), {"state": "s"}, 128, repeats=1)  # type: ignore[arg-type]
    assert row["tokens"] == 0 and math.isnan(row["seconds"]) and row["readout"].startswith("unsupported")


def test_server_and_in_process_engine_share_their_settings():
    from pathlib import Path

    args = argparse.Namespace(model=None, n_gpu_layers=-1, threads=2)
    fields = model_settings(args, Path("/models/bundled.gguf"))
    assert fields == {"model_path": Path("/models/bundled.gguf"), "n_gpu_layers": -1, "n_threads": 2}
    args = argparse.Namespace(model=Path("/m/qwen.gguf"), n_gpu_layers=0, threads=None)
    assert model_settings(args, Path("/x.gguf")) == {"model_path": Path("/m/qwen.gguf"), "n_gpu_layers": 0}


def test_the_text_route_reads_the_best_label_among_the_top_logprobs():
    from decider_dev.bench.text_route import picked_option

    top = [{"token": " B", "logprob": -0.5}, {"token": "A", "logprob": -1.2}, {"token": "x", "logprob": -0.1}]
    body = {"choices": [{"logprobs": {"content": [{"token": "x", "top_logprobs": top}]}}]}
    assert picked_option(body, ["A", "B", "C"]) == 1  # "x" is no label; " B" is B
    assert picked_option(body, ["C", "D"]) is None
    assert picked_option({"choices": [{"logprobs": None}]}, ["A"]) is None


def test_the_text_route_line_compares_wall_times_and_argmax():
    from decider_dev.bench.server import Level, Outcome, TextComparison, text_route_line
    from decider_dev.bench.text_route import TextRun

    def answered(index: int, answers: dict[str, list[float]]) -> Outcome:
        body = {
            "answers": {
                k: {"type": "choice", "probabilities": dict(enumerate(p))} for k, p in answers.items()
            }
        }
        return Outcome(index, 1.0, 200, body)

    outcomes = [answered(0, {"q": [0.2, 0.8], "r": [0.3, 0.7]}), answered(1, {"q": [0.9, 0.1]})]
    before = Level(4, outcomes, wall_seconds=9.0, counters={"decider_engine_decode_tokens_sum": 900.0})
    after = Level(4, wall_seconds=11.0)  # the machine slowed down: the mean is the decision time
    run = TextRun(
        clients=4, wall_seconds=15.0, answers={(0, "q"): 1, (0, "r"): 0, (1, "q"): 0}, prompt_tokens=1200
    )
    line = text_route_line(TextComparison(4, before, run, after))
    assert "text_route=llama-server concurrency=4 decision_vs_text=1.50 argmax_agree=0.67" in line
    assert line.endswith("text_prompt_tokens=1200 decision_tokens=900")


def test_the_text_route_counts_the_prompt_tokens_llama_server_evaluated(monkeypatch):
    """Every answered request adds its `timings.prompt_n` (what llama-server's cache did not hold)."""
    import httpx

    from decider_dev.bench import text_route

    def reply(request: httpx.Request) -> httpx.Response:
        top = [{"token": "A", "logprob": -0.1}, {"token": "B", "logprob": -2.0}]
        body = {"choices": [{"logprobs": {"content": [{"top_logprobs": top}]}}], "timings": {"prompt_n": 7}}
        return httpx.Response(200, json=body)

    real_client = httpx.Client
    monkeypatch.setattr(
        text_route.httpx, "Client", lambda **kw: real_client(transport=httpx.MockTransport(reply), **kw)
    )
    questions = [text_route.TextQuestion(case, key, [], ["A", "B"]) for case in (0, 1) for key in "qr"]
    run = text_route.run_text_route("http://127.0.0.1:1", questions, clients=2)
    assert run.errors == 0 and run.prompt_tokens == 28
    assert set(run.answers.values()) == {0}


def test_the_mixed_line_sets_decisions_beside_chats_against_decisions_alone():
    alone = Level(1, [Outcome(i, seconds, 200) for i, seconds in enumerate([1.0, 1.0, 2.0])])
    beside = Level(1, [Outcome(i, seconds, 200) for i, seconds in enumerate([1.5, 1.5, 4.0])])
    beside.outcomes.append(Outcome(3, 9.0, "503 deadline_unreachable"))
    line = MixedResult(4, alone, beside, {"cut": 4, "stop": 2}, 27.25).line()
    assert line == (
        "mixed_chats=4 decision_p50_ratio=1.500 decision_p95_ratio=1.974 p50_alone=1.000 "
        "p50_beside=1.500 p95_alone=1.900 p95_beside=3.750 chat_tokens_per_second=27.250 "
        "decision_errors={'503 deadline_unreachable': 1} chat_ends=cut:4,stop:2"
    )


def test_the_batch_chat_line_sets_the_chat_s_first_token_against_issue_34_s_bound():
    def result(ttft_beside: float, batch_status: str = "200", chat_end: str = "length") -> BatchBesideChat:
        return BatchBesideChat(16, 0.2, ttft_beside, 0.01, 2.4, 40.0, 42.0, chat_end, batch_status)

    # The bound is max(5 x 0.2 s alone, 40 s / 4) = 10 s: a first token at 5 s is half of it.
    assert result(5.0).line() == (
        "batch_chat_states=16 chat_ttft_vs_target=0.500 chat_ttft_alone=0.200 chat_ttft_beside=5.000 "
        "chat_gap_alone=0.010 chat_gap_beside=2.400 batch_alone=40.000 batch_beside=42.000 "
        "batch_beside_over_alone=1.050 chat_end=length batch_status=200"
    )
    assert result(39.0).target == 10.0 and not result(39.0).failed  # slow, but answered: the ratio says it
    assert result(5.0, "alone 504 deadline_exceeded").failed
    assert result(5.0, chat_end="deadline_exceeded").failed


def test_the_multi_turn_line_sets_the_last_turn_s_first_token_against_the_first():
    """The median over conversations per turn, with kept turns and without the caches."""
    kept = [
        [Turn(0.5, 37, "length"), Turn(0.6, 120, "length", 90), Turn(0.75, 200, "stop", 150)],
        [Turn(0.4, 37, "length"), Turn(0.5, 120, "length", 90), Turn(0.45, 200, "stop", 150)],
        [Turn(0.6, 37, "length"), Turn(math.nan, 0, "500 internal_error"), Turn(0.5, 200, "stop", 150)],
    ]
    uncached = [[Turn(0.5, 37, "length"), Turn(0.9, 120, "length"), Turn(1.5, 200, "stop")]]
    assert MultiTurn(kept, uncached).line() == (
        "multi_turn=3 conversations=3 ttft_first=0.500 ttft_last=0.500 ttft_last_over_first=1.000 "
        "uncached_ttft_last_over_first=3.000 prompt_tokens_first=37 prompt_tokens_last=200 "
        "cached_tokens_first=0 cached_tokens_last=150 turn_ends=length,length,stop,length,length,stop,"
        "length,500 internal_error,stop"
    )


def test_the_schema_fuzz_sends_an_outlier_again_and_keeps_the_median(monkeypatch: pytest.MonkeyPatch) -> None:
    """One slow decision beside a schema's chat is sent four more times, each right after the decision
    alone: the median of the five ratios stands for it (two slow tries of five are noise), and the first
    try is still reported. A machine that slowed down since the start (the decision alone now takes 2 s,
    not 1 s) does not count as the schema's cost. With `outlier_tries=1` nothing is sent again."""
    from decider_dev.fuzz import schema_corpus

    beside = {"slow": [5.0, 2.2, 8.0, 4.6, 4.4], "fast": [1.5], None: [1.0, 1.0, 1.0]}
    alone = [1.0] * 4 + [2.0] * 4  # warm-up and the 3 at the start, then one before each retry

    def fake_beside(client, other, url, named, max_tokens, strict):
        name = named[0] if named else None
        return schema_corpus.Outcome(name or "plain", 200, finish="length"), beside[name].pop(0)

    monkeypatch.setattr(schema_corpus, "_beside", fake_beside)
    monkeypatch.setattr(schema_corpus, "decide", lambda client, url: alone.pop(0))
    monkeypatch.setattr(schema_corpus, "engine_restarts", lambda url: 0.0)
    items = list(schema_corpus.run("http://127.0.0.1:1", [("slow", {}), ("fast", {})], 8))
    counts = items[-1].counts()
    assert beside == {"slow": [], "fast": [], None: []} and alone == []  # the slow one five times, paired
    # slow: 5.0 / 1.0, then 2.2 / 2, 8.0 / 2, 4.6 / 2, 4.4 / 2: the median is 2.3, not 4.6 / 1
    assert counts["decision_beside_max_ratio"] == pytest.approx(2.3)
    assert counts["decision_beside_max_schema"] == "slow"
    assert counts["decision_beside_first_max_ratio"] == 5.0 and counts["decision_beside_retried"] == 1

    beside.update({"slow": [5.0], "fast": [1.5], None: [1.0, 1.0, 1.0]})
    alone.extend([1.0] * 4)
    items = list(schema_corpus.run("http://127.0.0.1:1", [("slow", {}), ("fast", {})], 8, outlier_tries=1))
    assert beside == {"slow": [], "fast": [], None: []} and items[-1].counts()["decision_beside_retried"] == 0
    assert items[-1].counts()["decision_beside_max_ratio"] == 5.0


def test_the_schema_fuzz_tells_best_effort_s_price_from_a_bug() -> None:
    """Best effort leaves out what llguidance does not enforce (`if`/`then`, `uniqueItems`, …) and
    takes `oneOf` as `anyOf`: an answer that breaks only those is the documented price, one that
    breaks what was enforced is a bug. Names of properties are not keywords."""
    from decider_dev.fuzz.schema_corpus import enforced_schema, validates

    schema = {
        "type": "object",
        "properties": {
            "if": {"type": "string"},  # a property called "if" stays
            "mode": {"type": "string"},
            "tags": {"type": "array", "uniqueItems": True, "items": {"oneOf": [{"type": "string"}, {}]}},
        },
        "required": ["mode"],
        "if": {"properties": {"mode": {"const": "wpa"}}},
        "then": {"required": ["key"]},
    }
    enforced = enforced_schema(schema)
    assert "if" not in enforced and "then" not in enforced and "if" in enforced["properties"]
    assert enforced["properties"]["tags"] == {"type": "array", "items": {"anyOf": [{"type": "string"}, {}]}}
    price = '{"mode": "wpa", "tags": ["a", "a"]}'  # breaks then/required, uniqueItems and oneOf only
    assert validates(schema, price) is False and validates(enforced, price) is True
    bug = '{"tags": []}'  # breaks `required`, which best effort enforces
    assert validates(schema, bug) is False and validates(enforced, bug) is False
    assert validates(enforced, '{"mode": "x", "if": 3}') is False  # the property "if" is still checked


def test_a_traffic_line_sets_another_tree_against_the_same_text_route():
    """`--against REV`: our side on that tree's server beside ours, both against one llama-server run."""
    ours = Level(1, [Outcome(0, 10.0, 200)], wall_seconds=10.0)
    older = Level(1, [Outcome(0, 12.5, 200), Outcome(1, 1.0, "503 deadline_unreachable")], wall_seconds=12.5)
    text = type("TextRun", (), {"wall_seconds": 30.0, "prompt_tokens": 900, "errors": 0})()
    line = TrafficLevel("hybrid_repeat", 4, ours, text, older).line()
    assert "level=hybrid_repeat concurrency=4 decision_vs_text=3.00 " in line
    assert " against_vs_text=2.40 against_seconds=12.50 " in line and " errors=1 " in line
    assert "against" not in TrafficLevel("hybrid", 1, ours, text).line()
