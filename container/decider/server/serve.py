"""Run the app under uvicorn with SageMaker's lifecycle: listen at once, load in the background,
exit non-zero on a fatal load error, and drain in-flight requests on SIGTERM, then exit 0."""

from __future__ import annotations

import threading

from decider.server.app import create_app
from decider.server.lifecycle import EXIT_OK, DrainingServer, uvicorn_server
from decider.server.runtime import EngineLoader, load_engine
from decider.settings import Settings


def run(
    settings: Settings,
    *,
    loader: EngineLoader = load_engine,
    uds: str | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (exit 0) or a fatal start-up error (its `StartupError.exit_code`).
    With `uds`, on that Unix socket behind the front (decider.server.supervisor)."""
    failed = threading.Event()
    server: DrainingServer | None = None

    def on_fatal(message: str) -> None:
        failed.set()
        if server is not None:
            server.should_exit = True

    app = create_app(settings, loader=loader, on_fatal=on_fatal, behind_front=uds is not None)
    server = uvicorn_server(app, settings, uds=uds)
    server.run()
    return app.state.runtime.exit_code if failed.is_set() else EXIT_OK
