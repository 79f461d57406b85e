"""The scratch lab of a game day: the app's own stacks (ImageStack and CpuStack, exactly as
`cdk deploy` synthesizes them) on the smallest CPU instance, serving the bundled SmolLM2.

The lab deploys with the CDK CLI the way a user does, with `-c` overrides that only make the run small
and its own (`lab_context`): a project and endpoint name per run, a prebuilt image and a model prefix
(so no CodeBuild build runs), one instance, ALL_AT_ONCE updates. Every guard, bake load, post-deploy
check and parking path is the shipped one. Scenarios update the stack by deploying again with more
overrides, as a user would; `teardown` deletes both stacks and everything they retain or leave.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from botocore.exceptions import ClientError

from decider_stacks.config import archive_key
from decider_stacks.handlers.post_deploy_check import parked_prefix
from decider_stacks.paths import ROOT

SMALLEST_INSTANCE = "ml.c6i.large"  # the cheapest CPU type the CPU image runs on (stacks/instances.py)
OTHER_INSTANCE = "ml.m6i.large"  # an instance-type change, which the update guard refuses
IMAGE_STACK, ENDPOINT_STACK = "ImageStack", "CpuStack"
APP_STACKS = (IMAGE_STACK, ENDPOINT_STACK, "GpuStack")
TERMINAL = re.compile(r"(_COMPLETE|_FAILED)$")
BUSY_ENDPOINT = ("Creating", "Updating", "SystemUpdating", "RollingBack")
CDK = ROOT / "node_modules" / ".bin" / "cdk"


@dataclass(frozen=True)
class Scratch:
    """What a game day runs on: a scratch account and bucket, a prebuilt image and a run id."""

    run_id: str
    account: str
    region: str
    image: str  # <account>.dkr.ecr.<region>.amazonaws.com/<repository>@sha256:<digest>
    bucket: str  # a scratch bucket the game day writes the model to (under work_prefix)
    model_file: str  # the bundled GGUF's file name
    instance_type: str = SMALLEST_INSTANCE
    hanging_image: str | None = None  # answers /ping, never /invocations (tools/dev/gameday/hang/)

    @property
    def name(self) -> str:
        """The run's project and endpoint name."""
        return f"gameday-{self.run_id}"

    @property
    def work_prefix(self) -> str:
        """Where the game day writes in the scratch bucket."""
        return f"gameday/{self.run_id}/"

    @property
    def model_prefix(self) -> str:
        return f"{self.work_prefix}model/"

    @property
    def model_s3_uri(self) -> str:
        return f"s3://{self.bucket}/{self.model_prefix}"

    @property
    def artifacts_bucket(self) -> str:
        """ImageStack's artifacts bucket (decider_stacks.image_stack.artifacts_bucket_name)."""
        return f"{self.name}-artifacts-{self.account}-{self.region}"


def lab_context(scratch: Scratch) -> dict[str, str]:
    """The `-c` overrides of every lab deploy: small, the run's own names, nothing built. Everything
    else is cdk.json's, so what the game day settles is about the stacks users deploy."""
    return {
        "project": scratch.name,
        "cpu.endpoint_name": scratch.name,
        "cpu.image_uri": scratch.image,
        "cpu.model_s3_uri": scratch.model_s3_uri,
        "cpu.instance_type": scratch.instance_type,
        "cpu.initial_instance_count": "1",
        "cpu.min_capacity": "1",
        "cpu.max_capacity": "2",
        # A canary of one instance is more than 50 % of a one-instance fleet (TrafficRoutingConfig).
        "cpu.deployment.traffic_routing": "ALL_AT_ONCE",
        "cpu.log_retention_days": "1",
    }


def context_args(context: Mapping[str, str]) -> list[str]:
    """`-c KEY=VALUE` pairs, sorted, as the CDK CLI and the project's tools take them."""
    return [arg for key, value in sorted(context.items()) for arg in ("-c", f"{key}={value}")]


def describe_stack(cloudformation: Any, name: str) -> dict[str, Any] | None:
    """A stack's description, or None when it does not exist (any other error is raised)."""
    try:
        return cloudformation.describe_stacks(StackName=name)["Stacks"][0]
    except ClientError as error:
        if "does not exist" in str(error):
            return None
        raise


class Process(Protocol):
    def wait(self) -> int: ...


