"""Pure parts: content-hash names, overrides, the field diff, and AWS_ENDPOINT_URL handling."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from promote_constants import IMAGE_A, IMAGE_B, ROLE

from decider_cli.promote.clients import make_clients
from decider_cli.promote.errors import GuardrailError
from decider_cli.promote.spec import (
    NAME_PATTERN,
    Overrides,
    compute_promotion,
    derived_name,
    field_changes,
    require_digest,
)

MODEL = {
    "ModelName": "m0",
    "ExecutionRoleArn": ROLE,
    "PrimaryContainer": {"Image": IMAGE_A, "ModelDataUrl": "s3://b/model.tar.gz", "Environment": {"A": "1"}},
    "EnableNetworkIsolation": False,
    "Containers": [],
    "VpcConfig": {},
    "CreationTime": "2026-01-01",
    "ModelArn": "arn:x",
}
CONFIG = {
    "EndpointConfigName": "c0",
    "EndpointConfigArn": "arn:y",
    "CreationTime": "2026-01-01",
    "ProductionVariants": [
        {
            "VariantName": "AllTraffic",
            "ModelName": "m0",
            "InitialInstanceCount": 1,
            "InstanceType": "ml.c7i.xlarge",
            "CurrentInstanceCount": 1,
        }
    ],
}


def test_names_are_deterministic_valid_and_short():
    long_endpoint = "d" * 50 + "-" * 5 + "x" * 8  # 63 chars with hyphens where truncation cuts
    for endpoint in ("e", "decider-cpu", long_endpoint):
        first = derived_name(endpoint, "c", {"a": 1})
        assert first == derived_name(endpoint, "c", {"a": 1})
        assert first != derived_name(endpoint, "c", {"a": 2})
        assert len(first) <= 63 and NAME_PATTERN.match(first), first
    assert derived_name("e1", "c", {"a": 1}) != derived_name("e2", "c", {"a": 1})


def test_only_changed_parts_get_new_names():
    same = compute_promotion("decider-cpu", CONFIG, MODEL, Overrides(image=IMAGE_A))
    assert not same.changed and field_changes(same) == []

    scaled = compute_promotion(
        "decider-cpu", CONFIG, MODEL, Overrides(instance_type="ml.c7i.2xlarge", count=2)
    )
    assert scaled.changed and not scaled.new_model and scaled.model_name == "m0"
    assert {c.path for c in field_changes(scaled)} == {
        "EndpointConfigName",
        "ProductionVariants[AllTraffic].InstanceType",
        "ProductionVariants[AllTraffic].InitialInstanceCount",
    }

    promoted = compute_promotion(
        "decider-cpu",
        CONFIG,
        MODEL,
        Overrides(image=IMAGE_B, model_s3="s3://b/gguf/", env={"B": "2"}, unset_env=("A",)),
    )
    container = promoted.model_request["PrimaryContainer"]
    assert container["Image"] == IMAGE_B and "ModelDataUrl" not in container
    assert container["ModelDataSource"] == {
        "S3DataSource": {"S3Uri": "s3://b/gguf/", "S3DataType": "S3Prefix", "CompressionType": "None"}
    }
    assert container["Environment"] == {"B": "2"}
    assert "VpcConfig" not in promoted.model_request and "Containers" not in promoted.model_request
    assert promoted.config_request["ProductionVariants"][0]["ModelName"] == promoted.model_name
    assert "CurrentInstanceCount" not in promoted.config_request["ProductionVariants"][0]


@pytest.mark.parametrize(
    "image", ["repo:latest", "repo@sha256:abc", "repo", f"{IMAGE_A}x", "repo@sha256:" + "A" * 64]
)
def test_digest_required(image):
    with pytest.raises(GuardrailError) as info:
        require_digest(image)
    assert info.value.code == "image_without_digest"


def test_boto3_honours_aws_endpoint_url(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:4566")
    clients = make_clients("eu-west-1", None)
    assert clients.sagemaker.meta.endpoint_url == "http://127.0.0.1:4566"
    assert clients.runtime.meta.endpoint_url == "http://127.0.0.1:4566"
    assert clients.cloudwatch.meta.endpoint_url == "http://127.0.0.1:4566"
    monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME", "http://127.0.0.1:9999")
    assert make_clients("eu-west-1", None).runtime.meta.endpoint_url == "http://127.0.0.1:9999"


def test_console_script_against_moto_server(aws):
    """The installed `promote` entry point, as CI runs it, pointed at moto only by AWS_ENDPOINT_URL."""
    aws.create_endpoint("decider-cpu")
    script = Path(sys.executable).with_name("promote")
    result = subprocess.run(
        [str(script), "plan", "--endpoint", "decider-cpu", "--image", IMAGE_B],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "PrimaryContainer.Image" in result.stdout
    missing = subprocess.run(
        [str(script), "status", "--endpoint", "nope"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=60,
    )
    assert missing.returncode == 1 and "endpoint_not_found" in missing.stderr


def test_missing_profile_and_region_are_clear_errors(monkeypatch, capsys):
    from decider_cli.promote import cli

    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    assert cli.main(["status", "--endpoint", "e", "--profile", "nope", "--region", "us-east-1"]) == 1
    assert "error[profile_not_found]" in capsys.readouterr().err
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    assert cli.main(["status", "--endpoint", "e"]) == 1
    assert "error[no_region]" in capsys.readouterr().err


def test_the_copied_config_keeps_instance_pools_and_the_provision_timeout():
    """Issue 33 §4: every ProductionVariant field the live config has reaches the promoted config."""
    pools = [
        {"InstanceType": "ml.g6.xlarge", "Priority": 1},
        {"InstanceType": "ml.g5.xlarge", "Priority": 2},
    ]
    variant = {
        **CONFIG["ProductionVariants"][0],
        "InstancePools": pools,
        "VariantInstanceProvisionTimeoutInSeconds": 1800,
    }
    promotion = compute_promotion(
        "decider-gpu", {**CONFIG, "ProductionVariants": [variant]}, MODEL, Overrides(image=IMAGE_B)
    )
    promoted = promotion.config_request["ProductionVariants"][0]
    assert promoted["InstancePools"] == pools
    assert promoted["VariantInstanceProvisionTimeoutInSeconds"] == 1800


def test_the_copied_keys_are_every_create_member_of_the_installed_botocore():
    """A field SageMaker adds to ProductionVariant or CreateEndpointConfig is copied, not dropped."""
    import botocore.session

    from decider_cli.promote.spec import CONFIG_KEYS, VARIANT_KEYS

    service = botocore.session.get_session().get_service_model("sagemaker")
    assert set(VARIANT_KEYS) == set(service.shape_for("ProductionVariant").members)
    create = set(service.operation_model("CreateEndpointConfig").input_shape.members)
    assert set(CONFIG_KEYS) == create - {"EndpointConfigName", "Tags"}
