"""Metric functions against hand-computed values."""

import math

import pytest

from decider_cli.evaluate.metrics import (
    argmax_label,
    brier,
    expected_calibration_error,
    expected_level,
    negative_log_likelihood,
    percentile,
    reliability_bins,
    softmax,
)


def test_argmax_ties_go_to_the_lexicographically_smallest_label():
    assert argmax_label({"b": 0.4, "a": 0.4, "c": 0.2}) == "a"
    assert argmax_label({"true": 0.5, "false": 0.5}) == "false"
    assert argmax_label({"x": 0.1, "y": 0.9}) == "y"


def test_brier_multiclass_by_hand():
    # (0.7-1)^2 + 0.2^2 + 0.1^2 = 0.09 + 0.04 + 0.01
    assert brier({"a": 0.7, "b": 0.2, "c": 0.1}, "a") == pytest.approx(0.14)
    # wrong and confident: 0.9^2 + (0.1-1)^2 = 1.62 on a two-label question
    assert brier({"true": 0.9, "false": 0.1}, "false") == pytest.approx(1.62)
    assert brier({"0": 0.0, "1": 1.0}, "1") == 0.0
    with pytest.raises(ValueError, match="not one of the labels"):
        brier({"a": 1.0}, "z")


def test_percentiles_use_linear_interpolation():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    # rank 0.95 * 3 = 2.85 between 3 and 4
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 95) == 7.0
    assert math.isnan(percentile([], 50))


def test_ece_by_hand():
    # bin [0.9, 1.0]: confidences 0.95, 0.95 -> mean 0.95, accuracy 0.5 -> gap 0.45, weight 2/4
    # bin [0.6, 0.7): 0.6, 0.6 -> mean 0.6, accuracy 1.0 -> gap 0.4, weight 2/4
    confidences = [0.95, 0.95, 0.6, 0.6]
    correct = [True, False, True, True]
    assert expected_calibration_error(confidences, correct) == pytest.approx(0.5 * 0.45 + 0.5 * 0.4)


def test_ece_is_zero_when_calibrated_and_nan_when_empty():
    assert expected_calibration_error([0.75] * 4, [True, True, True, False]) == pytest.approx(0.0)
    assert math.isnan(expected_calibration_error([], []))


def test_reliability_bins_edges_and_empty_bins_left_out():
    bins = reliability_bins([0.0, 0.1, 0.999, 1.0], [False, True, True, True])
    assert [(b.lower, b.count) for b in bins] == [(0.0, 1), (0.1, 1), (0.9, 2)]
    assert bins[-1].accuracy == 1.0
    with pytest.raises(ValueError, match="outside"):
        reliability_bins([1.2], [True])


def test_expected_level_and_softmax_temperature():
    assert expected_level({"0": 0.0, "1": 0.95, "2": 0.05}) == pytest.approx(1.05)
    assert softmax([0.0, 0.0]) == [0.5, 0.5]
    p = softmax([2.0, 0.0], temperature=2.0)
    assert p[0] == pytest.approx(math.e / (math.e + 1))
    assert negative_log_likelihood([2.0, 0.0], 0, 2.0) == pytest.approx(-math.log(p[0]))
