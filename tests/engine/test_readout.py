"""Pure readout math: no model needed."""

import math

import numpy as np
import pytest
from decider.engine.engine import _chunks, _Item, common_prefix_length
from decider.engine.readout import (
    align_to_options,
    allowed_token_mass,
    argmax,
    average_logits,
    normalized_peak,
    option_orders,
    score_expectation,
    softmax,
)
from decider.schemas.decision import Option, Question


def test_softmax_is_a_distribution_and_temperature_flattens_it():
    logits = [2.0, 1.0, -1.0]
    cold = softmax(logits)
    hot = softmax(logits, temperature=3.0)
    assert sum(cold) == pytest.approx(1.0) and sum(hot) == pytest.approx(1.0)
    assert argmax(cold) == argmax(hot) == 0
    assert hot[0] < cold[0]
    assert cold[0] == pytest.approx(math.exp(2) / (math.exp(2) + math.exp(1) + math.exp(-1)))


def test_softmax_is_stable_for_large_logits_and_rejects_bad_temperature():
    assert softmax([1000.0, 1000.0]) == [0.5, 0.5]
    with pytest.raises(ValueError):
        softmax([1.0], temperature=0)


def test_normalized_peak_matches_the_documented_example():
    assert normalized_peak([0.68, 0.31, 0.01]) == pytest.approx(0.52)
    assert normalized_peak([0.5, 0.5]) == 0.0
    assert normalized_peak([1.0, 0.0, 0.0]) == 1.0
    assert normalized_peak([1.0]) == 1.0
    assert isinstance(normalized_peak([0.25, 0.25, 0.25, 0.25]), float)


def test_score_expectation_matches_the_documented_vector():
    assert score_expectation([0.0, 0.95, 0.05]) == pytest.approx(1.05)


def test_allowed_token_mass():
    vocab = np.array([1.0, 1.0, 1.0, 1.0])
    lse = math.log(4 * math.e)
    assert allowed_token_mass(vocab[:2], lse) == pytest.approx(0.5)


def test_argmax_breaks_ties_to_the_first_option():
    assert argmax([0.4, 0.4, 0.2]) == 0


def test_option_orders_are_identity_reverse_then_distinct_and_deterministic():
    orders = option_orders(4, 5, seed=7)
    assert orders[0] == (0, 1, 2, 3) and orders[1] == (3, 2, 1, 0)
    assert len(set(orders)) == 5
    assert orders == option_orders(4, 5, seed=7)
    assert option_orders(2, 8) == [(0, 1), (1, 0)]  # only 2! orders exist
    assert option_orders(3, 1) == [(0, 1, 2)]


def test_alignment_maps_slot_logits_back_to_option_order_and_averages():
    # order (2, 0, 1): slot 0 shows option 2, slot 1 shows option 0, slot 2 shows option 1.
    assert align_to_options((2, 0, 1), [5.0, 6.0, 7.0]) == [6.0, 7.0, 5.0]
    assert average_logits([[1.0, 3.0], [3.0, 5.0]]) == [2.0, 4.0]


def test_common_prefix_keeps_one_token_to_decode():
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5]]) == 3
    assert common_prefix_length([[1, 2, 3], [1, 2, 3, 4]]) == 2
    assert common_prefix_length([[1, 2, 3]]) == 2
    assert common_prefix_length([[9], [1]]) == 0


def _item(n_tokens: int) -> _Item:
    question = Question(
        key="q",
        type="noul",
        instructions="x",
        options=(Option(key="true", description="y"), Option(key="false", description="n")),
    )
    return _Item(question=question, order=(0, 1), tokens=list(range(n_tokens)), sha256="")


def test_chunks_respect_branch_and_cell_limits():
    items = [_item(10 + 5) for _ in range(7)]  # prefix 10, suffix 5 each
    assert [len(c) for c in _chunks(items, 10, max_branches=3, cell_budget=100)] == [3, 3, 1]
    assert [len(c) for c in _chunks(items, 10, max_branches=31, cell_budget=12)] == [2, 2, 2, 1]
