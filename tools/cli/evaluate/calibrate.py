"""Fit a readout temperature per question type from a run's raw logits, checked out of fold.

For each type, T minimizes the mean negative log-likelihood of softmax(logits / T) at the gold label.
NLL is convex in beta = 1/T, so a golden-section search over log(beta) finds the global minimum.
The fit is judged by k-fold out-of-fold ECE: T is fitted on k-1 folds and applied to the held-out fold,
and that ECE is compared with the ECE of the probabilities as served. Temperature never changes the
argmax, so accuracy is unchanged; only confidence (and score expectations) move.

The printed deploy setting is the container setting `temperature_<type>` (decider.settings.Settings):
its environment variable, and the CDK context override the stacks pass to the container.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from decider_cli.evaluate.cases import QUESTION_TYPES
from decider_cli.evaluate.metrics import expected_calibration_error, mean, negative_log_likelihood, softmax
from decider_cli.evaluate.results import ResultRow
from decider_cli.evaluate.summary import fmt

T_MIN, T_MAX = 0.05, 50.0
CALIBRATION_FILE = "calibration.json"
Sample = tuple[list[float], int]  # (logits in label order, gold index)


def mean_nll(samples: Sequence[Sample], temperature: float) -> float:
    return mean([negative_log_likelihood(z, gold, temperature) for z, gold in samples])


def fit_temperature(samples: Sequence[Sample], *, iterations: int = 80) -> float:
    """The T in [T_MIN, T_MAX] that minimizes mean NLL (golden-section search over log(1/T))."""
    if not samples:
        raise ValueError("no samples to fit a temperature on")
    lo, hi = math.log(1 / T_MAX), math.log(1 / T_MIN)
    ratio = (math.sqrt(5) - 1) / 2

    def loss(log_beta: float) -> float:
        return mean_nll(samples, 1 / math.exp(log_beta))

    x1, x2 = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    f1, f2 = loss(x1), loss(x2)
    for _ in range(iterations):
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - ratio * (hi - lo)
            f1 = loss(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + ratio * (hi - lo)
            f2 = loss(x2)
    return 1 / math.exp((lo + hi) / 2)


def _top(samples: Sequence[Sample], temperature: float) -> tuple[list[float], list[bool]]:
    confidences, correct = [], []
    for logits, gold in samples:
        probs = softmax(logits, temperature)
        best = max(range(len(probs)), key=lambda i: (probs[i], -i))
        confidences.append(probs[best])
        correct.append(best == gold)
    return confidences, correct


def out_of_fold(
    samples: Sequence[Sample], *, folds: int, seed: int
) -> tuple[list[float], list[bool], list[float], list[float]]:
    """Confidence, correctness and NLL of every sample under the T fitted without its fold; the fold Ts."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    k = max(2, min(folds, len(samples)))
    confidences: list[float] = []
    correct: list[bool] = []
    nlls: list[float] = []
    temperatures: list[float] = []
    for fold in range(k):
        held = [samples[i] for i in order[fold::k]]
        train = [samples[i] for n, i in enumerate(order) if n % k != fold]
        temperature = fit_temperature(train)
        temperatures.append(temperature)
        c, ok = _top(held, temperature)
        confidences += c
        correct += ok
        nlls += [negative_log_likelihood(z, gold, temperature) for z, gold in held]
    return confidences, correct, nlls, temperatures


def samples_from_rows(rows: Sequence[ResultRow]) -> tuple[list[Sample], list[ResultRow], bool]:
    """(samples, the rows they came from, whether any were derived from probabilities rather than logits)."""
    samples: list[Sample] = []
    used: list[ResultRow] = []
    derived = False
    for row in rows:
        if not row.scored:
            continue
        if row.logits is not None:
            logits = [row.logits[label] for label in row.labels]
        else:  # no extension block: log p is the logit up to a constant, times the server's T if known
            derived = True
            logits = [
                math.log(max(row.probs[label], 1e-12)) * (row.temperature or 1.0) for label in row.labels
            ]
        samples.append((logits, row.labels.index(row.gold)))
        used.append(row)
    return samples, used, derived


class TypeCalibration(BaseModel):
    type: str
    samples: int
    temperature: float | None
    served_temperature: float | None
    ece_before: float
    ece_after_oof: float
    nll_before: float
    nll_after_oof: float
    fold_temperatures: list[float]
    improves: bool
    note: str | None = None


class Calibration(BaseModel):
    folds: int
    seed: int
    logits_source: str
    types: list[TypeCalibration]
    env: dict[str, str]
    cdk_command: str | None


