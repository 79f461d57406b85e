"""The capacity planner: it reproduces its sources, and the defaults pass what it checks."""

from __future__ import annotations

import json

import pytest

from decider_cli.capacity import cli, planner
from decider_stacks.config import container_settings, load_config
from decider_stacks.synth import cdk_json_context


def test_the_fit_reproduces_the_measured_points():
    cpu = planner.estimate("ml.c6i.8xlarge", deadline_s=55)
    assert cpu.p95_s == pytest.approx(planner.CPU_MEASUREMENT.p95_s)  # the conservative p95 rate
    assert cpu.p50_s >= planner.CPU_MEASUREMENT.p50_s  # and so p50 is over-, never under-estimated
    gpu = planner.estimate("ml.g6e.xlarge", deadline_s=55)
    assert gpu.p50_s == pytest.approx(planner.GPU_MEASUREMENT.p50_s)
    assert gpu.p95_s == pytest.approx(planner.GPU_MEASUREMENT.p95_s)


def test_the_old_default_would_miss_the_deadline_by_far():
    """ml.c7i.xlarge has an eighth of the guide's 32 vCPUs: p95 about 150 s, SageMaker allows 60."""
    old = planner.estimate("ml.c7i.xlarge", deadline_s=55)
    assert old.p95_s == pytest.approx(19.291 * 8, rel=1e-3)
    assert old.p95_s > 60 and not old.fits


def test_the_defaults_stay_well_under_the_deadline_and_follow_the_suggested_targets():
    config = load_config(cdk_json_context())
    for variant in (config.cpu, config.gpu):
        deadline = container_settings(variant, config.model).deadline_seconds
        found = planner.estimate(variant.instance_type, deadline_s=deadline)
        assert found.fits, f"{variant.instance_type}: p95 {found.p95_s:.1f} s over half of {deadline} s"
        assert variant.target_invocations_per_instance == found.suggested_target
    assert planner.estimate(config.cpu.instance_type, deadline_s=55).p95_s < 20


def test_the_cli_prints_the_sources_and_exits_0_for_the_defaults(capsys):
    assert cli.main([]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "semif-decision-model" in out and "RESULTS-v1.2.md" in out and "Price List API" in out
    assert "ml.c7i.8xlarge (configured)" in out and "ml.g6.xlarge (configured)" in out
    assert "6.48 tokens/s per vCPU" in out


def test_the_cli_exits_1_when_a_configured_type_is_too_slow(capsys):
    assert cli.main(["--variant", "cpu", "-c", "cpu.instance_type=ml.c7i.xlarge"]) == cli.EXIT_TOO_SLOW
    assert "over the headroom" in capsys.readouterr().err


def test_json_output_and_custom_workloads(capsys):
    assert (
        cli.main(["--variant", "cpu", "--json", "--p95-tokens", "1000", "--instance-type", "ml.m7i.2xlarge"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["p95_tokens"] == 1000 and out["workload"]["source"] == "command line"
    rows = {r["instance_type"]: r for r in out["rows"]}
    assert rows["ml.m7i.2xlarge"]["p95_s"] == pytest.approx(1000 / (6.4788 * 8), rel=1e-3)
    assert rows["ml.c7i.8xlarge"]["configured"] is True
    assert rows["ml.c7i.8xlarge"]["fleet_price_per_hour"] == pytest.approx(2 * 1.714)


def test_unknown_configured_types_are_a_usage_error(capsys):
    assert cli.main(["--variant", "cpu", "-c", "cpu.instance_type=ml.c5.xlarge"]) == cli.EXIT_USAGE
    assert "not in stacks/instances.py" in capsys.readouterr().err
