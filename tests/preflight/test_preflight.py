"""`preflight` against stubbed AWS APIs (botocore Stubber): what a new account lacks, and how to fix it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from decider_cli.preflight import checks, cli
from decider_stacks.config import load_config
from decider_stacks.synth import cdk_json_context

ACCOUNT, REGION = "123456789012", "eu-west-1"
NOW = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(name, value)
    # a stubbed client for each that preflight makes
    clients = {name: boto3.client(name, region_name=REGION) for name in cli.SERVICES}
    stubs = {name: Stubber(client) for name, client in clients.items()}
    for stub in stubs.values():
        stub.activate()
    stubs["sts"].add_response(
        "get_caller_identity",
        {"Account": ACCOUNT, "Arn": f"arn:aws:iam::{ACCOUNT}:user/ops", "UserId": "AIDAEXAMPLE"},
    )
    yield {"clients": clients, **stubs}
    for stub in stubs.values():
        stub.assert_no_pending_responses()
        stub.deactivate()


def quotas(aws, service: str, defaults: dict[str, float], applied: dict[str, float] | None = None) -> None:
    def entries(values):
        return [
            {"ServiceCode": service, "QuotaCode": f"L-{abs(hash(n)) % 10**8:08d}", "QuotaName": n, "Value": v}
            for n, v in values.items()
        ]

    aws["service-quotas"].add_response(
        "list_aws_default_service_quotas", {"Quotas": entries(defaults)}, {"ServiceCode": service}
    )
    aws["service-quotas"].add_response(
        "list_service_quotas", {"Quotas": entries(applied or {})}, {"ServiceCode": service}
    )


def bootstrapped(aws, version: str = "21") -> None:
    aws["cloudformation"].add_response(
        "describe_stacks",
        {"Stacks": [{"StackName": "CDKToolkit", "StackStatus": "UPDATE_COMPLETE", "CreationTime": NOW}]},
        {"StackName": "CDKToolkit"},
    )
    aws["ssm"].add_response(
        "get_parameter",
        {"Parameter": {"Name": checks.BOOTSTRAP_PARAMETER, "Value": version, "Type": "String"}},
        {"Name": checks.BOOTSTRAP_PARAMETER},
    )


def no_stack(aws, name: str) -> None:
    aws["cloudformation"].add_client_error(
        "describe_stacks",
        "ValidationError",
        f"Stack with id {name} does not exist",
        expected_params={"StackName": name},
    )


def no_endpoints(aws) -> None:
    aws["sagemaker"].add_response("list_endpoints", {"Endpoints": []})


def fresh_names(aws, names: tuple[str, ...] = ("decider-cpu", "decider-gpu")) -> None:
    no_stack(aws, "ImageStack")
    aws["s3"].add_client_error("head_bucket", "404", http_status_code=404)
    for name in names:
        aws["sagemaker"].add_client_error(
            "describe_endpoint",
            "ValidationException",
            f"Could not find endpoint {name}",
            expected_params={"EndpointName": name},
        )
    no_log_groups(aws, names)
    for name in names:  # the load check before an update: no endpoint yet
        no_endpoint(aws, name)


def no_endpoint(aws, name: str) -> None:
    aws["sagemaker"].add_client_error(
        "describe_endpoint",
        "ValidationException",
        f"Could not find endpoint {name}",
        expected_params={"EndpointName": name},
    )


def no_log_groups(aws, names: tuple[str, ...] = ("decider-cpu", "decider-gpu")) -> None:
    for name in names:
        prefix = f"/aws/sagemaker/Endpoints/{name}"
        aws["logs"].add_response("describe_log_groups", {"logGroups": []}, {"logGroupNamePrefix": prefix})


CODEBUILD_OK = {
    "Concurrently running builds for Linux/Small environment": 5,
    "Concurrently running builds for Linux/Large environment": 2,
    "Concurrently running builds for Linux/2XLarge environment": 1,
    "Concurrently running builds for Linux GPU/Large environment": 0,
}


def test_a_ready_account_passes(aws, capsys):
    bootstrapped(aws)
    quotas(aws, "sagemaker", {"ml.c7i.8xlarge for endpoint usage": 8, "ml.g6.xlarge for endpoint usage": 6})
    no_endpoints(aws)
    quotas(aws, "codebuild", CODEBUILD_OK)
    fresh_names(aws)
    assert cli.main([], clients=aws["clients"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "ml.c7i.8xlarge for endpoint usage" in out and "8 ≥ 8" in out  # 2 × max_capacity 4
    assert "6 ≥ 6" in out  # GPU: 2 × max_capacity 3
    assert "MISSING" not in out and "To fix" not in out


def test_a_new_account_gets_each_missing_item_and_the_command_to_request_it(aws, capsys):
    no_stack(aws, "CDKToolkit")
    quotas(
        aws,
        "sagemaker",
        {"ml.c7i.8xlarge for endpoint usage": 0, "ml.g6.xlarge for endpoint usage": 0},
        {"ml.c7i.8xlarge for endpoint usage": 8},  # one increase already granted: the applied value wins
    )
    no_endpoints(aws)
    quotas(aws, "codebuild", {**CODEBUILD_OK, "Concurrently running builds for Linux/2XLarge environment": 0})
    fresh_names(aws)
    assert cli.main(["--json"], clients=aws["clients"]) == cli.EXIT_MISSING
    findings = {f["check"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert findings["CDK bootstrap"]["status"] == "missing"
    assert findings["CDK bootstrap"]["fix"] == f"npx cdk bootstrap aws://{ACCOUNT}/{REGION}"
    assert findings["ml.c7i.8xlarge for endpoint usage"]["status"] == "ok"
    gpu = findings["ml.g6.xlarge for endpoint usage"]
    assert gpu["status"] == "missing" and gpu["detail"].startswith("0 < 6")
    assert gpu["fix"].startswith("aws service-quotas request-service-quota-increase --service-code sagemaker")
    assert gpu["fix"].endswith(f"--desired-value 6 --region {REGION}")
    build = findings["CodeBuild Linux/2XLarge concurrent builds"]
    assert build["status"] == "missing" and "AccountLimitExceededException" in build["detail"]
    assert "--service-code codebuild" in build["fix"]
    assert findings["CodeBuild Linux/Large concurrent builds"]["status"] == "ok"


def test_other_endpoints_on_the_same_type_count_against_the_quota(aws, capsys):
    bootstrapped(aws)
    quotas(aws, "sagemaker", {"ml.c7i.8xlarge for endpoint usage": 8})
    aws["sagemaker"].add_response(
        "list_endpoints",
        {
            "Endpoints": [
                {
                    "EndpointName": n,
                    "EndpointArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint/{n}",
                    "CreationTime": NOW,
                    "LastModifiedTime": NOW,
                    "EndpointStatus": "InService",
                }
                for n in ("decider-cpu", "reporting")
            ]
        },
    )
    aws["sagemaker"].add_response(
        "describe_endpoint",
        {
            "EndpointName": "reporting",
            "EndpointArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint/reporting",
            "EndpointConfigName": "reporting-config",
            "EndpointStatus": "InService",
            "CreationTime": NOW,
            "LastModifiedTime": NOW,
            "ProductionVariants": [{"VariantName": "AllTraffic", "CurrentInstanceCount": 3}],
        },
        {"EndpointName": "reporting"},
    )
    aws["sagemaker"].add_response(
        "describe_endpoint_config",
        {
            "EndpointConfigName": "reporting-config",
            "EndpointConfigArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint-config/reporting-config",
            "CreationTime": NOW,
            "ProductionVariants": [
                {"VariantName": "AllTraffic", "ModelName": "m", "InstanceType": "ml.c7i.8xlarge"}
            ],
        },
        {"EndpointConfigName": "reporting-config"},
    )
    quotas(aws, "codebuild", CODEBUILD_OK)
    no_stack(aws, "ImageStack")
    aws["s3"].add_client_error("head_bucket", "404", http_status_code=404)
    aws["sagemaker"].add_client_error("describe_endpoint", "ValidationException", "Could not find endpoint")
    no_log_groups(aws, ("decider-cpu",))
    no_endpoint(aws, "decider-cpu")
    assert cli.main(["--variant", "cpu"], clients=aws["clients"]) == cli.EXIT_MISSING
    out = " ".join(capsys.readouterr().out.split())
    assert "8 < 11" in out and "8 at the blue/green peak + 3 in use elsewhere" in out


def test_leftovers_of_an_earlier_install_block_a_fresh_deploy(aws, capsys):
    bootstrapped(aws)
    quotas(aws, "sagemaker", {"ml.c7i.8xlarge for endpoint usage": 8})
    no_endpoints(aws)
    quotas(aws, "codebuild", CODEBUILD_OK)
    no_stack(aws, "ImageStack")
    aws["s3"].add_response("head_bucket", {})  # retained by a deleted ImageStack
    aws["sagemaker"].add_response(
        "describe_endpoint",
        {
            "EndpointName": "decider-cpu",
            "EndpointArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint/decider-cpu",
            "EndpointConfigName": "hand-made",
            "EndpointStatus": "InService",
            "CreationTime": NOW,
            "LastModifiedTime": NOW,
        },
    )
    aws["sagemaker"].add_response("list_tags", {"Tags": []})
    no_log_groups(aws, ("decider-cpu",))
    no_endpoint(aws, "decider-cpu")  # (as it is gone by the time the load is read)
    assert cli.main(["--variant", "cpu"], clients=aws["clients"]) == cli.EXIT_MISSING
    out = " ".join(capsys.readouterr().out.split())
    assert f"s3://decider-artifacts-{ACCOUNT}-{REGION} exists" in out
    assert "-c project=<another name>" in out
    assert "an endpoint of that name exists outside CpuStack (owner: none)" in out


def test_unreadable_quotas_are_shown_not_counted(aws, capsys):
    bootstrapped(aws)
    aws["service-quotas"].add_client_error("list_aws_default_service_quotas", "AccessDeniedException")
    aws["service-quotas"].add_client_error("list_aws_default_service_quotas", "AccessDeniedException")
    fresh_names(aws)
    assert cli.main([], clients=aws["clients"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert out.count("unknown") == 2 and "AccessDeniedException" in out


def test_a_prebuilt_deploy_needs_no_codebuild_quota():
    config = load_config(
        {
            **cdk_json_context(),
            "image_uri": f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/d@sha256:" + "a" * 64,
            "model_s3_uri": "s3://models/qwen/",
        }
    )
    target = checks.Target(config, (config.cpu, config.gpu), REGION, ACCOUNT)
    [finding] = checks.codebuild_quotas(service_quotas=None, target=target)  # no API call at all
    assert finding.status == "ok" and "nothing is built" in finding.detail


def test_the_blue_green_peak_counts_the_retained_fleet():
    config = load_config(cdk_json_context())
    assert checks.peak_instances(config.cpu) == 2 * config.cpu.max_capacity
    manual = load_config({**cdk_json_context(), "cpu.autoscaling": "false"}).cpu
    assert checks.peak_instances(manual) == 2 * manual.initial_instance_count


def test_instances_of_other_endpoints_instance_pools_are_counted_per_type(aws):
    aws["clients"]["sts"].get_caller_identity()  # the fixture's identity call (the CLI makes it)
    aws["sagemaker"].add_response(
        "list_endpoints",
        {
            "Endpoints": [
                {
                    "EndpointName": "pooled",
                    "EndpointArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint/pooled",
                    "CreationTime": NOW,
                    "LastModifiedTime": NOW,
                    "EndpointStatus": "InService",
                }
            ]
        },
    )
    pools = [
        {"InstanceType": "ml.g6e.xlarge", "CurrentInstanceCount": 2},
        {"InstanceType": "ml.g5.xlarge", "CurrentInstanceCount": 1},
    ]
    aws["sagemaker"].add_response(
        "describe_endpoint",
        {
            "EndpointName": "pooled",
            "EndpointArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint/pooled",
            "EndpointConfigName": "pooled-config",
            "EndpointStatus": "InService",
            "CreationTime": NOW,
            "LastModifiedTime": NOW,
            "ProductionVariants": [
                {"VariantName": "AllTraffic", "CurrentInstanceCount": 3, "InstancePools": pools}
            ],
        },
        {"EndpointName": "pooled"},
    )
    aws["sagemaker"].add_response(
        "describe_endpoint_config",
        {
            "EndpointConfigName": "pooled-config",
            "EndpointConfigArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint-config/pooled-config",
            "CreationTime": NOW,
            "ProductionVariants": [
                {
                    "VariantName": "AllTraffic",
                    "ModelName": "m",
                    "InstancePools": [
                        {"InstanceType": "ml.g6e.xlarge", "Priority": 1},
                        {"InstanceType": "ml.g5.xlarge", "Priority": 2},
                    ],
                }
            ],
        },
        {"EndpointConfigName": "pooled-config"},
    )
    usage = checks.other_usage(aws["clients"]["sagemaker"], {"decider-cpu", "decider-gpu"})
    assert usage == {"ml.g6e.xlarge": 2, "ml.g5.xlarge": 1}


def test_a_leftover_endpoint_log_group_blocks_the_stack_and_says_what_to_do(aws, capsys):
    """A fixed-name group from a manual test or a deleted stack: CpuStack's creation would fail."""
    bootstrapped(aws)
    quotas(aws, "sagemaker", {"ml.c7i.8xlarge for endpoint usage": 8})
    no_endpoints(aws)
    quotas(aws, "codebuild", CODEBUILD_OK)
    no_stack(aws, "ImageStack")
    aws["s3"].add_client_error("head_bucket", "404", http_status_code=404)
    aws["sagemaker"].add_client_error(
        "describe_endpoint", "ValidationException", "Could not find endpoint decider-cpu"
    )
    group = "/aws/sagemaker/Endpoints/decider-cpu"
    aws["logs"].add_response(
        "describe_log_groups",
        {"logGroups": [{"logGroupName": group}, {"logGroupName": group + "-old"}]},
        {"logGroupNamePrefix": group},
    )
    no_stack(aws, "CpuStack")
    no_endpoint(aws, "decider-cpu")
    assert cli.main(["--variant", "cpu", "--json"], clients=aws["clients"]) == cli.EXIT_MISSING
    finding = {f["check"]: f for f in json.loads(capsys.readouterr().out)["findings"]}[f"log group {group}"]
    assert finding["status"] == "missing" and "already exists" in finding["detail"]
    assert f"aws logs delete-log-group --log-group-name {group} --region {REGION}" in finding["fix"]


