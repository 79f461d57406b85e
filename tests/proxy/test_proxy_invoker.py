"""The proxy's mapping of SageMaker runtime answers to the container's error shape, on botocore's
Stubber (no network, no model): `retryable` says whether the same call can succeed later."""

from __future__ import annotations

import gzip
import io
import json
from typing import Any

import boto3
import pytest
from botocore.exceptions import (
    EndpointConnectionError,
    EventStreamError,
    NoCredentialsError,
    ReadTimeoutError,
)
from botocore.response import StreamingBody
from botocore.stub import ANY, Stubber

from decider_cli.proxy.invoker import ProxyRequest, SageMakerInvoker, _payload_parts
from decider_cli.proxy.sagemaker_errors import map_botocore_error

CONTAINER_422 = {
    "error": {
        "type": "invalid_request_error",
        "code": "missing_field",
        "message": "`questions` is required.",
        "param": "questions",
        "retryable": False,
    },
    "detail": [{"loc": ["body", "questions"], "msg": "`questions` is required.", "type": "missing_field"}],
}


@pytest.fixture
def client() -> Any:
    return boto3.client(
        "sagemaker-runtime", region_name="us-east-1", aws_access_key_id="AKID", aws_secret_access_key="x"
    )


def _post(invoker: SageMakerInvoker, path: str = "/v1/systemone", body: bytes = b"{}", **headers: str) -> Any:
    return invoker.handle(ProxyRequest("POST", path, headers, body))


def _error(reply: Any) -> dict[str, Any]:
    body = json.loads(reply.body)
    assert set(body) == {"error", "detail"}
    assert set(body["error"]) == {"type", "code", "message", "param", "retryable"}
    assert reply.headers["x-should-retry"] == str(body["error"]["retryable"]).lower()
    return body["error"]


@pytest.mark.parametrize(
    ("code", "status", "expected_status", "expected_code", "retryable"),
    [
        ("ThrottlingException", 400, 429, "sagemaker_throttled", True),
        ("ServiceUnavailable", 503, 503, "sagemaker_unavailable", True),
        ("ModelNotReadyException", 429, 503, "model_not_ready", True),
        ("InternalFailure", 500, 502, "sagemaker_internal_failure", True),
        ("InternalDependencyException", 530, 502, "sagemaker_internal_failure", True),
        ("AccessDeniedException", 403, 403, "sagemaker_access_denied", False),
        ("ExpiredTokenException", 403, 401, "aws_credentials_invalid", False),
        ("ValidationError", 400, 400, "sagemaker_validation_error", False),
    ],
)
def test_service_errors(
    client: Any, code: str, status: int, expected_status: int, expected_code: str, retryable: bool
) -> None:
    with Stubber(client) as stub:
        stub.add_client_error("invoke_endpoint", code, "it went wrong", http_status_code=status)
        reply = _post(SageMakerInvoker("ep", client=client))
    assert reply.status == expected_status
    error = _error(reply)
    assert (error["code"], error["retryable"]) == (expected_code, retryable)
    assert "it went wrong" in error["message"]


def test_the_containers_error_passes_through_unchanged(client: Any) -> None:
    with Stubber(client) as stub:
        stub.add_client_error(
            "invoke_endpoint",
            "ModelError",
            "Received client error (422) from primary",
            http_status_code=424,
            modeled_fields={"OriginalStatusCode": 422, "OriginalMessage": json.dumps(CONTAINER_422)},
        )
        reply = _post(SageMakerInvoker("ep", client=client))
    assert reply.status == 422 and json.loads(reply.body) == CONTAINER_422
    assert reply.headers["x-should-retry"] == "false"


def test_a_retryable_container_error_stays_retryable(client: Any) -> None:
    body = {**CONTAINER_422, "error": {**CONTAINER_422["error"], "code": "queue_full", "retryable": True}}
    with Stubber(client) as stub:
        stub.add_client_error(
            "invoke_endpoint",
            "ModelError",
            "x",
            http_status_code=424,
            modeled_fields={"OriginalStatusCode": 429, "OriginalMessage": json.dumps(body)},
        )
        reply = _post(SageMakerInvoker("ep", client=client))
    assert reply.status == 429 and reply.headers["x-should-retry"] == "true"


