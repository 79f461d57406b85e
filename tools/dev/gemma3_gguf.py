"""A tiny sliding-window GGUF (`gemma3`, the bundled Gemma 3's architecture) with random weights, for
tests of the engine's mechanics where attention is windowed.

Gemma 3 interleaves sliding-window layers with global ones (llama.cpp: five windowed layers, then one
global, for a model with a `sliding_window` key), so the KV cache is llama.cpp's iSWA pair. The bundled
Gemma 3 270M has a 512-token window and costs about 270 M multiply-adds per token; this one has a
64-token window and 6 layers of 128 (five windowed, one global), so a state past the window is a
hundred tokens, each costing about 7 M (most of it the output row per vocabulary entry). Claims that
hold bit for bit (shared against fresh in batch-invariant mode) or count cached tokens run the same
code on it in a fraction of the time; claims within a tolerance, and those about Gemma's own
tokenizer and template, stay on the bundled model.

The tokenizer is copied from another GGUF, the bundled SmolLM2, as `decider_dev.llama_gguf` does.
Tensor names and shapes are those llama.cpp's loader requires for `gemma3` (ggml's order, ne0 first).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from decider_dev.llama_gguf import LlamaShape, attention_tensors
from decider_dev.qwen35_gguf import finish, random_tensors, read_tokenizer, start_writer

ARCH = "gemma3"


@dataclass(frozen=True)
class Gemma3Shape(LlamaShape):
    """The tiny llama's sizes, with one key/value head per four query heads as in Gemma 3 270M, six
    layers (llama.cpp's gemma3 pattern: layers 0-4 windowed, layer 5 global) and a window that a
    single JevBench state passes."""

    n_layer: int = 6
    n_head_kv: int = 1
    sliding_window: int = 64


TINY_GEMMA3 = Gemma3Shape()


def write_gemma3(
    path: Path, tokenizer_gguf: Path, *, seed: int = 0, shape: Gemma3Shape = TINY_GEMMA3
) -> Path:
    """Write the model to `path`, with `tokenizer_gguf`'s tokenizer; returns `path`."""
    s = shape
    rng = np.random.default_rng(seed)
    tokenizer = read_tokenizer(tokenizer_gguf)
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][1])  # type: ignore[arg-type]
    head_dim = s.n_embd // s.n_head

    writer = start_writer(path, ARCH, tokenizer, s)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_sliding_window(s.sliding_window)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)

    matrix, vector = random_tensors(writer, rng)

    def gemma_norms(blk: str) -> None:  # Gemma's per-head query/key norms and post-norms
        vector(f"{blk}.attn_q_norm.weight", np.ones(head_dim))
        vector(f"{blk}.attn_k_norm.weight", np.ones(head_dim))
        vector(f"{blk}.post_attention_norm.weight", np.ones(s.n_embd))
        vector(f"{blk}.post_ffw_norm.weight", np.ones(s.n_embd))

    attention_tensors(matrix, vector, s, n_vocab, per_layer=gemma_norms)
    finish(writer)
    return path
