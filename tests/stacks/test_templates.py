"""Template assertions: every resource the app creates, and the properties that matter."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import yaml
from aws_cdk.assertions import Match, Template
from stack_helpers import STACKS, only, resources

from decider.settings import Settings
from decider_stacks import config as app_config
from decider_stacks.config import container_environment
from decider_stacks.handlers import build_jobs
from decider_stacks.image_stack import image_tag

pytestmark = pytest.mark.cdk

EXPECTED_RESOURCES = {
    "ImageStack": {
        "AWS::ECR::Repository": 1,
        "AWS::S3::Bucket": 2,
        "AWS::S3::BucketPolicy": 2,
        "AWS::KMS::Key": 1,
        "AWS::CodeBuild::Project": 2,
        "AWS::Lambda::Function": 6,  # onEvent/isComplete, the build watcher, the provider framework's three
        "AWS::Lambda::Permission": 1,  # EventBridge → build watcher
        "AWS::Events::Rule": 1,
        "AWS::StepFunctions::StateMachine": 1,
        "AWS::IAM::Role": 9,
        "AWS::IAM::Policy": 8,
        "AWS::Logs::LogGroup": 7,  # two builds, three handlers, provider, waiter
    },
    "CpuStack": {
        "Custom::ModelStaging": 1,
        "Custom::ImageBuild": 1,
        "AWS::CloudFormation::WaitConditionHandle": 1,
        "AWS::CloudFormation::WaitCondition": 1,
        "Custom::DeployedImage": 1,
        "Custom::PostDeployCheck": 1,
        "Custom::BakeLoad": 1,
        "Custom::UpdateGuard": 1,
        "AWS::SSM::Parameter": 1,
        "AWS::IAM::Role": 1,
        "AWS::IAM::Policy": 1,
        "AWS::KMS::Key": 3,  # the ML volume, the alarm topic and the endpoint's log group
        "AWS::SNS::Topic": 1,
        "AWS::SNS::TopicPolicy": 1,
        "AWS::Logs::LogGroup": 1,
        "AWS::SageMaker::Model": 1,
        "AWS::SageMaker::EndpointConfig": 1,
        "AWS::SageMaker::Endpoint": 1,
        "AWS::ApplicationAutoScaling::ScalableTarget": 1,
        "AWS::ApplicationAutoScaling::ScalingPolicy": 1,
        "AWS::CloudWatch::Alarm": 8,
        "AWS::CloudWatch::Dashboard": 1,
    },
}
# The GPU stack is the CPU stack minus the volume key (NVMe instance storage).
EXPECTED_RESOURCES["GpuStack"] = {**EXPECTED_RESOURCES["CpuStack"], "AWS::KMS::Key": 2}


def _listify(value):
    return value if isinstance(value, list) else [value]


def _logical_id(template, cfn_type):
    (logical_id,) = resources(template, cfn_type)
    return logical_id


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


def test_image_stack_has_termination_protection_and_endpoint_stacks_do_not(synth):
    """Fn::GetStackOutput is a weak reference: nothing else would stop ImageStack's deletion."""
    manifest = json.loads((synth.outdir / "manifest.json").read_text())["artifacts"]
    assert manifest["ImageStack"]["properties"]["terminationProtection"] is True
    assert not manifest["CpuStack"]["properties"].get("terminationProtection")
    assert not manifest["GpuStack"]["properties"].get("terminationProtection")


def test_repository_is_immutable_scanned_encrypted_and_never_expires_deployed_images(synth):
    repo = only(synth.templates["ImageStack"], "AWS::ECR::Repository")
    props = repo["Properties"]
    assert props["ImageTagMutability"] == "IMMUTABLE"
    assert props["ImageScanningConfiguration"] == {"ScanOnPush": True}
    assert props["EncryptionConfiguration"] == {"EncryptionType": "AES256"}
    assert repo["DeletionPolicy"] == "Retain"
    rules = sorted(
        json.loads(props["LifecyclePolicy"]["LifecyclePolicyText"])["rules"], key=lambda r: r["rulePriority"]
    )
    # keep-<digest> first: an image a higher-priority rule selects cannot be expired by a lower one
    first = rules[0]["selection"]
    assert first == {
        "tagStatus": "tagged",
        "tagPrefixList": ["keep-"],
        "countType": "imageCountMoreThan",
        "countNumber": 10_000,
    }
    assert rules[-1]["selection"]["tagStatus"] == "any", "the ANY rule must have the highest priority number"
    assert {r["selection"]["tagStatus"] for r in rules} == {"untagged", "tagged", "any"}
    prefixes = {p for r in rules for p in r["selection"].get("tagPrefixList", [])}
    assert prefixes == {"keep-", "cpu-", "cuda-"}


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


def synthesized_jobs(synth) -> dict:
    """ImageStack's BUILD_JOBS as the functions will read it (references shown as `<token>`)."""
    (on_event,) = [
        f["Properties"]
        for f in resources(synth.templates["ImageStack"], "AWS::Lambda::Function").values()
        if f["Properties"]["Handler"] == "codebuild_job.on_event"
    ]
    value = on_event["Environment"]["Variables"][build_jobs.ENV]
    parts = value["Fn::Join"][1] if isinstance(value, dict) else [value]
    return json.loads("".join(p if isinstance(p, str) else "<token>" for p in parts))


def test_the_provider_builds_exactly_the_tags_the_endpoint_stacks_request(synth, synth_prebuilt):
    """What each endpoint stack asks for is what ImageStack's provider may build: the same tree
    synthesizes both, so a request for any other tag is refused (handlers/build_jobs.py)."""
    for app in (synth, synth_prebuilt):
        requested = {
            only(app.templates[name], "Custom::ImageBuild")["Properties"]["ImageTag"]
            for name in ("CpuStack", "GpuStack")
            if resources(app.templates[name], "Custom::ImageBuild")
        }
        assert requested and requested <= set(synthesized_jobs(app)["Image"]["Tags"])
    assert len(json.dumps(on_event_environment(synth))) < 3000  # Lambda: 4 KB of variables in all


