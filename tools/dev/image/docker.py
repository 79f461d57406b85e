"""A thin wrapper over the `docker` CLI for the image test: run, inspect, exec, logs, stop, remove.

Every container it starts carries the label `decider.contract=<run id>`, so one call removes all of
a run's containers, whatever happened. Ports are published on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

LABEL = "decider.contract"
CONTAINER_MODEL_DIR = "/opt/ml/model"
CONTAINER_PORT = 8080


class DockerError(RuntimeError):
    pass


def docker_client() -> str:
    """`$DOCKER`, else Debian's /usr/bin/docker (what tools/dev/image/docker-host.sh installs), else PATH."""
    for candidate in (os.environ.get("DOCKER"), "/usr/bin/docker", shutil.which("docker")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise DockerError("no docker client found: run tools/dev/image/docker-host.sh")


@dataclass
class Docker:
    client: str = field(default_factory=docker_client)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def __call__(
        self, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.client, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise DockerError(
                f"docker {' '.join(args[:2])} failed ({result.returncode}): {result.stderr.strip()}"
            )
        return result

    def answers(self) -> bool:
        try:
            return self("info", "--format", "{{.ServerVersion}}", timeout=20, check=False).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def image_size(self, image: str) -> int:
        return int(self("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())

    def run(
        self,
        image: str,
        *,
        name: str,
        environment: dict[str, str],
        model_dir: Path,
        memory_bytes: int,
        port: int | None = None,
        network: str | None = None,
    ) -> Container:
        """`docker run -d … IMAGE serve`, as SageMaker starts it: the model read-only at /opt/ml/model."""
        args = [
            "run",
            "--detach",
            "--name",
            f"{name}-{self.run_id}",
            "--label",
            f"{LABEL}={self.run_id}",
            "--memory",
            str(memory_bytes),
            "--memory-swap",
            str(memory_bytes),  # no swap on top: the instance's memory is the limit
            "--volume",
            f"{model_dir}:{CONTAINER_MODEL_DIR}:ro",
        ]
        if port is not None:
            args += ["--publish", f"127.0.0.1:{port}:{CONTAINER_PORT}"]
        if network is not None:
            args += ["--network", network]
        for key, value in sorted(environment.items()):
            args += ["--env", f"{key}={value}"]
        started = time.monotonic()
        container_id = self(*args, image, "serve").stdout.strip()
        return Container(self, container_id, f"{name}-{self.run_id}", started)

    def remove_all(self) -> None:
        """Remove every container of this run (running or not)."""
        ids = self("ps", "-aq", "--filter", f"label={LABEL}={self.run_id}", check=False).stdout.split()
        if ids:
            self("rm", "-f", *ids, check=False)


@dataclass
class Container:
    docker: Docker
    id: str
    name: str
    started: float  # time.monotonic() just before `docker run`

    def state(self) -> dict[str, str]:
        fmt = "{{.State.Status}} {{.State.ExitCode}} {{.State.OOMKilled}}"
        status, code, oom = self.docker("inspect", "--format", fmt, self.id).stdout.split()
        return {"status": status, "exit_code": code, "oom_killed": oom}

    def running(self) -> bool:
        return self.state()["status"] == "running"

    def exit_code(self) -> int:
        return int(self.state()["exit_code"])

    def inspect(self, fmt: str) -> str:
        return self.docker("inspect", "--format", fmt, self.id).stdout.strip()

    def logs(self) -> str:
        result = self.docker("logs", self.id, check=False)
        return result.stdout + result.stderr

    def exec(self, *command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.docker("exec", self.id, *command, timeout=timeout, check=False)

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code once the container has stopped, or None if it still runs after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                return self.exit_code()
            time.sleep(0.2)
        return None

    def stop(self, grace_seconds: int) -> float:
        """`docker stop -t GRACE` (SIGTERM, SIGKILL after the grace period); return the seconds it took."""
        started = time.monotonic()
        self.docker("stop", "--time", str(grace_seconds), self.id, timeout=grace_seconds + 30)
        return time.monotonic() - started