def test_the_stacks_own_log_group_is_fine(aws):
    target = checks.Target(
        load_config(cdk_json_context()), (load_config(cdk_json_context()).cpu,), REGION, ACCOUNT
    )
    group = "/aws/sagemaker/Endpoints/decider-cpu"
    aws["logs"].add_response(
        "describe_log_groups", {"logGroups": [{"logGroupName": group}]}, {"logGroupNamePrefix": group}
    )
    aws["cloudformation"].add_response(
        "describe_stacks",
        {"Stacks": [{"StackName": "CpuStack", "StackStatus": "UPDATE_COMPLETE", "CreationTime": NOW}]},
        {"StackName": "CpuStack"},
    )
    [finding] = checks.log_groups(aws["clients"]["logs"], aws["clients"]["cloudformation"], target)
    assert finding.status == "ok" and "CpuStack exists" in finding.detail
    aws["clients"]["sts"].get_caller_identity()  # (the fixture's queued answer)


def test_a_compute_type_codebuild_does_not_offer_in_the_region_blocks(aws, capsys):
    bootstrapped(aws)
    quotas(aws, "sagemaker", {"ml.c7i.8xlarge for endpoint usage": 8, "ml.g6.xlarge for endpoint usage": 6})
    no_endpoints(aws)
    offered = {k: v for k, v in CODEBUILD_OK.items() if "2XLarge" not in k}
    quotas(aws, "codebuild", offered)
    fresh_names(aws)
    assert cli.main(["--json"], clients=aws["clients"]) == cli.EXIT_MISSING
    build = {f["check"]: f for f in json.loads(capsys.readouterr().out)["findings"]}[
        "CodeBuild Linux/2XLarge concurrent builds"
    ]
    assert build["status"] == "missing"
    assert f"CodeBuild offers no BUILD_GENERAL1_2XLARGE in {REGION}" in build["detail"]
    assert "-c gpu.image_build.compute_type=BUILD_GENERAL1_XLARGE" in build["fix"]
    assert "-c gpu.image_uri=<repo>@sha256:<digest>" in build["fix"]


