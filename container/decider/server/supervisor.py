"""The front process: it holds the port and runs the engine (the model, the scheduler, the HTTP
handlers) in a child process that it restarts when it dies, as vLLM keeps its API server apart from
its engine core.

Why: a native fault (a llama.cpp assertion on a shape nobody tested, a CUDA error, a corrupt file)
ends the process it happens in, whatever Python catches. In the child it ends the child: the front
answers the requests that child was running with 503 `engine_restarted` (retryable), holds new ones
until the next child serves (within their deadline), and logs the death with the id of every request
that was running; the child's own `faulthandler` has printed the native traceback just before.

How the two talk: HTTP/1.1 over a Unix socket, to the child's unchanged server (`serve engine`). The
front relays bytes and never parses a body on clean traffic: validation, planning and answers stay in
the child's intake threads, where they already cost the engine nothing. It never imports the engine
(llama.cpp is not loaded here: tests/server/test_supervisor.py checks).

What `/ping` says (docs/server.md, "A server that outlives its engine"): until the first child is
ready, the child's own answer (503 while the model loads); then the child's answer while it serves,
and 200 `{"status": "restarting"}` while a new child starts after a crash, because requests sent
meanwhile wait for it and a restart takes seconds, where a replacement instance would take minutes.
More than `CRASH_BUDGET` crashes within `CRASH_WINDOW_S`, or a child that dies before it is ready:
the front stops (exit status EXIT_ENGINE_CRASHING, or the child's own start-up status) and SageMaker
replaces the instance.

One caller cannot keep the engine restarting: a request that was running at two crashes in a row is
refused from then on with 422 `request_crashes_engine` (its fingerprint: the path and its JSON body
in canonical form, or its bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, generate_latest
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from decider.errors import (
    EXIT_ENGINE_CRASHING,
    DeciderError,
    OverloadedError,
    RequestError,
    UnavailableError,
    internal_error,
    model_loading,
    shutting_down,
)
from decider.server.batch_settings import payload_limit
from decider.server.body import read_body
from decider.server.lifecycle import DrainingServer, uvicorn_server
from decider.settings import Settings

log = logging.getLogger("decider.supervisor")

CRASH_BUDGET = 5  # crashes within the window the front restarts the engine for; then it gives up
CRASH_WINDOW_S = 300.0
POISON_CRASHES = 2  # running at this many crashes in a row: refused from then on
KEPT_FINGERPRINTS = 1024
READY_POLL_S = 0.05
ANSWERED, LOST, NOT_SENT = "answered", "lost", "not sent"  # what became of a relayed request
STOP_WAIT_S = 10.0  # after the drain, for the child to exit on SIGTERM before it is killed
# Set by the front, read by a child behind it (decider.server.app): one request id in both logs,
# and the deadline counted from the front's arrival (time spent waiting for a restart included).
REQUEST_ID_HEADER = "x-decider-request-id"
WAITED_HEADER = "x-decider-waited-ms"
HOP_BY_HOP = frozenset(
    {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"te", b"upgrade"}
)
# the front's own uvicorn writes `date`; `content-length` is the relayed body's
RESPONSE_SKIP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"}
)


def engine_restarted(detail: str) -> DeciderError:
    return UnavailableError(
        f"the engine process {detail}; it is restarting, retry",
        code="engine_restarted",
        headers={"Retry-After": "1"},
    )


def fingerprint(path: str, body: bytes) -> str:
    """What identifies a request across retries: its path and its JSON body in canonical form (key
    order and spacing do not count), or its bytes when it is not JSON."""
    try:
        canonical = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":")).encode()
    except (ValueError, RecursionError):
        canonical = body
    return hashlib.sha256(path.encode() + b"\n" + canonical).hexdigest()


@dataclass
class Running:
    method: str
    path: str
    body: bytes
    generation: int = 0  # the child it was sent to


class CrashLedger:
    """Which requests were running when the engine died, and which are refused for it."""

    def __init__(self) -> None:
        self.suspects: dict[str, int] = {}  # fingerprint -> crashes in a row it was running at
        self.refused: OrderedDict[str, None] = OrderedDict()

    def crashed(self, running: Sequence[Running]) -> list[str]:
        """Count a crash; the fingerprints refused from now on because of it. A request not running
        at this crash starts from zero again (it is `in a row`)."""
        counts = {}
        for request in running:
            key = fingerprint(request.path, request.body)
            counts[key] = self.suspects.get(key, 0) + 1
        self.suspects = counts
        newly = [key for key, count in counts.items() if count >= POISON_CRASHES and key not in self.refused]
        for key in newly:
            self.refused[key] = None
            while len(self.refused) > KEPT_FINGERPRINTS:
                self.refused.popitem(last=False)
        return newly

    def is_refused(self, path: str, body: bytes) -> bool:
        return bool(self.refused) and fingerprint(path, body) in self.refused

    def answered(self, path: str, body: bytes) -> None:
        """A suspect that got an answer did not crash the engine this time."""
        if self.suspects:
            self.suspects.pop(fingerprint(path, body), None)


def engine_command(socket_path: str) -> list[str]:
    """The child: `serve`'s engine mode on a Unix socket (decider.cli)."""
    return [sys.executable, "-m", "decider.cli", "engine", "--socket", socket_path]