def on_event_environment(synth) -> dict:
    (on_event,) = [
        f["Properties"]
        for f in resources(synth.templates["ImageStack"], "AWS::Lambda::Function").values()
        if f["Properties"]["Handler"] == "codebuild_job.on_event"
    ]
    return on_event["Environment"]["Variables"]


def _projects(synth):
    projects = resources(synth.templates["ImageStack"], "AWS::CodeBuild::Project")
    image = next(p for p in projects.values() if "docker build" in p["Properties"]["Source"]["BuildSpec"])
    model = next(
        p for p in projects.values() if "sha256sum --check" in p["Properties"]["Source"]["BuildSpec"]
    )
    return image["Properties"], model["Properties"]


def test_image_project_never_combines_the_local_cache_with_2xlarge(synth):
    """CodeBuild does not support local caching on BUILD_GENERAL1_2XLARGE: the project default is
    LARGE with the Docker layer cache; 2XLARGE builds switch it off at StartBuild (handler test)."""
    image, _ = _projects(synth)
    assert image["Cache"] == {"Type": "LOCAL", "Modes": ["LOCAL_DOCKER_LAYER_CACHE"]}
    assert image["Environment"]["ComputeType"] == "BUILD_GENERAL1_LARGE"
    assert image["Environment"]["PrivilegedMode"] is True
    assert image["Environment"]["Image"].startswith("aws/codebuild/standard:7.0")
    assert image["EncryptionKey"]
    assert image["LogsConfig"]["CloudWatchLogs"]["Status"] == "ENABLED"
    spec = yaml.safe_load(image["Source"]["BuildSpec"])
    # the project's own source, fixed at synth: the container/ asset (a build request passes none)
    assert image["Source"]["Type"] == "S3"
    source_hash = synth.decider.image.source_hash
    assert f"/{source_hash}.zip" in json.dumps(image["Source"]["Location"]), image["Source"]
    assert spec["env"]["variables"]["DOCKER_BUILDKIT"] == "1"
    text = image["Source"]["BuildSpec"]
    assert '--build-arg VARIANT="$VARIANT"' in text and "WAIT_HANDLE_URL" in text
    assert "IMAGE_DIGEST" in text and "latest" not in text


def test_model_staging_project_verifies_size_and_sha256_within_its_budget(synth):
    _, model = _projects(synth)
    spec = model["Source"]["BuildSpec"]
    assert model["Environment"].get("PrivilegedMode") in (None, False)
    assert "MODEL_SIZE_BYTES" in spec and "sha256sum --check --strict" in spec
    assert "huggingface.co/${MODEL_REPOSITORY}/resolve/${MODEL_REVISION}/${MODEL_FILE}" in spec
    pinned = synth.decider.config.model
    assert model["TimeoutInMinutes"] == pinned.staging_timeout_minutes
    assert model["QueuedTimeoutInMinutes"] == pinned.staging_queued_timeout_minutes


def _policy(template, path_part: str) -> list[dict]:
    (policy,) = [
        p
        for p in resources(template, "AWS::IAM::Policy").values()
        if path_part in p["Metadata"]["aws:cdk:path"]
    ]
    return policy["Properties"]["PolicyDocument"]["Statement"]


def _actions(statements) -> set[str]:
    return {a for s in statements for a in _listify(s["Action"])}