def _live(aws, count: int, value: float, metric: str = "Invocations") -> None:
    aws["sagemaker"].add_response(
        "describe_endpoint",
        {
            "EndpointName": "decider-cpu",
            "EndpointArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint/decider-cpu",
            "EndpointConfigName": "DeciderConfig-1",
            "EndpointStatus": "InService",
            "CreationTime": NOW,
            "LastModifiedTime": NOW,
            "ProductionVariants": [{"VariantName": "AllTraffic", "CurrentInstanceCount": count}],
        },
        {"EndpointName": "decider-cpu"},
    )
    statistic = "Sum" if metric == "Invocations" else "Average"
    aws["cloudwatch"].add_response(
        "get_metric_statistics",
        {"Datapoints": [{statistic: value, "Timestamp": NOW}] * 15},
        {
            "Namespace": "AWS/SageMaker",
            "MetricName": metric,
            "Dimensions": [
                {"Name": "EndpointName", "Value": "decider-cpu"},
                {"Name": "VariantName", "Value": "AllTraffic"},
            ],
            "StartTime": NOW - checks.LOAD_WINDOW,
            "EndTime": NOW,
            "Period": 60,
            "Statistics": [statistic],
        },
    )


@pytest.mark.parametrize(
    ("count", "per_minute", "status"),
    [(2, 12.0, "warning"), (2, 4.0, "ok"), (4, 40.0, "ok")],  # target 10 a minute per instance
)
def test_a_deploy_at_a_low_instance_count_under_load_warns(aws, count, per_minute, status):
    config = load_config({**cdk_json_context(), "cpu.scaling_metric": "invocations"})
    target = checks.Target(config, (config.cpu,), REGION, ACCOUNT)
    _live(aws, count, per_minute)
    [finding] = checks.frozen_scaling(aws["clients"]["sagemaker"], aws["clients"]["cloudwatch"], target, NOW)
    assert finding.status == status and not finding.blocking
    assert f"{count} of at most 4 instances" in finding.detail
    if status == "warning":
        assert "autoscaling cannot add instances during the update" in finding.detail
        assert "--min-capacity 4" in finding.fix and "--min-capacity 2 after the deploy" in finding.fix
    aws["clients"]["sts"].get_caller_identity()  # (the fixture's queued answer)


