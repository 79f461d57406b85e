"""Chat parity with llama-server (issue 18): `logprobs` / `top_logprobs` and grammar-constrained
output (`response_format` with a JSON schema, or `json_object`), as additions beside the generation
loop (`decider.engine.chat.ChatWork` calls `grammar_sampler` and `token_logprobs`).

- **Grammar.** A JSON schema becomes GBNF with llama.cpp's own converter (`llama_cpp.llama_grammar`,
  the one llama-server's `json_schema_to_grammar` mirrors); `json_object` uses llama.cpp's JSON
  grammar. The grammar sampler goes first in the chain, so top-p, temperature and the seeded draw
  only ever see tokens the grammar allows; `llama_sampler_sample` advances it with each token. It is
  compiled once against the model's vocabulary while the request is planned, so a schema llama.cpp
  cannot use is a 422 naming `response_format`, never an engine failure.
- **Logprobs.** The log-softmax of the model's raw logits at each generated token (temperature 1,
  before top-p and the grammar), as OpenAI reports them: the chosen token's and the `top_logprobs`
  most likely ones, each with its text and UTF-8 bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from decider.engine.schema_limits import check_grammar_text, check_schema
from decider.settings import GrammarLimits

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


class GrammarError(ValueError):
    """A response format llama.cpp's grammar support cannot use."""


def schema_grammar(schema: dict[str, Any], limits: GrammarLimits | None = None) -> str:
    """GBNF for a JSON schema (llama.cpp's converter); GrammarError when it cannot convert it,
    GrammarLimitError (before the converter runs, or before llama.cpp parses its output) when the
    schema or its grammar is beyond `limits` (decider.engine.schema_limits)."""
    limits = limits or GrammarLimits()
    check_schema(schema, limits)
    try:
        grammar = json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # the converter asserts and raises KeyError/ValueError on what it cannot do
        raise GrammarError(f"llama.cpp cannot turn this JSON schema into a grammar: {exc}") from None
    check_grammar_text(grammar, limits)
    return grammar


def json_object_grammar() -> str:
    return JSON_GBNF


def grammar_sampler(vocab: Any, grammar: str) -> Any:
    """A grammar sampler for `vocab` (root rule `root`); GrammarError if llama.cpp refuses the grammar."""
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    if not sampler:
        raise GrammarError("llama.cpp refused the grammar made from this response format")
    return sampler


def check_grammar(vocab: Any, grammar: str) -> None:
    """Compile the grammar once (off the engine thread) and free it."""
    llama_cpp.llama_sampler_free(grammar_sampler(vocab, grammar))


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
