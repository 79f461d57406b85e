"""`make image-test`: start the serving image exactly as SageMaker does and check its contract.

    .venv/bin/python -m decider_dev.image.contract [--image decider:cpu] [--skip-live-tests]

1. The container's environment is the synthesized CpuStack template's `AWS::SageMaker::Model`
   `Environment`; only the model identity (DECIDER_MODEL_FILE, DECIDER_MODEL_SHA256) is replaced to
   name the bundled SmolLM2 GGUF. The memory limit is the memory of the template's instance type.
2. `docker run … IMAGE serve` with the model directory (several files, as a staged S3 prefix may
   hold) bind-mounted read-only at /opt/ml/model and the port published on 127.0.0.1. It checks
   /ping (never 200 before the model is ready, each answer within SageMaker's 2 s), the CPU
   backend variant llama.cpp loaded, resident memory, the read-only mount and PID 1.
3. The live-server tests (`tests/server`: openai SDK plain and streaming, typesafe-sdk,
   /invocations with and without CustomAttributes, bad input, load with /ping polled) run against
   the container's URL (DECIDER_TEST_BASE_URL), decider-proxy and Batch Transform included.
   Batch Transform (`decider_dev.image.batch_contract`): `/execution-parameters`, and JSON Lines in and
   out through the local stand-in of the service with one bad line among good ones.
4. `docker stop` (SIGTERM, SIGKILL after 30 s as on SageMaker) while two requests are in flight:
   both complete, the container exits 0 within the grace period.
5. The image again under `--network none` (SageMaker's network isolation): /ping 200 from inside
   (`docker exec` with the image's own Python), and no route out.
6. Bad model directories and settings: the container exits non-zero with one `startup failed:`
   line naming the reason, and /ping never answers 200.

Exit status: 0 when every check passed, 1 otherwise, 2 when the image or Docker is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from decider_dev import REPO_ROOT
from decider_dev.image.batch_contract import check_batch_transform
from decider_dev.image.docker import Container, Docker, DockerError
from decider_dev.image.template import (
    MODEL_FILE_ENV,
    MODEL_SHA256_ENV,
    ContainerSpec,
    TemplateError,
    container_spec,
    synthesize_stack,
)
from decider_dev.local_server import BASE_URL_ENV, free_port, ping_status

# The SageMaker hosting contract this reproduces, from "Custom Inference Code with Hosting Services"
# (https://docs.aws.amazon.com/sagemaker/latest/dg/your-algorithms-inference-code.html): the container
# runs as `docker run IMAGE serve`, its environment is the model's ContainerDefinition.Environment,
# the model artifacts are under /opt/ml/model, /ping must answer within 2 s, and stopping a container
# sends SIGTERM, then SIGKILL 30 s later. With EnableNetworkIsolation (set by the stacks), "no inbound
# or outbound network calls can be made to or from the model container" (API_DescribeModel):
# `--network none` here.
DEFAULT_IMAGE = "decider:cpu"
STACK = "CpuStack"
READY_TIMEOUT_SECONDS = 120.0
SAGEMAKER_PING_TIMEOUT_SECONDS = 2.0  # SageMaker's /ping request timeout
SAGEMAKER_STOP_GRACE_SECONDS = 30  # SIGKILL this long after SIGTERM
LIVE_TESTS = (
    "tests/server/test_live_clients.py",
    "tests/server/test_live_decisions.py",
    "tests/server/test_live_fuzz.py",
    "tests/server/test_live_faults.py",
    "tests/server/test_live_batch_transform.py",
    "tests/server/test_live_proxy.py",
    "tests/server/test_live_chat_parity.py",
)
BACKEND_LINE = re.compile(r"llama\.cpp backends: .* from (?P<libraries>[^\n]+)")
CPU_VARIANT = re.compile(r"libggml-cpu-(?P<variant>[\w.]+)\.so")
DRAIN_BODY = {
    "messages": [{"role": "user", "content": "Count from one to fifty, in words."}],
    "max_tokens": 32,  # long enough to be in flight at SIGTERM, short enough for a loaded machine
    "seed": 7,
}
DECISION_BODY = {
    "state": "I was charged twice for order 1182.",
    "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}},
}
TEXT_FILES = {"README.md": "Model staged for decider.\n", "tokenizer_config.json": "{}\n"}

# Polled inside the --network none container with the image's own Python: /ping until 200, then
# proof that nothing outside the container can be reached.
NETWORK_NONE_PROBE = r"""
import json, os, socket, time, urllib.request
started = time.monotonic(); status = None
while time.monotonic() - started < float(os.environ.get("PROBE_TIMEOUT", "120")):
    try:
        status = urllib.request.urlopen("http://127.0.0.1:8080/ping", timeout=2).status
    except Exception as exc:
        status = getattr(exc, "code", None)
    if status == 200:
        break
    time.sleep(0.05)