def test_build_roles_allow_the_calls_their_code_makes_and_no_more(synth):
    template = synth.templates["ImageStack"]
    assert "ecr:DescribeImages" in _actions(_policy(template, "/Builds/ImageBuild/Role/"))
    # a bootstrap bucket with a customer-managed key: decrypt through S3, for that bucket only
    decrypt = next(
        s
        for s in _policy(template, "/Builds/ImageBuild/Role/")
        if s.get("Sid") == "DecryptSourceWithBootstrapKey"
    )
    assert decrypt["Action"] == "kms:Decrypt" and decrypt["Resource"] == "*"
    assert set(decrypt["Condition"]) == {"StringEquals", "StringLike"}
    context = json.dumps(decrypt["Condition"]["StringLike"]["kms:EncryptionContext:aws:s3:arn"])
    assert "cdk-hnb659fds-assets-" in context and "/*" in context
    aws_calls = ("codebuild:", "ecr:", "ssm:", "cloudformation:", "sagemaker:", "cloudwatch:", "kms:")
    on_event = _policy(template, "/BuildRunner/OnEvent/")
    is_complete = _policy(template, "/BuildRunner/IsComplete/")
    assert {a for a in _actions(on_event) if a.startswith(aws_calls)} == {
        "codebuild:StartBuild",
        "ecr:DescribeImages",
        "ecr:BatchGetImage",  # keep-<digest>: read the manifest …
        "ecr:PutImage",  # … and put it again under the new tag
        "ecr:GetDownloadUrlForLayer",  # the deployed image's config blob: built for its tag?
        "ssm:GetParameter",  # the deployed-image record
        "cloudformation:DescribeStacks",  # the post-deploy check skips rollbacks
        "sagemaker:DescribeEndpoint",  # the update guard counts the live fleet's blue/green peak
        # a rolled-back or deleted image request stops the build it started (by its wait handle)
        "codebuild:ListBuildsForProject",
        "codebuild:BatchGetBuilds",
        "codebuild:StopBuild",
    }
    abandoned = next(s for s in on_event if s.get("Sid") == "StopAbandonedImageBuilds")
    (image_project,) = [
        k for k in resources(template, "AWS::CodeBuild::Project") if k.startswith("BuildsImageBuild")
    ]
    assert abandoned["Resource"] == {"Fn::GetAtt": [image_project, "Arn"]}
    assert {a for a in _actions(is_complete) if a.startswith(aws_calls)} == {
        "codebuild:BatchGetBuilds",
        "codebuild:StopBuild",
        "codebuild:StartBuild",  # AccountLimitExceededException retries
        "codebuild:ListBuildsForProject",
        "sagemaker:DescribeEndpoint",
        "sagemaker:InvokeEndpoint",
        # a failing post-deploy check parks the endpoint on a copy of the previous config
        "sagemaker:DescribeEndpointConfig",
        "sagemaker:CreateEndpointConfig",
        "sagemaker:AddTags",
        "sagemaker:ListTags",
        "sagemaker:UpdateEndpoint",
        "cloudwatch:DescribeAlarms",
        "kms:CreateGrant",  # the previous config's volume key, through SageMaker only
        "kms:DescribeKey",
    }
    parking = {s["Sid"]: s for s in is_complete if "Sid" in s}
    for sid in ("CreateParkedConfigs", "ParkEndpoints"):
        text = json.dumps(parking[sid]["Resource"])
        assert (
            "endpoint-config/decider-cpu-parked-*" in text and "endpoint-config/decider-gpu-parked-*" in text
        )
        assert "endpoint-config/*" not in text
    assert parking["UseVolumeKeysThroughSageMaker"]["Condition"] == {
        "StringEquals": {
            "kms:ViaService": {"Fn::Join": ["", ["sagemaker.", {"Ref": "AWS::Region"}, ".amazonaws.com"]]}
        }
    }
    records = json.dumps(next(s for s in on_event if s.get("Sid") == "ReadDeployedImageRecords")["Resource"])
    assert (
        "parameter/decider/decider-cpu/image" in records and "parameter/decider/decider-gpu/image" in records
    )
    endpoints = json.dumps(
        next(s for s in is_complete if s.get("Sid") == "CheckDeployedEndpoints")["Resource"]
    )
    assert "endpoint/decider-cpu" in endpoints and "endpoint/decider-gpu" in endpoints
    assert "endpoint/*" not in endpoints


def test_handlers_watcher_and_waiter_are_logged_and_bounded(synth):
    template = synth.templates["ImageStack"]
    functions = {
        f["Properties"]["Handler"]: f["Properties"]
        for f in resources(template, "AWS::Lambda::Function").values()
        if not f["Properties"]["Handler"].startswith("framework.")
    }
    assert set(functions) == {
        "codebuild_job.on_event",
        "codebuild_job.is_complete",
        "build_watcher.on_build_state_change",
    }
    assert {f["Runtime"] for f in functions.values()} == {"python3.14"}
    # the post-deploy check makes two invocations of up to 60 s each inside one isComplete call
    assert functions["codebuild_job.is_complete"]["Timeout"] == 300
    limits = dict(functions["codebuild_job.is_complete"]["Environment"]["Variables"])
    assert (
        limits.pop(build_jobs.ENV)
        == functions["codebuild_job.on_event"]["Environment"]["Variables"][build_jobs.ENV]
    )
    assert limits == {
        "POLL_SECONDS": "30",
        "START_RETRY_MINUTES": str(app_config.BUILD_START_RETRY_MINUTES),
        "DEADLINE_GRACE_MINUTES": str(app_config.BUILD_DEADLINE_GRACE_MINUTES),
    }
    machine = only(template, "AWS::StepFunctions::StateMachine")["Properties"]
    assert machine["LoggingConfiguration"]["Level"] == "ALL"
    # the waiter gives up before CloudFormation's one-hour limit on custom resources
    definition = json.dumps(machine["DefinitionString"])
    assert '\\"MaxAttempts\\":110' in definition  # 55 min / 30 s
    groups = resources(template, "AWS::Logs::LogGroup").values()
    assert {g["Properties"]["RetentionInDays"] for g in groups} == {30}


def test_failed_image_builds_reach_the_watcher(synth):
    template = synth.templates["ImageStack"]
    rule = only(template, "AWS::Events::Rule")["Properties"]
    image_project = next(
        k
        for k, v in resources(template, "AWS::CodeBuild::Project").items()
        if "docker build" in v["Properties"]["Source"]["BuildSpec"]
    )
    assert rule["EventPattern"] == {
        "source": ["aws.codebuild"],
        "detail-type": ["CodeBuild Build State Change"],
        "detail": {
            "build-status": ["FAILED", "FAULT", "STOPPED", "TIMED_OUT"],
            "project-name": [{"Ref": image_project}],
        },
    }
    (target,) = rule["Targets"]
    watcher = next(
        k
        for k, v in resources(template, "AWS::Lambda::Function").items()
        if v["Properties"]["Handler"] == "build_watcher.on_build_state_change"
    )
    assert target["Arn"] == {"Fn::GetAtt": [watcher, "Arn"]}
    assert target["RetryPolicy"]["MaximumRetryAttempts"] == 4


# --- endpoint stacks: deploy-time requests ----------------------------------------------------------


