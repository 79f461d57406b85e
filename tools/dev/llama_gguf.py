"""A tiny attention-only GGUF (`llama`, SmolLM2's architecture) with random weights, for tests of the
engine's mechanics on the attention-only path.

The bundled SmolLM2 is the same architecture at 30 layers of 576: every test token costs it about
135 M multiply-adds, where this model's 2 layers of 128 cost about 7 M (most of it the output row
per vocabulary entry). Tests whose claims hold bit for bit or count tokens, decodes, sequences and
cells (kept states, eviction, chunked prefill, streamed questions) run the same code on it in a
fraction of the time. The weights are noise: answers close to uniform, so a comparison within a
tolerance says little here; such claims stay on SmolLM2.

The tokenizer (vocabulary, merges, special ids, chat template) is copied from another GGUF, the
bundled SmolLM2, as `decider_dev.qwen35_gguf` does for the hybrid model, so labels and prompts are
SmolLM2's. About 6 MB, written in about a second.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from decider_dev.qwen35_gguf import CommonShape, finish, random_tensors, read_tokenizer, start_writer

ARCH = "llama"


@dataclass(frozen=True)
class LlamaShape:
    """Hyperparameters: grouped-query attention (fewer key/value heads than query heads) and a tied
    output matrix, as in SmolLM2."""

    n_embd: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 256
    context_length: int = 8192


TINY_LLAMA = LlamaShape()


def write_llama(path: Path, tokenizer_gguf: Path, *, seed: int = 0, shape: LlamaShape = TINY_LLAMA) -> Path:
    """Write the model to `path`, with `tokenizer_gguf`'s tokenizer; returns `path`."""
    s = shape
    rng = np.random.default_rng(seed)
    tokenizer = read_tokenizer(tokenizer_gguf)
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][1])  # type: ignore[arg-type]
    head_dim = s.n_embd // s.n_head

    writer = start_writer(path, ARCH, tokenizer, s)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(100_000.0)
    writer.add_layer_norm_rms_eps(1e-5)

    matrix, vector = random_tensors(writer, rng)
    attention_tensors(matrix, vector, s, n_vocab)
    finish(writer)
    return path


def attention_tensors(
    matrix: Callable[..., None],
    vector: Callable[[str, np.ndarray], None],
    shape: CommonShape,
    n_vocab: int,
    per_layer: Callable[[str], None] = lambda blk: None,
) -> None:
    """Write the tensors of a llama-style model (tied embeddings, the final norm, and per layer the
    attention and the gated feed-forward with their pre-norms); `per_layer(blk)` adds an architecture's
    own tensors to layer `blk` (`blk.N`)."""
    s = shape
    head_dim = s.n_embd // s.n_head
    ones = np.ones
    matrix("token_embd.weight", s.n_embd, n_vocab, scale=0.15)  # also the output matrix (tied)
    vector("output_norm.weight", ones(s.n_embd))
    for il in range(s.n_layer):
        blk = f"blk.{il}"
        vector(f"{blk}.attn_norm.weight", ones(s.n_embd))
        matrix(f"{blk}.attn_q.weight", s.n_embd, head_dim * s.n_head)
        matrix(f"{blk}.attn_k.weight", s.n_embd, head_dim * s.n_head_kv)
        matrix(f"{blk}.attn_v.weight", s.n_embd, head_dim * s.n_head_kv)
        matrix(f"{blk}.attn_output.weight", head_dim * s.n_head, s.n_embd)
        vector(f"{blk}.ffn_norm.weight", ones(s.n_embd))
        matrix(f"{blk}.ffn_gate.weight", s.n_embd, s.n_ff)
        matrix(f"{blk}.ffn_up.weight", s.n_embd, s.n_ff)
        matrix(f"{blk}.ffn_down.weight", s.n_ff, s.n_embd)
        per_layer(blk)
