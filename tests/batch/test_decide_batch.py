"""`decide-batch` against moto (create/describe_transform_job, S3): the job request it sends, progress,
fetch and its summary, and the refusals. No real AWS call, no container run (moto completes a job at
once); the container side of the contract is tests/server/test_live_batch_transform.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from decider_cli.batch import cli
from decider_cli.batch.jobs import BatchError, JobSpec, progress, summarize, transform_job_request
from decider_stacks.config import load_config
from decider_stacks.synth import cdk_json_context

REGION = "us-east-1"
ROLE = "arn:aws:iam::123456789012:role/decider-execution"
BUCKET = "decider-batch-test"


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with mock_aws():
        clients = {
            "sagemaker": boto3.client("sagemaker", REGION),
            "s3": boto3.client("s3", REGION),
            "cloudformation": boto3.client("cloudformation", REGION),
        }
        endpoint = load_config(cdk_json_context()).variant("cpu").endpoint_name
        sm = clients["sagemaker"]
        image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/decider@sha256:" + "a" * 64
        sm.create_model(  # the endpoint's Model: the GGUF through ModelDataSource
            ModelName="decider-cpu-model-1",
            ExecutionRoleArn=ROLE,
            PrimaryContainer={
                "Image": image,
                "ModelDataSource": {
                    "S3DataSource": {
                        "S3Uri": f"s3://{BUCKET}/models/m/",
                        "S3DataType": "S3Prefix",
                        "CompressionType": "None",
                    }
                },
            },
        )
        sm.create_model(  # the stack's Batch Transform Model: a model.tar.gz through ModelDataUrl
            ModelName="decider-cpu-transform-1",
            ExecutionRoleArn=ROLE,
            PrimaryContainer={"Image": image, "ModelDataUrl": f"s3://{BUCKET}/models/m/model.tar.gz"},
        )
        clients["cloudformation"].create_stack(
            StackName="CpuStack",
            TemplateBody=json.dumps(
                {
                    "Resources": {"Topic": {"Type": "AWS::SNS::Topic"}},
                    "Outputs": {"TransformModelName": {"Value": "decider-cpu-transform-1"}},
                }
            ),
        )
        sm.create_endpoint_config(
            EndpointConfigName="decider-cpu-config-1",
            ProductionVariants=[
                {
                    "VariantName": "AllTraffic",
                    "ModelName": "decider-cpu-model-1",
                    "InstanceType": "ml.c5.xlarge",
                    "InitialInstanceCount": 1,
                }
            ],
        )
        sm.create_endpoint(EndpointName=endpoint, EndpointConfigName="decider-cpu-config-1")
        clients["s3"].create_bucket(Bucket=BUCKET)
        clients["s3"].put_object(Bucket=BUCKET, Key="in/a.jsonl", Body=b'{"state":"x","questions":{}}\n')
        yield clients


def _run(clients: dict[str, Any], *argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(list(argv), clients=clients)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_submit_runs_the_stacks_transform_model_not_the_endpoints(
    aws: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """The endpoint's Model loads through ModelDataSource, which Batch Transform cannot use; the job
    runs the stack's TransformModelName (ModelDataUrl)."""
    code, out = _run(
        aws,
        "submit",
        "--variant",
        "cpu",
        "--input",
        f"s3://{BUCKET}/in/",
        "--output",
        f"s3://{BUCKET}/out/",
        "--job-name",
        "decide-cpu-test",
        "--instance-count",
        "2",
        capsys=capsys,
    )
    assert code == 0, out
    assert "started decide-cpu-test: model decider-cpu-transform-1 on 2 x" in out
    job = aws["sagemaker"].describe_transform_job(TransformJobName="decide-cpu-test")
    variant = load_config(cdk_json_context()).variant("cpu")
    assert job["ModelName"] == "decider-cpu-transform-1"
    assert job["TransformResources"] == {"InstanceType": variant.instance_type, "InstanceCount": 2}
    assert job["TransformInput"]["SplitType"] == "Line"
    assert job["TransformInput"]["ContentType"] == "application/jsonlines"
    assert job["TransformOutput"]["AssembleWith"] == "Line"
    assert job["DataProcessing"]["JoinSource"] == "Input"
    assert job["BatchStrategy"] == "MultiRecord"
    assert job["ModelClientConfig"]["InvocationsTimeoutInSeconds"] == 3600
    assert job["Environment"] == {"DECIDER_BATCH_INVOCATION_TIMEOUT_SECONDS": "3600"}
    assert "MaxPayloadInMB" not in job  # the container's /execution-parameters decides