@pytest.mark.parametrize(("concurrency", "status"), [(2.0, "warning"), (0.5, "ok")])
def test_under_concurrency_scaling_the_load_is_the_concurrency_per_instance(aws, concurrency, status):
    """The default target tracking follows ConcurrentRequestsPerModel (target 2.3), not invocations:
    2 requests in each container at once is load, whatever the invocations a minute."""
    config = load_config(cdk_json_context())
    assert config.cpu.scaling_metric == "concurrency"
    target = checks.Target(config, (config.cpu,), REGION, ACCOUNT)
    _live(aws, 2, concurrency, metric="ConcurrentRequestsPerModel")
    [finding] = checks.frozen_scaling(aws["clients"]["sagemaker"], aws["clients"]["cloudwatch"], target, NOW)
    assert finding.status == status
    assert f"{concurrency:.1f} concurrent requests per instance" in finding.detail
    assert "(target 2.3)" in finding.detail
    aws["clients"]["sts"].get_caller_identity()  # (the fixture's queued answer)


@pytest.mark.parametrize(("value", "status"), [(0, "missing"), (1, "ok")])
def test_the_transform_job_quota_is_checked_for_batch_transform(aws, value, status):
    """Often 0 on new accounts: every decide-batch job would fail with ResourceLimitExceeded."""
    config = load_config({**cdk_json_context(), "cpu.batch_transform": "true"})
    target = checks.Target(config, (config.cpu, config.gpu), REGION, ACCOUNT)
    quotas(aws, "sagemaker", {"ml.c7i.8xlarge for transform job usage": value})
    [finding] = checks.transform_quotas(aws["clients"]["service-quotas"], target)  # the GPU one is off
    assert (finding.check, finding.status) == ("ml.c7i.8xlarge for transform job usage", status)
    if status == "missing":
        assert "ResourceLimitExceeded" in finding.detail
        assert "request-service-quota-increase --service-code sagemaker" in finding.fix
        assert "--desired-value 1" in finding.fix
    assert (
        checks.transform_quotas(
            aws["clients"]["service-quotas"], checks.Target(config, (config.gpu,), REGION, ACCOUNT)
        )
        == []
    )
    aws["clients"]["sts"].get_caller_identity()  # (the fixture's queued answer)


