"""The variant config: defaults, `-c` overrides, and one clear error per bad value (no synth needed)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from decider.settings import Settings
from decider_stacks.config import (
    ConfigError,
    container_environment,
    load_config,
    merge_context,
    supports_volume_kms,
)
from decider_stacks.paths import ROOT as REPO_ROOT
from decider_stacks.synth import cdk_json_context

DIGEST = "sha256:" + "0" * 64
ECR_IMAGE = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/decider@{DIGEST}"


def config_with(**overrides: Any):
    return load_config({**cdk_json_context(), **overrides})


def error_for(**overrides: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        config_with(**overrides)
    return str(caught.value)


def test_defaults_from_cdk_json_pin_the_production_model_and_instances():
    config = config_with()
    assert config.model.repository == "bartowski/Qwen_Qwen3.5-4B-GGUF"
    assert config.model.revision == "4168f45a16a1290d65a4ec0fa312ae917a4c15d6"
    assert config.model.file == "Qwen_Qwen3.5-4B-Q4_K_M.gguf"
    assert config.model.size_bytes == 3_013_027_808
    assert config.model.sha256.startswith("13c16f42") and config.model.sha256.endswith("a983")
    # the capacity planner's choice: p95 well under the 55 s deadline (tests/capacity)
    assert config.cpu.instance_type == "ml.c7i.8xlarge"
    assert config.gpu.instance_type == "ml.g6.xlarge"
    # the AMI follows the CUDA image's toolkit (container/Dockerfile), never a setting that can disagree
    assert config.gpu.inference_ami_version is None and config.cpu.ami_version is None
    assert config.gpu.ami_version == "al2-ami-sagemaker-inference-gpu-3-1"
    assert config.cpu.encrypt_volume and not config.gpu.encrypt_volume
    assert (config.cpu.ebs_volume_size_gb, config.gpu.ebs_volume_size_gb) == (30, None)
    assert (config.cpu.build_variant, config.gpu.build_variant) == ("cpu", "cuda")
    assert (config.cpu.cuda_architectures, config.gpu.cuda_architectures) == (None, "89")
    assert config.gpu.docker_build_args == {"CUDA_ARCHITECTURES": "89"}
    assert config.cpu.docker_build_args == {}


def test_dotted_overrides_are_parsed_and_applied():
    config = config_with(
        **{
            "cpu.instance_type": "ml.c7i.2xlarge",
            "cpu.max_capacity": "6",
            "cpu.container.n_ctx": "4096",
            "cpu.container.max_state_tokens": "3072",
            "cpu.container.temperature_choice": "1.3",
            "cpu.data_capture.enabled": "true",
        }
    )
    assert config.cpu.instance_type == "ml.c7i.2xlarge"
    assert config.cpu.max_capacity == 6
    assert config.cpu.data_capture.enabled is True
    env = container_environment(config.cpu, config.model)
    assert env[Settings.env_name("n_ctx")] == "4096"
    assert env[Settings.env_name("temperature_choice")] == "1.3"
    # the other variant is untouched
    assert config.gpu.container.get("n_ctx") == 8192


def test_global_image_and_model_apply_to_both_variants_unless_one_sets_its_own():
    other = ECR_IMAGE.replace("0" * 64, "1" * 64)
    config = config_with(
        image_uri=ECR_IMAGE, model_s3_uri="s3://bucket/models/x/", **{"gpu.image_uri": other}
    )
    assert config.cpu.image_uri == ECR_IMAGE
    assert config.gpu.image_uri == other
    assert config.cpu.model_s3_uri == config.gpu.model_s3_uri == "s3://bucket/models/x/"


def test_a_variant_can_opt_out_of_the_global_image_with_null():
    config = config_with(image_uri=ECR_IMAGE, **{"cpu.image_uri": "null"})
    assert config.cpu.image_uri is None
    assert config.gpu.image_uri == ECR_IMAGE


def test_unrelated_context_keys_are_ignored():
    tree = merge_context(
        {**cdk_json_context(), "@aws-cdk/core:foo": True, "aws:cdk:enable-path-metadata": True}
    )
    assert set(tree) == {"project", "model", "cpu", "gpu"}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"cpu.instance_type": "ml.g6.xlarge"}, "cpu.instance_type: ml.g6.xlarge is a GPU/accelerator type"),
        (
            {"cpu.instance_pools": '["ml.inf2.xlarge"]', "cpu.provision_timeout_s": "600"},
            "cpu.instance_pools: ml.inf2",
        ),
        ({"gpu.instance_type": "ml.c7i.xlarge"}, "gpu.instance_type: ml.c7i.xlarge has no GPU"),
        ({"gpu.instance_type": "ml.inf2.xlarge"}, "has no NVIDIA GPU; the CUDA image needs one"),
        (
            {"gpu.instance_type": "ml.g7e.2xlarge"},
            "gpu.instance_type: ml.g7e.2xlarge has an NVIDIA RTX PRO 6000 Blackwell (sm_120), which needs "
            "CUDA 12.8 or newer; the CUDA image is built with CUDA 12.4",
        ),
        (
            {"gpu.instance_pools": '["ml.p6-b200.48xlarge"]', "gpu.provision_timeout_s": "600"},
            "gpu.instance_pools: ml.p6-b200.48xlarge has an NVIDIA B200 (sm_100)",
        ),
        ({"gpu.instance_type": "ml.g5.3xlarge"}, "ml.g5.3xlarge is not in stacks/instances.py"),
        ({"gpu.instance_pools": '["ml.g5.xlarge"]'}, "gpu.provision_timeout_s: set it with instance_pools"),
        (
            {"gpu.instance_pools": '["ml.g5.xlarge", "ml.g5.xlarge"]', "gpu.provision_timeout_s": "600"},
            "lists an instance type twice",
        ),
        (
            {
                "gpu.instance_pools": json.dumps(
                    ["ml.g5.xlarge", "ml.g5.2xlarge", "ml.g6e.xlarge", "ml.g6.2xlarge", "x"]
                )
            },
            "at most 4 items",
        ),
        ({"gpu.provision_timeout_s": "120"}, "gpu.provision_timeout_s"),
        ({"gpu.volume_size_gb": "100"}, "gpu.volume_size_gb: ml.g6.xlarge has NVMe instance storage"),
        ({"cpu.volume_size_gb": "4"}, "cpu.volume_size_gb: 4 GB is too small for the pinned 3.0 GB model"),
        ({"cpu.volume_size_gb": "600"}, "cpu.volume_size_gb"),
        (
            {"cpu.image_source": "build", "cpu.image_uri": ECR_IMAGE},
            "cpu.image_source: `build` contradicts image_uri",
        ),
        ({"cpu.image_source": "latest"}, "cpu.image_source"),
        (
            {"gpu.image_build.build_args.CUDA_ARCHITECTURES": "80"},
            "CUDA_ARCHITECTURES from the instance types",
        ),
        (
            {"gpu.image_build.timeout_minutes": "600", "gpu.image_build.queued_timeout_minutes": "480"},
            "exceeds the 720 min a CloudFormation WaitCondition can wait",
        ),
        (
            {"model.staging_timeout_minutes": "45"},
            "model.staging_timeout_minutes: 45 + queue 10 + start retries 10 + grace 5 = 70 min exceeds",
        ),
        ({"cpu.alarms.email": "not-an-address"}, "cpu.alarms.email"),
        ({"cpu.alarms.error_5xx_count": "1"}, "cpu.alarms.error_5xx_count: unknown key"),
        ({"cpu.alarms.error_rate_percent": "0"}, "cpu.alarms.error_rate_percent"),
        ({"gpu.routing.strategy": "STICKY"}, "gpu.routing.strategy"),
        ({"gpu.routing.prefix_length": "512"}, "gpu.routing.prefix_length"),
        ({"cpu.instance_type": "c7i.xlarge"}, "is not a SageMaker instance type"),
        ({"cpu.container_startup_health_check_timeout_s": "30"}, "greater than or equal to 60"),
        ({"gpu.model_data_download_timeout_s": "3601"}, "less than or equal to 3600"),
        (
            {"cpu.min_capacity": "5", "cpu.max_capacity": "4"},
            "cpu.min_capacity: 5 must not exceed max_capacity (4)",
        ),
        ({"cpu.initial_instance_count": "9"}, "cpu.initial_instance_count: 9 must lie within"),
        ({"image_uri": "123456789012.dkr.ecr.us-east-1.amazonaws.com/decider:latest"}, "by digest"),
        ({"cpu.image_uri": "docker.io/library/decider@" + DIGEST}, "private ECR image"),
        ({"model_s3_uri": "s3://bucket/model.gguf"}, "must be an S3 prefix ending in '/'"),
        ({"cpu.container.n_ctx": "-1"}, "cpu.container: invalid container setting(s): n_ctx"),
        ({"cpu.container.no_such_knob": "1"}, "no_such_knob"),
        ({"cpu.container.n_ctx": "4096"}, "max_state_tokens (6144) must be below n_ctx (4096)"),
        ({"cpu.instance_typo": "ml.c7i.xlarge"}, "cpu.instance_typo: unknown key"),
        ({"cpu.volume_kms": "true", "cpu.instance_type": "ml.c6id.xlarge"}, "NVMe instance storage"),
        (
            {"cpu.inference_ami_version": "al2-ami-sagemaker-inference-gpu-3-1"},
            "only applies to the gpu variant",
        ),
        ({"gpu.inference_ami_version": "al2-ami-latest"}, "inference_ami_version: must be one of"),
        ({"gpu.inference_ami_version": "al2-ami-sagemaker-inference-neuron-2"}, "inference_ami_version"),
        (
            {"cpu.min_capacity": "1", "cpu.initial_instance_count": "1"},
            "cpu.deployment.step_instance_count: 1 must be at most half of min_capacity",
        ),
        (  # issue 33 §5: LINEAR's 10 % floor at the largest fleet
            {"cpu.deployment.traffic_routing": "LINEAR", "cpu.max_capacity": "20"},
            "cpu.deployment.step_instance_count: 1 is below 10 % of max_capacity (20)",
        ),
        (  # issue 33 §5: the waits against MaximumExecutionTimeoutInSeconds
            {"cpu.deployment.wait_interval_s": "3600", "cpu.deployment.termination_wait_s": "3600"},
            "cpu.deployment.maximum_execution_timeout_s: 7200 s is not larger than the update's waits",
        ),
        (
            {
                "cpu.deployment.traffic_routing": "LINEAR",
                "cpu.deployment.step_instance_count": "1",
                "cpu.max_capacity": "8",
                "cpu.min_capacity": "2",
                "cpu.deployment.wait_interval_s": "900",
            },
            "not larger than the update's waits (7500 s",
        ),
        ({"cpu.log_retention_days": "31"}, "retention periods"),
        ({"model.sha256": "13c16f42a983"}, "model.sha256"),
        ({"cpu.endpoint_name": "decider_cpu"}, "cpu.endpoint_name"),
        ({"cpu.replace_endpoint": "decider-cpu"}, "cannot be endpoint_name (decider-cpu) itself"),
        ({"cpu.replace_endpoint": "decider_cpu"}, "cpu.replace_endpoint"),
        ({"gpu.image_build.build_args.VARIANT": "cpu"}, "VARIANT is set per variant"),
        ({"gpu.image_build.compute_type": "BUILD_GENERAL1_SMALL"}, "gpu.image_build.compute_type"),
    ],
)
def test_invalid_values_fail_with_a_message_naming_the_key(overrides, expected):
    assert expected in error_for(**overrides)


@pytest.mark.parametrize(
    ("types", "archs"),
    [
        (["ml.g6.xlarge"], "89"),
        (["ml.g6.xlarge", "ml.g6e.xlarge"], "89"),
        (
            ["ml.g6e.xlarge", "ml.g6.2xlarge", "ml.g5.2xlarge", "ml.g4dn.2xlarge"],
            "75;86;89",
        ),  # the AWS guide's
        (["ml.p4d.24xlarge", "ml.p5.48xlarge"], "80;90"),
    ],
)
def test_cuda_architectures_follow_the_allowed_gpus(types, archs):
    """Compile for what the config allows (g4dn sm_75 and p4d sm_80 included), nothing more."""
    primary, *pools = types
    overrides = {"gpu.instance_type": primary}
    if pools:
        overrides |= {"gpu.instance_pools": json.dumps(pools), "gpu.provision_timeout_s": "1200"}
    variant = config_with(**overrides).gpu
    assert variant.cuda_architectures == archs
    assert variant.docker_build_args["CUDA_ARCHITECTURES"] == archs
    assert variant.instance_types == types


def test_the_ami_is_chosen_from_the_image_s_cuda_version():
    from decider_stacks.config import CUDA_IMAGE_TOOLKIT, image_cuda_version, inference_ami_for

    assert CUDA_IMAGE_TOOLKIT == image_cuda_version() == "12.4"  # the Dockerfile's nvidia/cuda:12.4.1 bases
    dockerfile = (REPO_ROOT / "container" / "Dockerfile").read_text()
    assert "cuda-compat-12-4" in dockerfile and "cuda:12.4.1-runtime" in dockerfile
    assert inference_ami_for("12.4") == "al2-ami-sagemaker-inference-gpu-3-1"  # driver 550 = CUDA 12.4
    assert inference_ami_for("12.2") == "al2-ami-sagemaker-inference-gpu-2"
    assert inference_ami_for("13.0") == "al2023-ami-sagemaker-inference-gpu-4-1"  # driver 580
    with pytest.raises(ValueError, match=r"CUDA 12\.8"):
        inference_ami_for("12.8")


def test_an_ami_of_another_cuda_major_than_the_image_is_refused():
    # a CUDA 12 container on the driver-580 (CUDA 13) AMI: stuck in Creating with no log (DLC #6187)
    with pytest.raises(Exception, match="another CUDA major can leave the endpoint in Creating"):
        config_with(**{"gpu.inference_ami_version": "al2023-ami-sagemaker-inference-gpu-4-1"})
    assert config_with(
        **{"gpu.inference_ami_version": "al2-ami-sagemaker-inference-gpu-2"}
    ).gpu.ami_version == (
        "al2-ami-sagemaker-inference-gpu-2"  # driver 535: the image's cuda-compat covers 12.4 (entrypoint.sh)
    )


def test_mixed_storage_pools_drop_kms_and_the_volume_size():
    variant = config_with(
        **{"cpu.instance_pools": '["ml.c6id.8xlarge"]', "cpu.provision_timeout_s": "900"}
    ).cpu
    assert not variant.on_ebs and not variant.encrypt_volume and variant.ebs_volume_size_gb is None


def test_a_prebuilt_model_skips_the_volume_size_check():
    config = config_with(model_s3_uri="s3://bucket/models/small/", **{"cpu.volume_size_gb": "4"})
    assert config.cpu.ebs_volume_size_gb == 4


def test_every_problem_is_reported_at_once():
    message = error_for(**{"cpu.container_startup_health_check_timeout_s": "5", "gpu.max_capacity": "0"})
    assert "cpu.container_startup_health_check_timeout_s" in message
    assert "gpu.max_capacity" in message


def test_single_instance_fleet_is_allowed_with_all_at_once():
    config = config_with(
        **{
            "gpu.min_capacity": "1",
            "gpu.initial_instance_count": "1",
            "gpu.deployment.traffic_routing": "ALL_AT_ONCE",
        }
    )
    assert config.gpu.min_capacity == 1


def test_container_environment_uses_the_settings_names_and_the_pinned_model():
    config = config_with()
    env = container_environment(config.gpu, config.model)
    assert (
        env
        == Settings.from_values(
            {"model_file": config.model.file, "model_sha256": config.model.sha256, **config.gpu.container}
        ).to_environment()
    )
    assert env[Settings.env_name("n_gpu_layers")] == "-1"
    assert env[Settings.env_name("model_sha256")] == config.model.sha256
    assert all(name.startswith("DECIDER_") for name in env)


def test_the_synth_machines_decider_variables_never_reach_the_template(monkeypatch):
    """A developer's exported DECIDER_* (e.g. from running the local server) is not a deploy setting."""
    config = config_with()
    clean = container_environment(config.cpu, config.model)
    monkeypatch.setenv(Settings.env_name("n_threads"), "1")
    monkeypatch.setenv(Settings.env_name("n_ctx"), "not a number")  # not even validated against
    assert container_environment(config.cpu, config.model) == clean
    assert Settings.env_name("n_threads") not in clean
    assert config_with() == config  # the config's own container check ignores them too