def test_model_errors_without_the_containers_body(client: Any) -> None:
    with Stubber(client) as stub:
        stub.add_client_error(
            "invoke_endpoint",
            "ModelError",
            'Received server error (0) from primary with message "Your invocation timed out while waiting '
            'for a response from container primary."',
            http_status_code=424,
        )
        stub.add_client_error(
            "invoke_endpoint",
            "ModelError",
            "x",
            http_status_code=424,
            modeled_fields={"OriginalStatusCode": 502, "OriginalMessage": "<html>Bad Gateway</html>"},
        )
        invoker = SageMakerInvoker("ep", client=client)
        timed_out, plain = _post(invoker), _post(invoker)
    assert timed_out.status == 504
    assert _error(timed_out)["code"] == "invocation_timed_out" and not _error(timed_out)["retryable"]
    assert plain.status == 502 and _error(plain)["code"] == "model_error"


def test_what_is_sent(client: Any) -> None:
    """The route in CustomAttributes, the decoded body, the target variant; GET /v1/models as `{}`."""
    body = json.dumps({"state": "s", "questions": {}}).encode()
    with Stubber(client) as stub:
        for route, sent in (("/v1/systemone", body), ("/v1/models", b"{}")):
            stub.add_response(
                "invoke_endpoint",
                {
                    "Body": StreamingBody(io.BytesIO(b"{}"), 2),
                    "ContentType": "application/json",
                    "CustomAttributes": "request_id=abc",
                },
                {
                    "EndpointName": "ep",
                    "Body": sent,
                    "ContentType": "application/json",
                    "Accept": ANY,
                    "CustomAttributes": f"route={route}",
                    "TargetVariant": "AllTraffic",
                },
            )
        invoker = SageMakerInvoker("ep", client=client, target_variant="AllTraffic")
        decided = _post(invoker, body=gzip.compress(body), **{"Content-Encoding": "gzip"})
        listed = invoker.handle(ProxyRequest("GET", "/v1/models/", {}, b""))
    assert decided.status == listed.status == 200
    assert decided.headers["x-request-id"] == decided.headers["x-typesafe-request-id"] == "abc"


def test_refused_before_sagemaker(client: Any) -> None:
    invoker = SageMakerInvoker("ep", client=client)
    with Stubber(client):  # any call would fail: nothing is queued
        cases = {
            "unsupported_content_encoding": _post(invoker, body=b"x", **{"Content-Encoding": "br"}),
            "invalid_encoding": _post(invoker, body=b"not gzip", **{"Content-Encoding": "gzip"}),
            "body_too_large": _post(invoker, body=b" " * 6_291_457),
            "unknown_endpoint": _post(invoker, path="/v1/embeddings"),
            "method_not_allowed": invoker.handle(ProxyRequest("DELETE", "/v1/decisions", {}, b"")),
        }
    for code, reply in cases.items():
        assert _error(reply)["code"] == code and 400 <= reply.status < 500
    assert invoker.handle(ProxyRequest("GET", "/ping", {}, b"")).status == 200


def test_botocore_errors() -> None:
    cases = [
        (NoCredentialsError(), 401, "aws_credentials_missing", False),
        (ReadTimeoutError(endpoint_url="http://x"), 504, "invocation_timed_out", False),
        (EndpointConnectionError(endpoint_url="http://x"), 502, "sagemaker_unreachable", True),
    ]
    for exc, status, code, retryable in cases:
        error = map_botocore_error(exc)
        assert (error.status, error.code, error.retryable) == (status, code, retryable)


def test_a_stream_error_becomes_an_sse_error_event() -> None:
    def events() -> Any:
        yield {"PayloadPart": {"Bytes": b'data: {"x":1}\n\n'}}
        raise EventStreamError(
            {"Error": {"Code": "ModelStreamError", "Message": "ModelInvocationTimeExceeded: too slow"}},
            "InvokeEndpointWithResponseStream",
        )

    parts = list(_payload_parts(events()))
    assert parts[0] == b'data: {"x":1}\n\n'
    text = parts[1].decode()
    assert text.rstrip().endswith("data: [DONE]")
    event = json.loads(text.strip().split("\n\n")[0].removeprefix("data: "))
    assert event["error"]["code"] in {"model_stream_error", "invocation_timed_out"}