class HeldBodies:
    """The bytes of request bodies the front holds at once.

    The front keeps each body whole until its answer (the crash fingerprint, and a resend to the next
    child), so without a bound a flood of large bodies would fill its memory, while the child reads at
    most `parse_concurrency` bodies and lets `queue_size` more wait in TCP buffers. The bound is the
    same number of bodies at the body cap, counted in bytes: small bodies pass however many run, and a
    body that would pass the bound is refused while it is read (429 `queue_full`, retryable), what it
    had taken given back at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> None:
        if self.held + size > self.limit:
            raise OverloadedError(
                f"the front already holds {self.held} bytes of request bodies, its bound "
                f"({self.limit}: DECIDER_PARSE_CONCURRENCY + DECIDER_QUEUE_SIZE bodies at the body cap); "
                "retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self.held += size

    def give_back(self, size: int) -> None:
        self.held -= size


class Supervisor:
    """The front's ASGI app and the child's keeper."""

    def __init__(
        self,
        settings: Settings,
        *,
        command: Callable[[str], list[str]] = engine_command,
        on_exit: Callable[[int], None] | None = None,
    ) -> None:
        self.settings = settings
        self._command = command
        self._body_cap = payload_limit(settings)
        self.bodies = HeldBodies((settings.parse_concurrency + settings.queue_size) * self._body_cap)
        self._on_exit = on_exit
        self._dir = tempfile.mkdtemp(prefix="decider-engine-")
        self.socket_path = str(Path(self._dir) / "engine.sock")
        self._client: httpx.AsyncClient | None = None
        self.process: asyncio.subprocess.Process | None = None
        self.serving = asyncio.Event()
        self.ever_ready = False
        self.gave_up = False
        self.stopping = False
        self.exit_code = 0
        self.running: dict[str, Running] = {}
        # requests whose child died under them, kept until the keeper has counted that death
        self.lost: dict[str, Running] = {}
        self.generation = 0
        self.ledger = CrashLedger()
        self._crashes: deque[float] = deque()
        self._keeper: asyncio.Task[None] | None = None
        self.registry = CollectorRegistry()
        self.restarts = Counter(
            "decider_engine_restarts",
            "Engine processes started again after one died (the front's count, kept across them)",
            registry=self.registry,
        )
        self.refusals = Counter(
            "decider_requests_refused_as_crashing",
            "Requests refused because they were running at two engine crashes in a row",
            registry=self.registry,
        )

    # --- the child ------------------------------------------------------------------------------
    async def start(self) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per relayed request
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=self.socket_path),
            base_url="http://engine",
            timeout=httpx.Timeout(None, connect=5.0),
            # A connection per request (a Unix socket's connect costs microseconds): a dead child then
            # refuses it (ConnectError: never sent, sent again to the next child) instead of a kept
            # connection failing after the request was written (ambiguous: answered 503).
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
        )
        self._keeper = asyncio.ensure_future(self._keep_engine())

    async def _keep_engine(self) -> None:
        try:
            await self._keep_engine_running()
        except Exception:  # a bug here must not leave a front that holds the port and serves nothing
            log.exception("the front's engine keeper failed: stopping")
            self._give_up(EXIT_ENGINE_CRASHING)

    async def _keep_engine_running(self) -> None:
        env = dict(os.environ)
        while not self.stopping:
            started = time.monotonic()
            Path(self.socket_path).unlink(missing_ok=True)
            self.generation += 1
            self.process = await asyncio.create_subprocess_exec(
                *self._command(self.socket_path), env=env, stdin=asyncio.subprocess.DEVNULL
            )
            ready = asyncio.ensure_future(self._wait_ready())
            exited = asyncio.ensure_future(self.process.wait())
            await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
            served = ready.done() and not ready.cancelled() and ready.result()
            if served:
                if self.ever_ready:
                    log.info("engine process serving again after %.1f s", time.monotonic() - started)
                self.ever_ready = True
                self.serving.set()
                await exited
            ready.cancel()
            self.serving.clear()
            code = exited.result()
            if self.stopping:
                return
            if not served:  # it never served: restarting cannot help (its own log line says why)
                if self.ever_ready:
                    log.error("the engine process died again before it served (status %d): stopping", code)
                self._give_up(code if code > 0 else EXIT_ENGINE_CRASHING)
                return
            if code in (0, -signal.SIGTERM, -signal.SIGINT):  # told to stop (the process group was): so do we
                log.info("engine process stopped (status %d): stopping", code)
                self._give_up(0)
                return
            if not self._crashed(code):
                return
            env = {**os.environ, "DECIDER_LOAD_PROBE": "false"}  # it loaded before: no probe again
            self.restarts.inc()

    async def _wait_ready(self) -> bool:
        assert self._client is not None
        while True:
            with contextlib.suppress(httpx.TransportError):
                if (await self._client.get("/ping", timeout=2.0)).status_code == 200:
                    return True
            await asyncio.sleep(READY_POLL_S)

    def _crashed(self, code: int) -> bool:
        """Log the death and count it; False when the budget is spent (the front gives up)."""
        cause = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        # what it was running: still waiting for its answer, or already answered 503 for it
        candidates = {**self.lost, **self.running}
        running = [(rid, r) for rid, r in candidates.items() if r.generation == self.generation]
        self.lost.clear()
        log.error(
            "engine process died (%s) while running %d request(s): %s",
            cause,
            len(running),
            ", ".join(f"{rid} {r.method} {r.path}" for rid, r in running) or "none",
        )
        for key in self.ledger.crashed([r for _, r in running]):
            log.error(
                "request fingerprint %s was running at %d crashes in a row: refused", key, POISON_CRASHES
            )
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > CRASH_WINDOW_S:
            self._crashes.popleft()
        if len(self._crashes) > CRASH_BUDGET:
            log.error(
                "the engine process died %d times in %g s: giving up, so the instance is replaced",
                len(self._crashes),
                CRASH_WINDOW_S,
            )
            self._give_up(EXIT_ENGINE_CRASHING)
            return False
        return True

    def _give_up(self, code: int) -> None:
        self.gave_up = True
        self.exit_code = code
        if self._on_exit is not None:
            self._on_exit(code)

    async def stop(self) -> None:
        """After the front's own drain: the child drains nothing left, and exits."""
        self.stopping = True
        process = self.process
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), STOP_WAIT_S + self.settings.shutdown_grace_seconds)
            except TimeoutError:
                process.kill()
                await process.wait()
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        if self._client is not None:
            await self._client.aclose()
        shutil.rmtree(self._dir, ignore_errors=True)

    # --- the front's ASGI app -------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.monotonic()
        request_id = uuid.uuid4().hex
        if scope["path"] == "/ping" and not self.serving.is_set():
            await self._ping_while_down(send, request_id)
            return

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                scope.setdefault("state", {})["response_started"] = True
            await send(message)

        try:
            await self._relay(scope, receive, tracked, request_id, arrived)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs when DECIDER_SHUTDOWN_GRACE_SECONDS ran out after SIGTERM
            # (the child then sees its connection go, and stops the work): the caller gets the error body
            log.warning(
                "request %s %s %s cut off: the shutdown grace period ran out",
                request_id,
                scope["method"],
                scope["path"],
            )
            if not self._started(scope):
                await _send_error(send, shutting_down(), request_id)

    async def _relay(
        self, scope: Scope, receive: Receive, send: Send, request_id: str, arrived: float
    ) -> None:
        held = 0

        def hold(size: int) -> None:
            nonlocal held
            self.bodies.take(size)
            held += size

        try:
            await self._relay_held(scope, receive, send, request_id, arrived, hold)
        finally:
            self.bodies.give_back(held)

    async def _relay_held(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        request_id: str,
        arrived: float,
        hold: Callable[[int], None],
    ) -> None:
        path: str = scope["path"]
        try:
            # the largest body any route takes: what the front may hold; the child applies each route's own
            body = await read_body(Request(scope, receive), self._body_cap, hold=hold)
            if self.ledger.is_refused(path, body):
                self.refusals.inc()
                raise RequestError(
                    "this request was running each time the engine process died, twice in a row: it is "
                    "refused so that it cannot keep restarting the engine",
                    code="request_crashes_engine",
                )
        except DeciderError as exc:
            await _send_error(send, exc, request_id)
            return
        refused_by: int | None = None  # a child that refused the connection: it never saw the request
        while True:
            try:
                await self._wait_serving(arrived, after=refused_by)
            except DeciderError as exc:
                await _send_error(send, exc, request_id)
                return
            running = Running(scope["method"], path, body, self.generation)
            outcome = await self._run(scope, receive, send, request_id, running, arrived)
            if outcome != NOT_SENT:
                break
            if path == "/ping":  # SageMaker waits 2 s for a ping: say what is happening instead
                await self._ping_while_down(send, request_id)
                return
            refused_by = running.generation  # dead, not noticed yet: the next child gets it
        if outcome == ANSWERED:
            self.ledger.answered(path, body)

    async def _run(
        self, scope: Scope, receive: Receive, send: Send, request_id: str, running: Running, arrived: float
    ) -> str:
        """The relay raced with the caller going away (which closes the child's connection too)."""
        proxy = asyncio.ensure_future(self._proxy(scope, send, request_id, running, arrived))
        gone = asyncio.ensure_future(_disconnected(receive))
        self.running[request_id] = running
        try:
            await asyncio.wait({proxy, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.running.pop(request_id, None)
            for task in (proxy, gone):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await proxy
        if proxy.cancelled():  # the caller went away
            return LOST
        if (error := proxy.exception()) is not None:
            log.error("request %s: relaying it failed: %r", request_id, error, exc_info=error)
            if not self._started(scope):
                await _send_error(send, internal_error(error), request_id)
            return LOST
        return proxy.result()

    @staticmethod
    def _started(scope: Scope) -> bool:
        return bool(scope.get("state", {}).get("response_started"))

    async def _ping_while_down(self, send: Send, request_id: str) -> None:
        if self.ever_ready and not self.gave_up and not self.stopping:
            status, body = 200, {"status": "restarting"}
        else:
            status = 503
            body = {"status": "stopping" if self.stopping or self.gave_up else "loading"}
        await _send_json(send, status, body, request_id, {"Retry-After": "2"} if status == 503 else {})

    async def _wait_serving(self, arrived: float, *, after: int | None = None) -> None:
        """Until a child serves (one newer than `after`), within the request's deadline."""
        if self.serving.is_set() and self.generation != after:
            return
        if not self.ever_ready and not self.gave_up:
            raise model_loading()
        deadline = arrived + self.settings.deadline_seconds
        while not (self.serving.is_set() and self.generation != after):
            if self.gave_up or self.stopping:
                raise shutting_down()
            if time.monotonic() >= deadline:
                raise engine_restarted("died and was not back within the request's deadline")
            await asyncio.sleep(READY_POLL_S)

    async def _proxy(
        self, scope: Scope, send: Send, request_id: str, running: Running, arrived: float
    ) -> str:
        """Relay one request to the child and its answer back: ANSWERED, LOST (the child died under
        it: 503 sent) or NOT_SENT (no connection: the child never saw it, nothing was sent back)."""
        assert self._client is not None
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP]
        headers += [
            (REQUEST_ID_HEADER.encode(), request_id.encode()),
            (WAITED_HEADER.encode(), str(round((time.monotonic() - arrived) * 1000)).encode()),
        ]
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        upstream = self._client.build_request(
            running.method, target.decode("latin-1"), headers=headers, content=running.body
        )
        try:
            response = await self._client.send(upstream, stream=True)
        except httpx.ConnectError:
            return NOT_SENT
        except httpx.TransportError:
            self.lost[request_id] = running
            await _send_error(send, engine_restarted("died while running this request"), request_id)
            return LOST
        try:
            out = [
                (k.encode("latin-1"), v.encode("latin-1"))
                for k, v in response.headers.multi_items()
                if k.lower() not in RESPONSE_SKIP
            ]
            streamed = response.headers.get("content-type", "").startswith("text/event-stream")
            if not streamed:
                try:  # raw: the child's Content-Encoding, if any, goes with its bytes
                    content = b"".join([chunk async for chunk in response.aiter_raw()])
                except httpx.TransportError:
                    self.lost[request_id] = running
                    await _send_error(send, engine_restarted("died while running this request"), request_id)
                    return LOST
                if running.path == "/metrics" and response.status_code == 200:
                    content += generate_latest(self.registry)  # the front's counters, kept across children
                out.append((b"content-length", str(len(content)).encode()))
                await send({"type": "http.response.start", "status": response.status_code, "headers": out})
                await send({"type": "http.response.body", "body": content})
                return ANSWERED
            await send({"type": "http.response.start", "status": response.status_code, "headers": out})
            try:
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except (
                httpx.TransportError
            ):  # mid-stream: the error as one last event, as the child sends its own
                error = engine_restarted("died while streaming this answer").to_wire()
                await send(
                    {
                        "type": "http.response.body",
                        "body": f"data: {json.dumps(error)}\n\n".encode(),
                        "more_body": True,
                    }
                )
                await send({"type": "http.response.body", "body": b""})
                return LOST
            await send({"type": "http.response.body", "body": b""})
            return ANSWERED
        finally:
            await response.aclose()


async def _disconnected(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _send_json(send: Send, status: int, body: Any, request_id: str, headers: dict[str, str]) -> None:
    content = json.dumps(body).encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(content)).encode()),
        (b"x-request-id", request_id.encode()),
        (b"x-typesafe-request-id", request_id.encode()),
        *((k.lower().encode(), v.encode()) for k, v in headers.items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": content})


async def _send_error(send: Send, exc: DeciderError, request_id: str) -> None:
    await _send_json(send, exc.status, exc.to_wire(), request_id, exc.response_headers())


def run_front(settings: Settings, *, command: Callable[[str], list[str]] = engine_command) -> int:
    """The front on the port, the engine in a child process it restarts; its exit status is the
    child's start-up failure, EXIT_ENGINE_CRASHING, or 0 after a drain."""
    server: DrainingServer | None = None

    def on_exit(code: int) -> None:
        if server is not None:
            server.should_exit = True

    supervisor = Supervisor(settings, command=command, on_exit=on_exit)
    server = uvicorn_server(supervisor, settings)
    server.run()
    return supervisor.exit_code