@pytest.mark.parametrize(("stack", "variant"), [("CpuStack", "cpu"), ("GpuStack", "gpu")])
def test_image_build_request_names_tag_buildspec_and_its_wait_condition(synth, stack, variant):
    template = synth.templates[stack]
    config = synth.decider.config.variant(variant)
    source_hash = synth.decider.image.source_hash
    build_id = _logical_id(template, "Custom::ImageBuild")
    props = template["Resources"][build_id]["Properties"]
    assert props["ServiceTimeout"] == "3600"  # CloudFormation's ceiling for a custom resource
    # only the tag: how it is built is ImageStack's, fixed at synth (the provider takes no recipe)
    assert set(props) == {
        "ServiceToken",
        "ServiceTimeout",
        "Kind",
        "ImageTag",
        "ImageSource",
        "DeployedImageParameter",
        "WaitHandle",
    }
    assert props["ImageSource"] == "auto"
    assert props["DeployedImageParameter"] == f"/decider/{config.endpoint_name}/image"
    buildspec = _projects(synth)[0]["Source"]["BuildSpec"]
    assert props["ImageTag"] == image_tag(config, source_hash, buildspec)
    recipe = synthesized_jobs(synth)["Image"]["Tags"][props["ImageTag"]]
    assert recipe["Variant"] == {"cpu": "cpu", "gpu": "cuda"}[variant]
    assert recipe["ComputeType"] == config.image_build.compute_type
    assert recipe["QueuedTimeoutMinutes"] == str(config.image_build.queued_timeout_minutes)
    if variant == "cpu":
        assert props["ImageTag"].startswith("cpu-") and recipe["BuildArgs"] == ""
    else:  # the CUDA architectures of the allowed GPUs (g6: sm_89) are a build argument and in the tag
        assert recipe["BuildArgs"] == "CUDA_ARCHITECTURES=89"
        assert props["ImageTag"].startswith("cuda-")
    # the wait condition: its handle goes to the build, it waits queue + build + margin, after the start
    handle_id = _logical_id(template, "AWS::CloudFormation::WaitConditionHandle")
    wait_id = _logical_id(template, "AWS::CloudFormation::WaitCondition")
    wait = template["Resources"][wait_id]
    assert props["WaitHandle"] == {"Ref": handle_id}
    assert wait["Properties"] == {
        "Count": 1,
        "Handle": {"Ref": handle_id},
        "Timeout": str(app_config.image_wait_minutes(config.image_build) * 60),
    }
    assert int(wait["Properties"]["Timeout"]) <= app_config.WAIT_CONDITION_MAX_S
    assert build_id in wait["DependsOn"]
    # the staging runs first: new accounts often run one CodeBuild build at a time
    staging_id = _logical_id(template, "Custom::ModelStaging")
    assert staging_id in template["Resources"][build_id]["DependsOn"]


def test_a_new_build_input_gets_a_new_handle_and_wait_condition(synth, synth_prebuilt):
    """Wait conditions cannot be updated and handles must not be reused."""
    default = synth.templates["CpuStack"]["Resources"]
    other = synth_prebuilt.templates["CpuStack"]["Resources"]  # other build args and image_source
    for cfn_type in ("AWS::CloudFormation::WaitConditionHandle", "AWS::CloudFormation::WaitCondition"):
        assert set(resources({"Resources": default}, cfn_type)).isdisjoint(
            resources({"Resources": other}, cfn_type)
        )


def test_the_image_tag_hashes_source_build_args_and_buildspec(synth) -> None:
    """A buildspec edit rebuilds (the recipe is an input of the image); compute type and timeouts do
    not (they only change how the build runs: test_update_rules walks them)."""
    config, source = synth.decider.config.cpu, synth.decider.image.source_hash
    buildspec = synth.decider.image.image_buildspec
    tag = image_tag(config, source, buildspec)
    assert tag == only(synth.templates["CpuStack"], "Custom::ImageBuild")["Properties"]["ImageTag"]
    assert image_tag(config, source, buildspec + "\n# edited") != tag
    assert image_tag(config, "0" * 64, buildspec) != tag
    faster = config.model_copy(
        update={"image_build": config.image_build.model_copy(update={"timeout_minutes": 90})}
    )
    assert image_tag(faster, source, buildspec) == tag


@pytest.mark.parametrize("stack", ["CpuStack", "GpuStack"])
def test_the_signalled_image_is_checked_protected_and_served(synth, stack):
    template = synth.templates[stack]
    deployed_id = _logical_id(template, "Custom::DeployedImage")
    wait_id = _logical_id(template, "AWS::CloudFormation::WaitCondition")
    props = template["Resources"][deployed_id]["Properties"]
    assert props["Kind"] == "DeployedImage"
    assert props["WaitData"] == {"Fn::GetAtt": [wait_id, "Data"]}
    container = only(template, "AWS::SageMaker::Model")["Properties"]["PrimaryContainer"]
    assert container["Image"] == {"Fn::GetAtt": [deployed_id, "ImageUri"]}


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
    assert props["ServiceTimeout"] == "3600"
    # the provider stages only the model ImageStack pins, with ImageStack's limits and project
    pinned = synthesized_jobs(synth)["Model"]
    for field in build_jobs.MODEL_FIELDS:
        if field != "Bucket":  # a token: ${AWS::AccountId} in both
            assert props[field] == pinned[field]
    assert pinned["TimeoutMinutes"] == str(model.staging_timeout_minutes)
    assert not {"ProjectName", "Buildspec", "TimeoutMinutes"} & set(props)


# --- endpoint stacks: model, config, endpoint -------------------------------------------------------


@pytest.mark.parametrize(("stack", "variant"), [("CpuStack", "cpu"), ("GpuStack", "gpu")])
def test_model_serves_the_image_by_digest_from_an_uncompressed_prefix(synth, stack, variant):
    template = synth.templates[stack]
    staging_id = _logical_id(template, "Custom::ModelStaging")
    model = only(template, "AWS::SageMaker::Model")
    props = model["Properties"]
    assert "ModelName" not in props
    assert props["EnableNetworkIsolation"] is True
    container = props["PrimaryContainer"]
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
    assert any("DefaultPolicy" in d for d in model["DependsOn"])


