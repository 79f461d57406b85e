"""What AWS enforces on an update that moto and Stubber do not (issue 24), on template pairs as
CloudFormation will apply them: the baseline, then one deploy that upgrades the model (`model.revision`,
`model.sha256`), flips the CPU variant to async under the same endpoint name and pins a GPU image from
another account's repository.

1. A rollback's fleet can still read the previous model and pull the previous image with the previous
   Model's role (aws_rules.rollback_readability_violations).
2. No CANARY/LINEAR step exceeds 50% of the fewest instances the variant can run (async scales to 0).
3. The invocation flip is refused by `Custom::UpdateGuard`, which the Endpoint depends on, before
   UpdateEndpoint is called; under a new endpoint name it is not.
"""

from __future__ import annotations

from typing import Any

import pytest
from aws_rules import canary_violations, rollback_readability_violations
from stack_helpers import Synth, only, resources, run_synth

from decider_stacks.config import ConfigError, load_config
from decider_stacks.handlers import update_guard
from decider_stacks.synth import cdk_json_context

pytestmark = pytest.mark.cdk

FOREIGN_IMAGE = "999999999999.dkr.ecr.us-east-1.amazonaws.com/other-team@sha256:" + "d" * 64
UPGRADE = {
    "model.revision": "b" * 40,
    "model.sha256": "c" * 64,
    "cpu.invocation": "async",
    "gpu.image_uri": FOREIGN_IMAGE,
}


@pytest.fixture(scope="module")
def upgraded(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    return run_synth(tmp_path_factory.mktemp("cdk-upgrade"), UPGRADE, nag=False)


@pytest.mark.parametrize("stack", ["CpuStack", "GpuStack"])
def test_a_rollback_can_read_the_previous_model_and_image(synth: Synth, upgraded: Synth, stack: str) -> None:
    before, after = synth.templates[stack], upgraded.templates[stack]
    assert rollback_readability_violations(before, after) == []
    # The new Model's role reads the new model (and pulls the new image), not only the old one.
    new_model = only(after, "AWS::SageMaker::Model")
    assert (
        new_model["Properties"]["ExecutionRoleArn"]
        != only(before, "AWS::SageMaker::Model")["Properties"]["ExecutionRoleArn"]
    )


def test_the_readability_rule_catches_a_policy_narrowed_in_place(synth: Synth) -> None:
    """The checker itself: the old shape (one role, its ReadModel moved to the new key) is a violation."""
    import copy

    before = synth.templates["CpuStack"]
    after = copy.deepcopy(before)
    for policy in resources(after, "AWS::IAM::Policy").values():
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]:
            if statement.get("Sid") == "ReadModel":
                statement["Resource"] = ["arn:aws:s3:::bucket/models/new/model.gguf"]
    problems = rollback_readability_violations(before, after)
    assert problems and "loses s3:GetObject" in problems[0]


@pytest.mark.parametrize("stack", ["CpuStack", "GpuStack"])
def test_no_canary_larger_than_half_the_smallest_fleet(synth: Synth, upgraded: Synth, stack: str) -> None:
    assert canary_violations(synth.templates[stack]) == []
    assert canary_violations(upgraded.templates[stack]) == []


def test_an_async_variant_that_scales_to_zero_updates_all_at_once(upgraded: Synth) -> None:
    template = upgraded.templates["CpuStack"]
    target = only(template, "AWS::ApplicationAutoScaling::ScalableTarget")["Properties"]
    assert target["MinCapacity"] == 0
    routing = only(template, "AWS::SageMaker::Endpoint")["Properties"]["DeploymentConfig"]
    policy = routing["BlueGreenUpdatePolicy"]
    assert policy["TrafficRoutingConfiguration"]["Type"] == "ALL_AT_ONCE"
    assert "AutoRollbackConfiguration" in routing  # still blue/green with the rollback alarms


def test_an_explicit_canary_on_an_async_variant_that_scales_to_zero_is_refused() -> None:
    context = {
        **cdk_json_context(),
        "cpu.invocation": "async",
        "cpu.deployment.traffic_routing": "CANARY",
    }
    with pytest.raises(ConfigError, match=r"cpu\.deployment\.step_instance_count: 1 must be at most half"):
        load_config(context)
    load_config({**context, "cpu.async_inference.min_capacity": "2"})  # a floor the canary fits


