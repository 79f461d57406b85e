"""Run the app under uvicorn with SageMaker's lifecycle: listen at once, load in the background,
exit non-zero on a fatal load error, and drain in-flight requests on SIGTERM, then exit 0."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

import uvicorn

from decider.server.app import create_app
from decider.server.runtime import EngineLoader, load_engine
from decider.settings import Settings

log = logging.getLogger("decider.server")
EXIT_OK = 0


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM after a graceful shutdown, which would end the process with
    status 143; SageMaker and our tests expect a drained server to exit 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: object) -> None:
        if not self.should_exit:
            log.info("received %s: draining in-flight requests", signal.Signals(sig).name)
        super().handle_exit(sig, frame)  # type: ignore[arg-type]


def run(settings: Settings, *, loader: EngineLoader = load_engine) -> int:
    """Serve until SIGTERM/SIGINT (exit 0) or a fatal start-up error (its `StartupError.exit_code`)."""
    failed = threading.Event()
    server: _Server | None = None

    def on_fatal(message: str) -> None:
        failed.set()
        if server is not None:
            server.should_exit = True

    app = create_app(settings, loader=loader, on_fatal=on_fatal)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_grace_seconds,
        timeout_keep_alive=75,  # longer than typical load balancer idle timeouts (SageMaker's is 60 s)
        server_header=False,
    )
    server = _Server(config)
    server.run()
    return app.state.runtime.exit_code if failed.is_set() else EXIT_OK
