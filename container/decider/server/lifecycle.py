"""The uvicorn server both processes run (the front on the port, the engine child on its socket):
SageMaker's lifecycle, where SIGTERM drains in-flight requests and then exits 0."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

import uvicorn

from decider.settings import Settings

log = logging.getLogger("decider.server")
EXIT_OK = 0


class DrainingServer(uvicorn.Server):
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


def uvicorn_server(app: object, settings: Settings, *, uds: str | None = None) -> DrainingServer:
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=settings.host,
        port=settings.port,
        uds=uds,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_grace_seconds,
        timeout_keep_alive=75,  # longer than typical load balancer idle timeouts (SageMaker's is 60 s)
        server_header=False,
    )
    return DrainingServer(config)
