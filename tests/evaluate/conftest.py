"""Fixtures for the evaluation tests: paths to the JevBench data, and hand-made rows and runs."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JEVBENCH = REPO.parent / "shared" / "data" / "jevbench" / "jevbench-coherence-0.1.0"
JEVBENCH_CASES = JEVBENCH / "suites" / "jevbench-240" / "cases.jsonl"
JEVBENCH_GOLD = JEVBENCH / "data" / "gold.jsonl"


@pytest.fixture
def jevbench_cases() -> Path:
    if not JEVBENCH_CASES.is_file():
        pytest.skip(f"JevBench data not found at {JEVBENCH}")
    return JEVBENCH_CASES


@pytest.fixture
def jevbench_gold(jevbench_cases) -> Path:
    return JEVBENCH_GOLD
