"""prune deletes only unused promote-created configs/models, never the live one or the rollback target."""

from __future__ import annotations

from promote_constants import IMAGE_A, REPO

from decider_cli.promote import cli
from decider_cli.promote.errors import EXIT_OK

FAST = ["--poll-seconds", "0", "--timeout-minutes", "1", "--skip-smoke"]


def _image(char: str) -> str:
    return f"{REPO}@sha256:{char * 64}"


def _promote_three_times(aws) -> list[str]:
    """Returns the configs in promotion order: B, C, D (D live, C rollback target)."""
    aws.create_endpoint("decider-cpu", image=IMAGE_A)
    aws.create_alarm("a")
    configs = []
    for char in "bcd":
        assert (
            cli.main(["apply", "--endpoint", "decider-cpu", "--image", _image(char), "--alarm", "a", *FAST])
            == 0
        )
        configs.append(aws.endpoint("decider-cpu")["EndpointConfigName"])
    return configs


def _names(aws):
    configs = {c["EndpointConfigName"] for c in aws.sagemaker.list_endpoint_configs()["EndpointConfigs"]}
    models = {m["ModelName"] for m in aws.sagemaker.list_models()["Models"]}
    return configs, models


def _model_of(aws, config):
    return aws.sagemaker.describe_endpoint_config(EndpointConfigName=config)["ProductionVariants"][0][
        "ModelName"
    ]


def test_prune_keeps_live_and_rollback_target(aws, capsys):
    config_b, config_c, config_d = _promote_three_times(aws)
    model_b, model_c, model_d = (_model_of(aws, c) for c in (config_b, config_c, config_d))

    assert cli.main(["prune", "--endpoint", "decider-cpu", "--keep", "0"]) == EXIT_OK
    configs, models = _names(aws)
    assert configs == {"decider-cpu-config-0", config_c, config_d}  # config-0 was never promote's to delete
    assert models == {"decider-cpu-model-0", model_c, model_d}
    assert model_b not in models
    out = capsys.readouterr().out
    assert "rollback target" in out and "in use" in out

    # the rollback target still works after pruning
    assert cli.main(["rollback", "--endpoint", "decider-cpu", *FAST]) == EXIT_OK
    assert aws.endpoint("decider-cpu")["EndpointConfigName"] == config_c


def test_prune_keep_n_and_dry_run(aws):
    config_b, _, _ = _promote_three_times(aws)
    before = _names(aws)
    assert cli.main(["prune", "--endpoint", "decider-cpu", "--keep", "0", "--dry-run"]) == EXIT_OK
    assert _names(aws) == before
    assert cli.main(["prune", "--endpoint", "decider-cpu", "--keep", "1"]) == EXIT_OK
    assert _names(aws) == before  # B is the one unused config and --keep 1 keeps it
    assert config_b in _names(aws)[0]


def test_prune_never_deletes_a_config_another_endpoint_runs(aws, capsys):
    config_b, _, _ = _promote_three_times(aws)
    aws.sagemaker.create_endpoint(EndpointName="decider-cpu-shadow", EndpointConfigName=config_b)
    assert cli.main(["prune", "--endpoint", "decider-cpu", "--keep", "0"]) == EXIT_OK
    configs, models = _names(aws)
    assert config_b in configs and _model_of(aws, config_b) in models
    assert "in use by endpoint decider-cpu-shadow" in capsys.readouterr().out


def _stack_resources(aws, suffix: str, image: str) -> tuple[str, str]:
    """A model and config as CloudFormation names and the stacks tag them (retained on replacement)."""
    from promote_constants import ROLE

    model, config = f"DeciderModel63255C53-{suffix}", f"DeciderConfig6F0D9096-{suffix}"
    tags = [
        {"Key": "promote:endpoint", "Value": "decider-cpu"},
        {"Key": "aws:cloudformation:stack-name", "Value": "CpuStack"},
    ]
    aws.sagemaker.create_model(
        ModelName=model, ExecutionRoleArn=ROLE, PrimaryContainer={"Image": image}, Tags=tags
    )
    aws.sagemaker.create_endpoint_config(
        EndpointConfigName=config,
        ProductionVariants=[
            {
                "VariantName": "AllTraffic",
                "ModelName": model,
                "InitialInstanceCount": 1,
                "InstanceType": "ml.c5.xlarge",
            }
        ],
        Tags=tags,
    )
    return model, config