@pytest.mark.parametrize(("stack", "name"), [("CpuStack", "decider-cpu"), ("GpuStack", "decider-gpu")])
def test_replaced_models_and_configs_are_retained_and_tagged_for_prune(synth, stack, name):
    """After a silent SageMaker rollback the endpoint still runs the old config: never delete it."""
    template = synth.templates[stack]
    for cfn_type in ("AWS::SageMaker::Model", "AWS::SageMaker::EndpointConfig"):
        resource = only(template, cfn_type)
        assert resource["UpdateReplacePolicy"] == "Retain" and resource["DeletionPolicy"] == "Retain"
        assert {"Key": "promote:endpoint", "Value": name} in resource["Properties"]["Tags"]


def test_cpu_endpoint_config_is_kms_encrypted_with_an_ebs_volume_and_explicit_timeouts(synth):
    template = synth.templates["CpuStack"]
    config = only(template, "AWS::SageMaker::EndpointConfig")["Properties"]
    volume_key = next(
        k
        for k, v in resources(template, "AWS::KMS::Key").items()
        if "/Decider/VolumeKey/" in v["Metadata"]["aws:cdk:path"]
    )
    assert "EndpointConfigName" not in config
    assert config["KmsKeyId"] == {"Fn::GetAtt": [volume_key, "Arn"]}
    (variant,) = config["ProductionVariants"]
    assert variant["InstanceType"] == "ml.c7i.8xlarge"
    assert variant["InitialInstanceCount"] == 2
    assert variant["VolumeSizeInGB"] == app_config.DEFAULT_EBS_VOLUME_GB  # EBS-backed type
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 900
    assert variant["ModelDataDownloadTimeoutInSeconds"] == 900
    assert "InferenceAmiVersion" not in variant and "InstancePools" not in variant
    assert "DataCaptureConfig" not in config


def test_gpu_endpoint_config_sets_the_driver_ami_and_no_kms_or_volume_size(synth):
    config = only(synth.templates["GpuStack"], "AWS::SageMaker::EndpointConfig")["Properties"]
    assert "KmsKeyId" not in config and "EndpointConfigName" not in config
    (variant,) = config["ProductionVariants"]
    assert variant["InstanceType"] == "ml.g6.xlarge"
    assert variant["InferenceAmiVersion"] == "al2-ami-sagemaker-inference-gpu-3-1"  # CUDA 12.4 image
    assert "VolumeSizeInGB" not in variant  # NVMe instance storage: SageMaker refuses it
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 900


@pytest.mark.parametrize(("stack", "name"), [("CpuStack", "decider-cpu"), ("GpuStack", "decider-gpu")])
def test_endpoint_rolls_out_blue_green_canary_with_alarm_rollback_and_keeps_its_fleet(synth, stack, name):
    template = synth.templates[stack]
    endpoint = only(template, "AWS::SageMaker::Endpoint")
    props = endpoint["Properties"]
    assert props["EndpointName"] == name
    config_id = _logical_id(template, "AWS::SageMaker::EndpointConfig")
    assert props["EndpointConfigName"] == {"Fn::GetAtt": [config_id, "EndpointConfigName"]}
    # an autoscaled fleet keeps its size through an update (not reset to initial_instance_count)
    assert props["RetainAllVariantProperties"] is True
    assert "ExcludeRetainedVariantProperties" not in props
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
    names = sorted(alarms[alarm_id]["Metadata"]["aws:cdk:path"].split("/")[-2] for alarm_id in rollback)
    assert names == ["ErrorRate5xx", "ModelFailureRate", "ModelLatencyP90"]


def _alarms_by_name(template):
    return {
        a["Metadata"]["aws:cdk:path"].split("/")[-2]: a["Properties"]
        for a in resources(template, "AWS::CloudWatch::Alarm").values()
    }


@pytest.mark.parametrize(("stack", "name"), [("CpuStack", "decider-cpu"), ("GpuStack", "decider-gpu")])
def test_the_rollback_alarm_is_an_error_rate_not_a_single_error(synth, stack, name):
    alarm = _alarms_by_name(synth.templates[stack])["ErrorRate5xx"]
    thresholds = synth.decider.config.variant(stack[:3].lower()).alarms
    assert alarm["Threshold"] == thresholds.error_rate_percent
    assert alarm["ComparisonOperator"] == "GreaterThanThreshold"
    assert (alarm["EvaluationPeriods"], alarm["DatapointsToAlarm"]) == (3, 2)
    metrics = {m["Id"]: m for m in alarm["Metrics"]}
    expression = next(m for m in alarm["Metrics"] if "Expression" in m)
    assert expression["Expression"] == (
        f"IF(server_invocations >= {thresholds.error_rate_min_invocations}, "
        "100 * server_errors / server_invocations, 0)"
    )
    assert expression.get("ReturnData", True) is True
    errors = metrics["server_errors"]["MetricStat"]
    assert errors["Metric"]["MetricName"] == "Invocation5XXErrors" and errors["Stat"] == "Sum"
    assert metrics["server_invocations"]["MetricStat"]["Metric"]["MetricName"] == "Invocations"
    for metric in ("server_errors", "server_invocations"):
        dimensions = metrics[metric]["MetricStat"]["Metric"]["Dimensions"]
        assert {"Name": "EndpointName", "Value": name} in dimensions
        assert {"Name": "VariantName", "Value": "AllTraffic"} in dimensions
        assert metrics[metric]["ReturnData"] is False