waited = time.monotonic() - started
try:
    socket.create_connection(("1.1.1.1", 443), timeout=3).close(); outbound = "connected"
except OSError as exc:
    outbound = type(exc).__name__ + ": " + str(exc)
try:
    socket.getaddrinfo("pypi.org", 443); dns = "resolved"
except OSError as exc:
    dns = type(exc).__name__ + ": " + str(exc)
print(json.dumps({"status": status, "waited": waited, "interfaces": sorted(os.listdir("/sys/class/net")),
                  "outbound": outbound, "dns": dns}))
"""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Report:
    console: Console
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, str] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, ok, detail))
        mark = "[green]PASS[/green]" if ok else "[bold red]FAIL[/bold red]"
        shown = f"  {mark} {escape(name)}" + (f" [dim]— {escape(detail)}[/dim]" if detail else "")
        self.console.print(shown, highlight=False)
        return ok

    def fact(self, name: str, value: str) -> None:
        self.facts[name] = value
        self.console.print(f"  [cyan]{escape(name)}[/cyan]: {escape(value)}", highlight=False)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


# --- model directories -------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSource:
    path: Path  # the bundled GGUF
    sha256: str


def _place(source: Path, target: Path) -> None:
    try:
        os.link(source, target)  # same file system: no copy of the weights
    except OSError:
        shutil.copyfile(source, target)


def model_dir(root: Path, name: str, files: dict[str, str], source: ModelSource) -> Path:
    """A directory as SageMaker would mount it. `files` maps a file name to its kind: `model` (the
    bundled GGUF), `truncated` (its first half), `decoy` (a tiny file with a GGUF magic) or `text`."""
    directory = root / name
    directory.mkdir(parents=True)
    for file_name, kind in files.items():
        target = directory / file_name
        if kind == "model":
            _place(source.path, target)
        elif kind == "truncated":
            with source.path.open("rb") as handle:
                target.write_bytes(handle.read(source.path.stat().st_size // 2))
        elif kind == "decoy":
            target.write_bytes(b"GGUF" + bytes(1020))
        else:
            target.write_text(TEXT_FILES.get(file_name, "text\n"))
        target.chmod(0o644)
    directory.chmod(0o755)
    return directory


# --- the checks --------------------------------------------------------------------------------


@dataclass
class Startup:
    ready_after: float | None  # seconds from `docker run` to the first /ping 200
    statuses: list[int | None]  # every /ping answer before that (None: no answer)
    slowest_ping: float  # the slowest answer, or the 2 s timeout of one that never came
    timed_out: int  # pings that got no answer within 2 s (a refused connection is quick)


def wait_for_ping(container: Container, base_url: str, timeout: float = READY_TIMEOUT_SECONDS) -> Startup:
    statuses: list[int | None] = []
    slowest = 0.0
    timed_out = 0
    deadline = container.started + timeout
    last_state_check = 0.0
    while time.monotonic() < deadline:
        asked = time.monotonic()
        status = ping_status(base_url, timeout=SAGEMAKER_PING_TIMEOUT_SECONDS)
        took = time.monotonic() - asked
        if status is not None or took >= SAGEMAKER_PING_TIMEOUT_SECONDS:
            slowest = max(slowest, took)
            timed_out += status is None
        if status == 200:
            return Startup(time.monotonic() - container.started, statuses, slowest, timed_out)
        statuses.append(status)
        if time.monotonic() - last_state_check > 0.5:
            last_state_check = time.monotonic()
            if not container.running():
                break
        time.sleep(0.02)
    return Startup(None, statuses, slowest, timed_out)


def vm_rss_mib(container: Container) -> float | None:
    """Resident memory of the container's processes (the front, PID 1, and its engine child), from
    /proc/*/status."""
    result = container.exec("sh", "-c", "cat /proc/[0-9]*/status 2>/dev/null")
    sizes = [int(kb) for kb in re.findall(r"^VmRSS:\s+(\d+) kB", result.stdout, re.M)]
    return sum(sizes) / 1024 if sizes else None


