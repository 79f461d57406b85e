"""The sidecar: a Starlette app that serves the container's HTTP API and forwards every call
through a `SageMakerInvoker` (boto3 on worker threads; streamed chats relayed part by part)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from decider_cli.proxy.errors import request_error
from decider_cli.proxy.invoker import MAX_BODY_BYTES, ProxyReply, ProxyRequest, SageMakerInvoker

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


async def _read_capped(request: Request) -> bytes | None:
    """The body, or None once it passes the payload limit (the rest is not read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _response(reply: ProxyReply) -> Response:
    if reply.stream is not None:
        return StreamingResponse(reply.stream, status_code=reply.status, headers=reply.headers)
    return Response(reply.body, status_code=reply.status, headers=reply.headers)


def create_proxy_app(invoker: SageMakerInvoker) -> Starlette:
    async def forward(request: Request) -> Response:
        body = await _read_capped(request)
        if body is None:
            error = request_error(
                f"the request body is larger than {MAX_BODY_BYTES} bytes, InvokeEndpoint's payload limit",
                "body_too_large",
                status=413,
            )
            return Response(error.body(), status_code=413, headers=error.response_headers())
        proxied = ProxyRequest(request.method, request.url.path, dict(request.headers), body)
        return _response(await run_in_threadpool(invoker.handle, proxied))

    app = Starlette(routes=[Route("/{path:path}", forward, methods=METHODS)])
    app.state.invoker = invoker
    return app
