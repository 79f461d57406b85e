"""Fixtures' building blocks for the deploy-time handler tests: stubbed boto3 clients and a local
receiver standing in for a wait condition handle's presigned URL (127.0.0.1 only)."""

from __future__ import annotations

import io
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import boto3
from botocore.response import StreamingBody
from botocore.stub import Stubber

SERVICES = (
    "codebuild",
    "ecr",
    "s3",
    "ssm",
    "sagemaker",
    "sagemaker-runtime",
    "cloudformation",
    "cloudwatch",
    "service-quotas",
)


@dataclass
class Handle:
    """Records the signals PUT to it; answers `status` (200 by default)."""

    url: str
    signals: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    status: int = 200


def start_handle() -> tuple[Handle, ThreadingHTTPServer]:
    handle = Handle(url="")

    class Receiver(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            handle.headers.append(dict(self.headers))
            if handle.status == 200:
                handle.signals.append(json.loads(body))
            self.send_response(handle.status)
            self.end_headers()
            self.wfile.write(b"<Error>AccessDenied</Error>" if handle.status != 200 else b"")

        def log_message(self, *_args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    handle.url = f"http://127.0.0.1:{server.server_address[1]}/signal?X-Amz-Signature=abc"
    # A short poll: shutdown() waits for the loop's next poll, 0.5 s by default, at every test's end.
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    return handle, server


def stubbed_clients() -> tuple[dict[str, Any], dict[str, Stubber]]:
    clients = {name: boto3.client(name) for name in SERVICES}
    stubs = {name: Stubber(client) for name, client in clients.items()}
    for stub in stubs.values():
        stub.activate()
    return clients, stubs


def body(payload: Any) -> StreamingBody:
    data = json.dumps(payload).encode()
    return StreamingBody(io.BytesIO(data), len(data))
