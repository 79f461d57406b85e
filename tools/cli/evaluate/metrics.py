"""Pure metric functions, following the JevBench definitions (see `.drafts/evaluate.md`).

- Accuracy: argmax over the exact label set; ties go to the lexicographically smallest label.
- Brier: multi-class, sum over labels of (p_k - y_k)^2 (so a two-label question ranges 0..2).
- ECE: top-label confidence, 10 equal-width bins, empty bins left out.
- Ordinal MAE: |sum_i i * p_i - gold level| for score questions.
- Percentiles: linear interpolation between order statistics (numpy's default, "type 7").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Probabilities = Mapping[str, float]


def argmax_label(probs: Probabilities) -> str:
    """The label with the highest probability; ties go to the lexicographically smallest label."""
    if not probs:
        raise ValueError("empty probability vector")
    best = max(probs.values())
    return min(label for label, p in probs.items() if p == best)


def top_confidence(probs: Probabilities) -> float:
    return max(probs.values())


def brier(probs: Probabilities, gold: str) -> float:
    """Multi-class Brier score of one answer against its gold label."""
    if gold not in probs:
        raise ValueError(f"gold label {gold!r} is not one of the labels {sorted(probs)}")
    return sum((p - (1.0 if label == gold else 0.0)) ** 2 for label, p in probs.items())


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN when there are no values."""
    if not values:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=float), q, method="linear"))


@dataclass(frozen=True)
class ReliabilityBin:
    lower: float
    upper: float
    count: int
    mean_confidence: float
    accuracy: float


N_BINS = 10


def reliability_bins(
    confidences: Sequence[float], correct: Sequence[bool], n_bins: int = N_BINS
) -> list[ReliabilityBin]:
    """Non-empty equal-width bins over [0, 1]: [0, 0.1), [0.1, 0.2), ..., [0.9, 1.0] (the last one closed)."""
    if len(confidences) != len(correct):
        raise ValueError("confidences and correct must have the same length")
    members: list[list[int]] = [[] for _ in range(n_bins)]
    for i, conf in enumerate(confidences):
        if not 0.0 <= conf <= 1.0:
            raise ValueError(f"confidence {conf} is outside [0, 1]")
        members[min(int(conf * n_bins), n_bins - 1)].append(i)
    bins = []
    for b, idx in enumerate(members):
        if not idx:
            continue
        bins.append(
            ReliabilityBin(
                lower=b / n_bins,
                upper=(b + 1) / n_bins,
                count=len(idx),
                mean_confidence=sum(confidences[i] for i in idx) / len(idx),
                accuracy=sum(1 for i in idx if correct[i]) / len(idx),
            )
        )
    return bins


def expected_calibration_error(
    confidences: Sequence[float], correct: Sequence[bool], n_bins: int = N_BINS
) -> float:
    """Top-label ECE: sum over non-empty bins of (n_b / N) * |accuracy_b - mean confidence_b|."""
    total = len(confidences)
    if total == 0:
        return math.nan
    return sum(
        b.count / total * abs(b.accuracy - b.mean_confidence)
        for b in reliability_bins(confidences, correct, n_bins)
    )


def expected_level(probs: Probabilities) -> float:
    """The probability-weighted level of a score answer (labels are "0".."n-1")."""
    return sum(int(label) * p for label, p in probs.items())


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def softmax(logits: Sequence[float], temperature: float = 1.0) -> list[float]:
    """Numerically stable softmax of logits / temperature."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    scaled = [z / temperature for z in logits]
    top = max(scaled)
    exps = [math.exp(z - top) for z in scaled]
    total = sum(exps)
    return [e / total for e in exps]


def negative_log_likelihood(logits: Sequence[float], gold_index: int, temperature: float = 1.0) -> float:
    """-log softmax(logits / T)[gold], computed with log-sum-exp."""
    scaled = [z / temperature for z in logits]
    top = max(scaled)
    log_norm = top + math.log(sum(math.exp(z - top) for z in scaled))
    return log_norm - scaled[gold_index]
