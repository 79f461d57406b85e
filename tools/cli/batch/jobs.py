"""The Batch Transform job of `decide-batch`: its request, progress and the summary of its output.

A job runs the stack's Batch Transform Model (the output `TransformModelName` of a stack deployed with
`-c <variant>.batch_transform=true`: the same image and settings as the endpoint's Model, the model from
a `model.tar.gz` through ModelDataUrl), on the variant's instance type, over every object under an S3
prefix of JSON Lines (one decision request per line). The endpoint's own Model loads the GGUF through
ModelDataSource, and "Currently you cannot use ModelDataSource in conjunction with SageMaker batch
transform" (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_ContainerDefinition.html):
such a model is refused before a job is started.

- `SplitType=Line`, `BatchStrategy=MultiRecord`: as many whole lines per invocation as fit under
  `MaxPayloadInMB`, which the container chooses (`GET /execution-parameters`) unless given;
- `AssembleWith=Line`, `Accept=application/jsonlines`: one output line per input line, written to
  `<output>/<input key>.out`;
- `JoinSource=Input`: each output line is the input object plus `SageMakerOutput` (the decision,
  or the record's error body);
- `InvocationsTimeoutInSeconds` (default here 3600, the maximum) also goes to the container as
  `DECIDER_BATCH_INVOCATION_TIMEOUT_SECONDS`, its deadline under `SAGEMAKER_BATCH=true`.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import ClientError

from decider_stacks.config import CUDA_IMAGE_TOOLKIT, TRANSFORM_MODEL_OUTPUT, transform_ami_for
from decider_stacks.instances import family_of, gpu_model

S3_URI_RE = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])/(?P<key>.*)$")
JSONLINES = "application/jsonlines"
DEFAULT_TIMEOUT_SECONDS = 3600
TERMINAL_STATES = frozenset({"Completed", "Failed", "Stopped"})
INVOCATION_TIMEOUT_ENV = "DECIDER_BATCH_INVOCATION_TIMEOUT_SECONDS"
OUTPUT_KEY = "SageMakerOutput"


class BatchError(Exception):
    """A usage or AWS problem `decide-batch` reports as one message."""


def split_s3_uri(uri: str) -> tuple[str, str]:
    match = S3_URI_RE.match(uri)
    if not match:
        raise BatchError(f"{uri!r} is not an s3://bucket/prefix URI")
    return match["bucket"], match["key"]


def stack_name(variant: str) -> str:
    return "GpuStack" if variant == "gpu" else "CpuStack"


def transform_model_of_stack(cloudformation: Any, variant: str) -> str:
    """The Batch Transform Model the variant's stack outputs (`TransformModelName`)."""
    name = stack_name(variant)
    try:
        stacks = cloudformation.describe_stacks(StackName=name)["Stacks"]
    except ClientError as exc:
        raise BatchError(f"cannot read stack {name}: {exc}") from None
    outputs = {o["OutputKey"]: o["OutputValue"] for o in (stacks[0].get("Outputs") or []) if stacks}
    if TRANSFORM_MODEL_OUTPUT not in outputs:
        raise BatchError(
            f"{name} has no {TRANSFORM_MODEL_OUTPUT} output: deploy it with "
            f"-c {variant}.batch_transform=true (a Model on a model.tar.gz that Batch Transform can run)"
        )
    return outputs[TRANSFORM_MODEL_OUTPUT]


def check_transformable(sagemaker: Any, model_name: str) -> None:
    """Refuse a Model that loads its data through ModelDataSource: every transform job of it fails."""
    try:
        model = sagemaker.describe_model(ModelName=model_name)
    except ClientError as exc:
        raise BatchError(f"cannot read model {model_name}: {exc}") from None
    containers = [model.get("PrimaryContainer") or {}, *(model.get("Containers") or [])]
    if any(container.get("ModelDataSource") for container in containers):
        raise BatchError(
            f"{model_name} loads its model through ModelDataSource, which Batch Transform cannot use; "
            "use the stack's TransformModelName (deploy with -c <variant>.batch_transform=true)"
        )


