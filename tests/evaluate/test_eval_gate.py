"""`decide-eval thresholds` and `decide-eval check`: the statistics on known data, then the CLI on real runs
against the fake decision server of test_eval_cli (real HTTP, deterministic answers).

The pipeline around `check` (promote apply → run → check → promote rollback) is tested end to end in
tests/promote/test_pipeline_gate.py, against the real server behind the SageMaker runtime stand-in and moto.
"""

import json
import random

import numpy as np
import pytest
from test_eval_cli import fake_server, labelled_file  # noqa: F401  (a fixture, reused)

from decider_cli.evaluate.check import Bounds, check_runs, load_run_or_baseline, save_baseline
from decider_cli.evaluate.cli import main
from decider_cli.evaluate.metrics import argmax_label, expected_calibration_error
from decider_cli.evaluate.results import RequestRecord, ResultRow, RunMeta, load_run
from decider_cli.evaluate.thresholds import choose_cut, compute_thresholds, row_confidence, wilson


def rows_with_confidence(n: int, seed: int = 0, *, qtype: str = "choice", key: str = "k") -> list[ResultRow]:
    """Four-option answers whose peak p is uniform in [0.25, 1]; right with probability p (calibrated)."""
    rng = random.Random(seed)
    labels = ["a", "b", "c", "d"]
    rows = []
    for i in range(n):
        peak = rng.uniform(0.25, 1.0)
        probs = {"a": peak, **{label: (1 - peak) / 3 for label in labels[1:]}}
        gold = "a" if rng.random() < peak else rng.choice(labels[1:])
        predicted = argmax_label(probs)
        rows.append(
            ResultRow(
                index=i,
                case_id=f"c{i}",
                key=key,
                type=qtype,
                domain="even" if i % 2 == 0 else "odd",
                latency_s=1.0,
                http_status=200,
                status="ok",
                labels=labels,
                probs=probs,
                predicted=predicted,
                confidence=max(probs.values()),
                gold=gold,
                correct=predicted == gold,
            )
        )
    return rows


def meta_for(rows: list[ResultRow], latency: float = 1.0, seed: int = 0) -> RunMeta:
    rng = random.Random(seed)
    cases = sorted({r.case_id for r in rows})
    return RunMeta(
        target="t",
        target_description="t",
        cases_path="cases.jsonl",
        cases_sha256="0" * 64,
        gold_path=None,
        args={},
        model="m@1",
        started_at="2026-12-04T00:00:00+00:00",
        requests=[
            RequestRecord(
                index=i, case_id=c, latency_s=latency * rng.uniform(0.9, 1.1), http_status=200, questions=1
            )
            for i, c in enumerate(cases)
        ],
    )


def test_choose_cut_on_a_hand_example():
    conf = np.array([0.9, 0.8, 0.8, 0.6, 0.5, 0.2])
    ok = np.array([True, True, True, False, True, False])
    # accepted at >= 0.8: 3/3; at >= 0.6: 3/4; at >= 0.5: 4/5; at >= 0.2: 4/6
    assert choose_cut(conf, ok, 0.95, 1) == (0.8, 3, 3)
    assert choose_cut(conf, ok, 0.75, 1) == (0.5, 5, 4)
    assert choose_cut(conf, ok, 0.95, 4) == (None, 0, 0)  # 3 answers are not enough
    assert choose_cut(conf, ok, 0.6, 1) == (0.2, 6, 4)
    lo, hi = wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)


def test_confidence_is_normalized_peak_v1():
    row = rows_with_confidence(1)[0]
    peak = row.probs["a"]
    assert row_confidence(row) == pytest.approx((4 * peak - 1) / 3)
    noul = row.model_copy(
        update={"type": "noul", "labels": ["true", "false"], "probs": {"true": 0.2, "false": 0.8}}
    )
    assert row_confidence(noul) == pytest.approx(0.6)  # |2p - 1|


