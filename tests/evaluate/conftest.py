"""Fixtures for the evaluation tests: paths to the JevBench data, and hand-made rows and runs."""

from pathlib import Path

import pytest

from decider_cli.evaluate.jevbench import GOLD_240, JEVBENCH_240_CASES, MISSING_HINT


@pytest.fixture
def jevbench_cases() -> Path:
    """Missing data fails the tests that need it (never a skip: that would test less, silently)."""
    if not JEVBENCH_240_CASES.is_file():
        pytest.fail(f"JevBench data not found at {JEVBENCH_240_CASES}: {MISSING_HINT}")
    return JEVBENCH_240_CASES


@pytest.fixture
def jevbench_gold(jevbench_cases) -> Path:
    return GOLD_240
