"""A moto server on a free localhost port, reached through AWS_ENDPOINT_URL like a real emulator."""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import moto_update_endpoint
import pytest
from moto.server import ThreadedMotoServer
from promote_constants import IMAGE_A, REGION, ROLE
from rich.console import Console

from decider_cli.promote import cli


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def moto_url() -> Iterator[str]:
    moto_update_endpoint.install()
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def _post(url: str, payload: dict[str, Any] | None = None) -> None:
    data = json.dumps(payload or {}).encode()
    request = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


@dataclass
class Aws:
    url: str
    sagemaker: Any
    cloudwatch: Any
    simulator: moto_update_endpoint.UpdateSimulator

    def queue_invoke_results(self, *bodies: Any) -> None:
        """InvokeEndpoint answers, in call order (moto's static results API)."""
        results = [
            {"Body": body if isinstance(body, str) else json.dumps(body), "ContentType": "application/json"}
            for body in bodies
        ]
        _post(
            f"{self.url}/moto-api/static/sagemaker/endpoint-results", {"results": results, "region": REGION}
        )

    def create_endpoint(
        self,
        name: str,
        *,
        image: str = IMAGE_A,
        tags: list[dict[str, str]] | None = None,
        instance_type: str = "ml.c5.xlarge",
    ) -> None:
        model, config = f"{name}-model-0", f"{name}-config-0"
        self.sagemaker.create_model(
            ModelName=model,
            ExecutionRoleArn=ROLE,
            PrimaryContainer={
                "Image": image,
                "ModelDataSource": {
                    "S3DataSource": {
                        "S3Uri": "s3://models/smollm2/",
                        "S3DataType": "S3Prefix",
                        "CompressionType": "None",
                    }
                },
                "Environment": {"DECIDER_N_CTX": "2048"},
            },
        )
        self.sagemaker.create_endpoint_config(
            EndpointConfigName=config,
            ProductionVariants=[
                {
                    "VariantName": "AllTraffic",
                    "ModelName": model,
                    "InitialInstanceCount": 1,
                    "InstanceType": instance_type,
                    "InitialVariantWeight": 1.0,
                    "ContainerStartupHealthCheckTimeoutInSeconds": 600,
                }
            ],
        )
        self.sagemaker.create_endpoint(EndpointName=name, EndpointConfigName=config, Tags=tags or [])

    def create_alarm(self, name: str, state: str = "OK") -> None:
        self.cloudwatch.put_metric_alarm(
            AlarmName=name,
            MetricName="Invocation5XXErrors",
            Namespace="AWS/SageMaker",
            Statistic="Sum",
            Period=60,
            EvaluationPeriods=1,
            Threshold=1.0,
            ComparisonOperator="GreaterThanOrEqualToThreshold",
        )
        self.cloudwatch.set_alarm_state(AlarmName=name, StateValue=state, StateReason="test")

    def endpoint(self, name: str) -> dict[str, Any]:
        return self.sagemaker.describe_endpoint(EndpointName=name)

    def tags(self, arn: str) -> dict[str, str]:
        return {t["Key"]: t["Value"] for t in self.sagemaker.list_tags(ResourceArn=arn)["Tags"]}


@pytest.fixture
def aws(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> Aws:
    """A clean moto state per test; the env points boto3 (and `promote`) at the server."""
    _post(f"{moto_url}/moto-api/reset")
    moto_update_endpoint.SIMULATOR.reset()
    for key, value in {
        "AWS_ENDPOINT_URL": moto_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_CONFIG_FILE": "/dev/null",
        "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setattr(cli, "console", Console(width=240, highlight=False, force_terminal=False))
    monkeypatch.setattr(cli, "err_console", Console(width=240, highlight=False, stderr=True))
    session = boto3.Session(region_name=REGION)
    return Aws(
        moto_url, session.client("sagemaker"), session.client("cloudwatch"), moto_update_endpoint.SIMULATOR
    )