@pytest.mark.parametrize("stack", ["CpuStack", "GpuStack"])
def test_every_alarm_notifies_the_stacks_encrypted_topic(synth, stack):
    template = synth.templates[stack]
    topic_id = _logical_id(template, "AWS::SNS::Topic")
    alarms = _alarms_by_name(template)
    assert set(alarms) == {
        "ErrorRate5xx",
        "ModelLatencyP90",
        "ErrorRate4xx",
        "ModelErrorRate",
        "ModelFailureRate",
        "ModelSetupTime",
        "MemoryHigh",
        "DiskHigh",
    }
    for alarm in alarms.values():
        assert alarm["AlarmActions"] == [{"Ref": topic_id}]
        assert alarm["OKActions"] == [{"Ref": topic_id}]
        assert alarm["TreatMissingData"] == "notBreaching"
    assert alarms["ModelLatencyP90"]["ExtendedStatistic"] == "p90"
    assert alarms["ModelLatencyP90"]["Threshold"] == 20_000_000  # 20 s in microseconds
    assert (alarms["DiskHigh"]["MetricName"], alarms["DiskHigh"]["Namespace"]) == (
        "DiskUtilization",
        "/aws/sagemaker/Endpoints",
    )
    assert alarms["DiskHigh"]["Threshold"] == 90
    assert alarms["ModelSetupTime"]["Threshold"] == 900 * 1_000_000
    assert "Invocation4XXErrors" in json.dumps(alarms["ErrorRate4xx"]["Metrics"])
    assert "InvocationModelErrors" in json.dumps(alarms["ModelErrorRate"]["Metrics"])
    # the rollback alarm on model failures leaves callers' 4xx out (bad input must not roll back)
    failure = next(m for m in alarms["ModelFailureRate"]["Metrics"] if "Expression" in m)["Expression"]
    assert failure == (
        "IF(failure_invocations >= 10 AND failure_errors > failure_client, "
        "100 * (failure_errors - failure_client) / failure_invocations, 0)"
    )
    topic = template["Resources"][topic_id]["Properties"]
    assert "KmsMasterKeyId" in topic
    policy = only(template, "AWS::SNS::TopicPolicy")["Properties"]["PolicyDocument"]["Statement"]
    assert any(
        s.get("Principal") == {"Service": "cloudwatch.amazonaws.com"} and s["Action"] == "sns:Publish"
        for s in policy
    )
    assert any(s["Effect"] == "Deny" and "aws:SecureTransport" in json.dumps(s) for s in policy)
    key = next(
        v
        for v in resources(template, "AWS::KMS::Key").values()
        if "/Notify/Key/" in v["Metadata"]["aws:cdk:path"]
    )
    key_statements = key["Properties"]["KeyPolicy"]["Statement"]
    assert any(s.get("Principal") == {"Service": "cloudwatch.amazonaws.com"} for s in key_statements)
    assert not resources(template, "AWS::SNS::Subscription")  # no e-mail configured by default


@pytest.mark.parametrize(
    ("stack", "name", "low", "high"), [("CpuStack", "decider-cpu", 2, 4), ("GpuStack", "decider-gpu", 2, 3)]
)
def test_autoscaling_tracks_concurrency_within_configured_bounds(synth, stack, name, low, high):
    template = synth.templates[stack]
    endpoint_id = _logical_id(template, "AWS::SageMaker::Endpoint")
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
        "PredefinedMetricType": "SageMakerVariantConcurrentRequestsPerModelHighResolution"
    }
    variant = synth.decider.config.variant(stack[:3].lower())
    assert (
        tracking["TargetValue"]
        == variant.target_concurrency_per_instance
        == app_config.DEFAULT_CONCURRENCY_TARGET
    )
    assert policy["PolicyName"] == f"{name}-concurrency-per-instance"


def test_autoscaling_on_invocations_when_chosen(tmp_path):
    from stack_helpers import run_synth

    other = run_synth(tmp_path, {"cpu.scaling_metric": "invocations"}).templates["CpuStack"]
    policy = only(other, "AWS::ApplicationAutoScaling::ScalingPolicy")["Properties"]
    tracking = policy["TargetTrackingScalingPolicyConfiguration"]
    assert (
        tracking["PredefinedMetricSpecification"]["PredefinedMetricType"]
        == "SageMakerVariantInvocationsPerInstance"
    )
    assert tracking["TargetValue"] == 10  # cdk.json's target_invocations_per_instance


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
    # SageMaker reads the auto-rollback alarms with this role: exactly those three, by ARN
    alarms = _alarms_by_name(template)
    alarm_ids = {
        k
        for k, v in resources(template, "AWS::CloudWatch::Alarm").items()
        if v["Metadata"]["aws:cdk:path"].split("/")[-2]
        in {"ErrorRate5xx", "ModelLatencyP90", "ModelFailureRate"}
    }
    assert alarms
    assert statements["ReadRollbackAlarms"]["Action"] == "cloudwatch:DescribeAlarms"
    assert {r["Fn::GetAtt"][0] for r in statements["ReadRollbackAlarms"]["Resource"]} == alarm_ids
    if stack == "CpuStack":
        assert "kms:CreateGrant" in statements["UseVolumeKey"]["Action"]
    else:
        assert "UseVolumeKey" not in statements


# --- endpoint stacks: after the update --------------------------------------------------------------


@pytest.mark.parametrize(("stack", "name"), [("CpuStack", "decider-cpu"), ("GpuStack", "decider-gpu")])
def test_post_deploy_check_runs_after_the_endpoint_on_the_stacks_config(synth, stack, name):
    template = synth.templates[stack]
    endpoint_id = _logical_id(template, "AWS::SageMaker::Endpoint")
    config_id = _logical_id(template, "AWS::SageMaker::EndpointConfig")
    check = only(template, "Custom::PostDeployCheck")["Properties"]
    assert check["Kind"] == "PostDeployCheck" and check["ServiceTimeout"] == "3600"
    assert check["EndpointName"] == {"Fn::GetAtt": [endpoint_id, "EndpointName"]}
    assert check["EndpointConfigName"] == {"Fn::GetAtt": [config_id, "EndpointConfigName"]}