def _guard(template: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    [(logical, guard)] = resources(template, "Custom::UpdateGuard").items()
    return logical, guard["Properties"]


def test_an_invocation_flip_is_refused_before_the_endpoint_is_touched(synth: Synth, upgraded: Synth) -> None:
    before, after = synth.templates["CpuStack"], upgraded.templates["CpuStack"]
    logical, new = _guard(after)
    _, old = _guard(before)
    endpoint = only(after, "AWS::SageMaker::Endpoint")
    assert logical in endpoint["DependsOn"]  # CloudFormation runs the guard first
    assert only(before, "AWS::SageMaker::Endpoint")["Properties"]["EndpointName"] == new["EndpointName"]
    problems = update_guard.update_refusals(old, new)
    assert len(problems) == 1 and "invocation realtime -> async" in problems[0]
    assert "-c cpu.endpoint_name=<new name>" in problems[0]
    assert "-c cpu.replace_endpoint=decider-cpu" in problems[0]  # a new name deletes decider-cpu
    # Under a new name CloudFormation replaces the endpoint, deleting decider-cpu (issue 33 §3): refused
    # unless the deploy names the endpoint it deletes.
    renamed = {**new, "EndpointName": "decider-cpu-async"}
    [rename] = update_guard.update_refusals(old, renamed)
    assert "DELETE decider-cpu" in rename
    assert update_guard.update_refusals(old, {**renamed, "ReplaceEndpoint": "decider-cpu"}) == []


def test_an_instance_type_change_under_autoscaling_is_refused(synth: Synth) -> None:
    _, old = _guard(synth.templates["CpuStack"])
    new = {**old, "InstanceTypes": ["ml.c7i.4xlarge"]}
    [problem] = update_guard.update_refusals(old, new)
    assert "Application Auto Scaling target" in problem and "-c cpu.autoscaling=false alone first" in problem
    assert update_guard.update_refusals({**old, "Autoscaling": "false"}, new) == []
    assert update_guard.update_refusals(old, {**old, "PeakInstances": "10"}) == []  # the model only


LONG_NAMES = {"cpu": "decider-cpu-" + "x" * 51, "gpu": "Decider-GPU-" + "y" * 31}  # 63 and 43 characters


@pytest.fixture(scope="module")
def long_names(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    context = {f"{variant}.endpoint_name": name for variant, name in LONG_NAMES.items()}
    return run_synth(tmp_path_factory.mktemp("cdk-long-names"), context, nag=False)


def _config_patterns(template: dict[str, Any], sid: str) -> list[str]:
    """The endpoint-config ARN patterns of one statement of the provider's policies (their last part)."""
    patterns = []
    for policy in resources(template, "AWS::IAM::Policy").values():
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]:
            if statement.get("Sid") == sid:
                for arn in statement["Resource"]:
                    last = arn["Fn::Join"][1][-1] if isinstance(arn, dict) else arn
                    if ":endpoint-config/" in last:
                        patterns.append(last.split(":endpoint-config/", 1)[1])
    return patterns


def test_the_parking_iam_patterns_match_the_names_the_handler_makes(long_names: Synth) -> None:
    """SageMaker ARNs carry names in lower case; a parked config keeps 42 characters of the endpoint's."""
    from fnmatch import fnmatchcase

    from decider_stacks.handlers.post_deploy_check import parking_config_name

    template = long_names.templates["ImageStack"]
    for sid in ("CreateParkedConfigs", "ParkEndpoints"):
        patterns = _config_patterns(template, sid)
        assert len(patterns) == 2, (sid, patterns)
        for name in LONG_NAMES.values():
            parked = parking_config_name(name, "DeciderConfigAAAA-previous", "DeciderConfigBBBB-new").lower()
            assert any(fnmatchcase(parked, pattern) for pattern in patterns), (sid, parked, patterns)


def test_a_synthetic_load_below_the_alarms_floor_is_refused() -> None:
    """The rollback alarms count a minute under error_rate_min_invocations (10) as 0 %."""
    context = {**cdk_json_context(), "cpu.deployment.synthetic_load_per_minute": "6"}
    with pytest.raises(ConfigError, match=r"cpu\.deployment\.synthetic_load_per_minute: 6 is below"):
        load_config(context)
    load_config({**context, "cpu.deployment.synthetic_load_per_minute": "0"})  # none at all is allowed
