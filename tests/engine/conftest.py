"""Fixtures of the engine tests: tiny random-weight GGUFs (Qwen3.5 and Gemma 3's sliding window; SmolLM2's
attention-only architecture is `llama_path`, in tests/conftest.py), each written once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from decider_dev.gemma3_gguf import write_gemma3
from decider_dev.qwen35_gguf import write_qwen35


@pytest.fixture(scope="session")
def qwen35_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """The production architecture (qwen35: recurrent and attention layers), tiny
    (tools/dev/qwen35_gguf.py)."""
    return write_qwen35(tmp_path_factory.mktemp("qwen35") / "tiny-qwen35-Q4_1.gguf", smollm2_path)


@pytest.fixture(scope="session")
def gemma3_tiny_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """Gemma 3's architecture (five sliding-window layers, then a global one), tiny and random, with a
    64-token window (tools/dev/gemma3_gguf.py): for windowed-attention claims that hold bit for bit or
    count cached tokens."""
    return write_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3-Q4_1.gguf", smollm2_path)


@pytest.fixture(scope="session")
def invariant_llama(llama_path: Path) -> Iterator[Any]:
    """The tiny attention-only model with batch invariance on and the default context, batches and
    sequences: for claims that answers are bitwise the same in any company, at a fraction of
    SmolLM2's cost (the same Q4_1 kernels and architecture, smaller matrices)."""
    from decider.engine import DecisionEngine
    from decider.settings import Settings

    engine = DecisionEngine.load(Settings(model_path=llama_path, batch_invariant=True))
    yield engine
    engine.close()
