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
    """The CI path: prebuilt image and model for both variants, data capture on, LINEAR on GPU."""
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
    }
    return run_synth(tmp_path_factory.mktemp("cdk-prebuilt"), context)
