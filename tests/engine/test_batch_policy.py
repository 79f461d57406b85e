"""The batch policy's arithmetic, over every combination the settings accept.

llama.cpp aborts the whole process (`GGML_ASSERT(n_tokens_all <= cparams.n_batch)`) on a decode
larger than n_batch, so no accepted setting may ever produce one: the step budget leaves room for
the invariance pad, and with invariance every micro-batch holds 2-63 tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from decider.invariance import (
    HEAD_SEQ,
    MAX_INVARIANT_UBATCH,
    MIN_INVARIANT_UBATCH,
    BatchPolicy,
)
from decider.settings import Settings


def _accepted(**fields: object) -> Settings | None:
    try:
        return Settings(model_path="/nonexistent/model.gguf", **fields)
    except ValidationError:
        return None


def _check_every_decode_size(policy: BatchPolicy) -> None:
    """Every decode size up to the step budget (the cut depends on tokens mod n_ubatch, so the first and
    last two micro-batches' worth of sizes cover every case)."""
    step, window = policy.step_tokens, 2 * policy.n_ubatch
    for tokens in sorted(set(range(1, min(step, window) + 1)) | set(range(max(1, step - window), step + 1))):
        sizes = policy.micro_batches(tokens)
        assert sum(sizes) <= policy.n_batch, (policy, tokens)
        assert all(size <= policy.n_ubatch for size in sizes)
        if policy.invariant:
            assert all(MIN_INVARIANT_UBATCH <= size <= MAX_INVARIANT_UBATCH for size in sizes), (
                policy,
                tokens,
            )


@settings(max_examples=300, deadline=None)
@given(
    n_batch=st.integers(1, 4096),
    n_ubatch=st.one_of(st.none(), st.integers(1, 4096)),
    invariant=st.booleans(),
)
def test_no_accepted_setting_makes_a_decode_llama_cpp_refuses(
    n_batch: int, n_ubatch: int | None, invariant: bool
) -> None:
    accepted = _accepted(n_batch=n_batch, n_ubatch=n_ubatch, batch_invariant=invariant, n_ctx=8192)
    if accepted is None:
        return
    _check_every_decode_size(accepted.batch_policy)


@pytest.mark.parametrize(
    ("n_batch", "n_ubatch", "n_ctx"),
    [
        (2048, 23, 8192),
        (4096, None, 16384),
        (16384, None, 8192),
        (127, None, 8192),
        (64, None, 8192),
        (2, 2, 8192),
    ],
    ids=["ubatch-23", "batch-4096", "batch-over-ctx", "batch-127", "batch-64", "smallest"],
)
def test_the_reported_aborts_are_padded_inside_n_batch(
    n_batch: int, n_ubatch: int | None, n_ctx: int
) -> None:
    policy = Settings(
        model_path="/x.gguf", n_batch=n_batch, n_ubatch=n_ubatch, n_ctx=n_ctx, batch_invariant=True,
        max_state_tokens=min(6144, n_ctx - 1),
    ).batch_policy  # fmt: skip
    assert policy.step_tokens == min(n_batch, n_ctx) - 1
    _check_every_decode_size(policy)


def test_a_full_step_that_would_leave_one_token_is_cut_one_short() -> None:
    policy = BatchPolicy(invariant=True, n_batch=127, n_ubatch=63, n_seq_max=32)
    assert policy.micro_batches(126) == [63, 63]
    assert policy.micro_batches(64) == [63, 2]  # 63 + 1 + the pad
    assert policy.micro_batches(1) == [2]


def test_settings_refuse_what_cannot_serve_with_one_line() -> None:
    for fields, words in [
        ({"batch_invariant": True, "n_ubatch": 64}, "must be 2-63"),
        ({"batch_invariant": True, "n_ubatch": 1}, "must be 2-63"),
        ({"n_batch": 256, "n_ubatch": 512}, "must not exceed n_batch"),
        ({"batch_invariant": True, "n_seq_max": 6}, "must be at least 7"),
        ({"n_seq_max": 3}, "must be at least 4"),
        ({"batch_invariant": True, "n_gpu_layers": -1}, "CPU kernels only"),
    ]:
        with pytest.raises(ValidationError, match=words):
            Settings(model_path="/x.gguf", **fields)


def test_n_batch_is_taken_at_most_n_ctx_as_llama_cpp_does() -> None:
    policy = Settings(model_path="/x.gguf", n_ctx=1024, max_state_tokens=512).batch_policy
    assert (policy.n_batch, policy.n_ubatch) == (1024, 512)
    small = Settings(model_path="/x.gguf", n_ctx=300, max_state_tokens=200, batch_invariant=True).batch_policy
    assert (small.n_batch, small.n_ubatch, small.step_tokens) == (300, 63, 299)


def test_invariance_is_opt_in_and_reserves_its_sequences() -> None:
    default = Settings(model_path="/x.gguf")
    assert default.batch_invariant is False and default.micro_batch == 512
    assert default.batch_policy.reserved_seqs == (HEAD_SEQ,) and not default.batch_policy.epochs
    assert default.batch_policy.step_tokens == default.n_batch
    invariant = Settings(model_path="/x.gguf", batch_invariant=True).batch_policy
    assert invariant.n_ubatch == MAX_INVARIANT_UBATCH and invariant.epochs
    assert invariant.reserved_seqs == (HEAD_SEQ, 31, 30, 29) and invariant.reserved_cells == 1
