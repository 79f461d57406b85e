"""What a failed `apply` or `rollback` leaves behind, tried as a CI pipeline would (moto server).

A failed apply must record nothing: the rollback-target tag stays what the last *successful* apply
wrote, so a CI job's on-failure `promote rollback` can never put the failed config back live. A
rollback whose own smoke tests fail returns to the config it left.
"""

from __future__ import annotations

import json

import pytest
from promote_constants import CHAT_BODY, IMAGE_A, IMAGE_B, REGION, REPO

from decider_cli.promote import cli
from decider_cli.promote.errors import EXIT_OK, EXIT_ROLLED_BACK
from decider_cli.promote.live import TAG_ROLLBACK

FAST = ["--poll-seconds", "0", "--timeout-minutes", "1"]
IMAGE_C = f"{REPO}@sha256:{'c' * 64}"
BAD_DECISION = "<html>502 Bad Gateway</html>"


def _apply(image: str, *extra: str) -> list[str]:
    return [
        "apply",
        "--endpoint",
        "decider-cpu",
        "--image",
        image,
        "--alarm",
        "decider-cpu-5xx",
        *extra,
        *FAST,
    ]


@pytest.fixture
def promoted_once(aws):
    """decider-cpu promoted A → B successfully: B live, rollback target = the original config.

    (moto answers the same InvokeEndpoint request with the same queued result for the rest of a test,
    so the first apply skips its smoke calls and each test queues the answers it needs.)"""
    aws.create_endpoint("decider-cpu", image=IMAGE_A)
    aws.create_alarm("decider-cpu-5xx")
    assert cli.main(_apply(IMAGE_B, "--skip-smoke")) == EXIT_OK
    endpoint = aws.endpoint("decider-cpu")
    assert aws.tags(endpoint["EndpointArn"])[TAG_ROLLBACK] == "decider-cpu-config-0"
    return endpoint["EndpointConfigName"]


def _state(aws):
    endpoint = aws.endpoint("decider-cpu")
    return endpoint["EndpointConfigName"], aws.tags(endpoint["EndpointArn"]).get(TAG_ROLLBACK)


def test_a_canary_rolled_back_by_its_alarm_records_nothing(aws, promoted_once, capsys):
    def alarm_fires(backend, _endpoint):
        from moto.cloudwatch.models import cloudwatch_backends

        cloudwatch_backends[backend.account_id][backend.region_name].set_alarm_state(
            "decider-cpu-5xx", "5xx on canary", None, "ALARM"
        )

    aws.simulator.during_update.append(alarm_fires)
    assert cli.main(_apply(IMAGE_C)) == EXIT_ROLLED_BACK
    assert "error[rolled_back]" in capsys.readouterr().err
    assert _state(aws) == (promoted_once, "decider-cpu-config-0")


def test_a_smoke_failure_reverts_and_records_nothing(aws, promoted_once, capsys):
    aws.queue_invoke_results(BAD_DECISION, CHAT_BODY)
    assert cli.main(_apply(IMAGE_C)) == EXIT_ROLLED_BACK
    err = capsys.readouterr().err
    assert "error[smoke_failed]" in err and "the rollback target is unchanged" in err
    # B is live again and the target is still the config before B, not the failed C
    assert _state(aws) == (promoted_once, "decider-cpu-config-0")


def test_a_timed_out_apply_records_nothing(aws, promoted_once, capsys):
    aws.simulator.polls_until_done = 1000
    argv = ["apply", "--endpoint", "decider-cpu", "--image", IMAGE_C, "--alarm", "decider-cpu-5xx"]
    assert cli.main([*argv, "--poll-seconds", "0", "--timeout-minutes", "0"]) == EXIT_ROLLED_BACK
    assert "error[update_timeout]" in capsys.readouterr().err
    endpoint = aws.endpoint("decider-cpu")
    assert aws.tags(endpoint["EndpointArn"])[TAG_ROLLBACK] == "decider-cpu-config-0"


