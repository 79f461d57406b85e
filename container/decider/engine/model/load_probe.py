"""Load the model once in a child process before the server loads it in its own.

A native crash while llama.cpp loads a model (a CUDA backend that faults on this driver, a build
whose CPU kernels this host refuses, a file that trips an assertion) would end the serving process
with nothing in the log but a signal: llama.cpp's own load log is off, and SageMaker only sees a
container that never answered /ping. So the server first loads the model with exactly the settings
it will use (the same backends, the same llama.cpp context) in a child that also decodes a few
tokens, with llama.cpp's log and Python's faulthandler on. If the child dies by a signal, the
server logs one line naming the signal, the model and the settings, then the child's last log
lines (llama.cpp's load log and the native traceback), and exits with its own status
(`EXIT_LOAD_CRASHED`) without trying the load itself: no crash loop inside the container, and the
cause is in CloudWatch. A child that fails with an ordinary error proves nothing about crashes:
the server's own load then reports that error in its own words.

    python -m decider.engine.model.load_probe --model M.gguf --config '{"n_ctx": 8192, ...}' \
        [--backend lib.so ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from decider.engine.model import cxx_runtime
from decider.errors import LoadCrashedError
from decider.settings import Settings

log = logging.getLogger(__name__)

# The settings that shape the llama.cpp model and context (native.ContextConfig.from_settings).
CONTEXT_FIELDS = (
    "n_gpu_layers",
    "flash_attn",
    "n_ctx",
    "n_batch",
    "n_ubatch",
    "n_seq_max",
    "n_threads",
    "batch_invariant",
)
TIMEOUT_SECONDS = 600.0  # a 4B model from a cold volume loads in well under a minute
LOG_TAIL_LINES = 60  # of the child's output, logged after the one line when it crashed
PROBE_TOKENS = 48


@dataclass(frozen=True)
class LoadProbe:
    """How the child fared: `loaded` (and decoded), `crashed` (a signal), `failed` (an error exit)
    or `timed_out`."""

    outcome: Literal["loaded", "crashed", "failed", "timed_out"]
    seconds: float
    status: int | None = None  # the child's exit status (negative: the signal that ended it)
    output: str = ""  # the child's stdout and stderr together

    @property
    def signal_name(self) -> str:
        if self.status is None or self.status >= 0:
            return ""
        try:
            return signal.Signals(-self.status).name
        except ValueError:
            return f"signal {-self.status}"

    def tail(self, lines: int = LOG_TAIL_LINES) -> list[str]:
        return [line for line in self.output.splitlines() if line.strip()][-lines:]


def context_values(settings: Settings) -> dict[str, Any]:
    """What the child needs to build the same context: the context-shaping settings, as set."""
    return {name: getattr(settings, name) for name in CONTEXT_FIELDS}


def describe_settings(settings: Settings) -> str:
    """`DECIDER_N_GPU_LAYERS=-1 DECIDER_FLASH_ATTN=true …` for the settings the probe loaded with."""

    def shown(value: Any) -> str:
        if value is None:
            return "default"
        return str(value).lower() if isinstance(value, bool) else str(value)

    return " ".join(
        f"{Settings.env_name(name)}={shown(value)}" for name, value in context_values(settings).items()
    )


def probe_command(model: Path, settings: Settings, backends: Sequence[Path]) -> list[str]:
    command = [sys.executable, "-X", "faulthandler", "-m", __name__, "--model", str(model)]
    command += ["--config", json.dumps(context_values(settings))]
    for path in backends:
        command += ["--backend", str(path)]
    return command


def run_probe(
    model: Path,
    settings: Settings,
    backends: Sequence[Path] = (),
    *,
    timeout: float = TIMEOUT_SECONDS,
    command: Sequence[str] | None = None,
) -> LoadProbe:
    """Load `model` and decode a few tokens in a child with `settings`' context and `backends`."""
    argv = list(command) if command is not None else probe_command(model, settings, backends)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    started = time.monotonic()
    try:
        done = subprocess.run(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace")
        return LoadProbe("timed_out", time.monotonic() - started, None, output)
    seconds = time.monotonic() - started
    output = done.stdout.decode(errors="replace")
    if done.returncode == 0:
        return LoadProbe("loaded", seconds, 0, output)
    return LoadProbe("crashed" if done.returncode < 0 else "failed", seconds, done.returncode, output)


def check_load(
    model: Path,
    settings: Settings,
    backends: Sequence[Path] = (),
    *,
    backends_described: str = "",
    timeout: float = TIMEOUT_SECONDS,
    command: Sequence[str] | None = None,
) -> LoadProbe:
    """Probe the load; raise `LoadCrashedError` (one line) when the child died by a signal, after
    logging its last lines. Any other outcome is returned: the server's own load decides then."""
    probe = run_probe(model, settings, backends, timeout=timeout, command=command)
    if probe.outcome == "crashed":
        for line in probe.tail():
            log.error("load probe: %s", line)
        on = f" on {backends_described}" if backends_described else ""
        raise LoadCrashedError(
            f"loading {model.name} crashed a probe process with {probe.signal_name} after "
            f"{probe.seconds:.1f} s ({describe_settings(settings)}{on}); the server does not load it: "
            "llama.cpp's load log and the native traceback are the 'load probe:' lines above"
            f"{_runtime_suspect(backends)}"
        )
    if probe.outcome == "loaded":
        log.info("load probe: %s loaded and decoded in a child process in %.1f s", model.name, probe.seconds)
    elif probe.outcome == "timed_out":
        log.warning("load probe: no verdict after %.0f s (a slow volume?); loading in-process", probe.seconds)
    else:
        log.warning("load probe: the child exited with %s; the server's own load says why", probe.status)
    return probe


def _runtime_suspect(backends: Sequence[Path]) -> str:
    """'; <which library answers C++ runtime calls>' when one does (a known cause of such crashes),
    else ''. A diagnosis only: it never hides the crash it explains."""
    try:
        libraries = [*cxx_runtime.llama_cpp_libraries(), *backends]
        found = cxx_runtime.check(list(dict.fromkeys(libraries)))
    except Exception as exc:  # the crash line must be logged whatever happens here
        log.warning("load probe: the C++ runtime check did not run: %s", exc)
        return ""
    return f"; likely cause: {found.describe()}" if found.interpositions else ""


def _child(model: Path, values: dict[str, Any], backends: Sequence[Path]) -> None:
    """Load with llama.cpp's log on, decode `PROBE_TOKENS` tokens (long enough for the batched
    matmul kernels), close."""
    import llama_cpp._logger as llama_logger

    from decider.engine.model.ggml_backends import load_backend_files
    from decider.engine.model.native import ContextConfig, LlamaRuntime, OutputSpec, Row

    llama_logger.set_verbose(True)  # llama.cpp's own load log, to stderr (the parent keeps its tail)
    load_backend_files(backends)
    settings = Settings.from_values(values)
    print(f"load probe: loading {model} with {describe_settings(settings)}", flush=True)
    runtime = LlamaRuntime(model, ContextConfig.from_settings(settings))
    text = "A probe of this model's load and kernels on this host. " * 8
    tokens = runtime.tokenize(text, special=False)[:PROBE_TOKENS]
    runtime.decode([Row(0, tokens, 0, OutputSpec(argmax=True))])
    runtime.close()
    print("load probe: loaded and decoded", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Load a model in this process (the server's load probe)")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--config", default="{}", help="context settings as JSON (CONTEXT_FIELDS)")
    parser.add_argument("--backend", type=Path, action="append", default=[], help="a ggml backend library")
    args = parser.parse_args(argv)
    _child(args.model, json.loads(args.config), args.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
