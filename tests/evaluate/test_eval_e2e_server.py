"""End to end: `decide-eval run` against the REAL server (tools/dev/local_server.py) on the bundled model.

A small JevBench subset (two cases cut to one question of each type) plus one request the server must
refuse, so that the run shows both real answers and a server error recorded with its code. The model is
too small to judge meaning: this asserts the mechanics, never that the answers are right.
"""

import json
import math

import pytest

from decider_cli.evaluate.cli import main
from decider_cli.evaluate.results import load_run
from decider_dev.local_server import WITHOUT_LOAD_PROBE, run_local_server

pytestmark = [pytest.mark.server, pytest.mark.model]


def small_subset(cases_path, gold_path, tmp_path):
    gold = {g["id"]: g["gold"] for g in map(json.loads, gold_path.read_text().splitlines())}
    cases, golds = [], []
    for line in cases_path.read_text().splitlines()[:2]:
        case = json.loads(line)
        keep = {}
        for qtype in ("noul", "choice", "score"):
            key = next(k for k, q in case["questions"].items() if q["type"] == qtype)
            keep[key] = case["questions"][key]
        case["questions"] = keep
        cases.append(case)
        golds.append({"id": case["id"], "gold": {k: gold[case["id"]][k] for k in keep}})
    cases.append(
        {
            "id": "refused",
            "domain": "bad",
            "state": "",
            "questions": {"q": {"type": "noul", "instructions": "?"}},
        }
    )
    golds.append({"id": "refused", "gold": {}})
    (tmp_path / "cases.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    (tmp_path / "gold.jsonl").write_text("".join(json.dumps(g) + "\n" for g in golds))
    return tmp_path / "cases.jsonl", tmp_path / "gold.jsonl"


def test_cli_against_the_real_local_server(jevbench_cases, jevbench_gold, tmp_path, capsys):
    cases, gold = small_subset(jevbench_cases, jevbench_gold, tmp_path)
    out = tmp_path / "run"
    with run_local_server(WITHOUT_LOAD_PROBE) as server:
        code = main(
            [
                "run",
                "--target",
                server.base_url,
                "--cases",
                str(cases),
                "--gold",
                str(gold),
                "--out",
                str(out),
                "--warmup",
                "1",
                "--no-progress",
            ]
        )
    assert code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("p50=")

    meta, rows = load_run(out)
    assert meta.model and meta.model.startswith("SmolLM2-135M-Instruct@")
    assert [r.case_id for r in meta.requests] == ["customer_support-037", "customer_support-045", "refused"]
    assert len(meta.warmup) == 1 and all(r.latency_s > 0 for r in meta.requests)
    ok = [r for r in rows if r.status == "ok"]
    assert len(ok) == 6
    for row in ok:
        assert math.isclose(sum(row.probs.values()), 1.0, abs_tol=1e-6)
        assert row.logits is not None and set(row.logits) == set(row.labels)  # raw logits recorded
        assert row.predicted in row.labels and row.temperature == 1.0
    (refused,) = [r for r in rows if r.status == "error"]
    assert refused.http_status == 422 and refused.error_code and refused.correct is None
    assert (out / "report.html").is_file()

    # cut-points for the real run: they name the served model and prompt version they belong to
    assert main(["thresholds", str(out), "--target-accuracy", "0.95", "--min-accepted", "1"]) == 0
    saved = json.loads((out / "thresholds.json").read_text())
    assert saved["model"] == meta.model and saved["prompt_version"] == "decider-options-v1"
    assert saved["confidence"] == "normalized-peak-v1"
    assert {name: g["labelled"] for name, g in saved["types"].items()} == {"noul": 2, "choice": 2, "score": 2}
    assert "coverage-accuracy curve" in (out / "report.html").read_text()