@dataclass
class Cdk:
    """The CDK CLI of this checkout, run in the repository root as a user runs it."""

    region: str
    profile: str | None = None
    start: Callable[..., Process] = subprocess.Popen  # the tests' stand-in records the argv

    def argv(self, stacks: Sequence[str], context: Mapping[str, str]) -> list[str]:
        argv = [str(CDK), "deploy", *stacks, "--require-approval", "never", "--ci", "--progress", "events"]
        if self.profile:
            argv += ["--profile", self.profile]
        return argv + context_args(context)

    def deploy(self, stacks: Sequence[str], context: Mapping[str, str]) -> Process:
        env = {"AWS_REGION": self.region, "AWS_DEFAULT_REGION": self.region}
        return self.start(self.argv(stacks, context), cwd=ROOT, env={**os.environ, **env})


@dataclass(frozen=True)
class Deploy:
    """One `cdk deploy` of the endpoint stack and where it left the stack."""

    exit_code: int
    status: str  # the endpoint stack's status afterwards
    seconds: float
    reason: str  # the first failed resource and its reason, when the deploy failed

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.status in ("CREATE_COMPLETE", "UPDATE_COMPLETE")

    @property
    def line(self) -> str:
        return f"cdk deploy exit {self.exit_code} after {self.seconds:.0f} s; {ENDPOINT_STACK} {self.status}"


def tool_argv(tool: str, args: Sequence[str]) -> list[str]:
    """One of the project's scripts (pyproject's [project.scripts]) from this venv."""
    return [str(Path(sys.executable).parent / tool), *args]


