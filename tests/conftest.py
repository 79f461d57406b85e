"""Session-wide fixtures: the bundled model files, one SmolLM2 engine per batch mode, the JevBench cases.

Loading a model takes about a second and a few hundred MB, so model tests share one engine per
pytest session (one per worker process under pytest-xdist). The engine is not thread-safe; each
worker runs its tests one at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from decider_cli.evaluate.jevbench import JEVBENCH_240_CASES, MISSING_HINT

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """One process against a running server (DECIDER_TEST_BASE_URL, as `make image-test` runs
    tests/server): its tests read the server's counters and time it, so workers would disturb each
    other. None: pytest-xdist's own count."""
    return 0 if os.environ.get("DECIDER_TEST_BASE_URL") else None


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's engines and servers get its share of the cores.

    llama.cpp's threads wait on each other by spinning, so two workers with a thread per core each
    would oversubscribe the machine. The servers the tests start inherit the variable. A
    DECIDER_N_THREADS already set is kept.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault("DECIDER_N_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    share_botocore_loader()


def share_botocore_loader() -> None:
    """Every botocore session of the test process reads AWS's service models through one loader.

    The tools make a boto3 Session per command, and each new session parses the service model files
    again (SageMaker's is several MB of JSON): in the promote tests that was a quarter of their time. The
    files never change within a run, and no test sets AWS_DATA_PATH, so one cache serves every session;
    the clients built from it are the same."""
    import botocore.loaders
    import botocore.session

    shared = botocore.loaders.create_loader()
    botocore.session.create_loader = lambda *_args, **_kwargs: shared


HEAVY_MARKERS = ("server", "model", "cdk")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with a test that starts a server, loads a model or synthesizes the app run first.

    Under `--dist loadfile` a worker takes whole files in this order (pyproject's addopts turn
    pytest-xdist's own order, by test count, off: it put the long files of a few tests last, where
    one ran alone while the other worker idled). The quick files then fill the gaps at the end. The
    sort is stable: files keep their collection order within each group, and a file stays whole."""
    heavy = {item.path for item in items if any(item.get_closest_marker(name) for name in HEAVY_MARKERS)}
    items.sort(key=lambda item: item.path not in heavy)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from decider.engine.model.bundled import smollm2_path as locate

    return locate()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from decider.engine.model.bundled import gemma3_path as locate

    return locate()


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """SmolLM2's architecture (attention only), tiny and random, with SmolLM2's tokenizer and template
    (tools/dev/llama_gguf.py): for claims that hold bit for bit or count tokens and cells, and for
    servers under test for what they do with a body, never for the answer, at a fraction of SmolLM2's
    cost."""
    from decider_dev.llama_gguf import write_llama

    return write_llama(tmp_path_factory.mktemp("llama") / "tiny-llama-Q4_1.gguf", smollm2_path)


@pytest.fixture(scope="session")
def engine(smollm2_path: Path) -> Iterator[Any]:
    """One SmolLM2-135M DecisionEngine with the default settings, shared by the whole session."""
    from decider.engine import DecisionEngine
    from decider.settings import Settings

    loaded = DecisionEngine.load(Settings(model_path=smollm2_path))
    yield loaded
    loaded.close()


@pytest.fixture(scope="session")
def invariant_engine(smollm2_path: Path) -> Iterator[Any]:
    """The same model with `batch_invariant` on (the opt-in whose answers are bitwise the same in any
    company), shared by the whole session."""
    from decider.engine import DecisionEngine
    from decider.settings import Settings

    loaded = DecisionEngine.load(Settings(model_path=smollm2_path, batch_invariant=True))
    yield loaded
    loaded.close()


def load_jevbench_cases(path: Path = JEVBENCH_240_CASES) -> list[dict[str, Any]]:
    """JevBench-240 cases (Apache-2.0, see the data set's LICENSE/NOTICE): id, state, questions, …"""
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


@pytest.fixture(scope="session")
def jevbench_cases() -> list[dict[str, Any]]:
    """Missing data fails the tests that need it (never a skip: that would test less, silently)."""
    if not JEVBENCH_240_CASES.is_file():
        pytest.fail(f"JevBench data not found at {JEVBENCH_240_CASES}: {MISSING_HINT}")
    return load_jevbench_cases()