@pytest.mark.parametrize(("stack", "name"), [("CpuStack", "decider-cpu"), ("GpuStack", "decider-gpu")])
def test_the_deployed_image_is_recorded_after_the_check_for_the_next_deploy(synth, stack, name):
    template = synth.templates[stack]
    record = only(template, "AWS::SSM::Parameter")
    check_id = _logical_id(template, "Custom::PostDeployCheck")
    assert record["Properties"]["Name"] == f"/decider/{name}/image"
    assert check_id in record["DependsOn"]
    value = json.dumps(record["Properties"]["Value"])
    assert _logical_id(template, "Custom::DeployedImage") in value and "ImageUri" in value
    assert _logical_id(template, "Custom::ImageBuild") in value and "Source" in value


@pytest.mark.parametrize(("stack", "name"), [("CpuStack", "decider-cpu"), ("GpuStack", "decider-gpu")])
def test_outputs_name_the_endpoint_role_image_source_and_invoke_command(synth, stack, name):
    outputs = synth.templates[stack]["Outputs"]
    assert {
        "EndpointName",
        "ExecutionRoleArn",
        "InvokeCommand",
        "ImageUri",
        "ImageSource",
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
    assert list(body) == ["state", "questions"]  # state first: prefix-aware routing keys on it


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


# --- the CI path and the options ---------------------------------------------------------------------


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
    assert not resources(gpu, "Custom::ImageBuild") and not resources(
        gpu, "AWS::CloudFormation::WaitCondition"
    )
    image = "123456789012.dkr.ecr.eu-west-1.amazonaws.com/decider@sha256:" + "a" * 64
    model = only(gpu, "AWS::SageMaker::Model")
    assert model["Properties"]["PrimaryContainer"]["Image"] == image
    # the prebuilt image is still checked and protected from the lifecycle before the model exists
    pinned_id, pinned = next(iter(resources(gpu, "Custom::DeployedImage").items()))
    assert pinned["Properties"]["ImageUri"] == image
    assert pinned_id in model["DependsOn"]
    record = json.dumps(only(gpu, "AWS::SSM::Parameter")["Properties"]["Value"])
    assert '\\"source\\":\\"pinned\\"' in record
    statements = only(gpu, "AWS::IAM::Policy")["Properties"]["PolicyDocument"]["Statement"]
    pull = json.dumps(next(s for s in statements if s.get("Sid") == "PullImage")["Resource"])
    assert "eu-west-1" in pull and "123456789012:repository/decider" in pull


def test_build_args_and_image_source_are_passed_and_change_the_image_tag(synth, synth_prebuilt):
    build = only(synth_prebuilt.templates["CpuStack"], "Custom::ImageBuild")["Properties"]
    default = only(synth.templates["CpuStack"], "Custom::ImageBuild")["Properties"]
    recipe = synthesized_jobs(synth_prebuilt)["Image"]["Tags"][build["ImageTag"]]
    assert recipe["BuildArgs"] == "PYTHON_IMAGE=public.ecr.aws/docker/library/python:3.11.14-slim-bookworm"
    assert build["ImageSource"] == "build"
    assert recipe["ComputeType"] == "BUILD_GENERAL1_2XLARGE"
    assert synthesized_jobs(synth)["Image"]["Tags"][default["ImageTag"]]["BuildArgs"] == ""
    assert build["ImageTag"].startswith("cpu-") and build["ImageTag"] != default["ImageTag"]
    assert len(build["ImageTag"]) == len(default["ImageTag"])


def test_without_autoscaling_the_configured_instance_count_applies_on_update(synth_prebuilt):
    cpu = only(synth_prebuilt.templates["CpuStack"], "AWS::SageMaker::Endpoint")["Properties"]
    assert cpu["RetainAllVariantProperties"] is True
    assert cpu["ExcludeRetainedVariantProperties"] == [{"VariantPropertyType": "DesiredInstanceCount"}]
    assert not resources(synth_prebuilt.templates["CpuStack"], "AWS::ApplicationAutoScaling::ScalableTarget")


def test_volume_size_and_alarm_email_when_configured(synth_prebuilt):
    cpu = synth_prebuilt.templates["CpuStack"]
    (variant,) = only(cpu, "AWS::SageMaker::EndpointConfig")["Properties"]["ProductionVariants"]
    assert variant["VolumeSizeInGB"] == 40
    subscription = only(cpu, "AWS::SNS::Subscription")["Properties"]
    assert subscription["Protocol"] == "email" and subscription["Endpoint"] == "ops@example.com"
    assert subscription["TopicArn"] == {"Ref": _logical_id(cpu, "AWS::SNS::Topic")}


def test_gpu_instance_pools_provision_timeout_and_prefix_aware_routing(synth_prebuilt):
    (variant,) = only(synth_prebuilt.templates["GpuStack"], "AWS::SageMaker::EndpointConfig")["Properties"][
        "ProductionVariants"
    ]
    assert "InstanceType" not in variant  # InstancePools replaces it
    assert variant["InstancePools"] == [
        {"InstanceType": "ml.g6.2xlarge", "Priority": 1},
        {"InstanceType": "ml.g6e.2xlarge", "Priority": 2},
        {"InstanceType": "ml.g5.2xlarge", "Priority": 3},
    ]
    assert variant["VariantInstanceProvisionTimeoutInSeconds"] == 1200
    assert variant["RoutingConfig"] == {
        "RoutingStrategy": "PREFIX_AWARE",
        "PrefixAwareRoutingConfig": {"PrefixLength": 2048, "ConcurrencyThreshold": 2},
    }
    assert "VolumeSizeInGB" not in variant


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
    # autoscaling off (the first step of an instance-type change): no scalable target at all
    assert not resources(synth_prebuilt.templates["GpuStack"], "AWS::ApplicationAutoScaling::ScalableTarget")


def test_preflight_checks_the_bootstrap_version_the_templates_require(synth):
    from decider_cli.preflight.checks import MIN_BOOTSTRAP_VERSION

    manifest = json.loads((synth.outdir / "manifest.json").read_text())["artifacts"]
    for stack in STACKS:
        assert manifest[stack]["properties"]["requiresBootstrapStackVersion"] == MIN_BOOTSTRAP_VERSION
        rule = synth.templates[stack]["Rules"]["CheckBootstrapVersion"]["Assertions"][0]
        refused = rule["Assert"]["Fn::Not"][0]["Fn::Contains"][0]
        assert refused == [str(v) for v in range(1, MIN_BOOTSTRAP_VERSION)]


# --- what a platform team expects: logs, captures, cost tags, a warned-about empty alarm topic --------


@pytest.mark.parametrize(("stack", "name"), [("CpuStack", "decider-cpu"), ("GpuStack", "decider-gpu")])
def test_the_endpoint_log_group_is_encrypted_with_a_key_only_its_logs_may_use(synth, stack, name):
    template = synth.templates[stack]
    group = only(template, "AWS::Logs::LogGroup")["Properties"]
    assert group["LogGroupName"] == f"/aws/sagemaker/Endpoints/{name}"
    (key_id,) = [k for k in resources(template, "AWS::KMS::Key") if "LogsKey" in k]
    assert group["KmsKeyId"] == {"Fn::GetAtt": [key_id, "Arn"]}
    key = template["Resources"][key_id]["Properties"]
    assert key["EnableKeyRotation"] is True
    logs = next(s for s in key["KeyPolicy"]["Statement"] if s.get("Sid") == "CloudWatchLogsEncrypt")
    assert "logs." in json.dumps(logs["Principal"])
    assert f"/aws/sagemaker/Endpoints/{name}" in json.dumps(logs["Condition"])


def test_captured_data_expires(synth):
    bucket = next(
        v["Properties"]
        for k, v in resources(synth.templates["ImageStack"], "AWS::S3::Bucket").items()
        if "Artifacts" in k
    )
    rules = {r.get("Prefix"): r for r in bucket["LifecycleConfiguration"]["Rules"]}
    for name in ("decider-cpu", "decider-gpu"):
        rule = rules[f"data-capture/{name}/"]
        assert rule["ExpirationInDays"] == 30 and rule["Status"] == "Enabled"
        assert rule["NoncurrentVersionExpiration"] == {"NoncurrentDays": 1}


@pytest.mark.parametrize(("stack", "variant"), [("CpuStack", "cpu"), ("GpuStack", "gpu")])
def test_resources_carry_cost_allocation_tags(synth, stack, variant):
    template = synth.templates[stack]
    expected = {"project": "decider", "variant": variant, "endpoint": f"decider-{variant}"}
    for cfn_type in ("AWS::SageMaker::Endpoint", "AWS::SageMaker::EndpointConfig", "AWS::SageMaker::Model"):
        tags = {t["Key"]: t["Value"] for t in only(template, cfn_type)["Properties"]["Tags"]}
        assert expected.items() <= tags.items(), cfn_type
    image_tags = {
        t["Key"]: t["Value"]
        for t in only(synth.templates["ImageStack"], "AWS::ECR::Repository")["Properties"]["Tags"]
    }
    assert image_tags == {"project": "decider"}


def test_an_alarm_topic_without_subscriber_is_warned_about_at_synth_and_in_the_outputs(synth, synth_prebuilt):
    outputs = synth.templates["CpuStack"]["Outputs"]
    assert outputs["AlarmSubscribers"]["Value"].startswith("NONE: the alarms of decider-cpu notify")
    assert "-c cpu.alarms.email=" in outputs["AlarmSubscribers"]["Value"]
    assert "AlarmTopicArn" in outputs
    metadata = json.loads((synth.outdir / "CpuStack.metadata.json").read_text())
    warnings = [e["data"] for entries in metadata.values() for e in entries if e["type"] == "aws:cdk:warning"]
    assert any("without a subscriber" in str(w) for w in warnings), warnings
    assert synth_prebuilt.templates["CpuStack"]["Outputs"]["AlarmSubscribers"]["Value"] == "ops@example.com"


@pytest.mark.parametrize(("stack", "name"), [("CpuStack", "decider-cpu"), ("GpuStack", "decider-gpu")])
def test_synthetic_load_runs_beside_the_endpoint_update(synth, stack, name):
    """It needs the new config (so every update gets one) and must not wait for the Endpoint."""
    template = synth.templates[stack]
    load = only(template, "Custom::BakeLoad")
    config_id = _logical_id(template, "AWS::SageMaker::EndpointConfig")
    endpoint_id = _logical_id(template, "AWS::SageMaker::Endpoint")
    props = load["Properties"]
    assert props["EndpointName"] == name and props["LoadPerMinute"] == "12"
    assert props["EndpointConfigName"] == {"Fn::GetAtt": [config_id, "EndpointConfigName"]}
    assert endpoint_id not in json.dumps(load)
    floor = synth.decider.config.variant(stack[:3].lower()).alarms.error_rate_min_invocations
    assert int(props["LoadPerMinute"]) >= floor  # enough for the rollback alarms to count a minute
