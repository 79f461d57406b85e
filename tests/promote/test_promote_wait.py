"""The wait loop's edge cases, driven by botocore Stubber (no server): timeout, and an update that
registers only after the first poll."""

from __future__ import annotations

from botocore.stub import Stubber
from rich.console import Console

from decider_cli.promote.clients import make_clients
from decider_cli.promote.deploy import wait_for_update

BASE = {
    "EndpointName": "e",
    "EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/e",
    "CreationTime": "2026-01-01T00:00:00Z",
    "LastModifiedTime": "2026-01-01T00:00:00Z",
}


def _wait(stub_responses, timeout_s=60.0):
    clients = make_clients("us-east-1", None)
    stub = Stubber(clients.sagemaker)
    for status, config in stub_responses:
        stub.add_response(
            "describe_endpoint", {**BASE, "EndpointStatus": status, "EndpointConfigName": config}
        )
    with stub:
        outcome = wait_for_update(
            clients.sagemaker,
            clients.cloudwatch,
            "e",
            "new",
            alarms=(),
            timeout_s=timeout_s,
            poll_s=0,
            console=Console(quiet=True),
            sleep=lambda _: None,
        )
    stub.assert_no_pending_responses()
    return outcome


def test_old_in_service_state_before_the_update_registers_is_not_a_rollback():
    outcome = _wait([("InService", "old"), ("Updating", "old"), ("InService", "new")])
    assert outcome.succeeded and not outcome.rolled_back


def test_in_service_on_the_old_config_after_updating_is_a_rollback():
    outcome = _wait([("Updating", "old"), ("RollingBack", "old"), ("InService", "old")])
    assert outcome.rolled_back and not outcome.succeeded


def test_timeout_returns_a_timed_out_outcome():
    outcome = _wait([("Updating", "old")], timeout_s=-1)
    assert outcome.timed_out and not outcome.succeeded and outcome.status == "Updating"


def test_failed_status_is_neither_success_nor_rollback():
    outcome = _wait([("Updating", "old"), ("Failed", "old")])
    assert outcome.status == "Failed" and not outcome.succeeded and not outcome.rolled_back