def test_thresholds_on_calibrated_answers_meet_the_target_out_of_fold():
    rows = rows_with_confidence(3000, seed=1)
    meta = meta_for(rows)
    t = compute_thresholds("run", meta, rows, target=0.9, bootstrap=200, min_key_labels=50)
    choice = t.types["choice"]
    # right with probability p = (3c + 1) / 4 at confidence c (uniform on [0, 1]):
    # p averages 0.9 over [c*, 1] at c* = 0.733, a coverage of 0.267
    assert choice.threshold == pytest.approx(0.733, abs=0.06)
    assert choice.accuracy_above >= 0.9 and choice.coverage == pytest.approx(0.267, abs=0.05)
    assert choice.oof_accuracy == pytest.approx(0.9, abs=0.03)
    lo, hi = choice.oof_accuracy_interval
    assert lo < choice.oof_accuracy < hi
    assert choice.oof_coverage == pytest.approx(choice.coverage, abs=0.05)
    t_lo, t_hi = choice.threshold_interval
    assert t_lo <= choice.threshold <= t_hi and choice.reachable_share == 1.0
    assert choice.curve[0][0] < choice.curve[-1][0] == 1.0 and len(choice.curve) <= 200
    assert list(t.keys) == ["k"] and t.keys["k"].threshold == choice.threshold
    assert t.confidence == "normalized-peak-v1" and t.model == "m@1" and t.target_accuracy == 0.9


def test_an_unreachable_target_gives_no_cut():
    rows = [r.model_copy(update={"correct": False, "gold": "b"}) for r in rows_with_confidence(200)]
    t = compute_thresholds("run", meta_for(rows), rows, target=0.95, bootstrap=50)
    choice = t.types["choice"]
    assert choice.threshold is None and choice.coverage == 0 and choice.oof_coverage == 0
    assert choice.threshold_interval == (None, None) and choice.reachable_share == 0
    assert "no cut reaches" in choice.note
    assert t.skipped_keys == {} and list(t.keys) == ["k"]


def test_check_same_quality_passes_and_a_real_drop_fails():
    base = rows_with_confidence(600, seed=2)
    same = rows_with_confidence(600, seed=3)  # another sample of the same model: noise only
    bounds = Bounds(bootstrap=2000)
    result = check_runs("run", (meta_for(same), same), "base", (meta_for(base), base), bounds)
    assert not result.failed, [(c.metric, c.name, c.verdict) for c in result.comparisons]
    assert {c.name for c in result.comparisons} == {"all", "choice", "even", "odd"}

    # one answer in four turned wrong: accuracy falls about 0.16
    worse = [
        r.model_copy(update={"correct": False, "gold": "b"}) if i % 4 == 0 and r.correct else r
        for i, r in enumerate(same)
    ]
    result = check_runs("run", (meta_for(worse), worse), "base", (meta_for(base), base), bounds)
    assert result.failed
    failed = {(c.metric, c.name) for c in result.comparisons if c.verdict == "fail"}
    assert ("accuracy", "all") in failed and ("accuracy", "choice") in failed
    acc = next(c for c in result.comparisons if (c.metric, c.name) == ("accuracy", "all"))
    assert acc.interval[1] < -bounds.max_accuracy_drop and acc.delta == pytest.approx(
        sum(r.correct for r in worse) / 600 - sum(r.correct for r in base) / 600
    )
    # the same drop with a bound larger than it passes
    loose = Bounds(bootstrap=2000, max_accuracy_drop=0.3, max_ece_rise=0.5)
    assert not check_runs("run", (meta_for(worse), worse), "base", (meta_for(base), base), loose).failed


def test_check_ece_and_latency():
    base = rows_with_confidence(600, seed=4)
    overconfident = [
        r.model_copy(update={"confidence": 0.99, "probs": {"a": 0.99, "b": 0.0033, "c": 0.0033, "d": 0.0034}})
        for r in rows_with_confidence(600, seed=5)
    ]
    result = check_runs(
        "run",
        (meta_for(overconfident), overconfident),
        "base",
        (meta_for(base), base),
        Bounds(bootstrap=1000),
    )
    ece = next(c for c in result.comparisons if (c.metric, c.name) == ("ece", "all"))
    assert ece.verdict == "fail" and ece.run == pytest.approx(
        expected_calibration_error([0.99] * 600, [bool(r.correct) for r in overconfident])
    )
    slow = check_runs(
        "run", (meta_for(base, latency=2.0), base), "base", (meta_for(base), base), Bounds(bootstrap=1000)
    )
    p95 = next(c for c in slow.comparisons if c.metric == "p95_latency")
    assert p95.verdict == "fail" and p95.delta == pytest.approx(1.0, abs=0.25)
    assert [c.name for c in slow.comparisons if c.verdict == "fail"] == ["all"]