def gpu_transform_ami(instance_type: str, cuda_architectures: str | None) -> str | None:
    """TransformAmiVersion for a job on `instance_type`: None on CPU; on a GPU, the batch AMI the
    CUDA image's toolkit runs on (decider_stacks.config.transform_ami_for), after checking that the image
    was compiled for that GPU (the variant's CUDA architectures): without SASS for it, the CUDA
    runtime would have to JIT PTX newer than driver 535 knows. Raises BatchError with the reason."""
    model = gpu_model(instance_type)
    if model is None:
        if family_of(instance_type)[:1] in ("g", "p"):  # every g*/p* transform type has NVIDIA GPUs
            raise BatchError(
                f"{instance_type}: a GPU family stacks/instances.py does not know, so neither does the "
                "CUDA image's build: run it on the variant's GPU types"
            )
        return None
    if cuda_architectures is None or model.cuda_arch not in cuda_architectures.split(";"):
        raise BatchError(
            f"{instance_type} has a {model.name} (sm_{model.cuda_arch}) and the variant's image is built "
            f"for {cuda_architectures or 'no GPU'}: run it on the variant's GPU types"
        )
    try:
        return transform_ami_for(CUDA_IMAGE_TOOLKIT)
    except ValueError as exc:
        raise BatchError(f"refusing a GPU transform job: {exc}") from None


def default_job_name(variant: str, now: dt.datetime | None = None) -> str:
    stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%d-%H%M%S")
    return f"decide-{variant}-{stamp}"


@dataclass(frozen=True)
class JobSpec:
    name: str
    model_name: str
    input_uri: str
    output_uri: str
    instance_type: str
    instance_count: int = 1
    timeout_seconds: int = DEFAULT_TIMEOUT_SECONDS
    max_retries: int = 1
    max_payload_mb: int | None = None  # None: the container's /execution-parameters
    max_concurrent: int | None = None
    join_input: bool = True
    tags: dict[str, str] = field(default_factory=dict)
    ami_version: str | None = None  # TransformAmiVersion: set for GPU types (gpu_transform_ami)


def transform_job_request(spec: JobSpec) -> dict[str, Any]:
    """CreateTransformJob's parameters for `spec`."""
    split_s3_uri(spec.input_uri)
    split_s3_uri(spec.output_uri)
    if not 1 <= spec.timeout_seconds <= DEFAULT_TIMEOUT_SECONDS:
        raise BatchError(
            f"--timeout must be 1-3600 s (InvocationsTimeoutInSeconds), got {spec.timeout_seconds}"
        )
    if not 0 <= spec.max_retries <= 3:
        raise BatchError(f"--max-retries must be 0-3 (InvocationsMaxRetries), got {spec.max_retries}")
    request: dict[str, Any] = {
        "TransformJobName": spec.name,
        "ModelName": spec.model_name,
        "BatchStrategy": "MultiRecord",
        "ModelClientConfig": {
            "InvocationsTimeoutInSeconds": spec.timeout_seconds,
            "InvocationsMaxRetries": spec.max_retries,
        },
        "Environment": {INVOCATION_TIMEOUT_ENV: str(spec.timeout_seconds)},
        "TransformInput": {
            "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": spec.input_uri}},
            "ContentType": JSONLINES,
            "CompressionType": "None",
            "SplitType": "Line",
        },
        "TransformOutput": {"S3OutputPath": spec.output_uri, "Accept": JSONLINES, "AssembleWith": "Line"},
        "TransformResources": {
            "InstanceType": spec.instance_type,
            "InstanceCount": spec.instance_count,
            **({"TransformAmiVersion": spec.ami_version} if spec.ami_version else {}),
        },
        "DataProcessing": {"JoinSource": "Input" if spec.join_input else "None"},
        "Tags": [{"Key": k, "Value": v} for k, v in sorted(spec.tags.items())],
    }
    if spec.max_payload_mb is not None:
        if not 1 <= spec.max_payload_mb <= 100:
            raise BatchError("--max-payload-mb must be 1-100")
        request["MaxPayloadInMB"] = spec.max_payload_mb
    if spec.max_concurrent is not None:
        request["MaxConcurrentTransforms"] = spec.max_concurrent
    return request


def list_keys(s3: Any, uri: str, suffix: str = "") -> list[str]:
    bucket, prefix = split_s3_uri(uri)
    keys: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [item["Key"] for item in page.get("Contents", []) if item["Key"].endswith(suffix)]
    return keys


@dataclass(frozen=True)
class Progress:
    status: str
    inputs: int
    outputs: int
    seconds: float | None
    failure: str | None = None

    def line(self) -> str:
        elapsed = f", {self.seconds:.0f} s" if self.seconds is not None else ""
        failure = f": {self.failure}" if self.failure else ""
        return f"{self.status}: {self.outputs}/{self.inputs} input objects written{elapsed}{failure}"

    @property
    def done(self) -> bool:
        return self.status in TERMINAL_STATES