def calibrate_rows(
    rows: Sequence[ResultRow], *, folds: int = 5, seed: int = 0, min_samples: int = 30, variant: str = "cpu"
) -> Calibration:
    from decider.settings import Settings

    results: list[TypeCalibration] = []
    derived_any = False
    for qtype in QUESTION_TYPES:
        samples, used, derived = samples_from_rows([r for r in rows if r.type == qtype])
        derived_any |= derived
        served = sorted({r.temperature for r in used if r.temperature is not None})
        served_t = served[0] if len(served) == 1 else None
        ece_before = expected_calibration_error([r.confidence for r in used], [bool(r.correct) for r in used])
        nll_before = mean([-math.log(max(r.probs[r.gold], 1e-12)) for r in used])
        if len(samples) < min_samples:
            results.append(
                TypeCalibration(
                    type=qtype,
                    samples=len(samples),
                    temperature=None,
                    served_temperature=served_t,
                    ece_before=ece_before,
                    ece_after_oof=math.nan,
                    nll_before=nll_before,
                    nll_after_oof=math.nan,
                    fold_temperatures=[],
                    improves=False,
                    note=f"not fitted: {len(samples)} labelled answers, need at least {min_samples}",
                )
            )
            continue
        conf, ok, nlls, fold_ts = out_of_fold(samples, folds=folds, seed=seed)
        nll_after = mean(nlls)
        ece_after = expected_calibration_error(conf, ok)
        fitted = fit_temperature(samples)
        temperature = round(fitted, 2)
        at_bound = fitted >= T_MAX * 0.99 or fitted <= T_MIN * 1.01
        if at_bound:
            note = (
                f"T runs to the search bound ({temperature:g}): the logits carry no usable signal for "
                "this type (the best fit is a uniform answer); not recommended - the model needs fixing, "
                "not a temperature"
            )
        elif ece_after >= ece_before:
            note = "out-of-fold ECE does not improve: keep the current setting"
        else:
            note = None
        results.append(
            TypeCalibration(
                type=qtype,
                samples=len(samples),
                temperature=temperature,
                served_temperature=served_t,
                ece_before=ece_before,
                ece_after_oof=ece_after,
                nll_before=nll_before,
                nll_after_oof=nll_after,
                fold_temperatures=[round(t, 3) for t in fold_ts],
                improves=ece_after < ece_before and not at_bound,
                note=note,
            )
        )
    apply = [c for c in results if c.improves and c.temperature is not None]
    env = {Settings.env_name(f"temperature_{c.type}"): f"{c.temperature:g}" for c in apply}
    stack = {"cpu": "CpuStack", "gpu": "GpuStack"}[variant]
    cdk = (
        f"npx cdk deploy {stack} "
        + " ".join(f"-c {variant}.container.temperature_{c.type}={c.temperature:g}" for c in apply)
        if apply
        else None
    )
    return Calibration(
        folds=folds,
        seed=seed,
        logits_source="derived from probabilities" if derived_any else "raw option logits",
        types=results,
        env=env,
        cdk_command=cdk,
    )


def print_calibration(cal: Calibration, console: Console) -> None:
    console.rule("decide-eval calibrate")
    console.print(
        f"temperature fitted by NLL per question type on {cal.logits_source}; "
        f"ECE after = {cal.folds}-fold out-of-fold (seed {cal.seed}); ECE before = probabilities as served"
    )
    table = Table(title_justify="left")
    for column in (
        "type",
        "n",
        "served T",
        "fitted T",
        "ECE before",
        "ECE after (OOF)",
        "NLL before",
        "NLL after (OOF)",
        "fold T range",
        "apply",
    ):
        table.add_column(column, justify="right")
    for c in cal.types:
        table.add_row(
            c.type,
            str(c.samples),
            fmt(c.served_temperature, 2),
            fmt(c.temperature, 2),
            fmt(c.ece_before, 4),
            fmt(c.ece_after_oof, 4),
            fmt(c.nll_before, 4),
            fmt(c.nll_after_oof, 4),
            f"{min(c.fold_temperatures):.2f}–{max(c.fold_temperatures):.2f}" if c.fold_temperatures else "",
            "yes" if c.improves else "no",
        )
    console.print(table)
    for c in cal.types:
        if c.note:
            console.print(f"{c.type}: {c.note}")
    if not cal.env:
        console.print("No temperature to recommend: nothing to deploy.")
        return
    console.print("Deploy setting (container environment):")
    console.print("  " + " ".join(f"{k}={v}" for k, v in cal.env.items()), soft_wrap=True)
    console.print("CDK (the stacks pass it to the container):")
    console.print(f"  {cal.cdk_command}", soft_wrap=True)


def write_calibration(run_dir: Path, cal: Calibration) -> Path:
    path = run_dir / CALIBRATION_FILE
    path.write_text(cal.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return path
