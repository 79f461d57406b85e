"""Guardrails refuse before anything changes, each with its own error code."""

from __future__ import annotations

import pytest
from promote_constants import IMAGE_B, REPO

from decider_cli.promote import cli
from decider_cli.promote.errors import EXIT_REFUSED

FAST = ["--poll-seconds", "0", "--timeout-minutes", "1"]


def _refused(capsys, argv, code):
    assert cli.main(argv) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert f"error[{code}]" in err, err
    return err


def test_image_without_digest_is_refused(aws, capsys):
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("a")
    err = _refused(
        capsys,
        ["apply", "--endpoint", "decider-cpu", "--image", f"{REPO}:latest", "--alarm", "a", *FAST],
        "image_without_digest",
    )
    assert "sha256" in err
    assert aws.simulator.update_calls == [] and len(aws.sagemaker.list_models()["Models"]) == 1


def test_plan_reports_the_same_guardrail(aws, capsys):
    aws.create_endpoint("decider-cpu")
    _refused(capsys, ["plan", "--endpoint", "decider-cpu", "--image", f"{REPO}:v1"], "image_without_digest")


def test_missing_alarm_is_refused(aws, capsys):
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("exists")
    err = _refused(
        capsys,
        [
            "apply",
            "--endpoint",
            "decider-cpu",
            "--image",
            IMAGE_B,
            "--alarm",
            "exists",
            "--alarm",
            "typo-alarm",
            *FAST,
        ],
        "alarm_not_found",
    )
    assert "typo-alarm" in err and "exists" not in err.split("not found:")[1]
    assert aws.simulator.update_calls == []


def test_no_alarm_is_refused_unless_explicitly_unguarded(aws, capsys):
    aws.create_endpoint("decider-cpu")
    _refused(capsys, ["apply", "--endpoint", "decider-cpu", "--image", IMAGE_B, *FAST], "no_rollback_alarms")
    assert (
        cli.main(
            [
                "apply",
                "--endpoint",
                "decider-cpu",
                "--image",
                IMAGE_B,
                "--no-auto-rollback",
                "--skip-smoke",
                *FAST,
            ]
        )
        == 0
    )
    assert "AutoRollbackConfiguration" not in aws.simulator.update_calls[0]["DeploymentConfig"]


def test_alarm_already_firing_is_refused(aws, capsys):
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("hot", state="ALARM")
    _refused(
        capsys,
        ["apply", "--endpoint", "decider-cpu", "--image", IMAGE_B, "--alarm", "hot", *FAST],
        "alarm_already_firing",
    )


def test_endpoint_already_updating_is_refused(aws, capsys):
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("a")
    aws.sagemaker.create_endpoint_config(
        EndpointConfigName="other",
        ProductionVariants=[
            {
                "VariantName": "AllTraffic",
                "ModelName": "decider-cpu-model-0",
                "InitialInstanceCount": 1,
                "InstanceType": "ml.c5.xlarge",
            }
        ],
    )
    aws.simulator.polls_until_done = 100
    aws.sagemaker.update_endpoint(
        EndpointName="decider-cpu", EndpointConfigName="other"
    )  # someone else's update
    assert aws.endpoint("decider-cpu")["EndpointStatus"] == "Updating"
    err = _refused(
        capsys,
        ["apply", "--endpoint", "decider-cpu", "--image", IMAGE_B, "--alarm", "a", *FAST],
        "endpoint_busy",
    )
    assert "Updating" in err
    assert len(aws.simulator.update_calls) == 1
    _refused(capsys, ["rollback", "--endpoint", "decider-cpu", *FAST], "endpoint_busy")
    _refused(capsys, ["prune", "--endpoint", "decider-cpu", "--keep", "0"], "endpoint_busy")


def test_missing_endpoint_is_a_clear_error(aws, capsys):
    _refused(capsys, ["plan", "--endpoint", "nope"], "endpoint_not_found")


@pytest.mark.parametrize(
    ("extra", "code"),
    [
        (["--canary-percent", "80"], "bad_canary_percent"),
        (["--wait-minutes", "61"], "bad_wait"),
        (["--model-s3", "s3://bucket/prefix"], "bad_model_s3"),
        (["--env", "NOEQUALS"], "bad_env"),
        (["--count", "0"], "bad_count"),
        (["--variant", "Shadow"], "unknown_variant"),
    ],
)
def test_bad_input_is_refused_with_a_code(aws, capsys, extra, code):
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("a")
    _refused(
        capsys,
        ["apply", "--endpoint", "decider-cpu", "--image", IMAGE_B, "--alarm", "a", *extra, *FAST],
        code,
    )
    assert aws.simulator.update_calls == []
