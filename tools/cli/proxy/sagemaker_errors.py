"""SageMaker runtime errors → the container's error shape, with `retryable` told truthfully
(the table is docs/clients.md's). The container's own errors arrive as `ModelError` with its status
and body (`OriginalStatusCode`, `OriginalMessage`): those are passed through unchanged."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    ParamValidationError,
    PartialCredentialsError,
    ReadTimeoutError,
)

from decider_cli.proxy.errors import ProxyError, retryable_of

log = logging.getLogger("decider.proxy")

SAGEMAKER_TIMEOUT_SECONDS = 60  # SageMaker cuts a real-time invocation after 60 s
READ_TIMEOUT_SECONDS = SAGEMAKER_TIMEOUT_SECONDS + 10  # so that SageMaker's own timeout answer arrives
THROTTLING_CODES = frozenset(
    {"ThrottlingException", "Throttling", "ThrottledException", "TooManyRequestsException"}
)
CREDENTIAL_CODES = frozenset(
    {
        "UnrecognizedClientException",
        "InvalidSignatureException",
        "IncompleteSignature",
        "MissingAuthenticationToken",
        "ExpiredTokenException",
        "ExpiredToken",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
    }
)


def stream_event_error(event: Mapping[str, Any]) -> ProxyError:
    if "ModelStreamError" in event:
        info = event["ModelStreamError"] or {}
        return _model_stream_error(str(info.get("ErrorCode") or ""), str(info.get("Message") or ""))
    info = event.get("InternalStreamFailure") or {}
    return ProxyError(
        502,
        "sagemaker_stream_failure",
        f"SageMaker: {info.get('Message') or 'internal stream failure'}",
        retryable=True,
    )


def _model_stream_error(code: str, message: str) -> ProxyError:
    if code == "ModelInvocationTimeExceeded":
        return ProxyError(
            504,
            "invocation_timed_out",
            f"SageMaker stopped the stream: {message or code}",
            retryable=False,
        )
    return ProxyError(502, "model_stream_error", f"SageMaker: {code}: {message}".rstrip(": "), retryable=True)


# --- SageMaker's errors → the container's error shape ------------------------------------------


def map_client_error(exc: ClientError) -> ProxyError:
    """What a client should see of a SageMaker runtime error, with `retryable` told truthfully."""
    response: Mapping[str, Any] = exc.response
    error = response.get("Error") or {}
    code = str(error.get("Code") or "")
    message = str(error.get("Message") or exc)
    status = int((response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
    if code == "ModelError":
        return _model_error(response, message)
    if code == "ModelStreamError":
        return _model_stream_error(str(response.get("ErrorCode") or error.get("ErrorCode") or ""), message)
    if code == "InternalStreamFailure":
        return ProxyError(502, "sagemaker_stream_failure", f"SageMaker: {message}", retryable=True)
    if code in THROTTLING_CODES:
        return ProxyError(
            429,
            "sagemaker_throttled",
            f"SageMaker throttled the call (retry after a pause): {message}",
            type="rate_limit_error",
            retryable=True,
            headers={"retry-after": "1"},
        )
    if code == "ModelNotReadyException":
        return ProxyError(
            503, "model_not_ready", f"SageMaker: {message}", retryable=True, headers={"retry-after": "5"}
        )
    if code == "ServiceUnavailable":
        return ProxyError(
            503,
            "sagemaker_unavailable",
            f"SageMaker: {message}",
            retryable=True,
            headers={"retry-after": "2"},
        )
    if code in {"InternalFailure", "InternalServerError", "InternalDependencyException"}:
        return ProxyError(502, "sagemaker_internal_failure", f"SageMaker ({code}): {message}", retryable=True)
    if code == "ValidationError":
        if re.search(r"\bnot found\b", message, re.IGNORECASE):
            return ProxyError(
                404, "endpoint_not_found", f"SageMaker: {message}", type="not_found_error", retryable=False
            )
        return ProxyError(
            400, "sagemaker_validation_error", f"SageMaker: {message}", type="invalid_request_error"
        )
    if code == "AccessDeniedException" or (status == 403 and code not in CREDENTIAL_CODES):
        return ProxyError(
            403,
            "sagemaker_access_denied",
            f"SageMaker refused the caller's credentials (sagemaker:InvokeEndpoint needed): {message}",
            type="permission_error",
        )
    if code in CREDENTIAL_CODES:
        return ProxyError(
            401, "aws_credentials_invalid", f"SageMaker: {code}: {message}", type="authentication_error"
        )
    if status == 429:
        return ProxyError(
            429, "sagemaker_throttled", f"SageMaker: {message}", type="rate_limit_error", retryable=True
        )
    if status >= 500:
        return ProxyError(502, "sagemaker_error", f"SageMaker ({code or status}): {message}", retryable=True)
    return ProxyError(
        status if 400 <= status < 500 else 502,
        "sagemaker_error",
        f"SageMaker ({code or status}): {message}",
        type="invalid_request_error" if 400 <= status < 500 else "api_error",
    )


def _model_error(response: Mapping[str, Any], message: str) -> ProxyError:
    """The container answered non-2xx (or did not answer in time). Its own body is the answer."""
    original_status = response.get("OriginalStatusCode")
    original = response.get("OriginalMessage")
    if isinstance(original_status, int) and 400 <= original_status < 600 and isinstance(original, str):
        body = original.encode()
        retryable = retryable_of(body)
        if retryable is not None:  # the container's own error body: pass it through unchanged
            return ProxyReplyError(original_status, body, retryable)
        return ProxyError(
            original_status,
            "model_error",
            f"the container answered {original_status}: {original[:500]}",
            retryable=original_status in {429, 503},
        )
    if "timed out" in message.lower():
        return ProxyError(
            504,
            "invocation_timed_out",
            f"SageMaker gave up after {SAGEMAKER_TIMEOUT_SECONDS} s without an answer from the container "
            f"({message}); send less work per request",
            retryable=False,
        )
    return ProxyError(502, "model_error", f"SageMaker: {message}", retryable=True)


class ProxyReplyError(ProxyError):
    """The container's own error body, passed through with its status."""

    def __init__(self, status: int, body: bytes, retryable: bool) -> None:
        super().__init__(status, "container_error", "", retryable=retryable)
        self._body = body

    def body(self) -> bytes:
        return self._body

    def to_wire(self) -> dict[str, Any]:
        return json.loads(self._body)


def map_botocore_error(exc: Exception) -> ProxyError:
    """Errors botocore raises before SageMaker answers: credentials, region, network, timeouts."""
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return ProxyError(
            401,
            "aws_credentials_missing",
            f"no AWS credentials for SageMaker ({exc}); configure the standard credential chain",
            type="authentication_error",
        )
    if isinstance(exc, NoRegionError):
        return ProxyError(502, "aws_region_missing", f"{exc}; pass --region or set AWS_REGION")
    if isinstance(exc, ReadTimeoutError):
        return ProxyError(
            504,
            "invocation_timed_out",
            f"no answer from SageMaker within {READ_TIMEOUT_SECONDS} s ({exc})",
            retryable=False,
        )
    if isinstance(exc, EndpointConnectionError | ConnectTimeoutError | ConnectionClosedError):
        return ProxyError(502, "sagemaker_unreachable", f"cannot reach SageMaker: {exc}", retryable=True)
    if isinstance(exc, ParamValidationError | ValueError):
        return ProxyError(400, "invalid_invocation", str(exc), type="invalid_request_error")
    log.exception("SageMaker call failed")
    return ProxyError(502, "sagemaker_error", f"the SageMaker call failed: {type(exc).__name__}: {exc}")
