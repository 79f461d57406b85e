"""Template assertions: every resource the app creates, and the properties that matter."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from aws_cdk.assertions import Match, Template
from decider.settings import Settings
from stack_helpers import STACKS, only, resources

from stacks.config import container_environment

pytestmark = pytest.mark.cdk

EXPECTED_RESOURCES = {
    "ImageStack": {
        "AWS::ECR::Repository": 1,
        "AWS::S3::Bucket": 2,
        "AWS::S3::BucketPolicy": 2,
        "AWS::KMS::Key": 1,
        "AWS::CodeBuild::Project": 2,
        "AWS::Lambda::Function": 5,  # our onEvent/isComplete + the provider framework's three
        "AWS::StepFunctions::StateMachine": 1,
        "AWS::IAM::Role": 8,
        "AWS::IAM::Policy": 8,
        "AWS::Logs::LogGroup": 6,  # two builds, two handlers, provider, waiter
    },
    "CpuStack": {
        "Custom::ImageBuild": 1,
        "Custom::ModelStaging": 1,
        "AWS::IAM::Role": 1,
        "AWS::IAM::Policy": 1,
        "AWS::KMS::Key": 1,
        "AWS::Logs::LogGroup": 1,
        "AWS::SageMaker::Model": 1,
        "AWS::SageMaker::EndpointConfig": 1,
        "AWS::SageMaker::Endpoint": 1,
        "AWS::ApplicationAutoScaling::ScalableTarget": 1,
        "AWS::ApplicationAutoScaling::ScalingPolicy": 1,
        "AWS::CloudWatch::Alarm": 3,
        "AWS::CloudWatch::Dashboard": 1,
    },
}
# The GPU stack is the CPU stack minus the volume key (NVMe instance storage).
EXPECTED_RESOURCES["GpuStack"] = {
    k: v for k, v in EXPECTED_RESOURCES["CpuStack"].items() if k != "AWS::KMS::Key"
}


@pytest.mark.parametrize("stack", STACKS)
def test_each_stack_has_exactly_the_expected_resources(synth, stack):
    counts = Counter(r["Type"] for r in synth.templates[stack]["Resources"].values())
    assert dict(counts) == EXPECTED_RESOURCES[stack]


@pytest.mark.parametrize("stack", STACKS)
def test_templates_are_environment_agnostic(synth, stack):
    text = json.dumps(synth.templates[stack])
    assert not re.search(r"\b\d{12}\b", text), "an account id is hard-coded"
    assert "latest" not in re.findall(r'"[^"]*:latest"', text)


# --- ImageStack -----------------------------------------------------------------------------------


def test_repository_is_immutable_scanned_encrypted_with_lifecycle(synth):
    repo = only(synth.templates["ImageStack"], "AWS::ECR::Repository")
    props = repo["Properties"]
    assert props["ImageTagMutability"] == "IMMUTABLE"
    assert props["ImageScanningConfiguration"] == {"ScanOnPush": True}
    assert props["EncryptionConfiguration"] == {"EncryptionType": "AES256"}
    assert repo["DeletionPolicy"] == "Retain"
    rules = json.loads(props["LifecyclePolicy"]["LifecyclePolicyText"])["rules"]
    by_priority = sorted(rules, key=lambda r: r["rulePriority"])
    assert by_priority[-1]["selection"]["tagStatus"] == "any", (
        "the ANY rule must have the highest priority number"
    )
    assert {r["selection"]["tagStatus"] for r in rules} == {"untagged", "tagged", "any"}
    prefixes = {p for r in rules for p in r["selection"].get("tagPrefixList", [])}
    assert prefixes == {"cpu-", "cuda-"}


def test_artifacts_bucket_is_encrypted_private_versioned_logged(synth):
    template = Template.from_json(synth.templates["ImageStack"])
    template.has_resource_properties(
        "AWS::S3::Bucket",
        {
            "BucketEncryption": {
                "ServerSideEncryptionConfiguration": [
                    {"ServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}
                ]
            },
            "PublicAccessBlockConfiguration": {
                "BlockPublicAcls": True,
                "BlockPublicPolicy": True,
                "IgnorePublicAcls": True,
                "RestrictPublicBuckets": True,
            },
            "VersioningConfiguration": {"Status": "Enabled"},
            "LoggingConfiguration": {
                "DestinationBucketName": Match.any_value(),
                "LogFilePrefix": "artifacts/",
            },
        },
    )
    for policy in resources(synth.templates["ImageStack"], "AWS::S3::BucketPolicy").values():
        statements = policy["Properties"]["PolicyDocument"]["Statement"]
        assert any(
            s["Effect"] == "Deny" and s["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
            for s in statements
        ), "TLS-only policy missing"


def _projects(synth):
    projects = resources(synth.templates["ImageStack"], "AWS::CodeBuild::Project")
    image = next(p for p in projects.values() if "docker build" in p["Properties"]["Source"]["BuildSpec"])
    model = next(
        p for p in projects.values() if "sha256sum --check" in p["Properties"]["Source"]["BuildSpec"]
    )
    return image["Properties"], model["Properties"]


def test_image_build_project_is_privileged_large_inline_buildspec(synth):
    image, _ = _projects(synth)
    assert image["Environment"]["PrivilegedMode"] is True
    assert image["Environment"]["ComputeType"] == "BUILD_GENERAL1_2XLARGE"
    assert image["Environment"]["Image"].startswith("aws/codebuild/standard:7.0")
    assert image["TimeoutInMinutes"] == 110 and image["QueuedTimeoutInMinutes"] == 60
    assert image["EncryptionKey"]
    assert image["LogsConfig"]["CloudWatchLogs"]["Status"] == "ENABLED"
    spec = image["Source"]["BuildSpec"]
    assert image["Source"]["Type"] == "NO_SOURCE"  # source comes with each build (S3 asset)
    assert '--build-arg VARIANT="$VARIANT"' in spec
    assert "IMAGE_DIGEST" in spec and "latest" not in spec


def test_model_staging_project_verifies_size_and_sha256(synth):
    _, model = _projects(synth)
    spec = model["Source"]["BuildSpec"]
    assert model["Environment"].get("PrivilegedMode") in (None, False)
    assert "MODEL_SIZE_BYTES" in spec and "sha256sum --check --strict" in spec
    assert "huggingface.co/${MODEL_REPOSITORY}/resolve/${MODEL_REVISION}/${MODEL_FILE}" in spec


def _policy_actions(template, path_part: str) -> set[str]:
    (policy,) = [
        p
        for p in resources(template, "AWS::IAM::Policy").values()
        if path_part in p["Metadata"]["aws:cdk:path"]
    ]
    return {a for s in policy["Properties"]["PolicyDocument"]["Statement"] for a in _listify(s["Action"])}


def test_build_roles_allow_the_calls_their_code_makes_and_no_more(synth):
    """image.yml reads the digest with describe-images; on_event starts builds, is_complete polls them."""
    template = synth.templates["ImageStack"]
    assert "ecr:DescribeImages" in _policy_actions(template, "/Builds/ImageBuild/Role/")
    build_calls = ("codebuild:", "ecr:")
    on_event = _policy_actions(template, "/BuildRunner/OnEvent/")
    is_complete = _policy_actions(template, "/BuildRunner/IsComplete/")
    assert {a for a in on_event if a.startswith(build_calls)} == {
        "codebuild:StartBuild",
        "ecr:DescribeImages",
    }
    assert {a for a in is_complete if a.startswith(build_calls)} == {
        "codebuild:BatchGetBuilds",
        "codebuild:StopBuild",
    }


def test_build_handlers_and_waiter_are_logged_and_bounded(synth):
    template = synth.templates["ImageStack"]
    ours = [
        f["Properties"]
        for f in resources(template, "AWS::Lambda::Function").values()
        if f["Properties"].get("Handler", "").startswith("codebuild_job.")
    ]
    assert sorted(f["Handler"] for f in ours) == ["codebuild_job.is_complete", "codebuild_job.on_event"]
    assert {f["Runtime"] for f in ours} == {"python3.14"}
    machine = only(template, "AWS::StepFunctions::StateMachine")["Properties"]
    assert machine["LoggingConfiguration"]["Level"] == "ALL"
    groups = resources(template, "AWS::Logs::LogGroup").values()
    assert {g["Properties"]["RetentionInDays"] for g in groups} == {30}


# --- endpoint stacks ------------------------------------------------------------------------------


@pytest.mark.parametrize(("stack", "variant"), [("CpuStack", "cpu"), ("GpuStack", "gpu")])
def test_image_build_request_uses_the_source_hash_never_latest(synth, stack, variant):
    source_hash = synth.decider.image.source_hash
    props = only(synth.templates[stack], "Custom::ImageBuild")["Properties"]
    build_variant = {"cpu": "cpu", "gpu": "cuda"}[variant]
    assert props["ImageTag"] == f"{build_variant}-{source_hash}"
    assert props["Variant"] == build_variant
    assert props["SourceKey"] == f"{source_hash}.zip"
    assert props["ComputeType"] == {"cpu": "BUILD_GENERAL1_LARGE", "gpu": "BUILD_GENERAL1_2XLARGE"}[variant]


@pytest.mark.parametrize("stack", ["CpuStack", "GpuStack"])
def test_model_staging_request_pins_the_production_model(synth, stack):
    model = synth.decider.config.model
    props = only(synth.templates[stack], "Custom::ModelStaging")["Properties"]
    assert props["Repository"] == "bartowski/Qwen_Qwen3.5-4B-GGUF"
    assert props["Revision"] == model.revision
    assert props["File"] == "Qwen_Qwen3.5-4B-Q4_K_M.gguf"
    assert props["Sha256"] == model.sha256 and len(props["Sha256"]) == 64
    assert props["SizeBytes"] == "3013027808"
    assert props["Prefix"] == f"models/bartowski/Qwen_Qwen3.5-4B-GGUF/{model.revision}/{model.sha256[:12]}/"


@pytest.mark.parametrize(("stack", "variant"), [("CpuStack", "cpu"), ("GpuStack", "gpu")])
def test_model_serves_the_image_by_digest_from_an_uncompressed_prefix(synth, stack, variant):
    template = synth.templates[stack]
    build_id = next(iter(resources(template, "Custom::ImageBuild")))
    staging_id = next(iter(resources(template, "Custom::ModelStaging")))
    model = only(template, "AWS::SageMaker::Model")
    props = model["Properties"]
    assert "ModelName" not in props
    assert props["EnableNetworkIsolation"] is True
    container = props["PrimaryContainer"]
    assert container["Image"] == {"Fn::GetAtt": [build_id, "ImageUri"]}
    assert container["ModelDataSource"] == {
        "S3DataSource": {
            "S3Uri": {"Fn::GetAtt": [staging_id, "ModelS3Uri"]},
            "S3DataType": "S3Prefix",
            "CompressionType": "None",
        }
    }
    config = synth.decider.config
    assert container["Environment"] == container_environment(config.variant(variant), config.model)
    gpu_layers = container["Environment"][Settings.env_name("n_gpu_layers")]
    assert gpu_layers == ("-1" if variant == "gpu" else "0")
    assert any(d.endswith("DefaultPolicy") or "DefaultPolicy" in d for d in model["DependsOn"])


def test_cpu_endpoint_config_is_kms_encrypted_with_explicit_timeouts(synth):
    template = synth.templates["CpuStack"]
    config = only(template, "AWS::SageMaker::EndpointConfig")["Properties"]
    key_id = next(iter(resources(template, "AWS::KMS::Key")))
    assert "EndpointConfigName" not in config
    assert config["KmsKeyId"] == {"Fn::GetAtt": [key_id, "Arn"]}
    (variant,) = config["ProductionVariants"]
    assert variant["InstanceType"] == "ml.c7i.xlarge"
    assert variant["InitialInstanceCount"] == 2
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 900
    assert variant["ModelDataDownloadTimeoutInSeconds"] == 900
    assert "InferenceAmiVersion" not in variant
    assert "DataCaptureConfig" not in config
    assert only(template, "AWS::KMS::Key")["Properties"]["EnableKeyRotation"] is True


def test_gpu_endpoint_config_sets_the_driver_ami_and_no_kms(synth):
    config = only(synth.templates["GpuStack"], "AWS::SageMaker::EndpointConfig")["Properties"]
    assert "KmsKeyId" not in config and "EndpointConfigName" not in config
    (variant,) = config["ProductionVariants"]
    assert variant["InstanceType"] == "ml.g6.xlarge"
    assert variant["InferenceAmiVersion"] == "al2-ami-sagemaker-inference-gpu-3-1"
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 900


@pytest.mark.parametrize(("stack", "name"), [("CpuStack", "decider-cpu"), ("GpuStack", "decider-gpu")])
def test_endpoint_rolls_out_blue_green_canary_with_alarm_rollback(synth, stack, name):
    template = synth.templates[stack]
    endpoint = only(template, "AWS::SageMaker::Endpoint")
    props = endpoint["Properties"]
    assert props["EndpointName"] == name
    config_id = next(iter(resources(template, "AWS::SageMaker::EndpointConfig")))
    assert props["EndpointConfigName"] == {"Fn::GetAtt": [config_id, "EndpointConfigName"]}
    policy = props["DeploymentConfig"]["BlueGreenUpdatePolicy"]
    assert policy["TrafficRoutingConfiguration"] == {
        "Type": "CANARY",
        "CanarySize": {"Type": "INSTANCE_COUNT", "Value": 1},
        "WaitIntervalInSeconds": 600,
    }
    assert policy["TerminationWaitInSeconds"] == 300
    assert policy["MaximumExecutionTimeoutInSeconds"] == 7200
    alarms = resources(template, "AWS::CloudWatch::Alarm")
    rollback = [
        a["AlarmName"]["Ref"] for a in props["DeploymentConfig"]["AutoRollbackConfiguration"]["Alarms"]
    ]
    metrics = sorted(alarms[alarm_id]["Properties"]["MetricName"] for alarm_id in rollback)
    assert metrics == ["Invocation5XXErrors", "ModelLatency"]


@pytest.mark.parametrize(("stack", "name"), [("CpuStack", "decider-cpu"), ("GpuStack", "decider-gpu")])
def test_alarms_watch_this_endpoint_variant(synth, stack, name):
    alarms = {
        a["Properties"]["MetricName"]: a["Properties"]
        for a in resources(synth.templates[stack], "AWS::CloudWatch::Alarm").values()
    }
    assert set(alarms) == {"Invocation5XXErrors", "ModelLatency", "MemoryUtilization"}
    for alarm in alarms.values():
        assert {"Name": "EndpointName", "Value": name} in alarm["Dimensions"]
        assert {"Name": "VariantName", "Value": "AllTraffic"} in alarm["Dimensions"]
        assert alarm["TreatMissingData"] == "notBreaching"
    assert alarms["ModelLatency"]["ExtendedStatistic"] == "p90"
    assert alarms["ModelLatency"]["Threshold"] == 20_000_000  # 20 s in microseconds
    assert alarms["Invocation5XXErrors"]["Threshold"] == 1


@pytest.mark.parametrize(
    ("stack", "name", "low", "high"), [("CpuStack", "decider-cpu", 2, 4), ("GpuStack", "decider-gpu", 2, 3)]
)
def test_autoscaling_tracks_invocations_within_configured_bounds(synth, stack, name, low, high):
    template = synth.templates[stack]
    endpoint_id = next(iter(resources(template, "AWS::SageMaker::Endpoint")))
    target_id, target = next(iter(resources(template, "AWS::ApplicationAutoScaling::ScalableTarget").items()))
    props = target["Properties"]
    assert props["ResourceId"] == f"endpoint/{name}/variant/AllTraffic"
    assert props["ScalableDimension"] == "sagemaker:variant:DesiredInstanceCount"
    assert (props["MinCapacity"], props["MaxCapacity"]) == (low, high)
    assert endpoint_id in target["DependsOn"]
    assert "RoleARN" not in props  # the service-linked role; no extra role to manage
    policy = only(template, "AWS::ApplicationAutoScaling::ScalingPolicy")["Properties"]
    assert policy["ScalingTargetId"] == {"Ref": target_id}
    tracking = policy["TargetTrackingScalingPolicyConfiguration"]
    assert tracking["PredefinedMetricSpecification"] == {
        "PredefinedMetricType": "SageMakerVariantInvocationsPerInstance"
    }
    assert tracking["TargetValue"] == 60


@pytest.mark.parametrize(("stack", "name"), [("CpuStack", "decider-cpu"), ("GpuStack", "decider-gpu")])
def test_execution_role_is_least_privilege(synth, stack, name):
    template = synth.templates[stack]
    role = only(template, "AWS::IAM::Role")["Properties"]
    (trust,) = role["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Principal"] == {"Service": "sagemaker.amazonaws.com"}
    assert "aws:SourceAccount" in trust["Condition"]["StringEquals"]
    assert "ManagedPolicyArns" not in role
    statements = {
        s["Sid"]: s for s in only(template, "AWS::IAM::Policy")["Properties"]["PolicyDocument"]["Statement"]
    }
    assert all(not a.endswith("*") for s in statements.values() for a in _listify(s["Action"]))
    assert set(_listify(statements["PullImage"]["Action"])) == {
        "ecr:BatchGetImage",
        "ecr:GetDownloadUrlForLayer",
        "ecr:BatchCheckLayerAvailability",
    }
    assert "*" not in json.dumps(statements["PullImage"]["Resource"])
    read_model = json.dumps(statements["ReadModel"]["Resource"])
    assert read_model.endswith('Qwen_Qwen3.5-4B-Q4_K_M.gguf"]]}'), "reads exactly the staged GGUF"
    assert statements["ListModel"]["Condition"]["StringLike"]["s3:prefix"][0].startswith("models/bartowski/")
    assert f"/aws/sagemaker/Endpoints/{name}" in json.dumps(statements["WriteLogs"]["Resource"])
    assert statements["WriteMetrics"]["Condition"]["StringLike"]["cloudwatch:namespace"]
    if stack == "CpuStack":
        assert "kms:CreateGrant" in statements["UseVolumeKey"]["Action"]
    else:
        assert "UseVolumeKey" not in statements


def _listify(value):
    return value if isinstance(value, list) else [value]


@pytest.mark.parametrize(("stack", "name"), [("CpuStack", "decider-cpu"), ("GpuStack", "decider-gpu")])
def test_outputs_name_the_endpoint_role_and_invoke_command(synth, stack, name):
    outputs = synth.templates[stack]["Outputs"]
    assert {
        "EndpointName",
        "ExecutionRoleArn",
        "InvokeCommand",
        "ImageUri",
        "ModelS3Uri",
        "DashboardUrl",
    } <= set(outputs)
    parts = outputs["InvokeCommand"]["Value"]["Fn::Join"][1]
    command = "".join(p if isinstance(p, str) else "<region>" for p in parts)
    assert command.startswith("aws sagemaker-runtime invoke-endpoint --region <region> ")
    assert f"--endpoint-name {name} " in command
    assert "--custom-attributes route=/v1/systemone " in command
    assert "--content-type application/json" in command
    body = json.loads(command.split("--body '", 1)[1].split("' ", 1)[0])
    assert set(body) == {"state", "questions"}


def test_dashboard_covers_traffic_errors_latency_and_gpu(synth):
    cpu = json.dumps(
        only(synth.templates["CpuStack"], "AWS::CloudWatch::Dashboard")["Properties"]["DashboardBody"]
    )
    gpu = json.dumps(
        only(synth.templates["GpuStack"], "AWS::CloudWatch::Dashboard")["Properties"]["DashboardBody"]
    )
    for metric in (
        "Invocations",
        "Invocation5XXErrors",
        "ModelLatency",
        "CPUUtilization",
        "MemoryUtilization",
    ):
        assert metric in cpu and metric in gpu
    assert "GPUUtilization" in gpu and "GPUUtilization" not in cpu


# --- the CI path: prebuilt image and model ---------------------------------------------------------


def test_prebuilt_image_and_model_skip_the_deploy_time_builds(synth_prebuilt):
    """GPU: prebuilt image and model (the CI path). CPU: prebuilt model, image still built (mirror)."""
    for stack in ("CpuStack", "GpuStack"):
        template = synth_prebuilt.templates[stack]
        assert not resources(template, "Custom::ModelStaging")
        container = only(template, "AWS::SageMaker::Model")["Properties"]["PrimaryContainer"]
        assert container["ModelDataSource"]["S3DataSource"]["S3Uri"] == "s3://ci-models/qwen/"
        assert Settings.env_name("model_sha256") not in container["Environment"]
        statements = only(template, "AWS::IAM::Policy")["Properties"]["PolicyDocument"]["Statement"]
        read = next(s for s in statements if s.get("Sid") == "ReadModel")
        assert json.dumps(read["Resource"]).endswith(':s3:::ci-models/qwen/*"]]}')
    gpu = synth_prebuilt.templates["GpuStack"]
    assert not resources(gpu, "Custom::ImageBuild")
    container = only(gpu, "AWS::SageMaker::Model")["Properties"]["PrimaryContainer"]
    assert container["Image"] == "123456789012.dkr.ecr.eu-west-1.amazonaws.com/decider@sha256:" + "a" * 64
    statements = only(gpu, "AWS::IAM::Policy")["Properties"]["PolicyDocument"]["Statement"]
    pull = json.dumps(next(s for s in statements if s.get("Sid") == "PullImage")["Resource"])
    assert "eu-west-1" in pull and "123456789012:repository/decider" in pull


def test_build_args_are_passed_and_change_the_image_tag(synth, synth_prebuilt):
    build = only(synth_prebuilt.templates["CpuStack"], "Custom::ImageBuild")["Properties"]
    default = only(synth.templates["CpuStack"], "Custom::ImageBuild")["Properties"]
    assert build["BuildArgs"] == "PYTHON_IMAGE=public.ecr.aws/docker/library/python:3.11.14-slim-bookworm"
    assert default["BuildArgs"] == ""
    assert build["ImageTag"].startswith("cpu-") and build["ImageTag"] != default["ImageTag"]
    assert len(build["ImageTag"]) == len(default["ImageTag"])


def test_data_capture_and_linear_routing_when_configured(synth_prebuilt):
    cpu_config = only(synth_prebuilt.templates["CpuStack"], "AWS::SageMaker::EndpointConfig")["Properties"]
    capture = cpu_config["DataCaptureConfig"]
    assert capture["EnableCapture"] is True and capture["InitialSamplingPercentage"] == 25
    assert [o["CaptureMode"] for o in capture["CaptureOptions"]] == ["Input", "Output"]
    assert capture["KmsKeyId"]
    statements = only(synth_prebuilt.templates["CpuStack"], "AWS::IAM::Policy")["Properties"][
        "PolicyDocument"
    ]
    assert any(s.get("Sid") == "WriteDataCapture" for s in statements["Statement"])
    gpu = only(synth_prebuilt.templates["GpuStack"], "AWS::SageMaker::Endpoint")["Properties"]
    routing = gpu["DeploymentConfig"]["BlueGreenUpdatePolicy"]["TrafficRoutingConfiguration"]
    assert routing["Type"] == "LINEAR" and routing["LinearStepSize"] == {"Type": "INSTANCE_COUNT", "Value": 1}
    gpu_config = only(synth_prebuilt.templates["GpuStack"], "AWS::SageMaker::EndpointConfig")["Properties"]
    assert gpu_config["ProductionVariants"][0]["InstanceType"] == "ml.g6.2xlarge"
    # autoscaling off (the first step of an instance-type change): no scalable target at all
    assert not resources(synth_prebuilt.templates["GpuStack"], "AWS::ApplicationAutoScaling::ScalableTarget")
    assert resources(synth_prebuilt.templates["CpuStack"], "AWS::ApplicationAutoScaling::ScalableTarget")
