"""plan / apply / rollback against a moto server reached through AWS_ENDPOINT_URL."""

from __future__ import annotations

import pytest
from promote_constants import CHAT_BODY, DECISION_BODY, IMAGE_A, IMAGE_B

from decider_cli.promote import cli
from decider_cli.promote.errors import EXIT_OK, EXIT_REFUSED, EXIT_ROLLED_BACK
from decider_cli.promote.live import TAG_ENDPOINT, TAG_ROLLBACK

FAST = ["--poll-seconds", "0", "--timeout-minutes", "1"]


def test_plan_prints_field_diff_and_changes_nothing(aws, capsys):
    aws.create_endpoint("decider-cpu")
    code = cli.main(
        [
            "plan",
            "--endpoint",
            "decider-cpu",
            "--image",
            IMAGE_B,
            "--instance-type",
            "ml.c5.2xlarge",
            "--env",
            "DECIDER_N_CTX=4096",
            "--env",
            "DECIDER_THREADS=4",
        ]
    )
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert "PrimaryContainer.Image" in out and IMAGE_A in out and IMAGE_B in out
    assert "ProductionVariants[AllTraffic].InstanceType" in out and "ml.c5.2xlarge" in out
    assert "PrimaryContainer.Environment.DECIDER_THREADS" in out
    assert "ProductionVariants[AllTraffic].ModelName" in out
    assert "✓ image pinned by digest" in out
    assert len(aws.sagemaker.list_endpoint_configs()["EndpointConfigs"]) == 1
    assert len(aws.sagemaker.list_models()["Models"]) == 1
    assert aws.simulator.update_calls == []


def test_plan_without_change_says_so(aws, capsys):
    aws.create_endpoint("decider-cpu")
    assert cli.main(["plan", "--endpoint", "decider-cpu", "--image", IMAGE_A]) == EXIT_OK
    assert "No change" in capsys.readouterr().out


def test_apply_success_creates_named_resources_updates_with_canary_and_smokes(aws, capsys):
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("decider-cpu-5xx")
    aws.queue_invoke_results(DECISION_BODY, CHAT_BODY)
    code = cli.main(
        [
            "apply",
            "--endpoint",
            "decider-cpu",
            "--image",
            IMAGE_B,
            "--alarm",
            "decider-cpu-5xx",
            "--canary-percent",
            "20",
            "--wait-minutes",
            "5",
            *FAST,
        ]
    )
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    endpoint = aws.endpoint("decider-cpu")
    new_config = endpoint["EndpointConfigName"]
    assert new_config.startswith("decider-cpu-c-") and len(new_config) == len("decider-cpu-c-") + 12
    config = aws.sagemaker.describe_endpoint_config(EndpointConfigName=new_config)
    model = aws.sagemaker.describe_model(ModelName=config["ProductionVariants"][0]["ModelName"])
    assert model["PrimaryContainer"]["Image"] == IMAGE_B
    assert model["ModelName"].startswith("decider-cpu-m-")
    [call] = aws.simulator.update_calls
    policy = call["DeploymentConfig"]["BlueGreenUpdatePolicy"]["TrafficRoutingConfiguration"]
    assert policy == {
        "Type": "CANARY",
        "CanarySize": {"Type": "CAPACITY_PERCENT", "Value": 20},
        "WaitIntervalInSeconds": 300,
    }
    assert call["DeploymentConfig"]["AutoRollbackConfiguration"] == {
        "Alarms": [{"AlarmName": "decider-cpu-5xx"}]
    }
    assert aws.tags(endpoint["EndpointArn"])[TAG_ROLLBACK] == "decider-cpu-config-0"
    assert aws.tags(config["EndpointConfigArn"])[TAG_ENDPOINT] == "decider-cpu"
    assert "Updating" in out and "p(refund)=0.930" in out and "reply 'OK'" in out


