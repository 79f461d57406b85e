"""The proxy as a library: httpx transports that send a client's calls to a SageMaker endpoint.

    import httpx2, openai
    from decider_cli.proxy import sagemaker_http_client

    client = openai.OpenAI(
        base_url="http://sagemaker/v1", api_key="unused",
        http_client=sagemaker_http_client("decider-cpu", region="eu-west-1", http=httpx2),
    )
    client.decisions.create(...)          # InvokeEndpoint, CustomAttributes route=/v1/decisions

The openai SDK and typesafe-sdk are built on `httpx2`, jev-lite and most others on `httpx`; the two
have the same transport API, so `http=` picks which module's classes the transport and client are
(`httpx` by default). The host in a client's base URL is ignored; the path picks the container
route (`decider_cli.proxy.invoker.ROUTES`). The async transport runs the boto3 calls on worker threads,
so `openai.AsyncOpenAI(http_client=async_sagemaker_http_client(…, http=httpx2))` never blocks its
event loop.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

import httpx

from decider_cli.proxy.invoker import ProxyReply, ProxyRequest, SageMakerInvoker

PLACEHOLDER_BASE_URL = "http://sagemaker"
CLIENT_TIMEOUT_SECONDS = 75.0  # above the invoker's read timeout, which is above SageMaker's 60 s
_END = object()


def _invoker(
    endpoint: str | None, invoker: SageMakerInvoker | None, options: dict[str, Any]
) -> SageMakerInvoker:
    if invoker is not None:
        return invoker
    if endpoint is None:
        raise ValueError("give an endpoint name or an invoker")
    return SageMakerInvoker(endpoint, **options)


def _proxy_request(request: Any, body: bytes) -> ProxyRequest:
    return ProxyRequest(request.method, request.url.path, dict(request.headers), body)


def _close(parts: Iterator[bytes]) -> None:
    close = getattr(parts, "close", None)
    if close is not None:
        close()


@functools.cache
def transports(http: ModuleType = httpx) -> tuple[type[Any], type[Any]]:
    """(sync transport class, async transport class) for the httpx-like module `http`."""

    class SyncParts(http.SyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, parts: Iterator[bytes]) -> None:
            self._parts = parts

        def __iter__(self) -> Iterator[bytes]:
            yield from self._parts

        def close(self) -> None:
            _close(self._parts)

    class AsyncParts(http.AsyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, parts: Iterator[bytes]) -> None:
            self._parts = parts

        async def __aiter__(self) -> AsyncIterator[bytes]:
            while True:
                part = await asyncio.to_thread(next, self._parts, _END)
                if part is _END:
                    return
                yield part

        async def aclose(self) -> None:
            await asyncio.to_thread(_close, self._parts)

    def response(request: Any, reply: ProxyReply, stream: Any) -> Any:
        if stream is not None:
            return http.Response(reply.status, headers=reply.headers, stream=stream, request=request)
        return http.Response(reply.status, headers=reply.headers, content=reply.body, request=request)

    class SageMakerTransport(http.BaseTransport):  # type: ignore[name-defined,misc]
        """A synchronous transport onto one SageMaker endpoint."""

        def __init__(
            self, endpoint: str | None = None, *, invoker: SageMakerInvoker | None = None, **options: Any
        ) -> None:
            self.invoker = _invoker(endpoint, invoker, options)

        def handle_request(self, request: Any) -> Any:
            reply = self.invoker.handle(_proxy_request(request, request.read()))
            return response(request, reply, SyncParts(reply.stream) if reply.stream is not None else None)

    class AsyncSageMakerTransport(http.AsyncBaseTransport):  # type: ignore[name-defined,misc]
        """An asyncio transport onto one SageMaker endpoint (boto3 runs on worker threads)."""

        def __init__(
            self, endpoint: str | None = None, *, invoker: SageMakerInvoker | None = None, **options: Any
        ) -> None:
            self.invoker = _invoker(endpoint, invoker, options)

        async def handle_async_request(self, request: Any) -> Any:
            body = await request.aread()
            reply = await asyncio.to_thread(self.invoker.handle, _proxy_request(request, body))
            return response(request, reply, AsyncParts(reply.stream) if reply.stream is not None else None)

    return SageMakerTransport, AsyncSageMakerTransport


SageMakerTransport, AsyncSageMakerTransport = transports(httpx)


def sagemaker_http_client(
    endpoint: str | None = None,
    *,
    http: ModuleType = httpx,
    invoker: SageMakerInvoker | None = None,
    timeout: float = CLIENT_TIMEOUT_SECONDS,
    **options: Any,
) -> Any:
    """An `http.Client` (httpx by default, `http=httpx2` for the openai SDK and typesafe-sdk) whose
    calls go to `endpoint`; `region=`, `client=`, `target_variant=` are the invoker's options."""
    sync_transport, _ = transports(http)
    transport = sync_transport(endpoint, invoker=invoker, **options)
    return http.Client(transport=transport, base_url=PLACEHOLDER_BASE_URL, timeout=timeout)


def async_sagemaker_http_client(
    endpoint: str | None = None,
    *,
    http: ModuleType = httpx,
    invoker: SageMakerInvoker | None = None,
    timeout: float = CLIENT_TIMEOUT_SECONDS,
    **options: Any,
) -> Any:
    _, async_transport = transports(http)
    transport = async_transport(endpoint, invoker=invoker, **options)
    return http.AsyncClient(transport=transport, base_url=PLACEHOLDER_BASE_URL, timeout=timeout)
