"""Where decision requests go: a local/remote HTTP server, or a SageMaker endpoint by name.

Each target sends one JSON body and returns a `Reply` timed at the caller (wall clock around the whole
call, body read and JSON decode included). No retries: one attempt per request, as in the JevBench protocol.
Server errors become a `Reply` with the error code from the `{"error": {"code"}}` body; network failures
are flagged `transport_error` so the runner can stop after several in a row.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

DECISION_ROUTE = "/v1/systemone"
CUSTOM_ATTRIBUTES = f"route={DECISION_ROUTE}"
SAGEMAKER_ENDPOINT_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")


class TargetError(ValueError):
    """The target cannot be used at all (bad URL or endpoint name, no region)."""


@dataclass
class Reply:
    latency_s: float
    status: int | None = None
    body: dict[str, Any] | None = None
    error_code: str | None = None
    error_message: str | None = None
    transport_error: bool = False

    @property
    def ok(self) -> bool:
        return self.error_code is None and self.body is not None


class Target(Protocol):
    description: str

    def send(self, body: dict[str, Any]) -> Reply: ...

    def close(self) -> None: ...


def error_from_body(status: int, raw: bytes | str) -> tuple[str, str]:
    """(code, message) from an error response; `http_<status>` when the body carries no code."""
    try:
        payload = json.loads(raw)
    except (ValueError, TypeError):
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        err = payload["error"]
        return str(err.get("code") or f"http_{status}"), str(err.get("message") or "")
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return f"http_{status}", text[:300]


def _decode_ok(status: int, raw: bytes, started: float) -> Reply:
    try:
        body = json.loads(raw)
    except ValueError:
        return Reply(
            time.perf_counter() - started, status, None, "invalid_json", raw[:300].decode("utf-8", "replace")
        )
    latency = time.perf_counter() - started
    if not isinstance(body, dict):
        return Reply(latency, status, None, "invalid_json", "the response is not a JSON object")
    return Reply(latency, status, body)


class HttpTarget:
    """A decision server over HTTP: `/invocations` with the route in CustomAttributes, or the direct route.

    A URL with a path (e.g. `https://host/v1/systemone`) is used exactly as given.
    """

    def __init__(
        self,
        url: str,
        *,
        route: str = "invocations",
        timeout: float = 70.0,
        api_key: str | None = None,
        transport: Any = None,
    ):
        import httpx

        parts = urlsplit(url)
        if parts.scheme not in {"http", "https"} or not parts.netloc:
            raise TargetError(f"not an http(s) URL: {url!r}")
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        base = url.rstrip("/")
        if parts.path not in {"", "/"}:
            self.url = url
        elif route == "invocations":
            self.url = f"{base}/invocations"
            headers["X-Amzn-SageMaker-Custom-Attributes"] = CUSTOM_ATTRIBUTES
        elif route == "direct":
            self.url = f"{base}{DECISION_ROUTE}"
        else:
            raise TargetError(f"unknown route {route!r} (use 'invocations' or 'direct')")
        self.description = f"POST {self.url}"
        self._httpx = httpx
        self._client = httpx.Client(
            headers=headers, timeout=httpx.Timeout(timeout, connect=10.0), transport=transport
        )

    def send(self, body: dict[str, Any]) -> Reply:
        payload = json.dumps(body).encode("utf-8")
        started = time.perf_counter()
        try:
            response = self._client.post(self.url, content=payload)
        except self._httpx.TimeoutException as exc:
            return Reply(time.perf_counter() - started, None, None, "timeout", str(exc), transport_error=True)
        except self._httpx.TransportError as exc:
            return Reply(
                time.perf_counter() - started, None, None, "connection_error", str(exc), transport_error=True
            )
        except self._httpx.RequestError as exc:  # an unreadable response (bad encoding, redirects): recorded
            return Reply(time.perf_counter() - started, None, None, "invalid_response", str(exc))
        if response.status_code != 200:
            code, message = error_from_body(response.status_code, response.content)
            return Reply(time.perf_counter() - started, response.status_code, None, code, message)
        return _decode_ok(response.status_code, response.content, started)

    def close(self) -> None:
        self._client.close()


class SageMakerTarget:
    """A SageMaker real-time endpoint, called with `sagemaker-runtime` `invoke_endpoint`."""

    def __init__(
        self,
        endpoint_name: str,
        *,
        region: str | None = None,
        profile: str | None = None,
        timeout: float = 70.0,
        client: Any = None,
    ):
        if not SAGEMAKER_ENDPOINT_NAME.match(endpoint_name):
            raise TargetError(
                f"{endpoint_name!r} is neither an http(s) URL nor a valid SageMaker endpoint name "
                "(letters, digits and hyphens, at most 63 characters)"
            )
        from botocore.exceptions import BotoCoreError, ClientError

        self._client_error = ClientError
        self._botocore_error = BotoCoreError
        self.endpoint_name = endpoint_name
        if client is None:
            import boto3
            from botocore.config import Config

            session = boto3.Session(profile_name=profile, region_name=region)
            if session.region_name is None:
                raise TargetError("no AWS region: pass --region or set AWS_REGION / a profile region")
            client = session.client(
                "sagemaker-runtime",
                config=Config(
                    read_timeout=timeout,
                    connect_timeout=10,
                    retries={"total_max_attempts": 1, "mode": "standard"},
                ),
            )
        self._client = client
        self.description = (
            f"SageMaker endpoint {endpoint_name} ({client.meta.region_name}), {CUSTOM_ATTRIBUTES}"
        )

    def send(self, body: dict[str, Any]) -> Reply:
        payload = json.dumps(body).encode("utf-8")
        started = time.perf_counter()
        try:
            response = self._client.invoke_endpoint(
                EndpointName=self.endpoint_name,
                Body=payload,
                ContentType="application/json",
                Accept="application/json",
                CustomAttributes=CUSTOM_ATTRIBUTES,
            )
            raw = response["Body"].read()
        except self._client_error as exc:
            return self._reply_from_client_error(exc, started)
        except self._botocore_error as exc:  # connection, timeout, credentials
            code = "timeout" if "timeout" in type(exc).__name__.lower() else "connection_error"
            return Reply(time.perf_counter() - started, None, None, code, str(exc), transport_error=True)
        return _decode_ok(200, raw, started)

    def _reply_from_client_error(self, exc: Any, started: float) -> Reply:
        latency = time.perf_counter() - started
        response = exc.response
        aws_code = str(response.get("Error", {}).get("Code", "ClientError"))
        if aws_code == "ModelError" and "OriginalStatusCode" in response:
            # The container answered with a non-2xx: report the container's own error code.
            status = int(response["OriginalStatusCode"])
            code, message = error_from_body(status, response.get("OriginalMessage", ""))
            return Reply(latency, status, None, code, message)
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        message = str(response.get("Error", {}).get("Message", ""))
        return Reply(latency, status, None, aws_code, message)

    def close(self) -> None:
        return None


def make_target(
    target: str,
    *,
    route: str = "invocations",
    timeout: float = 70.0,
    region: str | None = None,
    profile: str | None = None,
    api_key: str | None = None,
) -> Target:
    """An http(s) URL gives an `HttpTarget`; anything else is a SageMaker endpoint name."""
    if target.startswith(("http://", "https://")):
        return HttpTarget(target, route=route, timeout=timeout, api_key=api_key)
    return SageMakerTarget(target, region=region, profile=profile, timeout=timeout)
