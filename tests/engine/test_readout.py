"""Pure readout math: no model needed."""

import math

import numpy as np
import pytest

from decider.engine.model.labels import (
    READOUT_CHAIN,
    READOUT_SINGLE,
    Label,
    LabelError,
    LabelTable,
    LabelTrie,
    check_prefix_free,
)
from decider.engine.model.native import RowOutput
from decider.engine.works.decisions import Item, allowed_mass, common_prefix_length, label_scores
from decider.engine.works.readout import (
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


def _labels(*token_lists: tuple[int, ...]) -> tuple[Label, ...]:
    return tuple(Label(f"L{i}", tokens) for i, tokens in enumerate(token_lists))


def _item(labels: tuple[Label, ...]) -> Item:
    question = Question(
        key="q",
        type="choice",
        instructions="x",
        options=tuple(Option(key=f"o{i}", description="d") for i in range(len(labels))),
    )
    order = tuple(range(len(labels)))
    return Item(question=question, order=order, labels=labels, trie=LabelTrie.of(labels), tokens=[1, 2])


def test_the_label_trie_needs_one_position_per_distinct_label_prefix():
    trie = LabelTrie.of(_labels((1,), (2,), (3, 4), (3, 5), (6, 7)))
    assert trie.nodes == {(): (1, 2, 3, 6), (3,): (4, 5), (6,): (7,)}
    assert trie.children(()) == [(3,), (6,)]
    assert trie.children((3,)) == []
    assert LabelTrie.of(_labels((1,), (2,))).nodes == {(): (1, 2)}


def test_single_token_labels_score_by_their_logits():
    item = _item(_labels((1,), (2,), (3,)))
    item.outputs[()] = RowOutput(logits=np.array([0.5, 2.0, -1.0]), logsumexp=4.0)
    assert item.readout == READOUT_SINGLE
    assert label_scores(item) == [0.5, 2.0, -1.0]
    assert allowed_mass(item) == pytest.approx(
        math.exp(math.log(math.exp(0.5) + math.exp(2) + math.exp(-1)) - 4.0)
    )


def test_multi_token_labels_score_by_the_chain_rule_over_full_vocabulary_logprobs():
    item = _item(_labels((1,), (3, 4), (3, 5)))
    item.outputs[()] = RowOutput(logits=np.array([1.0, 2.0]), logsumexp=3.0)  # ids (1, 3)
    item.outputs[(3,)] = RowOutput(logits=np.array([0.0, -2.0]), logsumexp=1.5)  # ids (4, 5)
    assert item.readout == READOUT_CHAIN
    expected = [1.0 - 3.0, (2.0 - 3.0) + (0.0 - 1.5), (2.0 - 3.0) + (-2.0 - 1.5)]
    assert label_scores(item) == pytest.approx(expected)
    # the declared labels' share of the model's probability is the sum of their sequence probabilities
    assert allowed_mass(item) == pytest.approx(sum(math.exp(v) for v in expected))


def test_a_label_set_must_be_prefix_free():
    check_prefix_free(_labels((1,), (2, 3)))
    with pytest.raises(LabelError, match="extends another label"):
        check_prefix_free(_labels((1,), (1, 3)))


def test_questions_beyond_the_single_token_labels_use_two_letter_codes():
    single = tuple(Label(chr(65 + i), (i,)) for i in range(3))
    double = tuple(Label(f"A{chr(65 + i)}", (100 + i,)) for i in range(5))
    table = LabelTable(single=single, double=double, limit=5)
    assert table.for_count(3) == single
    assert table.for_count(4) == double[:4]
    with pytest.raises(ValueError, match="exceed"):
        table.for_count(6)
