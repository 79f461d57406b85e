"""A thin, typed layer over llama-cpp-python's low-level ctypes API.

The high-level `llama_cpp.Llama` class owns one sequence and truncates its cache to reuse a
prefix, which breaks on recurrent and hybrid models and cannot fan one prefix out to many
sequences. This module exposes exactly what the engine needs instead: one model, one context
with several sequences over a unified KV cache, tokenization with special-token parsing on or
off, multi-sequence batched decoding with logits at chosen positions, whole-sequence copy and
removal, and a sequence saved to host memory and restored.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp._logger as llama_logger
import numpy as np

from decider.engine.model.abort_flag import AbortFlag
from decider.invariance import BatchPolicy
from decider.settings import Settings

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


class InvarianceUnsupportedError(NativeError):
    """batch_invariant was asked of a model with recurrent layers (recurrent or hybrid memory)."""


class KvCacheFullError(NativeError):
    """`llama_decode` returned 1: no memory slot for the batch (retry with less, or wait)."""


class DecodeAbortedError(NativeError):
    """`llama_decode` returned 2: the abort callback stopped it (processed micro-batches remain)."""


@dataclass(frozen=True)
class OutputSpec:
    """What to read at a row's last token.

    `token_ids`: keep only these logits (the option labels); `logsumexp` / `argmax`: also the
    full-vocabulary log-normalizer and top token (multi-token labels, extensions). A chat step's
    logits stay in the context for `LlamaRuntime.sample` until the next decode.
    """

    token_ids: tuple[int, ...] = ()
    logsumexp: bool = False
    argmax: bool = False


@dataclass
class RowOutput:
    logits: np.ndarray  # float64, one per OutputSpec.token_ids
    logsumexp: float | None = None
    argmax: int | None = None
    batch_index: int = -1  # where the row's logits sit in the last decode (for sampling)


@dataclass
class Row:
    """Tokens to append to one sequence, starting at `start_pos`; `output` is read after its last token."""

    seq_id: int
    tokens: Sequence[int]
    start_pos: int
    output: OutputSpec | None = None
    result: RowOutput | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ContextConfig:
    n_ctx: int
    policy: BatchPolicy  # n_batch, n_ubatch, n_seq_max and batch invariance
    n_threads: int
    n_gpu_layers: int
    flash_attn: bool
    count_passes: bool = False  # count forward passes (micro-batches): benchmarks and tests only

    @classmethod
    def from_settings(cls, settings: Settings, *, count_passes: bool = False) -> ContextConfig:
        """The llama.cpp context the settings ask for (the server's load and its load probe alike)."""
        return cls(
            n_ctx=settings.n_ctx,
            policy=settings.batch_policy,
            n_threads=settings.threads(),
            n_gpu_layers=settings.n_gpu_layers,
            flash_attn=settings.flash_attn,
            count_passes=count_passes,
        )


EMBEDDING_NODES = (b"embd", b"inp_embd", b"model.input_embed")  # the first node's name, by graph
# A saved sequence's memory (LlamaRuntime.seq_save): private to this process, its pages faulted in at
# once where the platform can (Linux).
SAVED_STATE_MAP_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)


def _ggml_get_name() -> Callable[[int], bytes | None]:
    """ggml's `ggml_get_name` (the binding does not wrap it), from the library llama.cpp loaded."""
    library = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    function = library.ggml_get_name
    function.restype = ctypes.c_char_p
    function.argtypes = [ctypes.c_void_p]
    return function  # type: ignore[no-any-return]