def _seconds(job: dict[str, Any], now: dt.datetime | None = None) -> float | None:
    start = job.get("TransformStartTime") or job.get("CreationTime")
    if start is None:
        return None
    end = job.get("TransformEndTime") or now or dt.datetime.now(dt.UTC)
    return max(0.0, (end - start).total_seconds())


def progress(sagemaker: Any, s3: Any, name: str) -> Progress:
    """Where a job stands: its status and how many input objects have their `.out` written."""
    job = sagemaker.describe_transform_job(TransformJobName=name)
    input_uri = job["TransformInput"]["DataSource"]["S3DataSource"]["S3Uri"]
    output_uri = job["TransformOutput"]["S3OutputPath"]
    inputs = len(list_keys(s3, input_uri))
    outputs = len(list_keys(s3, output_uri.rstrip("/") + "/", ".out"))
    return Progress(job["TransformJobStatus"], inputs, outputs, _seconds(job), job.get("FailureReason"))


@dataclass
class Summary:
    records: int = 0
    answered: int = 0
    decisions: int = 0  # answered questions
    errors: Counter[str] = field(default_factory=Counter)
    seconds: float | None = None

    def add(self, output: Any) -> None:
        self.records += 1
        if isinstance(output, dict) and "error" in output and isinstance(output["error"], dict):
            self.errors[str(output["error"].get("code"))] += 1
            return
        if isinstance(output, dict) and "answers" in output:
            self.answered += 1
            self.decisions += len(output["answers"])
        elif isinstance(output, dict) and "results" in output:
            self.answered += 1
            self.decisions += sum(len(result.get("answers", ())) for result in output["results"])
        else:
            self.errors["unreadable_output"] += 1

    def as_dict(self) -> dict[str, Any]:
        rate = self.decisions / self.seconds if self.seconds else None
        return {
            "records": self.records,
            "answered": self.answered,
            "errors": sum(self.errors.values()),
            "errors_by_code": dict(sorted(self.errors.items())),
            "decisions": self.decisions,
            "seconds": self.seconds,
            "decisions_per_second": round(rate, 3) if rate is not None else None,
        }

    def lines(self) -> list[str]:
        data = self.as_dict()
        out = [
            f"records {data['records']}: answered {data['answered']}, per-record errors {data['errors']}",
            f"decisions {data['decisions']}"
            + (
                f" in {data['seconds']:.0f} s = {data['decisions_per_second']} decisions/s"
                if self.seconds
                else ""
            ),
        ]
        out += [f"  {code}: {count}" for code, count in data["errors_by_code"].items()]
        return out


def outputs_of(lines: Iterable[bytes | str], *, joined: bool = True) -> Iterator[Any]:
    """The container's output of each line (`SageMakerOutput` of a joined line)."""
    for raw in lines:
        text = raw.decode() if isinstance(raw, bytes) else raw
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except ValueError:
            yield None
            continue
        yield line.get(OUTPUT_KEY) if joined and isinstance(line, dict) and OUTPUT_KEY in line else line


def summarize(lines: Iterable[bytes | str], *, joined: bool = True, seconds: float | None = None) -> Summary:
    summary = Summary(seconds=seconds)
    for output in outputs_of(lines, joined=joined):
        summary.add(output)
    return summary


def fetch(sagemaker: Any, s3: Any, name: str) -> tuple[Summary, list[tuple[str, bytes]]]:
    """Download every `.out` object of a job; (summary, [(key, bytes)])."""
    job = sagemaker.describe_transform_job(TransformJobName=name)
    if job["TransformJobStatus"] != "Completed":
        raise BatchError(
            f"{name} is {job['TransformJobStatus']}"
            + (f": {job['FailureReason']}" if job.get("FailureReason") else "")
            + "; fetch reads the output of a Completed job"
        )
    output_uri = job["TransformOutput"]["S3OutputPath"].rstrip("/") + "/"
    bucket, _ = split_s3_uri(output_uri)
    joined = job.get("DataProcessing", {}).get("JoinSource") == "Input"
    summary = Summary(seconds=_seconds(job))
    objects: list[tuple[str, bytes]] = []
    for key in sorted(list_keys(s3, output_uri, ".out")):
        data = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        objects.append((key, data))
        for output in outputs_of(data.splitlines(), joined=joined):
            summary.add(output)
    return summary, objects
