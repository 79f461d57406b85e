"""Deploy-time sagemaker-runtime calls bounded by their Lambda (issue 33 §1).

A canary that answers `/ping` but hangs on `/invocations`: every InvokeEndpoint attempt ends in a read
timeout after the client's `read_timeout`, and botocore retries it as its retry mode says (the real
client of the handlers, built by `codebuild_job.Clients`, with a `before-send` hook standing in for the
socket, and botocore's backoff sleeps on the same fake clock). Each poll must return within the
polling Lambda's timeout, whatever `context.get_remaining_time_in_millis()` says is left, and the
post-deploy check must reach the parking path instead of a Lambda timeout (which the CDK provider
reports as FAILED at once, with nothing parked).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import botocore.endpoint
import pytest
from botocore.exceptions import ClientError, ReadTimeoutError

from decider_stacks.handlers import bake_load, codebuild_job, post_deploy_check

IS_COMPLETE_TIMEOUT_S = (
    300  # the polling Lambda's (decider_stacks.config.IS_COMPLETE_TIMEOUT_S, tested equal)
)

REGION = "us-east-1"
SERVICE_TOKEN = f"arn:aws:lambda:{REGION}:123456789012:function:ImageStack-Provider"
STACK_ID = f"arn:aws:cloudformation:{REGION}:123456789012:stack/CpuStack/abc"
PREVIOUS, NEW = "DeciderConfig-OLD", "DeciderConfig-NEW"
PREVIOUS_PROPERTIES = {
    "ProductionVariants": [
        {
            "VariantName": "AllTraffic",
            "ModelName": "model-previous",
            "InstanceType": "ml.c7i.8xlarge",
            "InitialInstanceCount": 2,
            "ModelDataDownloadTimeoutInSeconds": 600,
            "ContainerStartupHealthCheckTimeoutInSeconds": 600,
        }
    ]
}


class FakeClock:
    """Stands in for the `time` module of bake_load and botocore.endpoint (retry backoff).

    A call made on the main thread (the post-deploy check's) moves the clock by its own duration; one
    made on a worker thread (the bake load's pool) waits until the main thread's sleeps have moved the
    clock past its end, as a call in parallel would. A sleep moves the clock only while every task
    handed to the pool is waiting on it (none is starting or finishing), so each starts at the time
    it was sent and ends at the time its call ends."""

    def __init__(self, start: float) -> None:
        self.now = start
        self.cond = threading.Condition()
        self.hanging: list[float] = []  # ends of the calls in progress on worker threads
        self.running = 0  # tasks handed to the pool and not finished

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def _quiet(self) -> bool:
        return self.running == len(self.hanging)

    def sleep(self, seconds: float) -> None:
        with self.cond:
            assert self.cond.wait_for(self._quiet, timeout=10)
            self.now += max(0.0, seconds)
            self.cond.notify_all()
            assert self.cond.wait_for(self._quiet, timeout=10)

    def call(self, seconds: float) -> None:
        """A runtime call that takes `seconds`."""
        with self.cond:
            if threading.current_thread() is threading.main_thread():
                self.now += seconds
                return
            end = self.now + seconds
            self.hanging.append(end)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.now >= end, timeout=30)
            self.hanging.remove(end)
            self.cond.notify_all()


class LambdaContext:
    """The Lambda context of one invocation: `timeout_s` from its start on the fake clock."""

    def __init__(self, clock: FakeClock, timeout_s: float) -> None:
        self.clock, self.deadline = clock, clock.now + timeout_s

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self.deadline - self.clock.now) * 1000))


class FakeSageMaker:
    """DescribeEndpoint/DescribeEndpointConfig/UpdateEndpoint/ListTags of one endpoint."""

    def __init__(self, live: str, status: str = "InService") -> None:
        self.live, self.status = live, status
        self.configs: dict[str, list[dict[str, str]]] = {PREVIOUS: [], NEW: []}
        self.updates: list[dict[str, Any]] = []

    def describe_endpoint(self, EndpointName: str) -> dict[str, Any]:  # noqa: N803 - boto3's spelling
        return {"EndpointName": EndpointName, "EndpointConfigName": self.live, "EndpointStatus": self.status}

    def describe_endpoint_config(self, EndpointConfigName: str) -> dict[str, Any]:  # noqa: N803
        if EndpointConfigName not in self.configs:
            error = {"Error": {"Code": "ValidationException", "Message": "Could not find"}}
            raise ClientError(error, "DescribeEndpointConfig")
        return {"EndpointConfigName": EndpointConfigName, "EndpointConfigArn": f"arn:{EndpointConfigName}"}

    def list_tags(self, ResourceArn: str) -> dict[str, Any]:  # noqa: N803
        return {"Tags": self.configs[ResourceArn.removeprefix("arn:")]}

    def update_endpoint(self, **kwargs: Any) -> dict[str, Any]:
        self.updates.append(kwargs)
        self.live = kwargs["EndpointConfigName"]  # the parking update, done by the next poll
        return {"EndpointArn": "arn:endpoint"}


class FakeSageMakerJson:
    def __init__(self, sagemaker: FakeSageMaker) -> None:
        self.sagemaker = sagemaker

    def call(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
        assert operation == "CreateEndpointConfig"
        self.sagemaker.configs[body["EndpointConfigName"]] = body["Tags"]
        return {"EndpointConfigArn": f"arn:{body['EndpointConfigName']}"}


class NoAlarms:
    def describe_alarms(self, AlarmNames: list[str]) -> dict[str, Any]:  # noqa: N803
        return {"MetricAlarms": []}


class HangingCanaryClients(codebuild_job.Clients):
    """The handlers' own clients; sagemaker-runtime's built by the handlers' factory, its socket
    replaced by a hook that hangs each attempt for the client's read timeout, then times out."""

    def __init__(self, clock: FakeClock, sagemaker: FakeSageMaker) -> None:
        super().__init__()
        self.clock, self.attempts = clock, 0
        self._clients.update(
            {"sagemaker": sagemaker, "sagemaker-json": FakeSageMakerJson(sagemaker), "cloudwatch": NoAlarms()}
        )

    def __getitem__(self, name: str) -> Any:
        created = name not in self._clients
        client = super().__getitem__(name)
        if created and name.startswith("sagemaker-runtime"):
            client.meta.events.register(
                "before-send.sagemaker-runtime.InvokeEndpoint", functools.partial(self._hang, client)
            )
        return client

    def _hang(self, client: Any, request: Any, **_: Any) -> None:
        self.attempts += 1
        self.clock.call(client.meta.config.read_timeout)
        raise ReadTimeoutError(endpoint_url=request.url)


class CountingPool(ThreadPoolExecutor):
    """bake_load's pool, telling the clock which tasks are running."""

    clock: FakeClock

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        clock = self.clock
        with clock.cond:
            clock.running += 1

        def run() -> Any:
            try:
                return fn(*args, **kwargs)
            finally:
                with clock.cond:
                    clock.running -= 1
                    clock.cond.notify_all()

        return super().submit(run)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(name, value)
    fake = FakeClock(1_767_268_817.0)
    monkeypatch.setattr(bake_load, "time", fake)
    monkeypatch.setattr(botocore.endpoint, "time", fake)  # botocore's sleeps between attempts
    monkeypatch.setattr(CountingPool, "clock", fake, raising=False)
    monkeypatch.setattr(bake_load, "ThreadPoolExecutor", CountingPool, raising=False)
    return fake


def poll(clock: FakeClock, clients: Any, props: dict[str, Any], data: dict[str, Any]) -> tuple[Any, float]:
    """One isComplete invocation in a fresh Lambda context; its result (or exception) and duration."""
    started = clock.now
    context = LambdaContext(clock, IS_COMPLETE_TIMEOUT_S)
    update = {"RequestType": "Update", "RequestId": "r-1", "StackId": STACK_ID, "ResourceProperties": props}
    try:
        result: Any = codebuild_job.is_complete(
            {**update, "Data": data}, context, clients, now=datetime.fromtimestamp(clock.now, UTC)
        )
    except post_deploy_check.PostDeployCheckError as error:
        result = error
    return result, clock.now - started


def test_a_hanging_canary_fails_the_post_deploy_check_by_parking_within_each_lambda_run(clock):
    sagemaker = FakeSageMaker(live=NEW)
    clients = HangingCanaryClients(clock, sagemaker)
    props = {
        "ServiceToken": SERVICE_TOKEN,
        "Kind": "PostDeployCheck",
        "EndpointName": "decider-cpu",
        "EndpointConfigName": NEW,
    }
    data = {
        "StartedAt": datetime.fromtimestamp(clock.now, UTC).isoformat(),
        "PreviousConfig": PREVIOUS,
        "PreviousConfigProperties": json.dumps(PREVIOUS_PROPERTIES),
    }
    durations = []
    for _ in range(20):
        result, took = poll(clock, clients, props, data)
        durations.append(took)
        if not isinstance(result, dict):
            break
        assert result == {"IsComplete": False}
        clock.now += 30  # the provider's query interval
    assert max(durations) <= IS_COMPLETE_TIMEOUT_S, durations
    assert isinstance(result, post_deploy_check.PostDeployCheckError)
    parked = post_deploy_check.parking_config_name("decider-cpu", PREVIOUS, NEW)
    assert [u["EndpointConfigName"] for u in sagemaker.updates] == [parked]
    assert f"is parked on {parked}" in str(result) and "smoke calls on decider-cpu failed" in str(result)
    assert clients.attempts >= 2  # the hang was met, and retried as the client's config says


def test_a_hanging_canary_ends_every_bake_load_poll_within_its_lambda_and_gets_the_floor(clock, monkeypatch):
    """Every synthetic request hangs for the client's read timeout: each poll still returns within the
    polling Lambda, and every calendar minute still gets LoadPerMinute requests (the rollback alarms
    count a minute below their invocation floor as 0 %: a hanging canary must not starve them)."""
    from decider_stacks.config import load_config
    from decider_stacks.synth import cdk_json_context

    reports: list[bake_load.LoadReport] = []
    send_load = bake_load.send_load
    monkeypatch.setattr(
        bake_load, "send_load", lambda *a, **k: reports.append(send_load(*a, **k)) or reports[-1]
    )
    clients = HangingCanaryClients(clock, FakeSageMaker(live=PREVIOUS, status="Updating"))
    props = {
        "ServiceToken": SERVICE_TOKEN,
        "Kind": "BakeLoad",
        "EndpointName": "decider-cpu",
        "EndpointConfigName": NEW,
        "LoadPerMinute": "12",
    }
    data = {"StartedAt": datetime.fromtimestamp(clock.now, UTC).isoformat()}
    for _ in range(5):
        result, took = poll(clock, clients, props, data)
        assert result == {"IsComplete": False}
        assert took <= IS_COMPLETE_TIMEOUT_S, took
        clock.now += 30
    per_minute = sum((r.per_minute for r in reports), Counter())
    full = sorted(per_minute)[1:-1]
    assert len(full) >= 10
    floor = load_config(cdk_json_context()).cpu.alarms.error_rate_min_invocations
    assert min(per_minute[m] for m in full) >= int(props["LoadPerMinute"]) >= floor, per_minute
    assert clients.attempts == sum(r.sent for r in reports) == sum(r.failed for r in reports)


def test_promote_and_the_handlers_build_sagemaker_runtime_with_one_factory(clock):
    """70 s read timeout ("the SDK socket timeout should be set to be 70 seconds", InvokeEndpoint) and
    bounded standard-mode attempts for both; a call's worst case fits the polling Lambda with parking."""
    from decider_cli.promote.clients import make_clients
    from decider_stacks import config
    from decider_stacks.handlers import runtime_client

    assert config.IS_COMPLETE_TIMEOUT_S == IS_COMPLETE_TIMEOUT_S

    handler = codebuild_job.Clients()["sagemaker-runtime"].meta.config
    promote = make_clients(REGION, None).runtime.meta.config
    for client_config in (handler, promote):
        assert (client_config.read_timeout, client_config.connect_timeout) == (70, 10)
        assert client_config.retries["mode"] == "standard"
    assert handler.retries["total_max_attempts"] == runtime_client.DEPLOY_MAX_ATTEMPTS
    assert promote.retries["total_max_attempts"] == 4
    assert runtime_client.call_budget_s() + post_deploy_check.PARKING_RESERVE_S < IS_COMPLETE_TIMEOUT_S
    assert bake_load.LAMBDA_TIMEOUT_S == IS_COMPLETE_TIMEOUT_S