@dataclass
class Lab:
    """The scratch stacks, the clients the scenarios use, and the CLI runners. `sleep`, `now`,
    `poll_s` and the runners are what the tests replace."""

    clients: dict[str, Any]
    scratch: Scratch
    cdk: Cdk
    run_tool: Callable[[list[str]], int] = lambda argv: subprocess.run(argv, cwd=ROOT, check=False).returncode
    sleep: Callable[[float], None] = time.sleep
    now: Callable[[], float] = time.monotonic
    poll_s: float = 30.0
    max_polls: int = 240  # 2 h at 30 s
    context: dict[str, str] = field(default_factory=dict)  # the overrides of the last deploy that held
    seen: set[tuple[str, str]] = field(default_factory=set)  # (resource type, physical id) ever deployed
    objects: list[tuple[str, str]] = field(default_factory=list)  # (bucket, key) the game day wrote

    def __post_init__(self) -> None:
        self.context = self.context or lab_context(self.scratch)

    @property
    def cloudformation(self) -> Any:
        return self.clients["cloudformation"]

    @property
    def sagemaker(self) -> Any:
        return self.clients["sagemaker"]

    @property
    def endpoint_name(self) -> str:
        return self.context["cpu.endpoint_name"]

    @property
    def aws_args(self) -> list[str]:
        """The region and profile options the project's tools take."""
        profile = ["--profile", self.cdk.profile] if self.cdk.profile else []
        return ["--region", self.scratch.region, *profile]

    def stage_model(self, gguf: Path) -> None:
        """The bundled GGUF under the model prefix, and its Batch Transform archive beside it
        (decider_stacks.config.archive_key: a gzip'd tar with the GGUF at its root)."""
        s3, scratch = self.clients["s3"], self.scratch
        key = f"{scratch.model_prefix}{scratch.model_file}"
        with gguf.open("rb") as body:  # about 100 MB: one PUT (up to 5 GB)
            s3.put_object(Bucket=scratch.bucket, Key=key, Body=body)
        self.objects.append((scratch.bucket, key))
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w:gz", compresslevel=1) as tar:
            tar.add(gguf, arcname=scratch.model_file)
        key = archive_key(scratch.model_prefix)
        s3.put_object(Bucket=scratch.bucket, Key=key, Body=archive.getvalue())
        self.objects.append((scratch.bucket, key))

    def create(self) -> Deploy:
        """The first deploy: both stacks."""
        return self._deploy([IMAGE_STACK, ENDPOINT_STACK], {})

    def deploy(self, changes: Mapping[str, str]) -> Deploy:
        """Deploy the endpoint stack again with `changes` on top of the last deploy that held."""
        return self._deploy([ENDPOINT_STACK], changes)

    def _deploy(self, stacks: list[str], changes: Mapping[str, str]) -> Deploy:
        before, started, context = self.stack(), self.now(), {**self.context, **changes}
        return self._finish(self.cdk.deploy(stacks, context).wait(), started, context, before)

    def _finish(
        self, exit_code: int, started: float, context: dict[str, str], before: dict[str, Any] | None
    ) -> Deploy:
        stack = self.wait_stack(ENDPOINT_STACK)
        self.note()
        status = stack["StackStatus"] if stack else "NOT_CREATED"
        if exit_code == 0:
            reason = ""
        elif stack is None or _when(stack) == _when(before):
            reason = (
                f"cdk deploy failed before CloudFormation changed {ENDPOINT_STACK}: its output above says "
                "why (synth, credentials, assets, or ImageStack's events)"
            )
        else:
            reason = self.failure_reason()
        result = Deploy(exit_code, status, self.now() - started, reason)
        if result.ok:
            self.context = context
        return result

    def stack(self, name: str = ENDPOINT_STACK) -> dict[str, Any] | None:
        return describe_stack(self.cloudformation, name)

    def _poll(self, read: Callable[[], Any], done: Callable[[Any], bool], what: str) -> Any:
        """`read()` every poll_s until `done` says so; TimeoutError after max_polls."""
        for _ in range(self.max_polls):
            value = read()
            if done(value):
                return value
            self.sleep(self.poll_s)
        raise TimeoutError(f"{what} still changing after {self.max_polls} polls")

    def wait_stack(self, name: str) -> dict[str, Any] | None:
        """The stack once its status is terminal (…_COMPLETE, …_FAILED); None if it does not exist."""
        return self._poll(
            lambda: self.stack(name), lambda s: s is None or bool(TERMINAL.search(s["StackStatus"])), name
        )

    def failure_reason(self) -> str:
        """The first resource that failed in the endpoint stack's latest operation, with
        CloudFormation's reason (events come newest first; the operation's begin with the stack's
        own CREATE_ or UPDATE_IN_PROGRESS)."""
        events = self.cloudformation.describe_stack_events(StackName=ENDPOINT_STACK)["StackEvents"]
        latest: list[dict[str, Any]] = []
        for event in events:
            if event.get("LogicalResourceId") == ENDPOINT_STACK:
                if event.get("ResourceStatus") in ("CREATE_IN_PROGRESS", "UPDATE_IN_PROGRESS"):
                    break
                continue
            latest.append(event)
        failed = [
            e
            for e in latest
            if e.get("ResourceStatus", "").endswith("_FAILED")
            and "cancelled" not in e.get("ResourceStatusReason", "")
        ]
        if not failed:
            return "no failed resource in the stack's events"
        first = failed[-1]  # events come newest first
        return (
            f"{first['LogicalResourceId']} ({first['ResourceType']}): {first.get('ResourceStatusReason', '')}"
        )

    def output(self, key: str) -> str | None:
        outputs = (self.stack() or {}).get("Outputs", [])
        return next((o["OutputValue"] for o in outputs if o["OutputKey"] == key), None)

    def wait_endpoint(self) -> dict[str, Any]:
        """The endpoint once it is not Creating, Updating or RollingBack."""
        return self._poll(
            lambda: self.sagemaker.describe_endpoint(EndpointName=self.endpoint_name),
            lambda endpoint: endpoint["EndpointStatus"] not in BUSY_ENDPOINT,
            self.endpoint_name,
        )

    def on_config(self, endpoint: dict[str, Any], config: str) -> bool:
        """Whether `endpoint` serves `config`, or the post-deploy check's parked copy of it."""
        live = endpoint["EndpointConfigName"]
        return live == config or live.startswith(parked_prefix(self.endpoint_name))

    def note(self) -> None:
        """Remember what both stacks hold now: a later update or the delete may retain and forget it."""
        for stack in (IMAGE_STACK, ENDPOINT_STACK):
            try:
                pages = self.cloudformation.get_paginator("list_stack_resources").paginate(StackName=stack)
                for page in pages:
                    for resource in page.get("StackResourceSummaries", []):
                        if resource["ResourceType"] in DELETERS and resource.get("PhysicalResourceId"):
                            self.seen.add((resource["ResourceType"], resource["PhysicalResourceId"]))
            except ClientError:
                continue

    def teardown(self) -> list[str]:
        """Delete the endpoint stack, then ImageStack, then what they retained, the parked configs
        and what the game day wrote; returns what could not be deleted."""
        problems: list[str] = []
        self.note()
        for stack in (ENDPOINT_STACK, IMAGE_STACK):
            try:
                self.cloudformation.delete_stack(StackName=stack)
                status = self._wait_deleted(stack)
            except (ClientError, TimeoutError) as error:
                status = str(error)
            if status != "DELETE_COMPLETE":
                # ImageStack holds the provider of CpuStack's custom resources: without it CpuStack
                # could never be deleted, so it stays until CpuStack is gone.
                problems.append(f"stack {stack}: {status}; see its events, then delete it and what follows")
                return problems
        self._note_parked()
        for kind, name in sorted(self.seen, key=lambda item: (DELETE_ORDER.index(item[0]), item[1])):
            try:
                DELETERS[kind](self.clients, name)
            except ClientError as error:
                if not _gone(error):
                    problems.append(f"{kind} {name}: {error}")
        for bucket, key in self.objects:
            try:
                self.clients["s3"].delete_object(Bucket=bucket, Key=key)
            except ClientError as error:
                problems.append(f"s3://{bucket}/{key}: {error}")
        return problems

    def _note_parked(self) -> None:
        prefix = parked_prefix(self.endpoint_name)
        pages = self.sagemaker.get_paginator("list_endpoint_configs").paginate(NameContains="-parked-")
        for page in pages:
            for config in page.get("EndpointConfigs", []):
                if config["EndpointConfigName"].startswith(prefix):
                    self.seen.add(("AWS::SageMaker::EndpointConfig", config["EndpointConfigName"]))

    def _wait_deleted(self, name: str) -> str:
        stack = self.wait_stack(name)
        return "DELETE_COMPLETE" if stack is None else stack["StackStatus"]