def test_thresholds_and_check_on_real_runs(fake_server, tmp_path, capsys):  # noqa: F811
    url_good, _ = fake_server(3.0)  # the first option gets +3 logits: 'a' picked, right on most 'pick's
    url_bad, _ = fake_server(-3.0)  # the first option never wins
    cases = labelled_file(tmp_path, 60)
    runs = {}
    for name, url in (("good", url_good), ("again", url_good), ("bad", url_bad)):
        runs[name] = tmp_path / name
        args = ["run", "--target", url, "--cases", str(cases), "--out", str(runs[name]), "--no-progress"]
        assert main(args) == 0
    capsys.readouterr()

    assert main(["thresholds", str(runs["good"]), "--target-accuracy", "0.9", "--min-key-labels", "30"]) == 0
    out = capsys.readouterr().out
    assert "Confidence cut-points" in out and "OOF acc." in out and "key pick" in out
    saved = json.loads((runs["good"] / "thresholds.json").read_text())
    assert saved["format"] == "decider-thresholds-v1" and saved["model"] == "fake@3.0"
    assert saved["confidence"] == "normalized-peak-v1" and saved["target_accuracy"] == 0.9
    assert set(saved["types"]) == {"noul", "choice", "score"} and "pick" in saved["keys"]
    assert saved["served_temperatures"] == {"noul": 1.0, "choice": 1.0, "score": 1.0}
    html = (runs["good"] / "report.html").read_text()
    assert "Confidence thresholds" in html and "coverage-accuracy curve" in html
    assert (runs["good"] / "coverage.png").is_file()
    assert main(["report", str(runs["good"])]) == 0  # the report keeps the curve
    assert "coverage-accuracy curve" in (runs["good"] / "report.html").read_text()

    # the same server twice: nothing moved (p95 of a local fake is a few ms: its jitter is not gated here)
    common = ["--max-p95-increase", "100"]
    assert main(["check", str(runs["again"]), "--baseline", str(runs["good"]), *common]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "What moved" in out
    assert json.loads((runs["again"] / "check.json").read_text())["failed"] is False

    # a worse model fails, and says what moved, by type and domain
    baseline_file = tmp_path / "baselines" / "decider.json"
    assert save_baseline(baseline_file, *load_run(runs["good"])) == baseline_file
    code = main(["check", str(runs["bad"]), "--baseline", str(baseline_file), "--all", *common])
    out = capsys.readouterr().out
    assert code == 1 and "FAIL" in out and "accuracy all" in out and "accuracy choice" in out
    assert "domain alpha" in out and "domain beta" in out
    result = json.loads((runs["bad"] / "check.json").read_text())
    assert result["failed"] and result["same_cases"]

    # --accept writes the next baseline only on a pass; a missing baseline passes with the flag only
    accepted = tmp_path / "accepted.json"
    assert (
        main(
            ["check", str(runs["bad"]), "--baseline", str(baseline_file), "--accept", str(accepted), *common]
        )
        == 1
    )
    assert not accepted.exists()
    missing = tmp_path / "none.json"
    assert main(["check", str(runs["good"]), "--baseline", str(missing)]) == 2
    assert (
        main(
            [
                "check",
                str(runs["good"]),
                "--baseline",
                str(missing),
                "--allow-missing-baseline",
                "--accept",
                str(accepted),
            ]
        )
        == 0
    )
    assert "first run" in capsys.readouterr().out
    meta, rows = load_run_or_baseline(accepted)
    assert meta.model == "fake@3.0" and len(rows) == 180 and all(r.answer is None for r in rows)


def test_noise_alone_does_not_fail_even_with_zero_bounds():
    zero = Bounds(bootstrap=1000, max_accuracy_drop=0, max_ece_rise=0, max_p95_increase=0, min_group=10)
    failed = 0
    for s in range(40):  # 40 pairs of independent samples of the same (calibrated) model
        a, b = rows_with_confidence(150, seed=100 + s), rows_with_confidence(150, seed=200 + s)
        failed += check_runs("a", (meta_for(a, seed=s), a), "b", (meta_for(b, seed=s + 1), b), zero).failed
    assert failed <= 2  # at most 5 % by construction; 0 of 40 when this was written
