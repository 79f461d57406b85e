"""The decode sizes that used to abort the process (SIGABRT in llama.cpp), run for real.

In a child process: a regression kills that process, not the test session. On the tiny
attention-only model (SmolLM2's architecture and tokenizer): the abort was llama.cpp's check of a
decode's token count against n_batch, which no weight changes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

SCRIPT = textwrap.dedent(
    """
    import sys
    from decider.engine import DecisionEngine
    from decider.schemas.decision import parse_decision_request
    from decider.server.answers import decide
    from decider.settings import Settings

    state = " ".join(f"Ticket {i}: the payout failed again and the customer is upset." for i in range(12))
    body = {"state": state, "questions": {
        "refund": {"type": "noul", "instructions": "Is money back requested?"},
        "team": {"type": "choice", "criteria": {"billing": "Payments", "technical": "Bugs", "sales": None}},
    }}
    # Each fills whole steps of n_batch - 1 tokens with the ~170-token state (the arithmetic over every
    # accepted setting is tests/engine/test_batch_policy.py).
    for fields in [dict(n_batch=47, n_ubatch=23), dict(n_batch=64)]:
        engine = DecisionEngine.load(Settings(model_path=sys.argv[1], batch_invariant=True, n_threads=1,
                                              n_ctx=1024, max_state_tokens=512, **fields))
        answers = decide(engine, parse_decision_request(body)).answers
        assert set(answers) == {"refund", "team"}
        engine.close()
        print("served", fields, flush=True)
    """
)


def test_invariant_decodes_at_every_reported_setting_stay_inside_n_batch(llama_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(llama_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-2000:]}"
    assert done.stdout.count("served") == 2
