"""Chat parity with llama-server (issue 18): `logprobs` / `top_logprobs`, beside the generation loop
(`decider.engine.works.chat.ChatWork` calls `token_logprobs`). Constrained output (`response_format`) is
decider.engine.structured.constraints.

- **Logprobs.** The log-softmax of the model's raw logits at each generated token (temperature 1,
  before top-p and the response_format mask), as OpenAI reports them: the chosen token's and the
  `top_logprobs` most likely ones, each with its text and UTF-8 bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    bytes: list[int]
    logprob: float
    top: tuple[tuple[str, list[int], float], ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {
            "token": self.token,
            "logprob": self.logprob,
            "bytes": self.bytes,
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, b, lp in self.top],
        }


def _entry(piece: bytes) -> tuple[str, list[int]]:
    return piece.decode("utf-8", errors="replace"), list(piece)


def token_logprobs(logits: np.ndarray, token: int, top_n: int, piece: Callable[[int], bytes]) -> TokenLogprob:
    """The chosen token's log-probability and the `top_n` most likely tokens', from raw logits."""
    values = logits.astype(np.float64)
    peak = float(values.max())
    log_norm = peak + float(np.log(np.exp(values - peak).sum()))
    top: list[tuple[str, list[int], float]] = []
    if top_n > 0:
        best = np.argpartition(-values, min(top_n, values.size - 1))[:top_n]
        for candidate in sorted(best.tolist(), key=lambda i: -values[i]):
            text, raw = _entry(piece(int(candidate)))
            top.append((text, raw, float(values[candidate]) - log_norm))
    text, raw = _entry(piece(token))
    return TokenLogprob(text, raw, float(values[token]) - log_norm, tuple(top))


def logprobs_wire(entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's `choices[].logprobs`."""
    return {"content": [entry.to_wire() for entry in entries], "refusal": None}