def test_failed_canary_rolls_back_and_exits_nonzero(aws, capsys):
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("decider-cpu-5xx")

    def alarm_fires(backend, endpoint):  # the canary's 5xx alarm trips while it bakes
        from moto.cloudwatch.models import cloudwatch_backends

        cloudwatch_backends[backend.account_id][backend.region_name].set_alarm_state(
            "decider-cpu-5xx", "5xx on canary", None, "ALARM"
        )

    aws.simulator.during_update.append(alarm_fires)
    code = cli.main(
        ["apply", "--endpoint", "decider-cpu", "--image", IMAGE_B, "--alarm", "decider-cpu-5xx", *FAST]
    )
    captured = capsys.readouterr()
    assert code == EXIT_ROLLED_BACK
    assert "error[rolled_back]" in captured.err
    assert "decider-cpu-5xx" in captured.err and "in ALARM" in captured.err
    endpoint = aws.endpoint("decider-cpu")
    assert endpoint["EndpointConfigName"] == "decider-cpu-config-0"
    assert TAG_ROLLBACK not in aws.tags(endpoint["EndpointArn"])  # a failed apply records no rollback target


def test_reapply_same_content_is_idempotent(aws, capsys):
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("decider-cpu-5xx")
    aws.queue_invoke_results(DECISION_BODY, CHAT_BODY)
    args = ["apply", "--endpoint", "decider-cpu", "--image", IMAGE_B, "--alarm", "decider-cpu-5xx", *FAST]
    assert cli.main(args) == EXIT_OK
    configs = aws.sagemaker.list_endpoint_configs()["EndpointConfigs"]
    models = aws.sagemaker.list_models()["Models"]
    live_config = aws.endpoint("decider-cpu")["EndpointConfigName"]
    capsys.readouterr()

    assert cli.main(args) == EXIT_OK
    assert "Already live" in capsys.readouterr().out
    assert len(aws.simulator.update_calls) == 1  # no second UpdateEndpoint
    assert aws.sagemaker.list_endpoint_configs()["EndpointConfigs"] == configs
    assert aws.sagemaker.list_models()["Models"] == models
    assert aws.endpoint("decider-cpu")["EndpointConfigName"] == live_config


def test_reapply_after_rollback_reuses_the_same_names(aws):
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("decider-cpu-5xx")
    aws.queue_invoke_results(DECISION_BODY, CHAT_BODY)
    args = ["apply", "--endpoint", "decider-cpu", "--image", IMAGE_B, "--alarm", "decider-cpu-5xx", *FAST]
    assert cli.main(args) == EXIT_OK
    promoted = aws.endpoint("decider-cpu")["EndpointConfigName"]
    assert cli.main(["rollback", "--endpoint", "decider-cpu", *FAST]) == EXIT_OK
    assert aws.endpoint("decider-cpu")["EndpointConfigName"] == "decider-cpu-config-0"
    assert cli.main(args) == EXIT_OK
    assert aws.endpoint("decider-cpu")["EndpointConfigName"] == promoted
    assert len(aws.sagemaker.list_endpoint_configs()["EndpointConfigs"]) == 2


def test_rollback_returns_to_previous_and_toggles(aws, capsys):
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("decider-cpu-5xx")
    aws.queue_invoke_results(DECISION_BODY, CHAT_BODY)
    assert (
        cli.main(
            ["apply", "--endpoint", "decider-cpu", "--image", IMAGE_B, "--alarm", "decider-cpu-5xx", *FAST]
        )
        == EXIT_OK
    )
    promoted = aws.endpoint("decider-cpu")["EndpointConfigName"]
    assert cli.main(["rollback", "--endpoint", "decider-cpu", *FAST]) == EXIT_OK
    endpoint = aws.endpoint("decider-cpu")
    assert endpoint["EndpointConfigName"] == "decider-cpu-config-0"
    assert aws.tags(endpoint["EndpointArn"])[TAG_ROLLBACK] == promoted
    assert (
        "DeploymentConfig" not in aws.simulator.update_calls[-1]
        or aws.simulator.update_calls[-1]["DeploymentConfig"] is None
    )
    # An autoscaled fleet keeps its live count (and weight) on every update promote makes.
    assert all(call.get("RetainAllVariantProperties") is True for call in aws.simulator.update_calls)
    assert cli.main(["rollback", "--endpoint", "decider-cpu", *FAST]) == EXIT_OK
    assert aws.endpoint("decider-cpu")["EndpointConfigName"] == promoted


