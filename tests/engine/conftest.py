"""Fixtures of the engine tests: the tiny random-weight Qwen3.5 GGUF, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from decider_dev.qwen35_gguf import write_qwen35


@pytest.fixture(scope="session")
def qwen35_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """The production architecture (qwen35: recurrent and attention layers), tiny
    (tools/dev/qwen35_gguf.py)."""
    return write_qwen35(tmp_path_factory.mktemp("qwen35") / "tiny-qwen35-Q4_1.gguf", smollm2_path)
