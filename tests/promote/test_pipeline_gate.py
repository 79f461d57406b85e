"""The quality gate of the CI example, end to end: the pipeline's `promote apply` block and
buildspec/quality-gate.sh run for real in bash, against moto (the control plane, through AWS_ENDPOINT_URL)
and the SageMaker runtime stand-in (tools/cli/proxy/standin.py) in front of the real server. The server runs
the tiny random model (`llama_path`, SmolLM2's tokenizer): the gate's mechanics are under
test, not its answers, and a decision costs it a few ms where SmolLM2 spent ~0.2 s of a core.

Three promotions of one endpoint outside CDK:
1. no baseline yet: the gate passes and the run becomes the baseline;
2. the same answers: `check` passes (noise does not fail it) and the new run replaces the baseline;
3. answers that now disagree with every label: `check` fails, `promote rollback` puts the config of
   promotion 2 back live, and the baseline stays promotion 2's.
The labels come from the model's own answers (agreeing, then contrary), so the outcome does not depend on
what the model gets right.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from promote_constants import IMAGE_A, IMAGE_B, REPO

from decider_cli.evaluate.check import load_run_or_baseline
from decider_cli.evaluate.cli import main as decide_eval
from decider_cli.evaluate.results import load_run
from decider_cli.proxy.standin import RunningStandin, run_standin
from decider_dev.local_server import WITHOUT_LOAD_PROBE, LocalServer, run_local_server

pytestmark = [pytest.mark.server, pytest.mark.model]
ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "buildspec" / "pipeline.yml"
ENDPOINT = "decider-team"
ALARM = f"{ENDPOINT}-5xx"
IMAGE_C = f"{REPO}@sha256:{'c' * 64}"
TICKETS = [
    ("billing", "I was charged twice for my subscription this month, please give me my money back."),
    ("billing", "The invoice shows the wrong company name, can you fix it before we pay?"),
    ("technical", "The app crashes every time I open the settings page since the last update."),
    ("technical", "Login with SSO fails with error 500 for our whole team since this morning."),
    ("sales", "We would like a quote for 200 seats and an annual plan."),
    ("sales", "Is there a discount for non-profits? We are comparing you with two competitors."),
    ("billing", "Cancel my plan and refund the unused months, this is the third time I ask!"),
    ("technical", "Exports to CSV are missing the last column, which breaks our reports."),
]


def team_questions() -> dict:
    return {
        "refund": {"type": "noul", "instructions": "Does the customer ask for money back?"},
        "team": {
            "type": "choice",
            "instructions": "Which team should handle this?",
            "criteria": {"billing": "Payments, invoices", "technical": "Bugs, outages", "sales": "New deals"},
        },
        "urgency": {
            "type": "score",
            "instructions": "How urgent is this?",
            "criteria": ["Can wait", "Soon", "Now"],
        },
    }


def labelled(path: Path, expected: list[dict]) -> Path:
    lines = [
        {
            "id": f"ticket-{i}",
            "domain": domain,
            "request": {"state": state, "questions": team_questions()},
            "expected": labels,
        }
        for i, ((domain, state), labels) in enumerate(zip(TICKETS, expected, strict=True))
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def contrary(row) -> object:
    """A label the model did not pick."""
    other = next(label for label in row.labels if label != row.predicted)
    if row.type == "noul":
        return other == "true"
    return int(other) if row.type == "score" else other


def apply_block() -> str:
    spec = yaml.safe_load(PIPELINE.read_text())
    return next(c for c in spec["phases"]["build"]["commands"] if "APPLY_ENDPOINT:-" in c)


@pytest.fixture(scope="module")
def server(llama_path: Path) -> Iterator[LocalServer]:
    env = {"DECIDER_MODEL_PATH": str(llama_path), "DECIDER_N_THREADS": "1", **WITHOUT_LOAD_PROBE}
    with run_local_server(env) as running:
        yield running


@pytest.fixture
def standin(server: LocalServer, aws, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunningStandin]:
    with run_standin(server.base_url, endpoints={ENDPOINT}) as running:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME", running.url)
        yield running


def run_pipeline_step(workdir: Path, image: str, cases: Path) -> subprocess.CompletedProcess:
    for name in (".venv", "buildspec"):  # the block runs from the repository root: the same layout here
        if not (workdir / name).exists():
            (workdir / name).symlink_to(ROOT / name)
    env = {
        **os.environ,
        "CPU_IMAGE": IMAGE_A,
        "APPLY_ENDPOINT": ENDPOINT,
        "APPLY_ALARM": ALARM,
        "APPLY_IMAGE": image,
        "PROMOTE_ARGS": "--poll-seconds 0 --timeout-minutes 1",
        "GATE_CASES": str(cases),
        "GATE_BASELINE_URI": str(workdir / "baselines"),
    }
    return subprocess.run(
        ["bash", "-c", apply_block()], cwd=workdir, env=env, capture_output=True, text=True, timeout=500
    )


def test_promote_apply_gate_and_rollback(aws, standin: RunningStandin, tmp_path: Path, capsys) -> None:
    aws.create_endpoint(ENDPOINT)
    aws.create_alarm(ALARM)
    first_config = aws.endpoint(ENDPOINT)["EndpointConfigName"]

    # The model's own answers as labels (agreeing), and labels that contradict every one of them.
    probe = tmp_path / "probe"
    unlabelled = labelled(tmp_path / "unlabelled.jsonl", [{} for _ in TICKETS])
    assert decide_eval(["run", "--target", ENDPOINT, "--cases", str(unlabelled), "--out", str(probe),
                        "--no-progress"]) == 0  # fmt: skip
    capsys.readouterr()
    _meta, rows = load_run(probe)
    assert len(rows) == 24 and all(r.status == "ok" for r in rows)
    answers: list[dict] = [{} for _ in TICKETS]
    against: list[dict] = [{} for _ in TICKETS]
    for row in rows:
        i = int(row.case_id.split("-")[1])
        answers[i][row.key] = row.predicted == "true" if row.type == "noul" else row.predicted
        if row.type == "score":
            answers[i][row.key] = int(row.predicted)
        against[i][row.key] = contrary(row)
    agreeing = labelled(tmp_path / "agreeing.jsonl", answers)
    disagreeing = labelled(tmp_path / "disagreeing.jsonl", against)
    baseline = tmp_path / "baselines" / f"{ENDPOINT}.json"

    # 1. First promotion: no baseline, the gate passes and keeps the run.
    first = run_pipeline_step(tmp_path, IMAGE_B, agreeing)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "this one becomes the first baseline" in first.stdout
    assert "quality gate passed" in first.stdout and baseline.is_file()
    config_b = aws.endpoint(ENDPOINT)["EndpointConfigName"]
    assert config_b != first_config
    meta_1, rows_1 = load_run_or_baseline(baseline)
    assert len(rows_1) == 24 and sum(bool(r.correct) for r in rows_1) >= 22  # the model agrees with itself

    # 2. Same answers: nothing moved beyond noise; the new run is the new baseline.
    second = run_pipeline_step(tmp_path, IMAGE_C, agreeing)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "PASS" in second.stdout and "What moved" in second.stdout
    config_c = aws.endpoint(ENDPOINT)["EndpointConfigName"]
    assert config_c not in (first_config, config_b)
    meta_2, _ = load_run_or_baseline(baseline)
    assert meta_2.started_at != meta_1.started_at
    check = json.loads((tmp_path / "reports" / "gate" / ENDPOINT / "run" / "check.json").read_text())
    assert check["failed"] is False and check["gated"] >= 2

    # 3. Answers against every label: the check fails, says what moved, and the endpoint is rolled back.
    third = run_pipeline_step(tmp_path, IMAGE_A, disagreeing)
    assert third.returncode == 1, third.stdout + third.stderr
    out = third.stdout
    print(out)  # what a failing gate shows (pytest -s)
    assert "FAIL" in out and "accuracy all" in out
    assert "rolling back: .venv/bin/promote rollback --endpoint decider-team" in out
    endpoint = aws.endpoint(ENDPOINT)
    assert endpoint["EndpointStatus"] == "InService" and endpoint["EndpointConfigName"] == config_c
    meta_3, _ = load_run_or_baseline(baseline)
    assert meta_3.started_at == meta_2.started_at  # a failed run never becomes the baseline
    failed = json.loads((tmp_path / "reports" / "gate" / ENDPOINT / "run" / "check.json").read_text())
    moved = {(c["metric"], c["name"]) for c in failed["comparisons"] if c["verdict"] == "fail"}
    assert ("accuracy", "all") in moved
    # every call reached the model through the stand-in, signed
    assert all(call["authorization"].startswith("AWS4-HMAC-SHA256") for call in standin.state.calls)
