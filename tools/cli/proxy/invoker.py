"""One HTTP call of the container's API → one SigV4-signed SageMaker runtime call, and back.

`SageMakerInvoker.handle` takes a method, a path, headers and a body as a client sent them to the
container's own API, and answers what the container would have answered:

- the route goes into `CustomAttributes` (`route=/v1/systemone`, …), the body goes unchanged (after
  undoing a `Content-Encoding`, which InvokeEndpoint does not carry);
- a chat with `"stream": true` goes through `InvokeEndpointWithResponseStream`, and its
  `PayloadPart`s are the container's SSE bytes;
- the container's own errors come back from SageMaker as `ModelError` (424) with the container's
  status and body in `OriginalStatusCode` / `OriginalMessage`: they are answered as they were;
- SageMaker's own refusals (throttling, an unknown endpoint, a timeout, credentials) become the
  container's error body with `retryable` set to whether the same call can succeed later.

Credentials, region and endpoint URL come from botocore's standard chain, so
`AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME` points it at a local stand-in (`decider_cli.proxy.standin`).
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from decider_cli.proxy.errors import ProxyError, not_found, request_error
from decider_cli.proxy.sagemaker_errors import (
    READ_TIMEOUT_SECONDS,
    map_botocore_error,
    map_client_error,
    stream_event_error,
)

log = logging.getLogger("decider.proxy")

CUSTOM_ATTRIBUTES_HEADER = "X-Amzn-SageMaker-Custom-Attributes"
MAX_BODY_BYTES = 6_291_456  # InvokeEndpoint's payload limit (6 MB)
CONNECT_TIMEOUT_SECONDS = 10
# (method, path) → the container route named in CustomAttributes
ROUTES: dict[tuple[str, str], str] = {
    ("POST", "/v1/systemone"): "/v1/systemone",
    ("POST", "/v1/systemone/batch"): "/v1/systemone/batch",
    ("POST", "/v1/decisions"): "/v1/decisions",
    ("POST", "/v1/chat/completions"): "/v1/chat/completions",
    ("GET", "/v1/models"): "/v1/models",
}
PASSTHROUGH_PATH = "/invocations"  # sent as is, with the caller's own CustomAttributes
HEALTH_PATHS = frozenset({"/ping", "/healthz"})


@dataclass
class ProxyRequest:
    method: str
    path: str
    headers: Mapping[str, str]  # case-insensitive lookups are done on lower-cased keys
    body: bytes = b""

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        for key, value in self.headers.items():
            if key.lower() == lowered:
                return value
        return None


@dataclass
class ProxyReply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    stream: Iterator[bytes] | None = None  # set for a streamed chat: the SSE bytes


def _reply_for(error: ProxyError) -> ProxyReply:
    return ProxyReply(error.status, error.response_headers(), error.body())


def runtime_client(region: str | None = None, *, profile: str | None = None, max_attempts: int = 1) -> Any:
    """A `sagemaker-runtime` client with SageMaker's timeouts; no retries by default (the caller's
    SDK retries what the error body calls retryable, and two retry loops would multiply)."""
    session = boto3.session.Session(region_name=region, profile_name=profile)
    config = Config(
        connect_timeout=CONNECT_TIMEOUT_SECONDS,
        read_timeout=READ_TIMEOUT_SECONDS,
        retries={"mode": "standard", "total_max_attempts": max(1, max_attempts)},
        max_pool_connections=32,
    )
    return session.client("sagemaker-runtime", config=config)


def parse_custom_attributes(value: str | None) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in (value or "").replace(";", ",").split(","):
        key, sep, val = item.partition("=")
        if sep and key.strip():
            pairs[key.strip().lower()] = val.strip()
    return pairs


def _decode_body(body: bytes, encoding: str | None) -> bytes:
    """Undo `Content-Encoding` (InvokeEndpoint carries no such header), capped at the payload limit."""
    name = (encoding or "identity").strip().lower()
    if name in {"", "identity"}:
        return body
    if name in {"gzip", "x-gzip", "deflate"}:
        wbits = 16 + zlib.MAX_WBITS if name != "deflate" else zlib.MAX_WBITS
        try:
            out = zlib.decompressobj(wbits).decompress(body, MAX_BODY_BYTES + 1)
        except zlib.error as exc:
            raise request_error(f"the body is not valid {name} data: {exc}", "invalid_encoding") from None
    elif name == "zstd":
        try:  # Python 3.14+, else the backport pinned in requirements (typesafe-sdk sends zstd when it can)
            from compression import zstd  # type: ignore[import-not-found]
        except ImportError:
            try:
                from backports import zstd  # type: ignore[import-not-found,no-redef]
            except ImportError:
                raise _unsupported_encoding(name) from None
        try:
            out = zstd.ZstdDecompressor().decompress(body, max_length=MAX_BODY_BYTES + 1)
        except Exception as exc:
            raise request_error(f"the body is not valid zstd data: {exc}", "invalid_encoding") from None
    else:
        raise _unsupported_encoding(name)
    if len(out) > MAX_BODY_BYTES:
        raise _too_large()
    return out


def _unsupported_encoding(name: str) -> ProxyError:
    return request_error(
        f"Content-Encoding {name!r} is not supported; send the body uncompressed or gzip-compressed",
        "unsupported_content_encoding",
        status=415,
        param="Content-Encoding",
    )


def _too_large() -> ProxyError:
    return request_error(
        f"the request body is larger than {MAX_BODY_BYTES} bytes, InvokeEndpoint's payload limit",
        "body_too_large",
        status=413,
    )


def _wants_stream(body: bytes) -> bool:
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False  # the container answers the malformed body with its own 422
    return isinstance(parsed, dict) and parsed.get("stream") is True


class SageMakerInvoker:
    """The container's HTTP API on top of one SageMaker endpoint (thread-safe: boto3 clients are)."""

    def __init__(
        self,
        endpoint: str,
        *,
        region: str | None = None,
        client: Any = None,
        target_variant: str | None = None,
        inference_component: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.target_variant = target_variant
        self.inference_component = inference_component
        self.client = client if client is not None else runtime_client(region)

    def handle(self, request: ProxyRequest) -> ProxyReply:
        """Never raises for anything a client or SageMaker can cause: every failure is an error reply."""
        try:
            return self._handle(request)
        except ProxyError as exc:
            return _reply_for(exc)

    def _handle(self, request: ProxyRequest) -> ProxyReply:
        method = request.method.upper()
        path = request.path.rstrip("/") or "/"
        if path in HEALTH_PATHS and method == "GET":
            body = json.dumps({"status": "ready", "endpoint": self.endpoint}).encode()
            return ProxyReply(200, {"content-type": "application/json"}, body)
        if path == PASSTHROUGH_PATH:
            if method != "POST":
                raise _method_not_allowed(method, path, "POST")
            attributes = request.header(CUSTOM_ATTRIBUTES_HEADER)
            return self._invoke(request, attributes, stream=False)
        route = ROUTES.get((method, path))
        if route is None:
            allowed = [m for (m, p) in ROUTES if p == path]
            if allowed:
                raise _method_not_allowed(method, path, ", ".join(allowed))
            raise not_found(f"no route {method} {path}")
        stream = path == "/v1/chat/completions"  # decided on the decoded body below
        return self._invoke(request, f"route={route}", stream=stream)

    def _invoke(self, request: ProxyRequest, attributes: str | None, *, stream: bool) -> ProxyReply:
        if len(request.body) > MAX_BODY_BYTES:
            raise _too_large()
        body = _decode_body(request.body, request.header("content-encoding"))
        if request.method.upper() == "GET":
            body = b"{}"
        stream = stream and _wants_stream(body)
        params: dict[str, Any] = {
            "EndpointName": self.endpoint,
            "Body": body,
            "ContentType": _content_type(request),
            "Accept": "text/event-stream" if stream else (request.header("accept") or "application/json"),
        }
        if attributes:
            params["CustomAttributes"] = attributes
        if self.target_variant:
            params["TargetVariant"] = self.target_variant
        if self.inference_component:
            params["InferenceComponentName"] = self.inference_component
        try:
            if stream:
                return self._stream(params)
            response = self.client.invoke_endpoint(**params)
            content = response["Body"].read()
        except ClientError as exc:
            return _reply_for(map_client_error(exc))
        except (BotoCoreError, ValueError) as exc:
            return _reply_for(map_botocore_error(exc))
        return ProxyReply(200, _reply_headers(response, "application/json"), content)

    def _stream(self, params: dict[str, Any]) -> ProxyReply:
        response = self.client.invoke_endpoint_with_response_stream(**params)
        headers = _reply_headers(response, "text/event-stream")
        headers["cache-control"] = "no-cache"
        return ProxyReply(200, headers, stream=_payload_parts(response["Body"]))


def _content_type(request: ProxyRequest) -> str:
    value = request.header("content-type")
    return value or "application/json"


def _method_not_allowed(method: str, path: str, allowed: str) -> ProxyError:
    return ProxyError(
        405,
        "method_not_allowed",
        f"{method} is not allowed on {path}",
        type="invalid_request_error",
        headers={"allow": allowed},
    )


def _reply_headers(response: Mapping[str, Any], default_type: str) -> dict[str, str]:
    headers = {"content-type": response.get("ContentType") or default_type}
    attributes = response.get("CustomAttributes")
    if attributes:
        headers[CUSTOM_ATTRIBUTES_HEADER.lower()] = attributes
        request_id = parse_custom_attributes(attributes).get("request_id")
        if request_id:
            headers["x-request-id"] = request_id
            headers["x-typesafe-request-id"] = request_id
    variant = response.get("InvokedProductionVariant")
    if variant:
        headers["x-amzn-invoked-production-variant"] = variant
    return headers


def _payload_parts(events: Any) -> Iterator[bytes]:
    """The container's bytes from `PayloadPart` events; a stream error becomes an SSE error event
    (the container's own shape for an error after the first token), then `[DONE]`."""
    try:
        for event in events:
            part = event.get("PayloadPart")
            if part and part.get("Bytes"):
                yield part["Bytes"]
            elif "ModelStreamError" in event or "InternalStreamFailure" in event:
                yield _sse_error(stream_event_error(event))
                return
    except ClientError as exc:  # botocore raises exception events as EventStreamError
        yield _sse_error(map_client_error(exc))
    except BotoCoreError as exc:
        yield _sse_error(map_botocore_error(exc))
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


def _sse_error(error: ProxyError) -> bytes:
    data = json.dumps(error.to_wire(), ensure_ascii=False, separators=(",", ":"))
    return f"\n\ndata: {data}\n\ndata: [DONE]\n\n".encode()
