"""Throttling: botocore's retry config on every client, and our own backoff in the wait loop."""

from __future__ import annotations

import botocore.retries.standard
import pytest
from botocore.awsrequest import AWSResponse
from botocore.stub import Stubber
from rich.console import Console

from decider_cli.promote.clients import make_clients
from decider_cli.promote.deploy import call_with_backoff, wait_for_update


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_kwargs):
        yield self._body


def test_client_retries_throttling_over_http(aws, monkeypatch):
    """Two ThrottlingExceptions injected on the wire, then the real moto answer: the call succeeds."""
    monkeypatch.setattr(botocore.retries.standard.ExponentialBackoff, "delay_amount", lambda self, context: 0)
    aws.create_endpoint("decider-cpu")
    clients = make_clients("us-east-1", None)
    sent = []

    def throttle_twice(request, **_kwargs):
        sent.append(request.url)
        if len(sent) <= 2:
            body = b'{"__type": "ThrottlingException", "message": "Rate exceeded"}'
            return AWSResponse(request.url, 400, {"Content-Type": "application/x-amz-json-1.1"}, _Raw(body))
        return None

    clients.sagemaker.meta.events.register("before-send.sagemaker.DescribeEndpoint", throttle_twice)
    described = clients.sagemaker.describe_endpoint(EndpointName="decider-cpu")
    assert described["EndpointStatus"] == "InService"
    assert len(sent) == 3
    assert described["ResponseMetadata"]["RetryAttempts"] == 2


def test_wait_loop_backs_off_on_throttling_then_succeeds():
    clients = make_clients("us-east-1", None)
    stub = Stubber(clients.sagemaker)
    base = {
        "EndpointName": "e",
        "EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/e",
        "CreationTime": "2026-01-01T00:00:00Z",
        "LastModifiedTime": "2026-01-01T00:00:00Z",
    }
    stub.add_client_error("describe_endpoint", service_error_code="ThrottlingException", http_status_code=400)
    stub.add_client_error("describe_endpoint", service_error_code="ThrottlingException", http_status_code=400)
    stub.add_response(
        "describe_endpoint", {**base, "EndpointStatus": "Updating", "EndpointConfigName": "old"}
    )
    stub.add_client_error("describe_endpoint", service_error_code="ThrottlingException", http_status_code=400)
    stub.add_response(
        "describe_endpoint", {**base, "EndpointStatus": "InService", "EndpointConfigName": "new"}
    )
    sleeps: list[float] = []
    with stub:
        outcome = wait_for_update(
            clients.sagemaker,
            clients.cloudwatch,
            "e",
            "new",
            alarms=(),
            timeout_s=60,
            poll_s=5,
            console=Console(quiet=True),
            sleep=sleeps.append,
        )
    stub.assert_no_pending_responses()
    assert outcome.succeeded
    assert sleeps == [1.0, 2.0, 5, 1.0]  # backoff, backoff, poll interval, backoff


def test_backoff_gives_up_after_attempts_and_passes_other_errors_through():
    from botocore.exceptions import ClientError

    def throttled():
        raise ClientError(
            {"Error": {"Code": "ThrottlingException", "Message": "slow down"}}, "DescribeEndpoint"
        )

    sleeps: list[float] = []
    with pytest.raises(ClientError):
        call_with_backoff(throttled, attempts=4, sleep=sleeps.append)
    assert sleeps == [1.0, 2.0, 4.0]

    def denied():
        raise ClientError({"Error": {"Code": "AccessDeniedException", "Message": "no"}}, "DescribeEndpoint")

    sleeps.clear()
    with pytest.raises(ClientError):
        call_with_backoff(denied, sleep=sleeps.append)
    assert sleeps == []
