"""GGUFs of the production model's architecture (Qwen3.5: `qwen35`) with random weights.

Qwen3.5 is a hybrid: three gated delta-net (recurrent, linear attention) layers, then one gated
full-attention layer, repeated (`full_attention_interval` 4). The tensor names, shapes and
metadata keys are those llama.cpp's loader requires (llama-cpp-python 0.3.36's vendored
llama.cpp: `src/models/qwen35.cpp`, `src/llama-arch.cpp`); shapes are ggml's (ne0 first), numpy
arrays the reverse. The tokenizer (vocabulary, merges, token types, special ids, chat template)
is copied from another GGUF, the bundled SmolLM2 (ChatML), so the engine's labels and prompt
work as on that model.

- `TINY` (tests/engine/test_hybrid_model.py): 4 layers of 64, Q4_1 matrices as in SmolLM2, the
  rest F32; about 4 MB, written in a third of a second at test time.
- `QWEN35_4B` (the GPU benchmark, tools/dev/gpu): Qwen3.5-4B's shape and vocabulary size (the
  SmolLM2 vocabulary padded with unused tokens), Q4_1: 4.2 B parameters, 2.5 GiB, which llama.cpp
  reads as `qwen35 4B Q4_1`; written on the GPU machine (17 s here).
  Its rows repeat every `distinct_rows`: speed does not depend on the values.

The weights are noise: nothing here says anything about answers, only about the mechanics (hybrid
memory: a KV cache for the attention layers beside one recurrent state per sequence) and speed.

    python -m decider_dev.qwen35_gguf --tokenizer T.gguf --shape 4b --out qwen35-4b-random.gguf
"""

from __future__ import annotations

import argparse
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import gguf
import numpy as np

ARCH = "qwen35"


