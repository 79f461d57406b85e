"""Pure functions turning slot logits into typed answers (no model needed, unit-tested alone)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np

CONFIDENCE_FORMULA = "normalized-peak-v1"


def logsumexp(values: np.ndarray) -> float:
    values = np.asarray(values, dtype=np.float64)
    peak = float(np.max(values))
    return peak + math.log(float(np.sum(np.exp(values - peak))))


def softmax(logits: Sequence[float] | np.ndarray, temperature: float = 1.0) -> list[float]:
    """Probabilities over the given logits after dividing them by `temperature` (> 0)."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    scaled = np.asarray(logits, dtype=np.float64) / temperature
    scaled -= np.max(scaled)
    weights = np.exp(scaled)
    return [float(p) for p in weights / weights.sum()]


def allowed_token_mass(slot_logits: Sequence[float] | np.ndarray, vocab_logsumexp: float) -> float:
    """Share of the full-vocabulary probability (at T=1) that falls on the declared slots."""
    return float(min(1.0, math.exp(logsumexp(np.asarray(slot_logits)) - vocab_logsumexp)))


def normalized_peak(probabilities: Sequence[float]) -> float:
    """`normalized-peak-v1`: clamp((n·p_max − 1)/(n − 1), 0, 1); 1.0 for a single option."""
    n = len(probabilities)
    if n < 2:
        return 1.0
    value = (n * max(probabilities) - 1.0) / (n - 1.0)
    return float(min(1.0, max(0.0, value)))


def score_expectation(probabilities: Sequence[float]) -> float:
    """Σ i·p_i over 0-based levels."""
    return float(sum(i * p for i, p in enumerate(probabilities)))


def argmax(values: Sequence[float]) -> int:
    """Index of the largest value; the first one wins ties (deterministic)."""
    best = 0
    for i, value in enumerate(values):
        if value > values[best]:
            best = i
    return best


def option_orders(n_options: int, count: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Up to `count` distinct option orders: identity, reverse, then seeded shuffles.

    Fewer are returned when the options have fewer distinct orders (n! < count).
    """
    identity = tuple(range(n_options))
    orders = [identity]
    reverse = identity[::-1]
    if count > 1 and reverse not in orders:
        orders.append(reverse)
    limit = math.factorial(n_options) if n_options <= 10 else count
    rng = random.Random(seed)  # deterministic: the same request always gets the same orders
    attempts = 0
    while len(orders) < min(count, limit) and attempts < 100 * count:
        attempts += 1
        shuffled = list(identity)
        rng.shuffle(shuffled)
        candidate = tuple(shuffled)
        if candidate not in orders:
            orders.append(candidate)
    return orders


def align_to_options(order: Sequence[int], slot_logits: Sequence[float]) -> list[float]:
    """Map logits read in slot order back to the original option order.

    `order[j]` is the option index shown at slot j, so option `order[j]` gets `slot_logits[j]`.
    """
    aligned = [0.0] * len(order)
    for slot, option_index in enumerate(order):
        aligned[option_index] = float(slot_logits[slot])
    return aligned


def average_logits(per_order: Sequence[Sequence[float]]) -> list[float]:
    """Mean of aligned slot logits over option orders (softmax-equivalent to averaging log-probs)."""
    return [float(v) for v in np.mean(np.asarray(per_order, dtype=np.float64), axis=0)]
