"""Synthesize the CDK app once per session (in-process, offline) and share the templates."""

from __future__ import annotations

import os

import pytest
from stack_helpers import Synth, run_synth

# Node 20 still works for jsii; keep its end-of-life banner out of the test output.
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")


PYTHON_MIRROR = "public.ecr.aws/docker/library/python:3.11.14-slim-bookworm"


@pytest.fixture(scope="session")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """The default app (cdk.json context only), synthesized once."""
    return run_synth(tmp_path_factory.mktemp("cdk-default"))


@pytest.fixture(scope="session")
def synth_prebuilt(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """The CI path and the options: prebuilt image (GPU) and model (both), a CPU source build on
    2XLARGE without autoscaling, data capture, LINEAR routing, instance pools and PREFIX_AWARE on GPU."""
    context = {
        "image_uri": "123456789012.dkr.ecr.eu-west-1.amazonaws.com/decider@sha256:" + "a" * 64,
        "model_s3_uri": "s3://ci-models/qwen/",
        "cpu.data_capture.enabled": "true",
        "cpu.data_capture.sampling_percentage": "25",
        "gpu.deployment.traffic_routing": "LINEAR",
        "gpu.instance_type": "ml.g6.2xlarge",
        "gpu.autoscaling": "false",
        "cpu.image_uri": "null",  # as `-c cpu.image_uri=null`: the CPU image is still built (mirror)
        "cpu.image_build.build_args.PYTHON_IMAGE": PYTHON_MIRROR,
        "cpu.image_build.compute_type": "BUILD_GENERAL1_2XLARGE",
        "cpu.image_source": "build",
        "cpu.volume_size_gb": "40",
        "cpu.autoscaling": "false",
        "cpu.alarms.email": "ops@example.com",
        # GPU capacity options: fallback pools, their provisioning timeout, prefix-aware routing
        "gpu.instance_pools": '["ml.g6e.2xlarge", "ml.g5.2xlarge"]',
        "gpu.provision_timeout_s": "1200",
        "gpu.routing.strategy": "PREFIX_AWARE",
        "gpu.routing.prefix_length": "2048",
    }
    return run_synth(tmp_path_factory.mktemp("cdk-prebuilt"), context)