@dataclass(frozen=True)
class HybridShape:
    """Hyperparameters. The defaults are TINY: the proportions of the real model where they matter
    (fewer key heads than value heads in the delta-net layers, partial rotary, multi-section rope)."""

    n_embd: int = 64
    n_layer: int = 4
    full_attention_interval: int = 4
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    rope_dim: int = 8  # head_dim x partial_rotary_factor 0.25
    rope_sections: tuple[int, int, int, int] = (2, 1, 1, 0)  # sums to rope_dim / 2
    n_ff: int = 128
    ssm_conv_kernel: int = 4
    ssm_state: int = 16  # linear_key_head_dim (= value head dim)
    ssm_groups: int = 2  # linear_num_key_heads
    ssm_v_heads: int = 4  # linear_num_value_heads
    context_length: int = 32768
    n_vocab: int | None = None  # None: the tokenizer's; larger: padded with unused tokens
    distinct_rows: int | None = None  # None: every row random; else rows repeat (fast at full size)

    def is_recurrent(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0


TINY = HybridShape()
# Qwen3.5-4B (llama.cpp's loader: 32 layers of 2560 is its "4B"; the rest from the model's config):
# 16 query heads and 4 KV heads of 256, a 9216 FFN, delta-net layers with 16 key heads and 32 value
# heads of 128, a 4-tap convolution, rope over a quarter of each head in sections 11/11/10.
QWEN35_4B = HybridShape(
    n_embd=2560,
    n_layer=32,
    n_head=16,
    n_head_kv=4,
    head_dim=256,
    rope_dim=64,
    rope_sections=(11, 11, 10, 0),
    n_ff=9216,
    ssm_state=128,
    ssm_groups=16,
    ssm_v_heads=32,
    context_length=262144,
    n_vocab=248320,
    distinct_rows=256,
)
SHAPES = {"tiny": TINY, "4b": QWEN35_4B}


def write_qwen35(path: Path, tokenizer_gguf: Path, *, seed: int = 0, shape: HybridShape = TINY) -> Path:
    """Write the model to `path`, with `tokenizer_gguf`'s tokenizer; returns `path`."""
    s = shape
    rng = np.random.default_rng(seed)
    tokenizer = _padded(read_tokenizer(tokenizer_gguf), s.n_vocab)
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][1])

    writer = start_writer(path, ARCH, tokenizer, s)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_dimension_count(s.rope_dim)
    writer.add_rope_dimension_sections(list(s.rope_sections))
    writer.add_rope_freq_base(10_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_full_attention_interval(s.full_attention_interval)
    writer.add_ssm_conv_kernel(s.ssm_conv_kernel)
    writer.add_ssm_state_size(s.ssm_state)
    writer.add_ssm_group_count(s.ssm_groups)
    writer.add_ssm_time_step_rank(s.ssm_v_heads)
    writer.add_ssm_inner_size(s.ssm_state * s.ssm_v_heads)

    matrix, vector = random_tensors(writer, rng, s.distinct_rows)
    ones = np.ones
    matrix("token_embd.weight", s.n_embd, n_vocab, scale=0.15)
    vector("output_norm.weight", ones(s.n_embd))
    key_dim = s.ssm_state * s.ssm_groups
    value_dim = s.ssm_state * s.ssm_v_heads
    for il in range(s.n_layer):
        blk = f"blk.{il}"
        vector(f"{blk}.attn_norm.weight", ones(s.n_embd))
        vector(f"{blk}.post_attention_norm.weight", ones(s.n_embd))
        if s.is_recurrent(il):
            matrix(f"{blk}.attn_qkv.weight", s.n_embd, 2 * key_dim + value_dim)
            matrix(f"{blk}.attn_gate.weight", s.n_embd, value_dim)
            vector(
                f"{blk}.ssm_conv1d.weight",
                rng.normal(0.0, 0.3, size=(2 * key_dim + value_dim, s.ssm_conv_kernel)),
            )
            vector(f"{blk}.ssm_dt.bias", rng.normal(0.0, 0.1, size=s.ssm_v_heads))
            vector(f"{blk}.ssm_a", -np.exp(rng.uniform(0.0, np.log(16.0), size=s.ssm_v_heads)))
            vector(f"{blk}.ssm_beta.weight", rng.normal(0.0, 0.05, size=(s.ssm_v_heads, s.n_embd)))
            vector(f"{blk}.ssm_alpha.weight", rng.normal(0.0, 0.05, size=(s.ssm_v_heads, s.n_embd)))
            vector(f"{blk}.ssm_norm.weight", ones(s.ssm_state))
            matrix(f"{blk}.ssm_out.weight", value_dim, s.n_embd)
        else:
            matrix(f"{blk}.attn_q.weight", s.n_embd, s.head_dim * s.n_head * 2)  # query + gate
            matrix(f"{blk}.attn_k.weight", s.n_embd, s.head_dim * s.n_head_kv)
            matrix(f"{blk}.attn_v.weight", s.n_embd, s.head_dim * s.n_head_kv)
            matrix(f"{blk}.attn_output.weight", s.head_dim * s.n_head, s.n_embd)
            vector(f"{blk}.attn_q_norm.weight", ones(s.head_dim))
            vector(f"{blk}.attn_k_norm.weight", ones(s.head_dim))
        matrix(f"{blk}.ffn_gate.weight", s.n_embd, s.n_ff)
        matrix(f"{blk}.ffn_up.weight", s.n_embd, s.n_ff)
        matrix(f"{blk}.ffn_down.weight", s.n_ff, s.n_embd)

    finish(writer)
    return path


class CommonShape(Protocol):
    """The sizes every architecture here has (LlamaShape, Gemma3Shape and HybridShape alike)."""

    context_length: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int


def start_writer(path: Path, arch: str, tokenizer: dict[str, Value], shape: CommonShape) -> gguf.GGUFWriter:
    """A writer holding the keys every random model here shares (Q4_1 matrices, the sizes, the
    tokenizer); the caller adds its architecture's own keys and the tensors, then calls `finish`."""
    s = shape
    writer = gguf.GGUFWriter(path, arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"{arch}-random-{s.n_layer}x{s.n_embd}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_context_length(s.context_length)
    writer.add_embedding_length(s.n_embd)
    writer.add_block_count(s.n_layer)
    writer.add_feed_forward_length(s.n_ff)
    writer.add_head_count(s.n_head)
    writer.add_head_count_kv(s.n_head_kv)
    _add_tokenizer(writer, tokenizer)
    return writer


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer: dict[str, Value]) -> None:
    for key, (vtype, value, sub_type) in tokenizer.items():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)