def test_rollback_without_recorded_target_is_refused(aws, capsys):
    aws.create_endpoint("decider-cpu")
    assert cli.main(["rollback", "--endpoint", "decider-cpu", *FAST]) == EXIT_REFUSED
    assert "error[no_rollback_target]" in capsys.readouterr().err


def test_smoke_failure_after_update_rolls_back(aws, capsys):
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("decider-cpu-5xx")
    aws.queue_invoke_results("<html>502 Bad Gateway</html>", CHAT_BODY)
    code = cli.main(
        ["apply", "--endpoint", "decider-cpu", "--image", IMAGE_B, "--alarm", "decider-cpu-5xx", *FAST]
    )
    captured = capsys.readouterr()
    assert code == EXIT_ROLLED_BACK
    assert "error[smoke_failed]" in captured.err and "FAIL" in captured.out
    assert aws.endpoint("decider-cpu")["EndpointConfigName"] == "decider-cpu-config-0"


@pytest.mark.parametrize("cmd", ["apply", "rollback"])
def test_cloudformation_managed_endpoint_is_refused_with_cdk_hint(aws, capsys, cmd):
    aws.create_endpoint("decider-cpu", tags=[{"Key": "aws:cloudformation:stack-name", "Value": "CpuStack"}])
    aws.create_alarm("decider-cpu-5xx")
    extra = ["--image", IMAGE_B, "--alarm", "decider-cpu-5xx"] if cmd == "apply" else []
    assert cli.main([cmd, "--endpoint", "decider-cpu", *extra, *FAST]) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert "error[cloudformation_managed]" in err and "CpuStack" in err
    if cmd == "apply":
        assert f"npx cdk deploy CpuStack -c cpu.image_uri={IMAGE_B}" in err
    assert aws.simulator.update_calls == []


def test_force_applies_to_cloudformation_managed_endpoint(aws, capsys):
    aws.create_endpoint("decider-cpu", tags=[{"Key": "aws:cloudformation:stack-name", "Value": "CpuStack"}])
    aws.create_alarm("decider-cpu-5xx")
    args = [
        "apply",
        "--endpoint",
        "decider-cpu",
        "--image",
        IMAGE_B,
        "--alarm",
        "decider-cpu-5xx",
        "--force",
        "--skip-smoke",
        *FAST,
    ]
    assert cli.main(args) == EXIT_OK
    assert len(aws.simulator.update_calls) == 1
    assert "drifts the stack" in capsys.readouterr().out


def test_plan_on_cloudformation_endpoint_prints_the_equivalent_cdk_command(aws, capsys):
    aws.create_endpoint("decider-gpu", tags=[{"Key": "aws:cloudformation:stack-name", "Value": "GpuStack"}])
    argv = [
        "plan",
        "--endpoint",
        "decider-gpu",
        "--image",
        IMAGE_B,
        "--count",
        "3",
        "--env",
        "DECIDER_N_CTX=4096",
    ]
    assert cli.main(argv) == EXIT_OK  # read-only, so allowed on a stack's endpoint
    out = " ".join(capsys.readouterr().out.split())
    assert (
        f"npx cdk deploy GpuStack -c gpu.image_uri={IMAGE_B} -c gpu.initial_instance_count=3 "
        "-c gpu.container.n_ctx=4096" in out
    )


def test_update_that_outlasts_the_timeout_exits_3_and_says_where_to_look(aws, capsys):
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("decider-cpu-5xx")
    aws.simulator.polls_until_done = 1000
    argv = ["apply", "--endpoint", "decider-cpu", "--image", IMAGE_B, "--alarm", "decider-cpu-5xx"]
    assert cli.main([*argv, "--poll-seconds", "0", "--timeout-minutes", "0"]) == EXIT_ROLLED_BACK
    err = capsys.readouterr().err
    assert "error[update_timeout]" in err and "promote status --endpoint decider-cpu" in err