def check_main_container(
    report: Report, docker: Docker, image: str, spec: ContainerSpec, model: Path
) -> tuple[Container, str]:
    """Start the served container and check it up to ready; return it and its base URL."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    container = docker.run(
        image,
        name="main",
        environment=spec.environment,
        model_dir=model,
        memory_bytes=spec.memory_bytes,
        port=port,
    )
    startup = wait_for_ping(container, base_url)
    logs = container.logs()
    if not report.check(
        "/ping turns 200 (docker run … serve, template environment, model mounted read-only)",
        startup.ready_after is not None,
        f"{startup.ready_after:.2f} s after docker run" if startup.ready_after else logs[-1500:],
    ):
        raise RuntimeError("the container never became ready; stopping here")
    report.fact("docker run → /ping 200", f"{startup.ready_after:.2f} s")
    answered = [s for s in startup.statuses if s is not None]
    report.check(
        "/ping before the model is ready: never 200, each answer within 2 s",
        set(answered) <= {503}
        and startup.timed_out == 0
        and startup.slowest_ping < SAGEMAKER_PING_TIMEOUT_SECONDS,
        f"{len(answered)} × 503, {startup.statuses.count(None) - startup.timed_out} × not listening yet, "
        f"{startup.timed_out} × no answer in 2 s, slowest answer {startup.slowest_ping * 1000:.0f} ms",
    )
    backend = BACKEND_LINE.search(logs)
    variant = CPU_VARIANT.search(backend.group("libraries")) if backend else None
    report.check(
        "llama.cpp loaded a CPU backend variant at run time (GGML_BACKEND_DL)",
        variant is not None,
        backend.group(0) if backend else "no 'llama.cpp backends:' line in the logs",
    )
    if variant:
        report.fact("ggml CPU backend variant", f"{variant.group('variant')} ({variant.group(0)})")
    rss = vm_rss_mib(container)
    report.fact("resident memory after the model loads", f"{rss:.0f} MiB" if rss else "unknown")
    report.check(
        "memory limit = the instance type's memory",
        int(container.inspect("{{.HostConfig.Memory}}")) == spec.memory_bytes,
        f"{spec.memory_bytes / 1024**3:g} GiB ({spec.instance_type})",
    )
    touched = container.exec("sh", "-c", "touch /opt/ml/model/.write-test")
    report.check(
        "/opt/ml/model is read-only inside the container",
        touched.returncode != 0,
        (touched.stderr.strip() or "the write succeeded")[-120:],
    )
    cmdline = container.exec("cat", "/proc/1/cmdline").stdout.replace("\0", " ").strip()
    report.check("PID 1 is the server (it receives SIGTERM itself)", "serve" in cmdline, cmdline)
    leftovers = container.exec("sh", "-c", "find /run/secrets -type f 2>/dev/null; env | grep -i '^PIP_CERT'")
    report.check(
        "the build's CA secret left nothing in the image (no /run/secrets file, no PIP_CERT)",
        leftovers.stdout.strip() == "",
        leftovers.stdout.strip()[:200] or "none",
    )
    return container, base_url


def traceback_excerpt(logs: str, *, before: int = 3, after: int = 30) -> str:
    """The first traceback in `logs` with a few lines around it, to show beside a failed check."""
    lines = logs.splitlines()
    start = next((i for i, line in enumerate(lines) if "Traceback" in line), None)
    if start is None:
        return ""
    return "; the first traceback:\n" + "\n".join(lines[max(0, start - before) : start + after])


def run_live_tests(report: Report, base_url: str) -> None:
    env = {**os.environ, BASE_URL_ENV: base_url}
    command = [sys.executable, "-m", "pytest", *LIVE_TESTS, "-q", "-rs", "-p", "no:cacheprovider"]
    report.console.print(f"  [dim]$ {BASE_URL_ENV}={base_url} pytest {' '.join(LIVE_TESTS)} -q -rs[/dim]")
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
    output = (result.stdout + result.stderr).rstrip()
    report.console.print(output, highlight=False, markup=False)
    summary = output.splitlines()[-1] if output else ""
    report.check(
        "live-server tests against the container (tests/server)",
        result.returncode == 0,
        f"{summary.strip('= ')} in {time.monotonic() - started:.0f} s",
    )


# The engine child's pid, read inside the container with the image's own Python (no procps there).
ENGINE_PID = (
    "import pathlib\n"
    "for p in pathlib.Path('/proc').iterdir():\n"
    "    if p.name.isdigit():\n"
    "        try: argv = (p / 'cmdline').read_bytes().split(b'\\0')\n"
    "        except OSError: continue\n"
    "        if b'decider.cli' in argv and b'engine' in argv: print(p.name)\n"
)


def wait_for_engine_exit(container: Container, pid: str, deadline: float) -> None:
    """Wait until the signalled child is gone, so the next request goes to its successor rather
    than to a dying socket (a request the dying child accepted is honestly lost: 503)."""
    while time.monotonic() < deadline:
        if pid not in container.exec("/opt/venv/bin/python", "-c", ENGINE_PID).stdout.split():
            return
        time.sleep(0.05)


def check_engine_restart(report: Report, container: Container, base_url: str) -> None:
    """A native abort in the engine child (SIGABRT, as llama.cpp's GGML_ASSERT sends): the container
    keeps running, what the child ran gets 503 engine_restarted, and a decision is served again."""
    found = container.exec("/opt/venv/bin/python", "-c", ENGINE_PID).stdout.split()
    if len(found) != 1:
        report.check("the engine runs in a child of PID 1", False, f"engine processes found: {found}")
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        chat = pool.submit(httpx.post, f"{base_url}/v1/chat/completions", json=DRAIN_BODY, timeout=60)
        time.sleep(0.25)
        killed = time.monotonic()
        abort = f"import os, signal; os.kill({int(found[0])}, signal.SIGABRT)"
        container.exec("/opt/venv/bin/python", "-c", abort)
        wait_for_engine_exit(container, found[0], deadline=killed + 10)
        decision = httpx.post(f"{base_url}/v1/systemone", json=DECISION_BODY, timeout=60)
        back = time.monotonic() - killed
        cut = chat.result()
    code = cut.json().get("error", {}).get("code") if cut.status_code != 200 else "200"
    logs = container.logs()
    report.check(
        "a SIGABRT in the engine child: 503 engine_restarted for what it ran, served again within 10 s",
        container.running()
        and code in ("engine_restarted", "200")  # the chat may have ended before the signal
        and decision.status_code == 200
        and back < 10
        and "engine process died (signal SIGABRT)" in logs
        and "Fatal Python error: Aborted" in logs,
        f"chat: {code}; decision {decision.status_code} {back:.1f} s after the signal",
    )
    report.fact("engine SIGABRT → served again", f"{back:.1f} s")


def check_drain_on_stop(report: Report, container: Container, base_url: str) -> None:
    """Two requests in flight, then `docker stop`: both complete after SIGTERM, exit 0 within the
    grace period."""

    def call() -> tuple[httpx.Response | Exception, float]:
        try:
            response: httpx.Response | Exception = httpx.post(
                f"{base_url}/v1/chat/completions", json=DRAIN_BODY, timeout=60
            )
        except httpx.HTTPError as exc:
            response = exc
        return response, time.monotonic()

    with ThreadPoolExecutor(max_workers=2) as pool:
        in_flight = [pool.submit(call) for _ in range(2)]
        time.sleep(0.25)  # both admitted: one generating, one queued
        sigterm = time.monotonic()
        took = container.stop(SAGEMAKER_STOP_GRACE_SECONDS)
        results = [future.result() for future in in_flight]
    outcomes, ok = [], True
    for response, ended in results:
        after = ended - sigterm
        if isinstance(response, httpx.Response) and response.is_success:
            tokens = response.json().get("usage", {}).get("completion_tokens")
            outcomes.append(f"200 ({tokens} tokens, done {after:.1f} s after SIGTERM)")
            ok = ok and after > 0 and bool(tokens)
        else:
            status = response.status_code if isinstance(response, httpx.Response) else type(response).__name__
            outcomes.append(str(status))
            ok = False
    state = container.state()
    drained = "draining in-flight requests" in container.logs()
    report.check(
        f"docker stop (SIGKILL after {SAGEMAKER_STOP_GRACE_SECONDS} s) drains in-flight requests, exits 0",
        ok and drained and state["exit_code"] == "0" and took < SAGEMAKER_STOP_GRACE_SECONDS,
        f"exit {state['exit_code']} after {took:.1f} s; in flight: {'; '.join(outcomes)}; "
        f"drain logged: {drained}",
    )
    report.fact("docker stop → exit", f"{took:.1f} s, status {state['exit_code']}")


def check_network_none(report: Report, docker: Docker, image: str, spec: ContainerSpec, model: Path) -> None:
    container = docker.run(
        image,
        name="network-none",
        environment=spec.environment,
        model_dir=model,
        memory_bytes=spec.memory_bytes,
        network="none",
    )
    probe = container.exec("python", "-c", NETWORK_NONE_PROBE, timeout=READY_TIMEOUT_SECONDS + 30)
    waited = time.monotonic() - container.started
    try:
        result = json.loads(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        result = {"status": None, "error": (probe.stdout + probe.stderr)[-500:]}
    report.check(
        "--network none: /ping 200 from inside (docker exec, the image's own Python)",
        result.get("status") == 200,
        f"{waited:.2f} s after docker run; interfaces {result.get('interfaces')}"
        if result.get("status") == 200
        else str(result),
    )
    report.check(
        "--network none: no route out, no DNS",
        result.get("interfaces") == ["lo"]
        and result.get("outbound", "connected") != "connected"
        and result.get("dns", "resolved") != "resolved",
        f"connect 1.1.1.1:443 → {result.get('outbound')}; pypi.org → {result.get('dns')}",
    )
    report.fact("docker run → /ping 200 (--network none, from inside)", f"{waited:.2f} s")
    took = container.stop(SAGEMAKER_STOP_GRACE_SECONDS)
    report.check("--network none: docker stop exits 0", container.exit_code() == 0, f"{took:.1f} s")


@dataclass(frozen=True)
class BadStart:
    name: str
    files: dict[str, str]
    env: dict[str, str | None]  # None removes the variable
    expected: str  # in the one `startup failed:` line


def bad_starts(model_file: str) -> list[BadStart]:
    return [
        BadStart("no .gguf in the directory", {"README.md": "text"}, {MODEL_FILE_ENV: None}, "found 0"),
        BadStart(
            "DECIDER_MODEL_FILE names a file that is not there", {"README.md": "text"}, {}, "does not exist"
        ),
        BadStart(
            "several .gguf files, no DECIDER_MODEL_FILE",
            {model_file: "model", "other.Q8_0.gguf": "decoy"},
            {MODEL_FILE_ENV: None, MODEL_SHA256_ENV: None},
            "found 2",
        ),
        BadStart(
            "truncated GGUF, no DECIDER_MODEL_SHA256 (llama.cpp's own check)",
            {"model.Q4_1.gguf": "truncated"},
            {MODEL_FILE_ENV: "model.Q4_1.gguf", MODEL_SHA256_ENV: None},
            "could not load",
        ),
        BadStart("truncated GGUF with the template's sha256", {model_file: "truncated"}, {}, "sha256"),
        BadStart(
            "wrong DECIDER_MODEL_SHA256", {model_file: "model"}, {MODEL_SHA256_ENV: "0" * 64}, "requires"
        ),
        BadStart(
            "GPU layers requested on the CPU image",
            {model_file: "model"},
            {"DECIDER_N_GPU_LAYERS": "-1"},
            "GPU",
        ),
    ]


def check_bad_start(
    report: Report, docker: Docker, image: str, spec: ContainerSpec, case: BadStart, directory: Path
) -> None:
    environment = {**spec.environment}
    for key, value in case.env.items():
        if value is None:
            environment.pop(key, None)
        else:
            environment[key] = value
    port = free_port()
    container = docker.run(
        image,
        name="bad-start",
        environment=environment,
        model_dir=directory,
        memory_bytes=spec.memory_bytes,
        port=port,
    )
    pings: list[int | None] = []
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while time.monotonic() < deadline and container.running():
        pings.append(ping_status(f"http://127.0.0.1:{port}", timeout=1.0))
        time.sleep(0.1)
    code = container.wait_exit(5)
    logs = container.logs()
    lines = [line for line in logs.splitlines() if "startup failed:" in line]
    reason = lines[0].split("startup failed:", 1)[1].strip() if lines else ""
    report.check(
        f"bad start: {case.name}",
        code not in (None, 0)
        and len(lines) == 1
        and case.expected in reason
        and "Traceback" not in logs
        and 200 not in pings,
        f"exit {code}: {reason[:220]}" if lines else f"exit {code}; logs: {logs[-400:]}",
    )
    docker("rm", "-f", container.id, check=False)


# --- the run -----------------------------------------------------------------------------------

CONTRACT_ERRORS = (DockerError, subprocess.TimeoutExpired, RuntimeError, httpx.HTTPError)


def guarded(report: Report, name: str, step: Callable[[], None]) -> None:
    """Run one independent step; an error in it is a failed check, and the run goes on."""
    try:
        step()
    except CONTRACT_ERRORS as exc:
        report.check(name, False, f"{type(exc).__name__}: {exc}")


def run_contract(image: str, *, live_tests: bool, console: Console) -> int:
    from decider.engine.model.bundled import SMOLLM2_FILE, SMOLLM2_SHA256, smollm2_path

    report = Report(console)
    try:
        docker = Docker()
    except DockerError as exc:
        console.print(f"[red]{escape(str(exc))}[/red]")
        return 2
    if not docker.answers():
        console.print("[red]no Docker Engine answers: run tools/dev/image/docker-host.sh[/red]")
        return 2
    try:
        size = docker.image_size(image)
    except DockerError:
        console.print(f"[red]image {image} not found: build it with `make image`[/red]")
        return 2
    console.rule(f"image contract: {image}")
    report.fact("image size", f"{size / 1024**2:.0f} MiB")
    bind_label = docker("image", "inspect", "--format", "{{json .Config.Labels}}", image).stdout
    report.check(
        "image label com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true",
        '"com.amazonaws.sagemaker.capabilities.accept-bind-to-port":"true"' in bind_label,
    )

    console.print(f"[bold]Synthesizing {STACK} (offline) for the container environment[/bold]")
    try:
        template = synthesize_stack(STACK)
        spec = container_spec(template, model_file=SMOLLM2_FILE, model_sha256=SMOLLM2_SHA256, stack=STACK)
    except (TemplateError, KeyError) as exc:
        console.print(f"[red]cannot take the container environment from {STACK}: {escape(str(exc))}[/red]")
        return 2
    report.fact(
        "environment",
        f"{len(spec.environment)} variables from {STACK}'s AWS::SageMaker::Model; replaced: "
        + ", ".join(f"{k} {old!r} → {new!r}" for k, (old, new) in spec.replaced.items()),
    )
    report.fact(
        "memory limit", f"{spec.memory_bytes / 1024**3:g} GiB = {spec.instance_type} (stacks/instances.py)"
    )

    source = ModelSource(smollm2_path(), SMOLLM2_SHA256)
    root = Path(tempfile.mkdtemp(prefix="decider-image-test-"))
    root.chmod(0o755)
    try:
        served = model_dir(
            root,
            "served",
            {
                SMOLLM2_FILE: "model",
                "other.Q8_0.gguf": "decoy",
                "README.md": "text",
                "tokenizer_config.json": "text",
            },
            source,
        )
        console.print(
            "[bold]Main container[/bold] (model directory: several files, DECIDER_MODEL_FILE picks one)"
        )
        main, base_url = check_main_container(report, docker, image, spec, served)
        if live_tests:
            console.print("[bold]Live-server tests against the container[/bold]")
            run_live_tests(report, base_url)
            logs = main.logs()
            report.check(
                "after the live tests: still serving, no traceback in the logs",
                main.running() and ping_status(base_url) == 200 and "Traceback" not in logs,
                f"{len(logs.splitlines())} log lines{traceback_excerpt(logs)}",
            )
            rss = vm_rss_mib(main)
            report.fact("resident memory after the live tests", f"{rss:.0f} MiB" if rss else "unknown")
        console.print("[bold]Batch Transform (/execution-parameters, JSON Lines)[/bold]")
        guarded(report, "Batch Transform", lambda: check_batch_transform(report, base_url))
        console.print("[bold]A native crash in the engine child[/bold]")
        guarded(report, "engine restart", lambda: check_engine_restart(report, main, base_url))
        console.print("[bold]docker stop with requests in flight[/bold]")
        check_drain_on_stop(report, main, base_url)

        console.print("[bold]Network isolation (--network none)[/bold]")
        guarded(report, "--network none", lambda: check_network_none(report, docker, image, spec, served))
        console.print("[bold]Bad model directories and settings[/bold]")
        for index, case in enumerate(bad_starts(SMOLLM2_FILE)):
            directory = model_dir(root, f"bad-{index}", case.files, source)
            guarded(
                report,
                f"bad start: {case.name}",
                lambda case=case, directory=directory: check_bad_start(
                    report, docker, image, spec, case, directory
                ),
            )
    except CONTRACT_ERRORS as exc:
        report.check("contract run", False, f"{type(exc).__name__}: {exc}")
    finally:
        docker.remove_all()
        shutil.rmtree(root, ignore_errors=True)

    print_summary(report)
    return 1 if report.failed else 0


def print_summary(report: Report) -> None:
    console = report.console
    console.rule("summary")
    facts = Table(show_header=False, box=None)
    for name, value in report.facts.items():
        if name != "environment":
            facts.add_row(f"[cyan]{escape(name)}[/cyan]", escape(value))
    console.print(facts)
    passed = len(report.checks) - len(report.failed)
    verdict = (
        "[green]all passed[/green]"
        if not report.failed
        else f"[bold red]{len(report.failed)} failed[/bold red]"
    )
    console.print(f"{passed}/{len(report.checks)} checks passed: {verdict}")
    for check in report.failed:
        console.print(f"  [red]FAIL[/red] {escape(check.name)}: {escape(check.detail)}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the serving image as SageMaker does and check its contract."
    )
    parser.add_argument("--image", default=os.environ.get("IMAGE", DEFAULT_IMAGE))
    parser.add_argument(
        "--skip-live-tests", action="store_true", help="skip the tests/server run against the container"
    )
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 120, soft_wrap=not sys.stdout.isatty())
    started = time.monotonic()
    status = run_contract(args.image, live_tests=not args.skip_live_tests, console=console)
    console.print(f"image-test finished in {time.monotonic() - started:.0f} s (exit {status})")
    return status


if __name__ == "__main__":
    sys.exit(main())
