"""Temperature fitting recovers a known temperature; the deploy hint names the real setting."""

import math
import random

import pytest

from decider_cli.evaluate.calibrate import calibrate_rows, fit_temperature, mean_nll
from decider_cli.evaluate.metrics import argmax_label, softmax
from decider_cli.evaluate.results import ResultRow


def overconfident_rows(
    n: int, qtype: str, labels: list[str], factor: float, seed: int = 1
) -> list[ResultRow]:
    """Gold drawn from softmax(z); the 'server' reports logits factor * z (T=factor recalibrates)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        z = [rng.gauss(0, 1.0) for _ in labels]
        gold = rng.choices(labels, weights=softmax(z))[0]
        logits = {label: factor * v for label, v in zip(labels, z, strict=True)}
        probs = dict(zip(labels, softmax(list(logits.values())), strict=True))
        predicted = argmax_label(probs)
        rows.append(
            ResultRow(
                index=i,
                case_id=f"c{i}",
                key="k",
                type=qtype,
                domain="d",
                latency_s=0.1,
                http_status=200,
                status="ok",
                labels=labels,
                probs=probs,
                logits=logits,
                temperature=1.0,
                predicted=predicted,
                confidence=max(probs.values()),
                gold=gold,
                correct=predicted == gold,
            )
        )
    return rows


def test_fit_temperature_recovers_the_scale():
    rows = overconfident_rows(2000, "choice", ["a", "b", "c", "d"], factor=3.0)
    samples = [([r.logits[label] for label in r.labels], r.labels.index(r.gold)) for r in rows]
    temperature = fit_temperature(samples)
    assert temperature == pytest.approx(3.0, rel=0.15)
    # it is the NLL minimum
    assert mean_nll(samples, temperature) < min(
        mean_nll(samples, temperature * 0.8), mean_nll(samples, temperature * 1.25)
    )


def test_fit_temperature_on_a_tiny_hand_example():
    # one sample, logits (1, 0), gold is the second: NLL falls as T grows, so the fit goes to the upper bound
    assert fit_temperature([([1.0, 0.0], 1)]) == pytest.approx(50.0, rel=0.01)
    # two opposite samples with gold at the argmax on one only: the optimum is uniform-ish (large T)
    balanced = [([2.0, 0.0], 0), ([2.0, 0.0], 1), ([2.0, 0.0], 0)]
    t = fit_temperature(balanced)
    # p(first) should approach the empirical frequency 2/3: 1 / (1 + e^(-2/T)) = 2/3 -> T = 2 / ln 2
    assert t == pytest.approx(2 / math.log(2), rel=0.01)


def test_calibrate_rows_improves_out_of_fold_ece_and_prints_deploy_settings():
    rows = overconfident_rows(600, "choice", ["a", "b", "c", "d"], factor=3.0) + overconfident_rows(
        10, "noul", ["true", "false"], factor=1.0
    )
    cal = calibrate_rows(rows, folds=5, seed=0, min_samples=30, variant="gpu")
    by_type = {c.type: c for c in cal.types}
    choice = by_type["choice"]
    assert choice.improves and choice.ece_after_oof < choice.ece_before
    assert choice.nll_after_oof < choice.nll_before
    assert len(choice.fold_temperatures) == 5
    assert by_type["noul"].temperature is None and "need at least 30" in by_type["noul"].note
    assert by_type["score"].samples == 0
    assert cal.logits_source == "raw option logits"
    assert cal.env == {"DECIDER_TEMPERATURE_CHOICE": f"{choice.temperature:g}"}
    assert (
        cal.cdk_command
        == f"npx cdk deploy GpuStack -c gpu.container.temperature_choice={choice.temperature:g}"
    )


def test_calibrate_without_logits_uses_log_probabilities():
    rows = overconfident_rows(300, "noul", ["true", "false"], factor=2.0)
    with_logits = calibrate_rows(rows, min_samples=30)
    stripped = [r.model_copy(update={"logits": None}) for r in rows]
    derived = calibrate_rows(stripped, min_samples=30)
    assert derived.logits_source == "derived from probabilities"
    # log p differs from the logits by a per-row constant only, so the fit is the same
    assert derived.types[0].temperature == pytest.approx(with_logits.types[0].temperature, abs=0.02)


def test_a_signal_free_type_is_not_recommended():
    # gold always at the lower logit: the NLL keeps falling towards a uniform answer, T runs to the bound
    rows = overconfident_rows(200, "noul", ["true", "false"], factor=2.0)
    rows = [r.model_copy(update={"gold": min(r.logits, key=r.logits.get), "correct": False}) for r in rows]
    cal = calibrate_rows(rows, min_samples=30)
    noul = cal.types[0]
    assert noul.temperature == pytest.approx(50.0, rel=0.02)
    assert noul.ece_after_oof < noul.ece_before  # it would "improve" ECE, yet it is not recommended
    assert not noul.improves and "search bound" in noul.note
    assert cal.env == {} and cal.cdk_command is None
