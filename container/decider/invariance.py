"""The batch-invariance policy, in one place: what opting in changes, and the arithmetic behind it.

Off by default. With it on (`DECIDER_BATCH_INVARIANT=true`, CPU only), a question's answer is
bitwise the same alone, among other questions, beside other requests and at any thread count. It
costs throughput, so it is an opt-in, the way SGLang's and vLLM's deterministic modes are.

What it takes, all decided here:
- Kernels. llama.cpp's CPU flash attention switches to a tiled kernel at 64 query rows in one
  micro-batch, and to a split-KV reduction across threads for a micro-batch of one row (ggml-cpu
  ops.cpp, GGML_FA_TILE_Q). Both round differently from the per-row kernel, so every micro-batch
  holds 2 to 63 tokens. K-quant matmuls take the tiled path at every row count
  (`GGML_CPU_TILED_MM_FORCE`), and weights are not repacked (repacked matmuls take 4 rows at a time).
- The pad. A decode whose last micro-batch would hold one token gets one more token, in a sequence
  of its own (`pad_seq`, removed after the decode). The step budget leaves room for it, so a padded
  decode never exceeds n_batch (llama.cpp aborts the process on `n_tokens_all > n_batch`).
- Memory epochs. Cells must stay in position order (decider.engine.scheduling.steps): two graveyard sequences
  keep every decoded cell until no decision state is live.

Not available on models with recurrent layers (Qwen3.5 and other hybrids): llama.cpp cuts their
decodes into micro-batches of equal tokens per sequence, so a row can land alone whatever the pad
does; the runtime refuses it there at load (decider.engine.model.native).

Reserved sequences: HEAD_SEQ (0) always; with invariance the pad (n_seq_max - 1) and the graveyards
(n_seq_max - 2, n_seq_max - 3).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

HEAD_SEQ = 0  # the cached prompt head of the decision prompt version
MAX_INVARIANT_UBATCH = 63  # below the CPU flash-attention tile (64 query rows)
MIN_INVARIANT_UBATCH = 2  # a one-row micro-batch takes the split-KV path
DEFAULT_UBATCH = 512  # llama.cpp's own default physical batch
TILED_MM_ENV = "GGML_CPU_TILED_MM_FORCE"
# Sequences every running request shares the context with beyond the reserved ones: at least one
# state, one question branch and one label position.
MIN_WORK_SEQS = 3


@dataclass(frozen=True)
class BatchPolicy:
    """How decodes are cut, and what the context reserves for it."""

    invariant: bool
    n_batch: int
    n_ubatch: int
    n_seq_max: int

    @classmethod
    def default_ubatch(cls, invariant: bool) -> int:
        return MAX_INVARIANT_UBATCH if invariant else DEFAULT_UBATCH

    def problems(self) -> list[str]:
        """Why these numbers cannot serve (empty: they can). Every accepted setting must serve."""
        found = []
        if self.n_ubatch > self.n_batch:
            found.append(f"n_ubatch ({self.n_ubatch}) must not exceed n_batch ({self.n_batch})")
        if self.invariant:
            if not MIN_INVARIANT_UBATCH <= self.n_ubatch <= MAX_INVARIANT_UBATCH:
                found.append(
                    f"n_ubatch ({self.n_ubatch}) must be {MIN_INVARIANT_UBATCH}-{MAX_INVARIANT_UBATCH} with "
                    "batch_invariant: larger micro-batches switch llama.cpp's CPU attention to a tiled "
                    "kernel, one-token ones to a split-KV reduction"
                )
            if self.n_batch < MIN_INVARIANT_UBATCH:
                found.append(f"n_batch ({self.n_batch}) must be at least 2 with batch_invariant (the pad)")
        minimum = len(self.reserved_seqs) + MIN_WORK_SEQS
        if self.n_seq_max < minimum:
            found.append(
                f"n_seq_max ({self.n_seq_max}) must be at least {minimum}: {len(self.reserved_seqs)} "
                "reserved sequence(s), plus one for a state, one for a question branch and one for its "
                "label positions"
            )
        return found

    # --- sequences -------------------------------------------------------------------------------
    @property
    def pad_seq(self) -> int | None:
        """The sequence of the one-token pad (None without invariance)."""
        return self.n_seq_max - 1 if self.invariant else None

    @property
    def graveyards(self) -> tuple[int, ...]:
        """The sequences that keep cells in place for a memory epoch (none without invariance)."""
        return (self.n_seq_max - 2, self.n_seq_max - 3) if self.invariant else ()

    @property
    def reserved_seqs(self) -> tuple[int, ...]:
        pad = () if self.pad_seq is None else (self.pad_seq,)
        return (HEAD_SEQ, *pad, *self.graveyards)

    @property
    def epochs(self) -> bool:
        """Released cells stay until no decision state is live (memory epochs)."""
        return self.invariant

    # --- decode sizes ----------------------------------------------------------------------------
    @property
    def step_tokens(self) -> int:
        """Tokens the scheduler may put into one decode: n_batch, less room for the pad."""
        return self.n_batch - 1 if self.invariant else self.n_batch

    @property
    def reserved_cells(self) -> int:
        """Cells the pad takes during a decode (it is removed right after)."""
        return 1 if self.invariant else 0

    def needs_pad(self, tokens: int) -> bool:
        """A decode of `tokens` whose last micro-batch would hold a single token gets the pad."""
        return self.invariant and tokens % self.n_ubatch == 1

    def micro_batches(self, tokens: int) -> list[int]:
        """The micro-batch sizes llama.cpp cuts a decode of `tokens` (pad included) into."""
        total = tokens + (1 if self.needs_pad(tokens) else 0)
        sizes = [self.n_ubatch] * (total // self.n_ubatch)
        if total % self.n_ubatch:
            sizes.append(total % self.n_ubatch)
        return sizes

    def select_kernels(self) -> None:
        """Take ggml's tiled K-quant matmul for every row count (by default it starts at 8 rows, and
        the two paths round differently). ggml reads this once per process, at the first K-quant matmul."""
        if self.invariant:
            os.environ.setdefault(TILED_MM_ENV, "1")

    @property
    def repack_weights(self) -> bool:
        """Repacked weights (CPU "extra" buffers) multiply 4 activation rows at a time and the rest one
        by one, so a row's result depends on where it sits in the micro-batch."""
        return not self.invariant