def _when(stack: dict[str, Any] | None) -> tuple[str, Any]:
    """What changes whenever CloudFormation acts on a stack."""
    if stack is None:
        return ("", None)
    return (stack["StackStatus"], stack.get("LastUpdatedTime") or stack.get("CreationTime"))


def _gone(error: ClientError) -> bool:
    code = error.response.get("Error", {}).get("Code", "")
    return code in ("ValidationException", "NoSuchEntity", "NoSuchBucket", "RepositoryNotFoundException")


def _delete_role(clients: dict[str, Any], name: str) -> None:
    iam = clients["iam"]
    for policy in iam.list_role_policies(RoleName=name).get("PolicyNames", []):
        iam.delete_role_policy(RoleName=name, PolicyName=policy)
    for attached in iam.list_attached_role_policies(RoleName=name).get("AttachedPolicies", []):
        iam.detach_role_policy(RoleName=name, PolicyArn=attached["PolicyArn"])
    iam.delete_role(RoleName=name)


def _empty_and_delete_bucket(clients: dict[str, Any], name: str) -> None:
    s3 = clients["s3"]
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=name):
        doomed = [
            {"Key": item["Key"], "VersionId": item["VersionId"]}
            for item in page.get("Versions", []) + page.get("DeleteMarkers", [])
        ]
        if doomed:
            s3.delete_objects(Bucket=name, Delete={"Objects": doomed, "Quiet": True})
    s3.delete_bucket(Bucket=name)


# What the stacks retain (DeletionPolicy Retain) and the parking creates, and how each is deleted. A
# retained inline policy goes with its role. tests/gameday checks that every type the synthesized
# stacks retain is here.
DELETERS: dict[str, Callable[[dict[str, Any], str], Any]] = {
    "AWS::SageMaker::EndpointConfig": lambda c, n: c["sagemaker"].delete_endpoint_config(
        EndpointConfigName=n
    ),
    "AWS::SageMaker::Model": lambda c, n: c["sagemaker"].delete_model(ModelName=n),
    "AWS::IAM::Policy": lambda c, n: None,
    "AWS::IAM::Role": _delete_role,
    "AWS::ECR::Repository": lambda c, n: c["ecr"].delete_repository(repositoryName=n, force=True),
    "AWS::S3::Bucket": _empty_and_delete_bucket,
}
DELETE_ORDER = list(DELETERS)  # configs before their models, models before their roles
