"""Real-world schemas as response formats, live (issue 31 §3; tools/dev/fuzz/schema_corpus.py): a sample
spread over SchemaStore's catalogue (`make fuzz` sends all of it). Every answer is a 200, whose content
validates whenever the chat ended with `stop`, or a typed 4xx naming why; the engine never restarts,
and a decision sent beside each chat is answered. (Its time beside over alone is printed by `make
fuzz`, on SmolLM2 and a quiet machine; here the server runs the tiny random model, `tiny_server`.)"""

from __future__ import annotations

import pytest

from decider_dev.fuzz.schema_corpus import Outcome, Report, corpus, run, spread
from decider_dev.local_server import LocalServer

pytestmark = [pytest.mark.server, pytest.mark.model]
SAMPLE = 8  # each chat runs beside a decision of its own (on SmolLM2, ~1.3 s of a core apiece)
REFUSALS = {"invalid_response_format", "response_format_too_complex", "response_format_unsatisfiable"}


def test_the_corpus_is_there() -> None:
    schemas = corpus()
    assert len(schemas) > 400 and all(isinstance(schema, dict) for _, schema in schemas)


def test_a_sample_of_real_world_schemas_is_answered_or_refused_by_name(tiny_server: LocalServer) -> None:
    # Times are not asserted here (two test processes share the cores): no schema is sent again.
    items = list(run(tiny_server.base_url, spread(corpus(), SAMPLE), max_tokens=24, outlier_tries=1))
    report = items.pop()
    assert isinstance(report, Report) and len(items) == SAMPLE
    outcomes = [item for item in items if isinstance(item, Outcome)]
    for outcome in outcomes:
        if outcome.status == 200:
            assert outcome.finish in ("stop", "length") and outcome.valid is not False, outcome
        else:
            assert outcome.status in (413, 422) and outcome.code in REFUSALS and outcome.message, outcome
    counts = report.counts()
    assert counts["restarts"] == 0 and len(report.ratios) == SAMPLE, counts
    assert counts["ok"] > 0, counts
