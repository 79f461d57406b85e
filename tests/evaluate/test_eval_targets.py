"""HTTP and SageMaker targets: routing, timing, and server errors recorded with their codes."""

import io
import json

import boto3
import httpx
import pytest
from botocore.response import StreamingBody
from botocore.stub import Stubber

from decider_cli.evaluate.targets import HttpTarget, SageMakerTarget, TargetError, make_target

OK_BODY = {"model": "m", "answers": {"q": {"type": "noul", "noul": 0.25}}}


def http_target(handler, **kwargs) -> HttpTarget:
    return HttpTarget("http://127.0.0.1:9", transport=httpx.MockTransport(handler), **kwargs)


def test_invocations_route_sends_custom_attributes():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["url"] = str(request.url)
        seen["attrs"] = request.headers.get("X-Amzn-SageMaker-Custom-Attributes")
        seen["body"] = json.loads(request.content)
        return httpx.Response(200, json=OK_BODY)

    reply = http_target(handler).send({"state": "s"})
    assert reply.ok and reply.body == OK_BODY and reply.status == 200 and reply.latency_s > 0
    assert seen == {
        "url": "http://127.0.0.1:9/invocations",
        "attrs": "route=/v1/systemone",
        "body": {"state": "s"},
    }


def test_direct_route_and_explicit_path():
    urls = []

    def handler(request: httpx.Request) -> httpx.Response:
        urls.append((str(request.url), request.headers.get("X-Amzn-SageMaker-Custom-Attributes")))
        return httpx.Response(200, json=OK_BODY)

    http_target(handler, route="direct").send({})
    HttpTarget("https://jev.example/v1/systemone", transport=httpx.MockTransport(handler)).send({})
    assert urls == [("http://127.0.0.1:9/v1/systemone", None), ("https://jev.example/v1/systemone", None)]


@pytest.mark.parametrize(
    ("response", "status", "code"),
    [
        (
            httpx.Response(
                422, json={"error": {"type": "x", "code": "option_count_unsupported", "message": "m"}}
            ),
            422,
            "option_count_unsupported",
        ),
        (httpx.Response(429, json={"error": {"code": "queue_full", "message": "busy"}}), 429, "queue_full"),
        (httpx.Response(502, text="<html>bad gateway</html>"), 502, "http_502"),
        (httpx.Response(200, text="not json"), 200, "invalid_json"),
        (httpx.Response(200, json=[1, 2]), 200, "invalid_json"),
    ],
)
def test_server_errors_become_codes(response, status, code):
    reply = http_target(lambda _request: response).send({})
    assert not reply.ok and reply.status == status and reply.error_code == code
    assert not reply.transport_error


def test_connection_failure_is_a_transport_error():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    reply = http_target(handler).send({})
    assert reply.transport_error and reply.error_code == "connection_error" and reply.status is None


def test_bad_targets_are_refused():
    with pytest.raises(TargetError, match="neither an http"):
        make_target("not a name!", region="us-east-1")
    with pytest.raises(TargetError, match="unknown route"):
        HttpTarget("http://h:1", route="sideways")


@pytest.fixture
def runtime():
    client = boto3.client(
        "sagemaker-runtime", region_name="eu-west-1", aws_access_key_id="x", aws_secret_access_key="y"
    )
    with Stubber(client) as stubber:
        yield client, stubber


def expected_params(body: dict) -> dict:
    return {
        "EndpointName": "decider-cpu",
        "Body": json.dumps(body).encode(),
        "ContentType": "application/json",
        "Accept": "application/json",
        "CustomAttributes": "route=/v1/systemone",
    }


def test_sagemaker_invoke_endpoint_with_route(runtime):
    client, stubber = runtime
    raw = json.dumps(OK_BODY).encode()
    stubber.add_response(
        "invoke_endpoint",
        {"Body": StreamingBody(io.BytesIO(raw), len(raw)), "ContentType": "application/json"},
        expected_params({"state": "s"}),
    )
    target = SageMakerTarget("decider-cpu", client=client)
    reply = target.send({"state": "s"})
    assert reply.ok and reply.body == OK_BODY
    assert "decider-cpu" in target.description and "eu-west-1" in target.description
    stubber.assert_no_pending_responses()


def test_sagemaker_model_error_reports_the_container_code(runtime):
    client, stubber = runtime
    # ModelError's modeled fields carry the container's own status and body
    stubber.add_client_error(
        "invoke_endpoint",
        service_error_code="ModelError",
        service_message="Received client error (422) from primary",
        http_status_code=424,
        modeled_fields={
            "OriginalStatusCode": 422,
            "OriginalMessage": json.dumps({"error": {"code": "context_length_exceeded", "message": "long"}}),
        },
    )
    reply = SageMakerTarget("decider-cpu", client=client).send({"state": "s"})
    assert (reply.status, reply.error_code, reply.error_message) == (422, "context_length_exceeded", "long")
    assert not reply.transport_error


def test_sagemaker_service_errors_keep_the_aws_code(runtime):
    client, stubber = runtime
    stubber.add_client_error("invoke_endpoint", "ValidationError", "Endpoint decider-cpu not found.", 400)
    stubber.add_client_error("invoke_endpoint", "ThrottlingException", "slow down", 400)
    target = SageMakerTarget("decider-cpu", client=client)
    assert [target.send({}).error_code for _ in range(2)] == ["ValidationError", "ThrottlingException"]


def test_sagemaker_needs_a_region(monkeypatch):
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    with pytest.raises(TargetError, match="no AWS region"):
        make_target("decider-cpu")