class LlamaRuntime:
    """One llama.cpp model and ONE context, used for decisions and chat alike. Not thread-safe:
    every call comes from the scheduler's engine thread (tokenization excepted, which only reads
    the vocabulary)."""

    def __init__(self, path: Path, config: ContextConfig) -> None:
        self.path = path
        self.config = config
        self.policy = policy = config.policy
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = config.n_gpu_layers
        model_params.use_extra_bufts = policy.repack_weights
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise NativeError(f"llama.cpp could not load {path}")
        if policy.invariant and self.recurrent:
            architecture = self.architecture
            llama_cpp.llama_model_free(self._model)
            self._model = None
            # llama.cpp cuts such a batch into micro-batches of equal tokens per sequence (split_equal),
            # not into n_ubatch runs, so the 2-63-row rule and its pad cannot hold: a row can land alone.
            raise InvarianceUnsupportedError(
                f"batch invariance is not available for {path.name} ({architecture}): its recurrent layers "
                "make llama.cpp split decodes per sequence, so answers can depend on what shares a batch; "
                "set it to false"
            )
        policy.select_kernels()  # before the first matmul (ggml reads the choice once per process)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = config.n_ctx
        ctx_params.n_batch = policy.n_batch
        ctx_params.n_ubatch = policy.n_ubatch
        ctx_params.n_seq_max = policy.n_seq_max
        ctx_params.n_threads = config.n_threads
        ctx_params.n_threads_batch = config.n_threads
        ctx_params.kv_unified = True
        # Sliding-window models keep two caches. Fan-out puts a state's prefix, every branch tail
        # and every running request in ONE budget of n_ctx cells (the scheduler's), and memory
        # epochs keep cells past any window until the epoch ends; a window-sized SWA cache (swa_full
        # off: about n_swa x n_seq_max cells) could find no slot for a decode the budget allows.
        # With the full-size cache both caches hold the same cells, so one budget is true for both.
        ctx_params.swa_full = True
        # True = "auto": llama.cpp enables flash attention where the backend supports it.
        ctx_params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
            if config.flash_attn
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        ctx_params.no_perf = True
        # Forward passes: the graph of every micro-batch starts from the token embeddings, and the
        # eval callback is asked about each node once per pass (it observes none).
        self.passes = 0
        if config.count_passes:
            name_of = _ggml_get_name()

            def observe(tensor: int, ask: bool, _data: Any) -> bool:
                if ask and name_of(tensor) in EMBEDDING_NODES:
                    self.passes += 1
                return not ask  # observe nothing: the graph runs unsplit

            self._eval_cb = llama_cpp.ggml_backend_sched_eval_callback(observe)
            ctx_params.cb_eval = self._eval_cb
            ctx_params.cb_eval_user_data = None
        self._ctx = llama_cpp.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            self._model = None
            raise NativeError(
                f"llama.cpp could not create a context (n_ctx={config.n_ctx}, n_seq_max={policy.n_seq_max})"
            )
        took = (
            int(llama_cpp.llama_n_batch(self._ctx)),
            int(llama_cpp.llama_n_ubatch(self._ctx)),
            int(llama_cpp.llama_n_seq_max(self._ctx)),
        )
        # llama.cpp clamps what it cannot take; the scheduler must never size a decode it refuses.
        if took != (policy.n_batch, policy.n_ubatch, policy.n_seq_max):
            llama_cpp.llama_free(self._ctx)
            llama_cpp.llama_model_free(self._model)
            self._ctx = self._model = None
            raise NativeError(
                "llama.cpp took n_batch={}, n_ubatch={}, n_seq_max={} instead of {}, {}, {}: set "
                "DECIDER_N_BATCH, DECIDER_N_UBATCH and DECIDER_N_SEQ_MAX to values it keeps".format(
                    *took, policy.n_batch, policy.n_ubatch, policy.n_seq_max
                )
            )
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self.n_ctx = int(llama_cpp.llama_n_ctx(self._ctx))
        self.n_seq_max = int(llama_cpp.llama_n_seq_max(self._ctx))
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._batch = llama_cpp.llama_batch_init(policy.n_batch, 0, 1)
        self._piece_buf = ctypes.create_string_buffer(256)
        # The abort callback runs between graph nodes, on the compute threads: a native flag read
        # there needs no interpreter lock (decider.engine.model.abort_flag); a watcher sets it.
        self._abort = AbortFlag()
        llama_cpp.llama_set_abort_callback(self._ctx, self._abort.callback, self._abort.data)

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
    def recurrent(self) -> bool:
        """The model keeps a recurrent state per sequence (recurrent or hybrid architectures)."""
        model = self._model
        return bool(llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model))

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

    def max_token_bytes(self) -> int:
        """Bytes of the vocabulary's longest piece: a state of B bytes has at least B / this many tokens."""
        return max(len(self.piece(token)) for token in range(self.n_vocab))

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
        """Forget every sequence. The buffers are not zeroed: every cell is written before it is read."""
        llama_cpp.llama_memory_clear(self._mem, False)

    def seq_copy(self, src: int, dst: int) -> None:
        """Make `dst` share all of `src`'s cells (no data is copied in a unified KV cache)."""
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, -1, -1)

    def seq_remove(self, seq_id: int) -> None:
        """Remove a whole sequence (always possible, unlike a partial truncation)."""
        if not llama_cpp.llama_memory_seq_rm(self._mem, seq_id, -1, -1):
            raise NativeError(f"could not remove sequence {seq_id}")

    def seq_truncate(self, seq_id: int, position: int) -> None:
        """Remove a sequence's positions from `position` on (attention-only models: `partial_reuse`)."""
        if not llama_cpp.llama_memory_seq_rm(self._mem, seq_id, position, -1):
            raise NativeError(f"could not cut sequence {seq_id} at {position}")

    def seq_remove_before(self, seq_id: int, position: int) -> None:
        """Remove a sequence's positions below `position` (attention-only models: `partial_reuse`)."""
        if not llama_cpp.llama_memory_seq_rm(self._mem, seq_id, 0, position):
            raise NativeError(f"could not remove sequence {seq_id}'s positions below {position}")

    def seq_save(self, seq_id: int) -> mmap.mmap:
        """Every cell of a sequence (K/V, and the recurrent state on hybrid models) as bytes, for
        `seq_restore` into any sequence of this context (host memory: decider.engine.memory.host_cache).
        llama.cpp writes straight into the buffer that is kept: the state is copied once (a Qwen3.5-4B
        state carries ~50 MiB of recurrent state).

        The buffer is a private anonymous mapping of its own, not a bytearray: the C heap keeps what
        it frees in blocks of a few MiB (glibc maps only blocks above its threshold, which rises to
        32 MiB once one is freed), so a host tier evicting and saving such entries at its budget held
        tens of MB more than it counted, growing as `make soak` ran. A mapping goes back to the system
        when its entry is dropped. Its pages are faulted in by the kernel at once (MAP_POPULATE),
        faster than page by page as llama.cpp writes (the numbers: docs/engine.md, host tier)."""
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq_id)
        if not size:
            raise NativeError(f"could not save sequence {seq_id}: it holds nothing")
        try:
            data = mmap.mmap(-1, size, flags=SAVED_STATE_MAP_FLAGS)
        except OSError as exc:  # ENOMEM: no memory left for it, or no mapping (vm.max_map_count)
            raise MemoryError(f"no host memory for sequence {seq_id}'s {size} bytes: {exc}") from exc
        target = (ctypes.c_uint8 * size).from_buffer(data)
        written = llama_cpp.llama_state_seq_get_data(self._ctx, target, size, seq_id)
        del target  # the mapping is exported while a ctypes view holds it
        if written != size:
            raise NativeError(f"could not save sequence {seq_id}")
        return data

    def seq_restore(self, seq_id: int, data: bytes | bytearray | mmap.mmap) -> bool:
        """Put what `seq_save` returned into sequence `seq_id` (empty before). False when llama.cpp
        cannot (no free cells for it, most likely), and the sequence is empty again: llama.cpp
        removes what a failed restore placed (llama_kv_cache::state_read_sinfo, and the hybrid
        memory's state_read for its attention part), and so does this, should a read stop short."""
        if isinstance(data, (bytearray, mmap.mmap)):  # seq_save's own buffer: read in place
            source = (ctypes.c_uint8 * len(data)).from_buffer(data)
        else:
            source = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_seq_set_data(self._ctx, source, len(data), seq_id) == len(data):
            return True
        self.seq_remove(seq_id)
        return False

    @property
    def partial_reuse(self) -> bool:
        """Whether a copied sequence may be cut to a shorter prefix and extended from there: not on
        recurrent or hybrid models (a recurrent state cannot go back) nor with a sliding window
        (cells past the window may be gone)."""
        return not self.recurrent and self.n_swa == 0

    # --- decoding ------------------------------------------------------------------------------
    def decode(self, rows: Sequence[Row], *, should_abort: Callable[[], bool] | None = None) -> None:
        """Append every row's tokens to its sequence in ONE llama_decode (at most the policy's
        `step_tokens`) and read each row's `output` into `row.result`.

        Raises KvCacheFullError (nothing was decoded), DecodeAbortedError (`should_abort` returned
        true; micro-batches already processed stay in memory) or NativeError.
        """
        total = sum(len(row.tokens) for row in rows)
        if total == 0:
            return
        if total > self.policy.step_tokens:
            raise NativeError(f"a decode of {total} tokens exceeds the step budget {self.policy.step_tokens}")
        batch = self._batch
        n = 0
        outputs: list[tuple[Row, int]] = []
        for row in rows:
            for j, token in enumerate(row.tokens):
                batch.token[n] = token
                batch.pos[n] = row.start_pos + j
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = row.seq_id
                batch.logits[n] = 0
                n += 1
            if row.output is not None and row.tokens:
                batch.logits[n - 1] = 1
                outputs.append((row, n - 1))
        pad_seq = self.policy.pad_seq
        padded = self.policy.needs_pad(total)
        if padded:
            # A lone last token would take the split-KV attention path: give it a companion in the
            # pad sequence (position 0, removed right after), so every micro-batch has >= 2 rows.
            batch.token[n] = self.bos if self.bos is not None else 0
            batch.pos[n] = 0
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = pad_seq
            batch.logits[n] = 0
            n += 1
        batch.n_tokens = n
        self._abort.arm(should_abort)
        try:
            status = llama_cpp.llama_decode(self._ctx, batch)
        finally:
            self._abort.disarm()
            if padded:
                self.seq_remove(pad_seq)  # type: ignore[arg-type]
        if status == 1:
            raise KvCacheFullError(f"no memory slot for a batch of {total} tokens")
        if status == 2:
            raise DecodeAbortedError("the decode was aborted")
        if status != 0:
            raise NativeError(f"llama_decode returned {status} for a batch of {total} tokens")
        for row, batch_index in outputs:
            row.result = self._read_output(row.output, batch_index)  # type: ignore[arg-type]

    def _read_output(self, spec: OutputSpec, batch_index: int) -> RowOutput:
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, batch_index)
        if not ptr:
            raise NativeError("llama.cpp returned no logits")
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))  # a view: nothing is copied
        result = RowOutput(
            logits=logits[list(spec.token_ids)].astype(np.float64) if spec.token_ids else np.empty(0),
            batch_index=batch_index,
        )
        if spec.logsumexp:
            peak = float(logits.max())
            result.logsumexp = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
        if spec.argmax:
            result.argmax = int(np.argmax(logits))
        return result

    @property
    def vocab(self) -> Any:
        """The model's vocabulary handle (the response_format vocabulary is read from it)."""
        return self._vocab

    def logits_at(self, batch_index: int) -> np.ndarray:
        """A view of the last decode's full-vocabulary logits at `batch_index` (chat logprobs)."""
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, batch_index)
        if not ptr:
            raise NativeError("llama.cpp returned no logits")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def sample(self, sampler: Any, batch_index: int) -> int:
        """Sample the next token of a chat row from the last decode's logits at `batch_index`."""
        return int(llama_cpp.llama_sampler_sample(sampler, self._ctx, batch_index))

    # --- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "_abort", None) is not None:
            self._abort.close()
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
