"""A local stand-in of the SageMaker runtime API, forwarding to a real decider server.

    with run_standin("http://127.0.0.1:8080", endpoints={"decider-cpu"}) as standin:
        os.environ["AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME"] = standin.url   # botocore honours it

What it does, as the service documents it (AWS docs: the InvokeEndpoint and
InvokeEndpointWithResponseStream API references of the SageMaker runtime):
- `POST /endpoints/{name}/invocations` and `/invocations-response-stream` need a SigV4
  `Authorization` header (403 otherwise) and a known endpoint name (400 `ValidationError`
  "Endpoint … not found" otherwise);
- the body, `Content-Type`, `Accept` and `X-Amzn-SageMaker-Custom-Attributes` go to the server's
  `POST /invocations`; its `X-Amzn-SageMaker-Custom-Attributes` comes back, no other header;
- a non-2xx answer becomes `ModelError` (424) with `OriginalStatusCode`, `OriginalMessage` and
  `LogStreamArn`; no answer within 60 s becomes `ModelError` "invocation timed out";
- a stream is the server's chunks as `PayloadPart` events; a broken one ends with `ModelStreamError`.

`faults` makes an endpoint name answer a service error instead (throttling, unavailability), for
the error-mapping tests. Only ever bind it to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from decider_cli.proxy.eventstream import payload_part, stream_exception

CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
INVOCATION_TIMEOUT_SECONDS = 60.0
ACCOUNT = "123456789012"
FORWARDED_REQUEST_HEADERS = ("content-type", "accept", CUSTOM_ATTRIBUTES.lower())


@dataclass(frozen=True)
class Fault:
    """A service error the stand-in answers instead of forwarding (`x-amzn-ErrorType` + JSON body)."""

    status: int
    code: str
    message: str


THROTTLED = Fault(400, "ThrottlingException", "Rate exceeded")
UNAVAILABLE = Fault(503, "ServiceUnavailable", "Service Unavailable")
MODEL_NOT_READY = Fault(429, "ModelNotReadyException", "Model is not ready yet")


@dataclass
class StandinState:
    target: str
    endpoints: set[str]
    faults: dict[str, Fault] = field(default_factory=dict)
    calls: list[dict[str, str]] = field(default_factory=list)  # what each call looked like (tests read it)


def _service_error(fault: Fault) -> Response:
    return JSONResponse(
        {"message": fault.message},
        status_code=fault.status,
        headers={
            "x-amzn-ErrorType": f"{fault.code}:http://internal.amazon.com/coral/com.amazon.coral.service/"
        },
    )


def _model_error(name: str, status: int | None, body: str | None, message: str) -> Response:
    payload: dict[str, object] = {
        "ErrorCode": "CLIENT_ERROR_FROM_MODEL" if status and status < 500 else "SERVER_ERROR_FROM_MODEL",
        "LogStreamArn": f"arn:aws:logs:us-east-1:{ACCOUNT}:log-group:/aws/sagemaker/Endpoints/{name}",
        "Message": message,
    }
    if status is not None:
        payload["OriginalStatusCode"] = status
        payload["OriginalMessage"] = body or ""
    return JSONResponse(
        payload,
        status_code=424,
        headers={"x-amzn-ErrorType": "ModelError:http://internal.amazon.com/coral/com.amazon.sagemaker/"},
    )


def _refusal(state: StandinState, request: Request, name: str) -> Response | None:
    authorization = request.headers.get("authorization", "")
    state.calls.append(
        {
            "endpoint": name,
            "path": request.url.path,
            "authorization": authorization,
            "custom_attributes": request.headers.get(CUSTOM_ATTRIBUTES, ""),
            "content_type": request.headers.get("content-type", ""),
        }
    )
    if not authorization.startswith("AWS4-HMAC-SHA256 Credential="):
        return _service_error(
            Fault(403, "MissingAuthenticationTokenException", "Missing Authentication Token")
        )
    if name in state.faults:
        return _service_error(state.faults[name])
    if name not in state.endpoints:
        message = f"Endpoint {name} of account {ACCOUNT} not found."
        return _service_error(Fault(400, "ValidationError", message))
    return None


def _forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_REQUEST_HEADERS}


def _timed_out(name: str) -> Response:
    return _model_error(
        name,
        None,
        None,
        'Received server error (0) from primary with message "Your invocation timed out while waiting '
        "for a response from container primary. Review the latency metrics for each container in Amazon "
        'CloudWatch, resolve the issue, and try again."',
    )


def _from_model(name: str, upstream: httpx.Response, text: str) -> Response:
    kind = "client" if upstream.status_code < 500 else "server"
    message = f'Received {kind} error ({upstream.status_code}) from primary with message "{text[:500]}".'
    return _model_error(name, upstream.status_code, text, message)


def create_standin_app(state: StandinState) -> Starlette:
    client = httpx.AsyncClient(base_url=state.target, timeout=INVOCATION_TIMEOUT_SECONDS)

    async def invocations(request: Request) -> Response:
        name = request.path_params["name"]
        refusal = _refusal(state, request, name)
        if refusal is not None:
            return refusal
        body = await request.body()
        try:
            upstream = await client.post("/invocations", content=body, headers=_forward_headers(request))
        except httpx.TimeoutException:
            return _timed_out(name)
        if upstream.status_code >= 300:
            return _from_model(name, upstream, upstream.text)
        headers = {"x-Amzn-Invoked-Production-Variant": "AllTraffic"}
        if CUSTOM_ATTRIBUTES in upstream.headers:
            headers[CUSTOM_ATTRIBUTES] = upstream.headers[CUSTOM_ATTRIBUTES]
        media = upstream.headers.get("content-type", "application/json")
        return Response(upstream.content, headers=headers, media_type=media)

    async def response_stream(request: Request) -> Response:
        name = request.path_params["name"]
        refusal = _refusal(state, request, name)
        if refusal is not None:
            return refusal
        body = await request.body()
        upstream_request = client.build_request(
            "POST", "/invocations", content=body, headers=_forward_headers(request)
        )
        try:
            upstream = await client.send(upstream_request, stream=True)
        except httpx.TimeoutException:
            return _timed_out(name)
        if upstream.status_code >= 300:
            text = (await upstream.aread()).decode(errors="replace")
            await upstream.aclose()
            return _from_model(name, upstream, text)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    if chunk:
                        yield payload_part(chunk)
            except httpx.HTTPError as exc:
                yield stream_exception("ModelStreamError", f"the stream broke: {exc}", "StreamBroken")
            finally:
                await upstream.aclose()

        headers = {
            "X-Amzn-SageMaker-Content-Type": upstream.headers.get("content-type", "application/json"),
            "x-Amzn-Invoked-Production-Variant": "AllTraffic",
        }
        if CUSTOM_ATTRIBUTES in upstream.headers:
            headers[CUSTOM_ATTRIBUTES] = upstream.headers[CUSTOM_ATTRIBUTES]
        return StreamingResponse(events(), headers=headers, media_type="application/vnd.amazon.eventstream")

    app = Starlette(
        routes=[
            Route("/endpoints/{name}/invocations", invocations, methods=["POST"]),
            Route("/endpoints/{name}/invocations-response-stream", response_stream, methods=["POST"]),
        ]
    )
    app.state.standin = state
    return app


@dataclass
class RunningStandin:
    url: str
    state: StandinState


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def run_standin(
    target: str,
    *,
    endpoints: set[str] | None = None,
    faults: dict[str, Fault] | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
) -> Iterator[RunningStandin]:
    """Serve the stand-in on a background thread until the block exits."""
    state = StandinState(target.rstrip("/"), set(endpoints or {"decider-cpu"}), dict(faults or {}))
    port = port or _free_port(host)
    server = uvicorn.Server(
        uvicorn.Config(create_standin_app(state), host=host, port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, name="sagemaker-runtime-standin", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the SageMaker runtime stand-in did not start")
        time.sleep(0.01)
    try:
        yield RunningStandin(f"http://{host}:{port}", state)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A local stand-in of the SageMaker runtime API.")
    parser.add_argument("--target", default="http://127.0.0.1:8080", help="the decider server behind it")
    parser.add_argument("--endpoint", action="append", default=None, help="endpoint names it knows")
    parser.add_argument("--port", type=int, default=8081)
    args = parser.parse_args(argv)
    state = StandinState(args.target.rstrip("/"), set(args.endpoint or ["decider-cpu"]))
    print(json.dumps({"url": f"http://127.0.0.1:{args.port}", "endpoints": sorted(state.endpoints)}))
    uvicorn.run(create_standin_app(state), host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
