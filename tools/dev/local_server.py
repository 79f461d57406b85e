"""Start the real server locally, exactly as the image does, and stop it cleanly.

    with run_local_server() as server:            # bundled SmolLM2 model, a free port
        httpx.get(f"{server.base_url}/ping")

The process is `.venv/bin/serve serve`: the console script that the image's ENTRYPOINT runs.
Settings are passed as environment variables (`DECIDER_*`); the port goes through
`SAGEMAKER_BIND_TO_PORT` as on SageMaker. Run `python -m decider_dev.local_server` for a foreground
server on port 8080 (Ctrl-C to stop).

A SIGTERM to the harness stops the server as Ctrl-C does (then the harness dies of that SIGTERM):
by default Python ends at once on SIGTERM, and the server it started would outlive it.

`DECIDER_TEST_BASE_URL` (e.g. `http://127.0.0.1:18080`, a container started by `make image-test`)
points the live-server tests at a server that is already running instead: `remote_server()`
returns it as a `RemoteServer`, which answers `base_url`, `ping()` and `wait_ready()` the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from decider_dev.bench.common import unlabelled_metrics

DEFAULT_HOST = "127.0.0.1"
STOP_TIMEOUT_SECONDS = 60.0
BASE_URL_ENV = "DECIDER_TEST_BASE_URL"
# For a server started to test one behaviour other than its start (a deadline, a key, a marker):
# without the load probe, a child process that loads the model once more before the server does
# (~1 s of CPU per start). Start-up tests, and the shared servers of the test session, keep it.
WITHOUT_LOAD_PROBE = {"DECIDER_LOAD_PROBE": "false"}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised wherever the main thread is: it unwinds like Ctrl-C, through every `finally`."""


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated`; once the block has unwound, the process dies of
    the SIGTERM (as without this). Only in the main thread, and only where SIGTERM is not handled
    already (an enclosing block, or a harness of its own, such as pytest stopping its workers)."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def terminated(signum: int, _frame: object) -> None:
        raise Terminated(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    except Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise  # reached only if the signal is blocked
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def serve_command() -> list[str]:
    """The `serve` console script of the running interpreter's environment, with its `serve` argument."""
    script = Path(sys.executable).with_name("serve")
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: install the container package (`make setup`)")
    return [str(script), "serve"]


def default_model_path() -> str:
    from decider.engine.model.bundled import smollm2_path

    return str(smollm2_path())


RESTARTS_SERIES = "decider_engine_restarts_total"


def engine_restarts(base_url: str, timeout: float = 10.0) -> float:
    """The front's count of engine processes started again after one died (decider.server.supervisor;
    0 where nothing counts them). A check that ends with the front alive has not shown that the
    engine lived: the front restarts it within seconds, and only this count tells."""
    metrics = httpx.get(f"{base_url}/metrics", timeout=timeout).text
    return unlabelled_metrics(metrics, [RESTARTS_SERIES])[RESTARTS_SERIES]


def ping_status(base_url: str, timeout: float = 2.0) -> int | None:
    """`GET {base_url}/ping`'s status, or None when nothing answers."""
    try:
        return httpx.get(f"{base_url}/ping", timeout=timeout).status_code
    except httpx.HTTPError:
        return None


@dataclass
class RemoteServer:
    """A server this process did not start (a container, a remote host): only its URL is known."""

    base_url: str

    def ping(self, timeout: float = 2.0) -> int | None:
        return ping_status(self.base_url, timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ping(timeout=1.0) == 200:
                return
            time.sleep(0.1)
        raise TimeoutError(f"{self.base_url}/ping did not answer 200 within {timeout:g} s")


def remote_server() -> RemoteServer | None:
    """The server named by `$DECIDER_TEST_BASE_URL`, or None to start local processes."""
    url = os.environ.get(BASE_URL_ENV, "").strip().rstrip("/")
    return RemoteServer(url) if url else None


@dataclass
class LocalServer:
    process: subprocess.Popen[bytes]
    port: int
    host: str
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def logs(self) -> str:
        """Everything the server has written to stdout and stderr so far."""
        return self.log_path.read_text(errors="replace")

    def ping(self, timeout: float = 2.0) -> int | None:
        """`/ping`'s status, or None when nothing answers."""
        return ping_status(self.base_url, timeout)

    def wait_ready(self, timeout: float) -> None:
        """Poll `/ping` until it answers 200; raise with the log tail if the server exits or stalls."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited with status {self.process.returncode} before it was ready:\n"
                    + self.logs()[-4000:]
                )
            if self.ping(timeout=1.0) == 200:
                return
            time.sleep(0.05)
        raise TimeoutError(f"the server was not ready within {timeout:g} s:\n" + self.logs()[-4000:])

    def memory_kib(self, field: str = "VmRSS") -> int:
        """`field` of /proc/<pid>/status (VmRSS: resident now; VmHWM: each process's own peak) summed
        over the server's processes: the front and the engine child it runs. The front alone is about
        50 MB; the model, its context and the caches are the child's. 0 once the front has ended."""
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for process in processes:
            with contextlib.suppress(OSError):  # it ended between the listing and the read
                for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
                    if line.startswith(f"{field}:"):
                        total += int(line.split()[1])
        return total

    def stop(self, timeout: float = STOP_TIMEOUT_SECONDS) -> int:
        """SIGTERM (graceful drain), then SIGKILL after `timeout`; return the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except BaseException as exc:  # the drain timed out, or the wait was interrupted (a second Ctrl-C)
                self.process.kill()
                self.process.wait()
                if not isinstance(exc, subprocess.TimeoutExpired):
                    raise
        return self.process.returncode


def server_environment(env: dict[str, str] | None, *, port: int, host: str) -> dict[str, str]:
    """This process's environment plus `env`, the bundled model unless one is set, the port and the host."""
    environment = {**os.environ, **(env or {})}
    if "DECIDER_MODEL_PATH" not in environment:
        environment["DECIDER_MODEL_PATH"] = default_model_path()
    environment["SAGEMAKER_BIND_TO_PORT"] = str(port)
    environment["DECIDER_HOST"] = host
    return environment


def start_local_server(
    env: dict[str, str] | None = None, *, port: int | None = None, host: str = DEFAULT_HOST
) -> LocalServer:
    """Start the server process without waiting for it to become ready."""
    port = port or free_port(host)
    environment = server_environment(env, port=port, host=host)
    environment.setdefault("PYTHONUNBUFFERED", "1")
    log_file = tempfile.NamedTemporaryFile(prefix="decider-server-", suffix=".log", delete=False)  # noqa: SIM115
    process = subprocess.Popen(
        serve_command(), env=environment, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    log_file.close()
    return LocalServer(process=process, port=port, host=host, log_path=Path(log_file.name))


@contextlib.contextmanager
def run_local_server(
    env: dict[str, str] | None = None,
    *,
    port: int | None = None,
    ready_timeout: float = 120,
    wait_ready: bool = True,
) -> Iterator[LocalServer]:
    """Run the real server (bundled SmolLM2 by default) on a free port until the block exits, or
    until this process gets SIGTERM (`sigterm_unwinds`)."""
    with sigterm_unwinds():
        server = start_local_server(env, port=port)
        try:
            if wait_ready:
                server.wait_ready(ready_timeout)
            yield server
        finally:
            server.stop()
            with contextlib.suppress(OSError):
                server.log_path.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the decider server locally on the bundled model.")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--host", default=DEFAULT_HOST)
    args = parser.parse_args(argv)
    with sigterm_unwinds():
        process = subprocess.Popen(
            serve_command(), env=server_environment(None, port=args.port, host=args.host)
        )
        try:
            return process.wait()
        except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM: the server drains, then stops
            process.send_signal(signal.SIGTERM)
            status = process.wait()
            if isinstance(interrupt, Terminated):
                raise  # and this process dies of the SIGTERM (sigterm_unwinds)
            return status


if __name__ == "__main__":
    sys.exit(main())
