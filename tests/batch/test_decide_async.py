"""`decide-batch async` on moto: the request body uploaded under the artifacts bucket's async/ prefix,
InvokeEndpointAsync, and the answer waited for and printed (moto writes a canned answer)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from decider_cli.batch import cli
from decider_cli.batch.async_job import AsyncInvocation, wait_for_answer
from decider_cli.batch.jobs import BatchError

REGION = "us-east-1"
ACCOUNT = "123456789012"


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        clients = {
            name: boto3.client(name, REGION) for name in ("sagemaker", "s3", "sagemaker-runtime", "sts")
        }
        clients["s3"].create_bucket(Bucket=f"decider-artifacts-{ACCOUNT}-{REGION}")
        yield clients


def test_one_request_through_an_async_variant(
    aws: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}))
    code = cli.main(
        ["async", "--variant", "cpu", "-c", "cpu.invocation=async", "--input", str(request), "--wait"],
        clients=aws,
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"s3://decider-artifacts-{ACCOUNT}-{REGION}/async/decider-cpu/input/" in out
    assert '"default": "response"' in out  # moto's canned answer, read back from the output location
    (uploaded,) = aws["s3"].list_objects_v2(Bucket=f"decider-artifacts-{ACCOUNT}-{REGION}")["Contents"]
    assert uploaded["Key"].startswith("async/decider-cpu/input/") and uploaded["Key"].endswith(".json")


def test_a_realtime_variant_is_refused(
    aws: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    request = tmp_path / "request.json"
    request.write_text("{}")
    assert cli.main(["async", "--variant", "cpu", "--input", str(request)], clients=aws) == 2
    assert "deploy it with -c cpu.invocation=async" in capsys.readouterr().err


def test_waiting_gives_up_with_a_message() -> None:
    class NoObjects:
        class exceptions:  # noqa: N801 - boto3's shape
            class NoSuchKey(Exception):  # noqa: N818 - boto3's name
                pass

            ClientError = Exception

        def get_object(self, **_: Any) -> Any:
            raise self.exceptions.NoSuchKey

    ticks = iter(range(100))
    invocation = AsyncInvocation("id-1", "s3://b1b/i.json", "s3://b1b/o.out", "s3://b1b/f.out")
    with pytest.raises(BatchError, match=r"no answer at s3://b1b/o\.out"):
        wait_for_answer(
            NoObjects(), invocation, timeout_seconds=3, sleep=lambda _: None, clock=lambda: next(ticks)
        )