def test_status_and_fetch_summarise_the_output(
    aws: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = JobSpec(
        "decide-cpu-fetch",
        "decider-cpu-model-1",
        f"s3://{BUCKET}/in/",
        f"s3://{BUCKET}/out/",
        "ml.c7i.xlarge",
    )
    aws["sagemaker"].create_transform_job(**transform_job_request(spec))
    answered = {
        "model": "m",
        "answers": {"a": {"type": "noul", "noul": 0.5}, "b": {"type": "noul", "noul": 0.1}},
    }
    error = {
        "error": {"type": "invalid_request_error", "code": "missing_field", "message": "m", "param": "q"},
        "detail": [],
    }
    lines = [
        {"id": 1, "state": "x", "SageMakerOutput": answered},
        {"id": 2, "state": "y", "SageMakerOutput": error},
        {"id": 3, "SageMakerOutput": answered},
    ]
    body = "".join(json.dumps(line) + "\n" for line in lines).encode()
    aws["s3"].put_object(Bucket=BUCKET, Key="out/a.jsonl.out", Body=body)
    state = progress(aws["sagemaker"], aws["s3"], "decide-cpu-fetch")
    assert (state.status, state.inputs, state.outputs) == ("Completed", 1, 1)
    code, out = _run(aws, "status", "decide-cpu-fetch", capsys=capsys)
    assert code == 0 and "Completed: 1/1 input objects written" in out
    code, out = _run(aws, "fetch", "decide-cpu-fetch", "--dest", str(tmp_path), capsys=capsys)
    assert code == 0, out
    assert "records 3: answered 2, per-record errors 1" in out and "missing_field: 1" in out
    assert (tmp_path / "out" / "a.jsonl.out").read_bytes() == body
    code, out = _run(aws, "fetch", "decide-cpu-fetch", "--json", capsys=capsys)
    summary = json.loads(out)
    assert summary["decisions"] == 4 and summary["errors_by_code"] == {"missing_field": 1}


def test_refusals(aws: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(aws, "submit", "--variant", "cpu", "--input", "bucket/x", "--output", f"s3://{BUCKET}/o/",
                     capsys=capsys)  # fmt: skip
    assert code == 2 and "is not an s3://bucket/prefix URI" in out
    code, out = _run(aws, "submit", "--variant", "gpu", "--input", f"s3://{BUCKET}/in/", "--output",
                     f"s3://{BUCKET}/o/", capsys=capsys)  # fmt: skip
    assert code == 2 and "cannot read stack GpuStack" in out
    code, out = _run(aws, "submit", "--variant", "cpu", "--model", "decider-cpu-model-1", "--input",
                     f"s3://{BUCKET}/in/", "--output", f"s3://{BUCKET}/o/", capsys=capsys)  # fmt: skip
    assert code == 2
    assert (
        "decider-cpu-model-1 loads its model through ModelDataSource, which Batch Transform cannot use" in out
    )
    assert aws["sagemaker"].list_transform_jobs()["TransformJobSummaries"] == []  # nothing started
    with pytest.raises(BatchError, match="1-3600"):
        transform_job_request(
            JobSpec("j", "m", "s3://b1b/i/", "s3://b1b/o/", "ml.c7i.xlarge", timeout_seconds=7200)
        )


def test_summary_of_unjoined_lines_and_rates() -> None:
    summary = summarize(
        [b'{"answers": {"a": {}}}', b"not json", b'{"results": [{"answers": {"a": {}, "b": {}}}]}', b""],
        joined=False,
        seconds=2.0,
    )
    assert summary.as_dict() == {
        "records": 3,
        "answered": 2,
        "errors": 1,
        "errors_by_code": {"unreadable_output": 1},
        "decisions": 3,
        "seconds": 2.0,
        "decisions_per_second": 1.5,
    }


def test_gpu_submit_pins_the_batch_ami_the_cuda_image_runs_on(
    aws: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 33 §4: a GPU transform job without TransformAmiVersion runs on whatever driver SageMaker
    picks; the CUDA 12.4 image needs a CUDA 12 driver (535, with cuda-compat-12-4), never the 470 AMI."""
    aws["sagemaker"].create_model(
        ModelName="decider-gpu-transform-1",
        ExecutionRoleArn=ROLE,
        PrimaryContainer={
            "Image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/decider@sha256:" + "c" * 64,
            "ModelDataUrl": f"s3://{BUCKET}/models/g-batch-transform/model.tar.gz",
        },
    )
    aws["cloudformation"].create_stack(
        StackName="GpuStack",
        TemplateBody=json.dumps(
            {
                "Resources": {"Topic": {"Type": "AWS::SNS::Topic"}},
                "Outputs": {"TransformModelName": {"Value": "decider-gpu-transform-1"}},
            }
        ),
    )
    argv = ["submit", "--variant", "gpu", "--input", f"s3://{BUCKET}/in/", "--output", f"s3://{BUCKET}/o/"]
    code, out = _run(aws, *argv, "--job-name", "decide-gpu-test", capsys=capsys)
    assert code == 0, out
    job = aws["sagemaker"].describe_transform_job(TransformJobName="decide-gpu-test")
    assert job["TransformResources"]["TransformAmiVersion"] == "al2-ami-sagemaker-batch-gpu-535"
    # a GPU the image was not compiled for, or one it does not know, is refused before anything starts
    for instance_type, why in (("ml.g4dn.xlarge", "sm_75"), ("ml.p3.2xlarge", "does not know")):
        code, out = _run(aws, *argv, "--instance-type", instance_type, "--job-name", "j2", capsys=capsys)
        assert code == 2 and why in out, out
    assert len(aws["sagemaker"].list_transform_jobs()["TransformJobSummaries"]) == 1
    # the CPU job sets no AMI
    assert (
        "TransformAmiVersion"
        not in transform_job_request(JobSpec("j", "m", "s3://b1b/i/", "s3://b1b/o/", "ml.c7i.xlarge"))[
            "TransformResources"
        ]
    )


def test_transform_ami_follows_the_cuda_major() -> None:
    from decider_stacks.config import CUDA_IMAGE_TOOLKIT, transform_ami_for

    assert CUDA_IMAGE_TOOLKIT == "12.4"
    assert transform_ami_for("12.4") == "al2-ami-sagemaker-batch-gpu-535"
    assert transform_ami_for("11.8") == "al2-ami-sagemaker-batch-gpu-470"
    with pytest.raises(ValueError, match="no Batch Transform AMI"):
        transform_ami_for("13.0")
