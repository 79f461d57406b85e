"""Start `decider-proxy` as a process (the console script) and stop it: for tests and demos.

with run_proxy("decider-cpu", runtime_url=standin.url) as proxy:
    openai.OpenAI(base_url=f"{proxy.base_url}/v1", api_key="unused")
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from decider_dev.local_server import free_port

# Credentials for a stand-in: botocore signs with them, nothing checks them.
STANDIN_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIDSTANDIN000000000",
    "AWS_SECRET_ACCESS_KEY": "standin-secret",
    "AWS_SESSION_TOKEN": "",
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class RunningProxy:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")


def proxy_environment(runtime_url: str | None) -> dict[str, str]:
    env = {**os.environ}
    if runtime_url is not None:
        env.update(STANDIN_CREDENTIALS)
        env.pop("AWS_SESSION_TOKEN")
        env.pop("AWS_PROFILE", None)
        env["AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME"] = runtime_url
    return env


@contextlib.contextmanager
def run_proxy(
    endpoint: str,
    *,
    runtime_url: str | None = None,
    extra_args: list[str] | None = None,
    ready_timeout: float = 30,
) -> Iterator[RunningProxy]:
    """`decider-proxy --endpoint ENDPOINT` on a free port; with `runtime_url`, pointed at a stand-in
    (`AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME`) with placeholder credentials."""
    script = Path(sys.executable).with_name("decider-proxy")
    port = free_port()
    log_file = tempfile.NamedTemporaryFile(prefix="decider-proxy-", suffix=".log", delete=False)  # noqa: SIM115
    process = subprocess.Popen(
        [str(script), "--endpoint", endpoint, "--port", str(port), *(extra_args or [])],
        env=proxy_environment(runtime_url),
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log_file.close()
    proxy = RunningProxy(process, port, Path(log_file.name))
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"decider-proxy exited with {process.returncode}:\n{proxy.logs()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{proxy.base_url}/ping", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"decider-proxy did not start:\n{proxy.logs()[-3000:]}")
            time.sleep(0.05)
        yield proxy
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        with contextlib.suppress(OSError):
            proxy.log_path.unlink()
