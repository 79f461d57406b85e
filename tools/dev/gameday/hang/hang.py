"""A container that passes SageMaker's health check and hangs every invocation (the game day's
`hanging-canary`): `docker run IMAGE serve` answers GET /ping with 200 on port 8080 and holds each
POST /invocations open, reading nothing back, until the caller gives up."""

from __future__ import annotations

import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FOREVER = threading.Event()  # never set


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path != "/ping":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        FOREVER.wait()


def main() -> None:
    # As PID 1 it gets no default SIGTERM action: stop when SageMaker (or docker stop) asks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = ThreadingHTTPServer(("0.0.0.0", 8080), Handler)  # noqa: S104 (SageMaker calls it from outside)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
