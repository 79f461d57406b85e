"""A thin, typed layer over llama-cpp-python's low-level ctypes API.

The high-level `llama_cpp.Llama` class owns one sequence and truncates its cache to reuse a
prefix, which breaks on recurrent and hybrid models and cannot fan one prefix out to many
sequences. This module exposes exactly what the engine needs instead: one model, one context
with several sequences over a unified KV cache, tokenization with special-token parsing on or
off, multi-sequence batched decoding with logits at chosen positions, and whole-sequence copy
and removal.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp._logger as llama_logger
import numpy as np

# llama.cpp logs every tensor at load; keep errors only (the engine reports its own summary).
llama_logger.set_verbose(False)
llama_cpp.llama_backend_init()

# `general.file_type` values to the conventional quantization names (from llama.h's llama_ftype).
QUANTIZATION_NAMES: dict[int, str] = {
    value: name.removeprefix("LLAMA_FTYPE_MOSTLY_").removeprefix("LLAMA_FTYPE_ALL_")
    for name, value in vars(llama_cpp).items()
    if name.startswith(("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_")) and isinstance(value, int)
}


class NativeError(RuntimeError):
    """llama.cpp refused an operation (load, context creation, decode)."""


@dataclass
class Row:
    """Tokens to append to one sequence, starting at `start_pos`; logits are read after its last token."""

    seq_id: int
    tokens: list[int]
    start_pos: int
    want_logits: bool = True
    logits: np.ndarray | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ContextConfig:
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    n_threads: int
    n_gpu_layers: int
    flash_attn: bool


class LlamaRuntime:
    """One llama.cpp model and ONE context, used for decisions and chat alike. Not thread-safe."""

    def __init__(self, path: Path, config: ContextConfig) -> None:
        self.path = path
        self.config = config
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = config.n_gpu_layers
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise NativeError(f"llama.cpp could not load {path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = config.n_ctx
        ctx_params.n_batch = config.n_batch
        ctx_params.n_ubatch = config.n_ubatch
        ctx_params.n_seq_max = config.n_seq_max
        ctx_params.n_threads = config.n_threads
        ctx_params.n_threads_batch = config.n_threads
        ctx_params.kv_unified = True
        # True = "auto": llama.cpp enables flash attention where the backend supports it.
        ctx_params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
            if config.flash_attn
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        ctx_params.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            self._model = None
            raise NativeError(
                f"llama.cpp could not create a context (n_ctx={config.n_ctx}, n_seq_max={config.n_seq_max})"
            )
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self.n_ctx = int(llama_cpp.llama_n_ctx(self._ctx))
        self.n_seq_max = int(llama_cpp.llama_n_seq_max(self._ctx))
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._batch = llama_cpp.llama_batch_init(config.n_batch, 0, 1)
        self._piece_buf = ctypes.create_string_buffer(256)

    # --- model metadata ------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        size = 1 << 16
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, size)
        if n < 0:
            return None
        if n >= size:  # long value (e.g. a chat template): retry with room for it
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, n + 1)
        return buf.value.decode("utf-8", errors="replace")

    def chat_template(self) -> str | None:
        raw = llama_cpp.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8") if raw else None

    @property
    def architecture(self) -> str:
        return self.meta("general.architecture") or "unknown"

    @property
    def quantization(self) -> str | None:
        value = self.meta("general.file_type")
        if value is None or not re.fullmatch(r"\d+", value):
            return None
        return QUANTIZATION_NAMES.get(int(value))

    @property
    def n_swa(self) -> int:
        return int(llama_cpp.llama_model_n_swa(self._model))

    # --- vocabulary ------------------------------------------------------------------------
    @property
    def bos(self) -> int | None:
        token = int(llama_cpp.llama_vocab_bos(self._vocab))
        return token if token >= 0 else None

    @property
    def add_bos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))

    def token_text(self, token: int, name: str) -> str:
        """Text form of a special token (e.g. `<bos>`), for chat templates that print it."""
        return self.piece(token, special=True).decode("utf-8", errors="replace") if token >= 0 else name

    @property
    def eos(self) -> int:
        return int(llama_cpp.llama_vocab_eos(self._vocab))

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def is_control(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_control(self._vocab, token))

    def token_attr(self, token: int) -> int:
        """The token's `LLAMA_TOKEN_ATTR_*` flags (CONTROL, USER_DEFINED, …)."""
        return int(llama_cpp.llama_vocab_get_attr(self._vocab, token))

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        """Tokens of `text`, never adding BOS/EOS. `special=True` parses `<|im_end|>`-style markers."""
        data = text.encode(
            "utf-8", errors="replace"
        )  # unpaired surrogates: "?" (requests reject them earlier)
        capacity = len(data) + 16
        out = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), out, capacity, False, special)
        if n < 0:
            capacity = -n
            out = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), out, capacity, False, special)
            if n < 0:
                raise NativeError("tokenization failed")
        return list(out[:n])

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes a token stands for (may be part of a multi-byte UTF-8 character)."""
        n = llama_cpp.llama_token_to_piece(
            self._vocab, token, self._piece_buf, len(self._piece_buf), 0, special
        )
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
            return buf.raw[:n]
        return self._piece_buf.raw[:n]

    # --- memory (KV cache / recurrent state) --------------------------------------------------
    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self._mem, True)

    def seq_copy(self, src: int, dst: int) -> None:
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, -1, -1)

    def seq_remove(self, seq_id: int) -> None:
        """Remove a whole sequence (always possible, unlike a partial truncation)."""
        if not llama_cpp.llama_memory_seq_rm(self._mem, seq_id, -1, -1):
            raise NativeError(f"could not remove sequence {seq_id}")

    # --- decoding ------------------------------------------------------------------------------
    def decode_rows(self, rows: list[Row]) -> int:
        """Append every row's tokens to its sequence, filling each llama_decode up to n_batch tokens.

        A row may span several decodes; its logits (if wanted) are taken at its last token and
        stored in `row.logits`. Returns the number of llama_decode calls made.
        """
        cursor = [0] * len(rows)
        pending = [i for i, row in enumerate(rows) if row.tokens]
        decodes = 0
        batch = self._batch
        while pending:
            n = 0
            outputs: list[tuple[int, int]] = []  # (row index, batch index)
            still: list[int] = []
            for i in pending:
                row = rows[i]
                take = min(len(row.tokens) - cursor[i], self.config.n_batch - n)
                if take <= 0:
                    still.append(i)
                    continue
                start = cursor[i]
                for j in range(start, start + take):
                    batch.token[n] = row.tokens[j]
                    batch.pos[n] = row.start_pos + j
                    batch.n_seq_id[n] = 1
                    batch.seq_id[n][0] = row.seq_id
                    batch.logits[n] = 0
                    n += 1
                cursor[i] = start + take
                if cursor[i] == len(row.tokens):
                    if row.want_logits:
                        batch.logits[n - 1] = 1
                        outputs.append((i, n - 1))
                else:
                    still.append(i)
            batch.n_tokens = n
            status = llama_cpp.llama_decode(self._ctx, batch)
            decodes += 1
            if status != 0:
                raise NativeError(f"llama_decode returned {status} for a batch of {n} tokens")
            for i, batch_index in outputs:
                ptr = llama_cpp.llama_get_logits_ith(self._ctx, batch_index)
                if not ptr:
                    raise NativeError("llama.cpp returned no logits")
                rows[i].logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
            pending = still
        return decodes

    @property
    def context(self) -> Any:
        """The raw llama_context pointer (for the sampler API in generation)."""
        return self._ctx

    # --- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "_ctx", None):
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing left to report to
            self.close()