def test_prune_deletes_what_a_stack_retained_and_keeps_what_it_runs(aws, capsys):
    _, old_config = _stack_resources(aws, "OLD1", IMAGE_A)
    live_model, live_config = _stack_resources(aws, "LIVE2", _image("b"))
    aws.sagemaker.create_endpoint(
        EndpointName="decider-cpu",
        EndpointConfigName=live_config,
        Tags=[{"Key": "aws:cloudformation:stack-name", "Value": "CpuStack"}],
    )
    aws.sagemaker.create_model(
        ModelName="someone-elses",
        ExecutionRoleArn="arn:aws:iam::123456789012:role/x",
        PrimaryContainer={"Image": IMAGE_A},
    )
    assert cli.main(["prune", "--endpoint", "decider-cpu", "--keep", "0"]) == EXIT_OK
    configs, models = _names(aws)
    assert configs == {live_config}
    assert models == {live_model, "someone-elses"}  # untagged resources are never touched
    assert old_config in capsys.readouterr().out


def test_prune_after_the_stack_was_deleted_removes_what_it_left(aws, capsys):
    _, kept_config = _stack_resources(aws, "NEWER", _image("b"))
    _stack_resources(aws, "OLDER", IMAGE_A)
    # a retained config another endpoint still runs is never deleted
    _, shared_config = _stack_resources(aws, "SHARED", _image("c"))
    aws.sagemaker.create_endpoint(EndpointName="decider-cpu-shadow", EndpointConfigName=shared_config)
    assert cli.main(["prune", "--endpoint", "decider-cpu", "--keep", "1", "--dry-run"]) == EXIT_OK
    assert "does not exist" in capsys.readouterr().out
    assert cli.main(["prune", "--endpoint", "decider-cpu", "--keep", "0"]) == EXIT_OK
    configs, _ = _names(aws)
    assert configs == {shared_config}
    assert kept_config not in configs


def _stack_with_outputs(aws, stack: str, outputs: dict[str, str]) -> None:
    """A CloudFormation stack in moto whose outputs name what the real stack's would."""
    import json

    import boto3

    template = {
        "Resources": {"Topic": {"Type": "AWS::SNS::Topic"}},
        "Outputs": {key: {"Value": value} for key, value in outputs.items()},
    }
    boto3.client("cloudformation").create_stack(StackName=stack, TemplateBody=json.dumps(template))


def test_prune_keeps_the_stacks_transform_model(aws, capsys):
    """Issue 33 §4: TransformModel carries the endpoint tag and no endpoint config uses it."""
    from promote_constants import ROLE

    live_model, live_config = _stack_resources(aws, "LIVE2", _image("b"))
    aws.sagemaker.create_endpoint(
        EndpointName="decider-cpu",
        EndpointConfigName=live_config,
        Tags=[{"Key": "aws:cloudformation:stack-name", "Value": "CpuStack"}],
    )
    tags = [
        {"Key": "promote:endpoint", "Value": "decider-cpu"},
        {"Key": "aws:cloudformation:stack-name", "Value": "CpuStack"},
    ]
    for name in ("TransformModelA1B2-LIVE", "TransformModelA1B2-OLD"):  # OLD: a replaced, retained one
        aws.sagemaker.create_model(
            ModelName=name,
            ExecutionRoleArn=ROLE,
            PrimaryContainer={"Image": _image("b"), "ModelDataUrl": "s3://m/x-batch-transform/model.tar.gz"},
            Tags=tags,
        )
    _stack_with_outputs(aws, "CpuStack", {"TransformModelName": "TransformModelA1B2-LIVE"})
    assert cli.main(["prune", "--endpoint", "decider-cpu", "--keep", "0"]) == EXIT_OK
    _, models = _names(aws)
    assert models == {live_model, "TransformModelA1B2-LIVE"}
    assert "Batch Transform model of stack CpuStack" in " ".join(capsys.readouterr().out.split())