def test_apply_rerun_after_a_ci_timeout_smokes_and_records_the_rollback_target(aws, capsys):
    """Issue 33 §4: the first apply stops waiting (CI timeout) while the update goes on and succeeds;
    the re-run finds the new config live ("Already live") and must still smoke it and record the
    config it replaced as the rollback target."""
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("decider-cpu-5xx")
    aws.simulator.polls_until_done = 3
    argv = ["apply", "--endpoint", "decider-cpu", "--image", IMAGE_B, "--alarm", "decider-cpu-5xx"]
    assert cli.main([*argv, "--poll-seconds", "0", "--timeout-minutes", "0"]) == EXIT_ROLLED_BACK
    assert "error[update_timeout]" in capsys.readouterr().err
    while aws.endpoint("decider-cpu")["EndpointStatus"] == "Updating":  # the update goes on
        pass
    promoted = aws.endpoint("decider-cpu")["EndpointConfigName"]
    assert promoted != "decider-cpu-config-0"

    aws.queue_invoke_results(DECISION_BODY, CHAT_BODY)
    assert cli.main([*argv, *FAST]) == EXIT_OK
    out = capsys.readouterr().out
    assert "Already live" in out and "smoke" in out.lower()
    assert len(aws.simulator.update_calls) == 1  # no second UpdateEndpoint
    tags = aws.tags(aws.endpoint("decider-cpu")["EndpointArn"])
    assert tags[TAG_ROLLBACK] == "decider-cpu-config-0"
    assert "promote:apply-in-flight" not in tags
    # and `promote rollback` now has somewhere to go
    assert cli.main(["rollback", "--endpoint", "decider-cpu", *FAST, "--skip-smoke"]) == EXIT_OK
    assert aws.endpoint("decider-cpu")["EndpointConfigName"] == "decider-cpu-config-0"


def test_apply_rerun_after_a_ci_timeout_reverts_when_the_smoke_fails(aws, capsys):
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("decider-cpu-5xx")
    argv = ["apply", "--endpoint", "decider-cpu", "--image", IMAGE_B, "--alarm", "decider-cpu-5xx"]
    assert cli.main([*argv, "--poll-seconds", "0", "--timeout-minutes", "0"]) == EXIT_ROLLED_BACK
    while aws.endpoint("decider-cpu")["EndpointStatus"] == "Updating":
        pass
    aws.queue_invoke_results({"unexpected": True}, {"unexpected": True})
    assert cli.main([*argv, *FAST]) != EXIT_OK
    assert "error[smoke_failed]" in capsys.readouterr().err
    endpoint = aws.endpoint("decider-cpu")
    assert endpoint["EndpointConfigName"] == "decider-cpu-config-0"
    assert TAG_ROLLBACK not in aws.tags(endpoint["EndpointArn"])


def test_apply_count_takes_effect_under_retained_variant_properties(aws):
    """Issue 33 §4: RetainAllVariantProperties keeps the live instance count unless
    ExcludeRetainedVariantProperties names DesiredInstanceCount (API_VariantProperty)."""
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("decider-cpu-5xx")
    argv = ["apply", "--endpoint", "decider-cpu", "--count", "3", "--alarm", "decider-cpu-5xx"]
    assert cli.main([*argv, *FAST, "--skip-smoke"]) == EXIT_OK
    call = aws.simulator.update_calls[-1]
    assert call["RetainAllVariantProperties"] is True
    assert call["ExcludeRetainedVariantProperties"] == [{"VariantPropertyType": "DesiredInstanceCount"}]
    variant = aws.endpoint("decider-cpu")["ProductionVariants"][0]
    assert variant["CurrentInstanceCount"] == 3 and variant["DesiredInstanceCount"] == 3


def test_apply_without_count_keeps_the_live_count(aws):
    aws.create_endpoint("decider-cpu")
    aws.create_alarm("decider-cpu-5xx")
    argv = ["apply", "--endpoint", "decider-cpu", "--image", IMAGE_B, "--alarm", "decider-cpu-5xx"]
    assert cli.main([*argv, *FAST, "--skip-smoke"]) == EXIT_OK
    assert aws.simulator.update_calls[-1]["ExcludeRetainedVariantProperties"] is None