def _live_config(aws, *, asynchronous: bool, instance_type: str, registered: bool) -> None:
    config: dict[str, Any] = {
        "EndpointConfigName": "DeciderConfig-1",
        "EndpointConfigArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:endpoint-config/deciderconfig-1",
        "CreationTime": NOW,
        "ProductionVariants": [
            {"VariantName": "AllTraffic", "ModelName": "m", "InstanceType": instance_type}
        ],
    }
    if asynchronous:
        config["AsyncInferenceConfig"] = {"OutputConfig": {"S3OutputPath": "s3://b/async/decider-cpu/output"}}
    aws["sagemaker"].add_response(
        "describe_endpoint_config", config, {"EndpointConfigName": "DeciderConfig-1"}
    )
    target = {
        "ServiceNamespace": "sagemaker",
        "ResourceId": "endpoint/decider-cpu/variant/AllTraffic",
        "ScalableDimension": "sagemaker:variant:DesiredInstanceCount",
        "MinCapacity": 2,
        "MaxCapacity": 4,
        "RoleARN": f"arn:aws:iam::{ACCOUNT}:role/aas",
        "CreationTime": NOW,
    }
    aws["application-autoscaling"].add_response(
        "describe_scalable_targets",
        {"ScalableTargets": [target] if registered else []},
        {
            "ServiceNamespace": "sagemaker",
            "ResourceIds": ["endpoint/decider-cpu/variant/AllTraffic"],
            "ScalableDimension": "sagemaker:variant:DesiredInstanceCount",
        },
    )