def test_prebuilt_model_drops_the_pinned_file_and_hash():
    config = config_with(model_s3_uri="s3://bucket/models/other/")
    env = container_environment(config.cpu, config.model)
    assert Settings.env_name("model_file") not in env
    assert Settings.env_name("model_sha256") not in env


def test_synth_machine_environment_does_not_leak_into_the_container(monkeypatch):
    monkeypatch.setenv("DECIDER_N_CTX", "128")
    config = config_with()
    assert container_environment(config.cpu, config.model)["DECIDER_N_CTX"] == "8192"


@pytest.mark.parametrize(
    ("instance_type", "allowed"),
    [
        ("ml.c7i.xlarge", True),
        ("ml.m7i.large", True),
        ("ml.g6.xlarge", False),
        ("ml.g5.2xlarge", False),
        ("ml.c6id.xlarge", False),
        ("ml.p4d.24xlarge", False),
        ("ml.inf2.xlarge", False),
        ("ml.c5.xlarge", True),  # not in stacks/instances.py: by family
        ("ml.g7e.2xlarge", False),
    ],
)
def test_volume_kms_support_follows_instance_storage(instance_type, allowed):
    assert supports_volume_kms(instance_type) is allowed


@pytest.mark.cdk
def test_cdk_entry_point_prints_every_config_error_and_exits_2(capsys):
    """`npx cdk synth -c cpu.instance_type=ml.g6.xlarge` path: the CLI hands the context to app.py."""
    import importlib.util

    from decider_stacks.paths import ROOT

    spec = importlib.util.spec_from_file_location("cdk_app", ROOT / "app.py")
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    context = {**cdk_json_context(), "cpu.instance_type": "ml.g6.xlarge", "gpu.container.n_ctx": "0"}
    assert app.main(context) == 2
    err = capsys.readouterr().err
    assert "cpu.instance_type: ml.g6.xlarge is a GPU/accelerator type" in err
    assert "gpu.container: invalid container setting(s): n_ctx" in err


def test_the_model_context_and_host_tier_must_fit_the_instance_memory():
    """decider.memory_budget at synth: an 8 GiB instance takes the 4B model with the host tier left to
    its default (sized at start from what is left); a fixed 2 GiB tier beside it, or a 4 GiB instance,
    is refused with the numbers."""
    config = config_with(**{"cpu.instance_type": "ml.m6i.large", "cpu.autoscaling": "false"})
    assert config.cpu.instance_type == "ml.m6i.large"
    text = error_for(
        **{
            "cpu.instance_type": "ml.m6i.large",
            "cpu.autoscaling": "false",
            "cpu.container.state_cache_host_mib": "2048",
        }
    )
    assert "cpu on ml.m6i.large: host memory: model 2.8 GiB + KV cache 0.2 GiB" in text
    assert "host tier 2.0 GiB + reserve 1.0 GiB = 9.5 GiB > the instance's 8.0 GiB" in text
    text = error_for(**{"cpu.instance_type": "ml.c6i.large", "cpu.autoscaling": "false"})
    assert "cpu on ml.c6i.large: host memory" in text and "the instance's 4.0 GiB" in text
