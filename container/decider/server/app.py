"""The ASGI application: SageMaker's `/ping`, `/invocations` and `/execution-parameters` (Batch
Transform; JSON Lines on `/invocations`: `decider.server.batch_transform`), the decision routes (Jev's
`/v1/systemone` and `/v1/systemone/batch`, OpenAI's `/v1/decisions`), the chat route,
`/v1/models` and `/metrics`.

Every response carries `x-request-id` (also as `x-typesafe-request-id`, which typesafe-sdk reads).
`/invocations` responses also carry `X-Amzn-SageMaker-Custom-Attributes:
request_id=…,duration_ms=…,route=…`, because SageMaker passes only that header back to the caller.
For a streamed answer `duration_ms` is the time to the first byte. Every error response carries
`x-should-retry: true|false` (the openai SDK obeys it) next to the body's `error.retryable`.

With `DECIDER_API_KEY` set, every route but `/ping` requires `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from decider.errors import (
    AuthenticationError,
    DeciderError,
    NotFoundError,
    RequestError,
    internal_error,
    shutting_down,
)
from decider.schemas.openapi import openapi_document
from decider.server.batch_transform import handle_execution_parameters, handle_jsonlines, is_jsonlines
from decider.server.body import read_payload
from decider.server.handlers import (
    ClientDisconnectedError,
    handle_batch,
    handle_chat,
    handle_decision,
    handle_openai_decision,
)
from decider.server.metrics import route_label
from decider.server.routing import (
    CUSTOM_ATTRIBUTES_HEADER,
    TARGET_PATHS,
    parse_custom_attributes,
    target_from_attributes,
    target_from_body,
)
from decider.server.runtime import EngineLoader, ServerRuntime, load_engine
from decider.server.supervisor import REQUEST_ID_HEADER, WAITED_HEADER
from decider.settings import Settings

log = logging.getLogger("decider.server")
access_log = logging.getLogger("decider.access")
QUIET_PATHS = frozenset({"/ping", "/metrics"})
REQUEST_ID = re.compile(r"[0-9a-f]{32}")
CLIENT_CLOSED_REQUEST = 499  # nginx's convention, for logs and metrics only


class RequestContextMiddleware:
    """Request id, SageMaker response attributes, metrics, access log, and a JSON 500 of last resort."""

    def __init__(self, app: ASGIApp, runtime: ServerRuntime, behind_front: bool = False) -> None:
        self.app = app
        self.runtime = runtime
        self.behind_front = behind_front

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id, waited = uuid.uuid4().hex, 0.0
        if self.behind_front:  # on the front's Unix socket: its id, and its arrival time
            request_id, waited = from_front(Headers(scope=scope), request_id)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["arrived_at"] = time.monotonic() - waited  # the deadline runs from here (SageMaker's 60 s do)
        path: str = scope["path"]
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_with_context(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                response_started = True
                status = message["status"]
                headers = MutableHeaders(scope=message)
                headers["x-request-id"] = request_id
                headers["x-typesafe-request-id"] = request_id
                if path == "/invocations":
                    duration_ms = round((time.perf_counter() - started) * 1000)
                    attributes = f"request_id={request_id},duration_ms={duration_ms}"
                    if target := state.get("invocation_target"):
                        attributes += f",route={target}"
                    headers[CUSTOM_ATTRIBUTES_HEADER] = attributes
            await send(message)

        try:
            await self.app(scope, receive, send_with_context)
        except asyncio.CancelledError:
            # uvicorn cancels a request only when DECIDER_SHUTDOWN_GRACE_SECONDS ran out after
            # SIGTERM: answer 503 `shutting_down` (retry elsewhere) instead of its bare text 500
            # and a traceback. The task ends here either way.
            log.warning(
                "request %s %s %s cut off: the shutdown grace period ran out",
                request_id,
                scope.get("method"),
                path,
            )
            if not response_started:
                await _error_response(shutting_down())(scope, receive, send_with_context)
        except Exception as exc:
            log.exception("request %s %s %s failed", request_id, scope.get("method"), path)
            if not response_started:
                await _error_response(internal_error(exc))(scope, receive, send_with_context)
        finally:
            elapsed = time.perf_counter() - started
            route = route_label(path)
            self.runtime.metrics.requests.labels(route, str(status)).inc()
            self.runtime.metrics.latency.labels(route).observe(elapsed)
            level = logging.DEBUG if path in QUIET_PATHS and status < 500 else logging.INFO
            access_log.log(
                level,
                "%s %s %s %d %.1fms%s",
                request_id,
                scope.get("method"),
                path,
                status,
                elapsed * 1000,
                f" route={state['invocation_target']}" if "invocation_target" in state else "",
            )


def from_front(headers: Headers, default_id: str) -> tuple[str, float]:
    """The request id and the seconds already spent that the front sent (decider.server.supervisor)."""
    given = headers.get(REQUEST_ID_HEADER, "")
    request_id = given if REQUEST_ID.fullmatch(given) else default_id
    waited = headers.get(WAITED_HEADER, "")
    return request_id, min(int(waited), 3_600_000) / 1000 if waited.isdigit() else 0.0


class ApiKeyMiddleware:
    """With a key configured, `Authorization: Bearer <key>` is required on every route but `/ping`
    (401 `authentication_error` otherwise, before the body is read). Without one, any
    `Authorization` header is accepted and ignored."""

    UNAUTHENTICATED_PATHS = frozenset({"/ping"})

    def __init__(self, app: ASGIApp, api_key: SecretStr | None) -> None:
        self.app = app
        self._key = api_key.get_secret_value().encode() if api_key is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._key is None or scope["type"] != "http" or scope["path"] in self.UNAUTHENTICATED_PATHS:
            await self.app(scope, receive, send)
            return
        error = self._check(Headers(scope=scope).get("authorization"))
        if error is None:
            await self.app(scope, receive, send)
            return
        await _error_response(error)(scope, receive, send)

    def _check(self, header: str | None) -> AuthenticationError | None:
        challenge = {"WWW-Authenticate": 'Bearer realm="decider"'}
        if not header:
            return AuthenticationError(
                "An API key is required: send `Authorization: Bearer <key>`.",
                code="missing_api_key",
                headers=challenge,
            )
        scheme, _, token = header.partition(" ")
        # Starlette decodes header bytes as latin-1; compare the raw bytes in constant time.
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode("latin-1"), self._key or b""
        ):
            return AuthenticationError("The API key is not valid.", code="invalid_api_key", headers=challenge)
        return None


def _error_response(exc: DeciderError) -> JSONResponse:
    return JSONResponse(exc.to_wire(), status_code=exc.status, headers=exc.response_headers())


async def _on_decider_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, DeciderError)
    return _error_response(exc)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return _error_response(
            NotFoundError(f"no route {request.method} {request.url.path}", code="unknown_endpoint")
        )
    if exc.status_code == 405:
        error = RequestError(
            f"{request.method} is not allowed on {request.url.path}",
            code="method_not_allowed",
            status=405,
            headers=dict(exc.headers or {}),
        )
        return _error_response(error)
    error = RequestError(str(exc.detail), code="http_error", status=exc.status_code)
    return _error_response(error)


async def _on_client_disconnected(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def create_app(
    settings: Settings,
    *,
    loader: EngineLoader = load_engine,
    on_fatal: Callable[[str], None] | None = None,
    behind_front: bool = False,
) -> Starlette:
    """Build the app; the model starts loading when the ASGI lifespan starts. `behind_front`: the
    engine child of decider.server.supervisor, which takes the front's request ids."""
    runtime = ServerRuntime(settings, loader=loader)
    limit = settings.max_body_bytes

    def fatal(message: str) -> None:
        log.error("startup failed: %s", message)
        if on_fatal is not None:
            on_fatal(message)

    def engine_failed(message: str) -> None:
        log.error("engine failed: %s; exiting", message)
        if on_fatal is not None:
            on_fatal(message)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runtime.start_loading(fatal)
        watchdog = asyncio.ensure_future(runtime.watch_engine(engine_failed))
        try:
            yield
        finally:
            watchdog.cancel()
            runtime.stop()

    async def ping(request: Request) -> Response:
        if runtime.ready:
            return JSONResponse({"status": "ready", "model": runtime.served_model_id()})
        body: dict[str, Any] = {"status": runtime.state}
        try:
            runtime.require_engine()
        except DeciderError as exc:
            body.update(exc.to_wire())
        return JSONResponse(body, status_code=503, headers={"Retry-After": "2"})

    @asynccontextmanager
    async def intake(request: Request) -> AsyncIterator[None]:
        """What can be refused is refused before the body is read (model not ready, queue full);
        then a place in intake, from the first byte read to the end of planning."""
        runtime.require_engine()
        runtime.scheduler.refuse_when_full()
        async with runtime.intake.slot() as release:
            request.state.release_intake = release
            yield

    async def payload(request: Request) -> Any:
        return await read_payload(request, limit, runtime.intake.run)

    async def invocations(request: Request) -> Response:
        if is_jsonlines(request.headers.get("content-type")):  # Batch Transform: one record per line
            return await handle_jsonlines(runtime, request)
        attributes = parse_custom_attributes(request.headers.get(CUSTOM_ATTRIBUTES_HEADER))
        target = target_from_attributes(attributes)  # an unknown route fails before the body is read
        if target == "models":  # by `route=` only: no body to read
            request.state.invocation_target = TARGET_PATHS["models"]
            runtime.metrics.invocation_targets.labels(TARGET_PATHS["models"]).inc()
            return await models(request)
        async with intake(request):
            return await _invoke(request, target, await payload(request))

    async def _invoke(request: Request, target: Any, body: Any) -> Response:
        if target is None:
            target = target_from_body(body)
        path = TARGET_PATHS[target]
        request.state.invocation_target = path
        runtime.metrics.invocation_targets.labels(path).inc()
        if target == "decision":
            return await handle_decision(runtime, request, body)
        if target == "batch":
            return await handle_batch(runtime, request, body)
        if target == "openai_decision":
            return await handle_openai_decision(runtime, request, body)
        return await handle_chat(runtime, request, body)

    async def systemone(request: Request) -> Response:
        async with intake(request):
            return await handle_decision(runtime, request, await payload(request))

    async def systemone_batch(request: Request) -> Response:
        async with intake(request):
            return await handle_batch(runtime, request, await payload(request))

    async def decisions(request: Request) -> Response:
        async with intake(request):
            return await handle_openai_decision(runtime, request, await payload(request))

    async def chat_completions(request: Request) -> Response:
        async with intake(request):
            return await handle_chat(runtime, request, await payload(request))

    async def models(request: Request) -> Response:
        engine = runtime.require_engine()
        info = engine.model_info
        details = info.model_dump(mode="json")
        created = int(runtime.loaded_at or time.time())
        description = (
            f"{info.name} ({info.quantization}, sha256 {info.sha256[:12]}), typed decisions and chat"
        )
        return JSONResponse(
            {
                # OpenAI shape (openai SDK `models.list()`), with the model's details alongside.
                "object": "list",
                "data": [
                    {**details, "id": info.id, "object": "model", "created": created, "owned_by": "decider"}
                ],
                # Jev / SemIf shape (typesafe-sdk `models.list()`).
                "models": [
                    {
                        "name": info.id,
                        "description": description,
                        "release_date": dt.datetime.fromtimestamp(created, dt.UTC).date().isoformat(),
                    }
                ],
            }
        )

    async def execution_parameters(request: Request) -> Response:
        return await handle_execution_parameters(runtime.settings)

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_document())

    async def metrics(request: Request) -> Response:
        content, media_type = runtime.metrics.render()
        return Response(content, media_type=media_type)

    routes = [
        Route("/ping", ping, methods=["GET"]),
        Route("/invocations", invocations, methods=["POST"]),
        Route("/v1/systemone", systemone, methods=["POST"]),
        Route("/v1/systemone/batch", systemone_batch, methods=["POST"]),
        Route("/v1/decisions", decisions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/execution-parameters", execution_parameters, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[
            Middleware(
                RequestContextMiddleware, runtime=runtime, behind_front=behind_front
            ),  # outermost: ids and metrics for 401s too
            Middleware(ApiKeyMiddleware, api_key=settings.api_key),
        ],
        exception_handlers={
            DeciderError: _on_decider_error,
            HTTPException: _on_http_exception,
            ClientDisconnectedError: _on_client_disconnected,
            ClientDisconnect: _on_client_disconnected,  # gone while its body was being read
        },
    )
    app.state.runtime = runtime
    return app