def random_tensors(
    writer: gguf.GGUFWriter, rng: np.random.Generator, distinct_rows: int | None = None
) -> tuple[Callable[..., None], Callable[[str, np.ndarray], None]]:
    """`matrix(name, ne0, ne1, scale=0.05)`: a Q4_1 matrix of normal noise (its rows repeating every
    `distinct_rows`, if set); `vector(name, values)`: an F32 tensor."""

    def matrix(name: str, ne0: int, ne1: int, scale: float = 0.05) -> None:
        rows = ne1 if distinct_rows is None else min(ne1, distinct_rows)
        data = rng.normal(0.0, scale, size=(rows, ne0)).astype(np.float32)
        quantized = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_1)
        if rows < ne1:
            quantized = np.tile(quantized, (-(-ne1 // rows), 1))[:ne1]
        writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q4_1)

    def vector(name: str, values: np.ndarray) -> None:
        writer.add_tensor(name, values.astype(np.float32))

    return matrix, vector


def finish(writer: gguf.GGUFWriter) -> None:
    """Write the header, the key-values and the tensors added to `writer`, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tokenizer_only(path: Path, source_gguf: Path) -> Path:
    """A GGUF holding only `source_gguf`'s tokenizer keys (no tensors): what `write_qwen35` reads.
    SmolLM2's is about 2 MB, where the whole model is 93 MB."""
    writer = gguf.GGUFWriter(path, ARCH)
    _add_tokenizer(writer, read_tokenizer(source_gguf))
    finish(writer)
    return path


def _padded(tokenizer: dict[str, Value], n_vocab: int | None) -> dict[str, Value]:
    """The vocabulary grown to `n_vocab` with unused tokens (text never tokenizes to them)."""
    tokens_type, tokens, tokens_item = tokenizer["tokenizer.ggml.tokens"]
    types_type, types, types_item = tokenizer["tokenizer.ggml.token_type"]
    assert isinstance(tokens, list) and isinstance(types, list)
    if n_vocab is None or n_vocab <= len(tokens):
        return tokenizer
    extra = range(n_vocab - len(tokens))
    return {
        **tokenizer,
        "tokenizer.ggml.tokens": (tokens_type, [*tokens, *(f"<|unused_{i}|>" for i in extra)], tokens_item),
        "tokenizer.ggml.token_type": (
            types_type,
            [*types, *(int(gguf.TokenType.UNUSED) for _ in extra)],
            types_item,
        ),
    }


# GGUF scalar value types: struct format (gguf.GGUFValueType numbering).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
Value = tuple[gguf.GGUFValueType, object, gguf.GGUFValueType | None]


def read_tokenizer(path: Path) -> dict[str, Value]:
    """Every `tokenizer.*` key of a GGUF file with its exact types: (type, value, array item type).

    A direct read of the key-value header: gguf.GGUFReader builds a numpy view per string, about
    3 s for a 49k-token vocabulary; this takes a tenth of that."""
    with path.open("rb") as handle:
        data = handle.read(64 << 20)  # the header of a small model fits (SmolLM2's: ~2 MB)
    magic, _version, _n_tensors, n_kv = struct.unpack_from("<IIQQ", data, 0)
    if magic != gguf.GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    offset = 24

    def string() -> str:
        nonlocal offset
        (n,) = struct.unpack_from("<Q", data, offset)
        offset += 8 + n
        return data[offset - n : offset].decode("utf-8")

    def scalar(vtype: int) -> object:
        nonlocal offset
        fmt = "<" + _SCALARS[vtype]
        offset += struct.calcsize(fmt)
        return struct.unpack_from(fmt, data, offset - struct.calcsize(fmt))[0]

    out: dict[str, Value] = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if vtype == _ARRAY:
            item, count = struct.unpack_from("<IQ", data, offset)
            offset += 12
            if item == _STRING:
                value: object = [string() for _ in range(count)]
            else:
                fmt = "<" + _SCALARS[item] * count
                value = list(struct.unpack_from(fmt, data, offset))
                offset += struct.calcsize(fmt)
            entry: Value = (gguf.GGUFValueType(vtype), value, gguf.GGUFValueType(item))
        else:
            value = string() if vtype == _STRING else scalar(vtype)
            entry = (gguf.GGUFValueType(vtype), value, None)
        if key.startswith("tokenizer."):
            out[key] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a random-weight Qwen3.5 GGUF.")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a GGUF whose tokenizer to copy")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_suffix(".partial")
    write_qwen35(partial, args.tokenizer, shape=SHAPES[args.shape])
    partial.replace(args.out)
    print(f"{args.out}: {args.out.stat().st_size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