@pytest.mark.parametrize(
    ("asynchronous", "instance_type", "registered", "refusal"),
    [
        (True, "ml.c7i.8xlarge", True, "invocation async -> realtime under the same endpoint name"),
        (False, "ml.c7i.4xlarge", True, "while the variant is an Application Auto Scaling target"),
        (False, "ml.c7i.4xlarge", False, None),  # not registered: the type may change
        (False, "ml.c7i.8xlarge", True, None),
    ],
)
def test_an_update_sagemaker_refuses_blocks_before_ci_builds(
    aws, asynchronous, instance_type, registered, refusal
):
    """The live endpoint against this config, by the update guard's rules."""
    config = load_config(cdk_json_context())
    target = checks.Target(config, (config.cpu,), REGION, ACCOUNT)
    _live(aws, 4, 0.1, metric="ConcurrentRequestsPerModel")
    _live_config(aws, asynchronous=asynchronous, instance_type=instance_type, registered=registered)
    findings = checks.frozen_scaling(
        aws["clients"]["sagemaker"],
        aws["clients"]["cloudwatch"],
        target,
        NOW,
        autoscaling=aws["clients"]["application-autoscaling"],
    )
    rules = next(f for f in findings if f.check == "update of decider-cpu")
    if refusal is None:
        assert rules.status == "ok"
    else:
        assert rules.status == "missing" and rules.blocking and refusal in rules.detail
    aws["clients"]["sts"].get_caller_identity()  # (the fixture's queued answer)
