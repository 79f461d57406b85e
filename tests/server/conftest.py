"""Fixtures for the server tests: the real `serve` process on the real bundled model.

One server with the default settings is shared by the whole session (`live_server`), one more
with batch invariance on by the bitwise comparisons (`invariant_server`); tests that need other settings
(a tiny queue, a short deadline, a start-up failure, SIGTERM) start their own with
`decider_dev.local_server`. The live servers use one inference thread: on this 2-core machine that
leaves a core for the HTTP loop and the test clients, and keeps timings steady when other work
shares the machine (with OpenMP threads oversubscribed, llama.cpp slows down many times over).

With `DECIDER_TEST_BASE_URL` set (`make image-test` sets it to the container's URL), `live_server`
is that running server instead, and the tests that must start a server with settings of their own
are skipped (`server_helpers.LOCAL_ONLY`). Tests of what the server does with a body, whatever the
answer, use `tiny_server`: the same server on a tiny random model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from decider_dev.local_server import (
    WITHOUT_LOAD_PROBE,
    LocalServer,
    RemoteServer,
    remote_server,
    run_local_server,
)

LIVE_ENV = {"DECIDER_N_THREADS": "1"}
REMOTE_READY_TIMEOUT_SECONDS = 60


def _running_or_local(env: dict[str, str]) -> Iterator[LocalServer | RemoteServer]:
    """The server named by DECIDER_TEST_BASE_URL once it is ready, else a local one with `env`."""
    remote = remote_server()
    if remote is not None:
        remote.wait_ready(REMOTE_READY_TIMEOUT_SECONDS)
        yield remote
        return
    with run_local_server(env) as server:
        yield server


@pytest.fixture(scope="session")
def live_server() -> Iterator[LocalServer | RemoteServer]:
    yield from _running_or_local(LIVE_ENV)


@pytest.fixture(scope="session")
def invariant_server() -> Iterator[LocalServer]:
    """A second local server with `DECIDER_BATCH_INVARIANT=true`, for the tests that compare answers
    bit for bit across batch company (skipped against a running image: it has the defaults)."""
    if remote_server() is not None:
        pytest.skip("needs a server with DECIDER_BATCH_INVARIANT=true of its own")
    with run_local_server({**LIVE_ENV, "DECIDER_BATCH_INVARIANT": "true"}) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_server(llama_path: Path) -> Iterator[LocalServer | RemoteServer]:
    """For tests of what the server does with a body, never of the answer (fuzzing, hostile schemas):
    the running image under `make image-test`, else a local server on the tiny random attention-only
    model (`llama_path`: SmolLM2's tokenizer and template, so prompts, labels and grammars are the
    same). A decision of a few hundred tokens costs it a few ms, where SmolLM2 spends about
    half a second of a core."""
    yield from _running_or_local({**LIVE_ENV, "DECIDER_MODEL_PATH": str(llama_path), **WITHOUT_LOAD_PROBE})