def test_after_a_failed_apply_ci_rollback_never_puts_the_failed_config_back(aws, promoted_once):
    aws.queue_invoke_results(BAD_DECISION, CHAT_BODY)
    assert cli.main(_apply(IMAGE_C)) == EXIT_ROLLED_BACK
    failed = {c["EndpointConfigName"] for c in aws.sagemaker.list_endpoint_configs()["EndpointConfigs"]} - {
        "decider-cpu-config-0",
        promoted_once,
    }
    assert len(failed) == 1
    # the CI job's usual on-failure step (moto would repeat the failed smoke answers: not checked here)
    assert cli.main(["rollback", "--endpoint", "decider-cpu", "--skip-smoke", *FAST]) == EXIT_OK
    live, target = _state(aws)
    assert live == "decider-cpu-config-0" and live not in failed
    assert target == promoted_once


def test_smoke_failure_left_live_on_request_records_the_previous_config(aws, promoted_once, capsys):
    aws.queue_invoke_results(BAD_DECISION, CHAT_BODY)
    assert cli.main(_apply(IMAGE_C, "--no-rollback-on-smoke-failure")) == EXIT_ROLLED_BACK
    assert "promote rollback --endpoint decider-cpu" in capsys.readouterr().err
    live, target = _state(aws)
    assert live != promoted_once and target == promoted_once  # `rollback` returns to B


def test_a_rollback_whose_smoke_test_fails_returns_to_the_config_it_left(aws, promoted_once, capsys):
    aws.queue_invoke_results(BAD_DECISION, CHAT_BODY)
    assert cli.main(["rollback", "--endpoint", "decider-cpu", *FAST]) == EXIT_ROLLED_BACK
    err = capsys.readouterr().err
    assert "error[smoke_failed]" in err and f"returned to {promoted_once}" in err
    assert _state(aws) == (promoted_once, "decider-cpu-config-0")
    calls = [c["EndpointConfigName"] for c in aws.simulator.update_calls]
    assert calls[-2:] == ["decider-cpu-config-0", promoted_once]


def test_a_rollback_left_live_on_request_records_the_way_back(aws, promoted_once):
    aws.queue_invoke_results(BAD_DECISION, CHAT_BODY)
    argv = ["rollback", "--endpoint", "decider-cpu", "--no-revert-on-smoke-failure", *FAST]
    assert cli.main(argv) == EXIT_ROLLED_BACK
    assert _state(aws) == ("decider-cpu-config-0", promoted_once)


def test_apply_keeps_the_promoted_image_out_of_the_ecr_lifecycle(aws, capsys):
    import boto3

    ecr = boto3.client("ecr", region_name=REGION)
    ecr.create_repository(repositoryName="decider")
    manifest = json.dumps(
        {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json"}
    )
    pushed = ecr.put_image(repositoryName="decider", imageManifest=manifest, imageTag="cpu-123")
    image = f"{REPO}@{pushed['image']['imageId']['imageDigest']}"
    aws.create_endpoint("decider-cpu", image=IMAGE_A)
    aws.create_alarm("decider-cpu-5xx")
    assert cli.main(_apply(image, "--skip-smoke")) == EXIT_OK
    assert "kept" in capsys.readouterr().out
    tags = {
        t
        for i in ecr.describe_images(repositoryName="decider")["imageDetails"]
        for t in i.get("imageTags", [])
    }
    assert tags == {"cpu-123", f"keep-{image.split(':')[-1]}"}


def test_an_image_that_cannot_be_tagged_only_warns(aws, capsys):
    aws.create_endpoint("decider-cpu", image=IMAGE_A)
    aws.create_alarm("decider-cpu-5xx")
    assert cli.main(_apply(IMAGE_B, "--skip-smoke")) == EXIT_OK
    assert "warning: could not protect" in capsys.readouterr().out
