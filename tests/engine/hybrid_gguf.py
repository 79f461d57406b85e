"""A tiny GGUF of the production model's architecture (Qwen3.5: `qwen35`), random weights, for tests.

Qwen3.5 is a hybrid: three gated delta-net (recurrent, linear attention) layers, then one gated
full-attention layer, repeated (`full_attention_interval` 4). The tensor names, shapes and
metadata keys are those llama.cpp's loader requires (llama-cpp-python 0.3.36's vendored
llama.cpp: `src/models/qwen35.cpp`, `src/llama-arch.cpp`); the shapes below are ggml's (ne0
first), numpy arrays are the reverse. The tokenizer (vocabulary, merges, token types, special
ids, chat template) is copied from the bundled SmolLM2 GGUF, so the engine's labels and
ChatML prompt work as on that model. Matrices are Q4_1 (as SmolLM2's), the rest F32:
about 2.5 MB, written in well under a second.

Nothing here says anything about answers: the weights are noise. It exercises the mechanics
(hybrid memory: a KV cache for the attention layers beside one recurrent state per sequence).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

ARCH = "qwen35"


@dataclass(frozen=True)
class HybridShape:
    """Hyperparameters: the real Qwen3.5-4B has 32 layers of 2560, 16 heads of 256, 16 key and 32
    value heads of 128 in its delta-net layers. Kept in the same proportions where it matters
    (fewer key heads than value heads, partial rotary, multi-section rope)."""

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

    def is_recurrent(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0


def write_tiny_qwen35(
    path: Path, tokenizer_gguf: Path, *, seed: int = 0, shape: HybridShape | None = None
) -> Path:
    """Write the model to `path`, with `tokenizer_gguf`'s tokenizer; returns `path`."""
    s = shape or HybridShape()
    rng = np.random.default_rng(seed)
    tokenizer = read_tokenizer(tokenizer_gguf)
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][1])

    writer = gguf.GGUFWriter(path, ARCH)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name("tiny-qwen35-random")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_context_length(s.context_length)
    writer.add_embedding_length(s.n_embd)
    writer.add_block_count(s.n_layer)
    writer.add_feed_forward_length(s.n_ff)
    writer.add_head_count(s.n_head)
    writer.add_head_count_kv(s.n_head_kv)
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
    for key, (vtype, value, sub_type) in tokenizer.items():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)

    def matrix(name: str, ne0: int, ne1: int, scale: float = 0.05) -> None:
        data = rng.normal(0.0, scale, size=(ne1, ne0)).astype(np.float32)
        quantized = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_1)
        writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q4_1)

    def vector(name: str, values: np.ndarray) -> None:
        writer.add_tensor(name, values.astype(np.float32))

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

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
