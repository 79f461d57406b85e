"""Rows of one length per decode on recurrent and hybrid models (`Step.take`, `Step.settle_row_tokens`):
llama.cpp cuts such a decode into micro-batches of equal tokens per sequence, about one per distinct
row length (the model-level check: tests/engine/test_hybrid_model.py)."""

from __future__ import annotations

from decider.engine.memory.sequences import SeqPool
from decider.engine.scheduling.steps import Step


def step(*, equal: bool = True, tokens: int = 2048) -> Step:
    return Step(
        seqs=SeqPool(None, 8, [0]),  # type: ignore[arg-type]
        tokens_left=tokens,
        cells_left=10_000,
        equal_rows=equal,
        long_row=256,
    )  # type: ignore[arg-type]


def test_without_equal_rows_a_row_takes_what_the_budget_allows() -> None:
    plain = step(equal=False, tokens=100)
    assert [plain.take(70), plain.take(300)] == [70, 100]  # tokens_left is spent by `add`, not here


def test_the_first_longer_row_sets_the_length_and_shorter_ones_wait() -> None:
    rows = step()
    assert rows.take(40) == 40 and rows.row_tokens == 40
    assert [rows.take(90), rows.take(39), rows.take(1)] == [40, 0, 1]  # one-token rows always go


def test_a_group_settles_on_the_length_that_decodes_most_of_its_tokens() -> None:
    rows = step()
    rows.settle_row_tokens([72, 70, 60, 1])
    assert rows.row_tokens == 60  # 3 x 60 beats 2 x 70, 1 x 72 and 3 x 32
    many = step()
    many.settle_row_tokens([70, 66, 65, 64, 10])
    assert many.row_tokens == 64  # a power of two below them all: 4 x 64
    tight = step(tokens=100)
    tight.settle_row_tokens([70, 70, 70])
    assert tight.row_tokens == 33  # the budget holds 3 x 33, or only 1 x 70
    settled = step()
    settled.take(30)
    settled.settle_row_tokens([72, 70])
    assert settled.row_tokens == 30  # a length already set stays


def test_a_long_row_alone_keeps_its_own_length() -> None:
    rows = step()
    rows.settle_row_tokens([64, 64])
    assert rows.take(600, alone=True) == 600  # a state's prefix: its own micro-batches
    assert rows.take(200, alone=True) == 64  # a short one matches the step's length
    assert rows.take(600) == 64
