"""What work costs the engine, and how long that takes on this machine: the admission estimate.

Decode time is not proportional to tokens alone. Each decode has a fixed cost (graph build, the
weights streamed once), each token a matmul cost, and each token attends every position before it,
so a 4,500-token request costs far more than nine 500-token ones. A `Cost` counts all three:
`steps` (decodes), `tokens`, and `attended` (the positions the tokens attend, summed). The
`CostModel` fits seconds = a·steps + b·tokens + c·attended to the decodes the engine has timed
(non-negative least squares) and predicts what a request will take.

The decodes it remembers are kept by size: the latest few of each power-of-two token count. A
stretch of chat-only work (every decode one token per chat, so tokens = chats × steps) would
otherwise fill a plain sliding window with decodes in which steps and tokens cannot be told
apart, and the fit could move the per-step cost onto the per-token one: a 300-token decision
would then be predicted at 300 chat steps. Larger decodes seen before stay in their own bins.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

ATTENTION_UNIT = 1000.0  # `attended` is fitted in thousands of positions (keeps the fit well scaled)
BIN_WINDOW = 32  # timed decodes the fit remembers per size bin (tokens per decode, powers of two)
SIZE_BINS = 14  # 1, 2-3, 4-7, ... tokens; the last bin takes every larger decode
MIN_OBSERVATIONS = 3


def span_attended(start: int, tokens: int) -> float:
    """Positions attended by `tokens` tokens appended at position `start` (each sees itself and
    everything before it)."""
    return tokens * start + tokens * (tokens + 1) / 2


@dataclass(frozen=True)
class Cost:
    steps: int = 0
    tokens: int = 0
    attended: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.steps + other.steps, self.tokens + other.tokens, self.attended + other.attended)

    def remaining(self, decoded_tokens: int) -> Cost:
        """What is left once `decoded_tokens` of it are done (in proportion)."""
        if self.tokens <= 0:
            return Cost()
        left = max(0.0, 1.0 - decoded_tokens / self.tokens)
        return Cost(math.ceil(self.steps * left), math.ceil(self.tokens * left), self.attended * left)

    def scaled(self, fraction: float) -> Cost:
        """The share `fraction` (0..1) of it: the part done before a deadline cuts it off."""
        fraction = min(1.0, max(0.0, fraction))
        return Cost(
            math.ceil(self.steps * fraction), math.ceil(self.tokens * fraction), self.attended * fraction
        )

    def features(self) -> np.ndarray:
        return np.array([self.steps, self.tokens, self.attended / ATTENTION_UNIT], dtype=np.float64)


class CostModel:
    """seconds ≈ a·steps + b·tokens + c·attended, a, b, c ≥ 0, fitted to recent timed decodes."""

    def __init__(self, bin_window: int = BIN_WINDOW) -> None:
        self._bins: list[deque[tuple[np.ndarray, float]]] = [
            deque(maxlen=bin_window) for _ in range(SIZE_BINS)
        ]
        self._coef: np.ndarray | None = None

    def observe(self, cost: Cost, seconds: float) -> None:
        """One decode of `cost` took `seconds`."""
        size_bin = min(SIZE_BINS - 1, max(0, cost.tokens).bit_length())
        self._bins[size_bin].append((cost.features(), seconds))
        self._coef = None

    @property
    def observations(self) -> int:
        return sum(len(size_bin) for size_bin in self._bins)

    @property
    def ready(self) -> bool:
        return self.observations >= MIN_OBSERVATIONS

    @property
    def coefficients(self) -> np.ndarray | None:
        if self._coef is None and self.ready:
            timed = [entry for size_bin in self._bins for entry in size_bin]
            self._coef = _nnls(np.array([row for row, _ in timed]), np.array([sec for _, sec in timed]))
        return self._coef

    def predict(self, cost: Cost) -> float | None:
        """Seconds that `cost` takes on an otherwise idle engine (None until enough decodes were timed)."""
        coef = self.coefficients
        if coef is None:
            return None
        return float(cost.features() @ coef)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients, exactly, for a few columns: the best
    unconstrained fit over every subset of columns whose coefficients all come out >= 0."""
    n = a.shape[1]
    best, best_error = np.zeros(n), float(b @ b)
    for size in range(1, n + 1):
        for columns in itertools.combinations(range(n), size):
            sub = a[:, columns]
            coef, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(coef < 0):
                continue
            error = float(np.sum((sub @ coef - b) ** 2))
            if error < best_error:
                best_error = error
                best = np.zeros(n)
                best[list(columns)] = coef
    return best
