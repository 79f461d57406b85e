"""`make bench-gpu`: pack what a GPU machine needs into `gpu-pack/`, check the size, print the command.

The GPU machine (one H100 or H200, the same image; nvcc 13, CMake, ninja, Python 3.12; no network)
receives this working tree, at most 64 MiB of it, and runs one command of at most 10 minutes at a
time. So everything it needs travels in `gpu-pack/` (gitignored; named in the device tool's `carry`):

- `wheels/`: the runtime and benchmark dependencies as CPython 3.12 manylinux x86_64 or pure-Python
  wheels, at the versions this venv runs (its `pip freeze` is the constraint file), and
  scikit-build-core to build llama-cpp-python; `jevbench`'s wheel among them carries the JevBench-240
  cases the benchmarks read (decider_cli.evaluate.jevbench);
- `llama_cpp_python-<v>.tar.gz`: llama-cpp-python's sdist without what a CUDA build never reads
  (llama.cpp's docs, vocab models, tests, tools, other GPU backends): 77 MB as published;
- `tokenizer.gguf`: the bundled SmolLM2's tokenizer alone. The bundled model itself (93 MB) cannot
  travel, so the machine writes a random-weight model of the production architecture at its size
  (tools/dev/qwen35_gguf.py, Qwen3.5-4B) and benchmarks that: speed does not depend on the weights;

- `cmake-args`: the CUDA image's llama.cpp CMake flags, read from `container/Dockerfile` (the one
  source of truth) with the architecture set to the machine's (sm_90): what is measured is built as
  what ships;
- `serve-env.json`: GpuStack's container environment, read from its template snapshot
  (tests/stacks/__snapshots__), so the server there runs with the settings the endpoint gets.

There, `tools/dev/gpu/remote.sh` does everything in ONE call of at most 600 s (files one call writes may
be gone by the next): a venv offline from the wheels, the CUDA build (with the model written beside
it), the image's library layout (`container/llama-libs.sh`), then `decider_dev.gpu.measure`'s steps.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from decider_dev import REPO_ROOT

PACK_DIR = "gpu-pack"
TREE_LIMIT_BYTES = 64 * 2**20  # what travels to the machine: tracked and untracked files, plus the pack
PYTHON_VERSION = "3.12"
# pip takes each tag with every older glibc's (manylinux_2_31 admits 2_28 and 2014). 2_31: llguidance's
# wheels need it; the GPU machine runs Python 3.12.3 (Ubuntu 24.04's, glibc 2.39).
PLATFORMS = (
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
LLAMA_CPP_PACKAGE = "llama-cpp-python"
# Packages the benchmarks need beyond the container's runtime (httpx is in it), pinned in requirements.txt.
BENCH_PACKAGES = ("rich", "gguf", "PyYAML", "jevbench")
# Builds the llama-cpp-python sdist there (pip --no-build-isolation: nothing to download); pip itself
# for a Python whose venv module has no ensurepip (the Makefile's pin).
BUILD_REQUIREMENTS = ("scikit-build-core==1.1.2", "pip==25.3")
# llama.cpp paths (under vendor/llama.cpp/) a CUDA build of llama-cpp-python never reads with its
# CMake options (LLAVA_BUILD=OFF; tests, tools and examples are off when llama.cpp is a subproject).
SDIST_DROPPED = (
    ".devops",
    ".github",
    "app",
    "benches",
    "ci",
    "conversion",
    "docs",
    "examples",
    "gguf-py",
    "grammars",
    "media",
    "models",
    "pocs",
    "tests",
    "tools",
)
# llama-cpp-python's own paths the build never reads (its published sdist even carries the vendored
# llama.cpp's git objects: 38 MB).
SDIST_TOP_DROPPED = (".git", "docker", "docs", "examples", "tests")
# ggml backends kept: the CPU one (always built) and CUDA; the others are added only when enabled.
GGML_BACKENDS_KEPT = ("ggml-cpu", "ggml-cuda")
REMOTE_COMMAND = "bash tools/dev/gpu/remote.sh"
DOCKERFILE = Path("container") / "Dockerfile"
CUDA_STAGE = "build-cuda"
MACHINE_ARCHITECTURES = "90"  # the H100 and the H200 lent there are both compute capability 9.0
GPU_SNAPSHOT = Path("tests/stacks/__snapshots__/test_snapshots/test_template_matches_snapshot[GpuStack].json")

Runner = Callable[[Sequence[str]], None]


class PackError(RuntimeError):
    """The pack cannot be made, or would not fit."""


@dataclass(frozen=True)
class Part:
    name: str
    size: int


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


# --- what to download ------------------------------------------------------------------------------
def pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a requirements file (comments, options and includes skipped)."""
    found: dict[str, str] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-") or "==" not in line:
            continue
        name, version = line.split("==", 1)
        found[name.split("[", 1)[0].strip()] = version.strip()
    return found


def gpu_requirements(repo: Path = REPO_ROOT) -> list[str]:
    """The pinned top-level requirements of the GPU venv (llama-cpp-python comes as an sdist)."""
    runtime = pins(repo / "container" / "requirements.txt")
    runtime.pop(LLAMA_CPP_PACKAGE, None)
    dev = pins(repo / "requirements.txt")
    missing = [name for name in BENCH_PACKAGES if name not in dev]
    if missing:
        raise PackError(f"requirements.txt pins none of {', '.join(missing)}")
    bench = {name: dev[name] for name in BENCH_PACKAGES}
    return [f"{name}=={version}" for name, version in {**runtime, **bench}.items()] + list(BUILD_REQUIREMENTS)


def llama_cpp_requirement(repo: Path = REPO_ROOT) -> str:
    version = pins(repo / "container" / "requirements.txt").get(LLAMA_CPP_PACKAGE)
    if version is None:
        raise PackError(f"container/requirements.txt does not pin {LLAMA_CPP_PACKAGE}")
    return f"{LLAMA_CPP_PACKAGE}=={version}"


def constraints(freeze: str) -> str:
    """This venv's versions (pip freeze) as a constraint file: the GPU venv gets the same ones."""
    keep = [
        line
        for line in freeze.splitlines()
        if "==" in line and not line.startswith(("-e", "#")) and not _is_llama_cpp(line.split("==")[0])
    ]
    return "\n".join(keep) + "\n"


def _is_llama_cpp(name: str) -> bool:
    return name.strip().lower().replace("_", "-") == LLAMA_CPP_PACKAGE


def wheel_download_command(pip: Sequence[str], dest: Path, requirements: Path, constraint: Path) -> list[str]:
    """`pip download` of binary wheels for CPython 3.12 on manylinux x86_64 (or pure Python)."""
    command = [*pip, "download", "--disable-pip-version-check", "--quiet", "--only-binary=:all:"]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    command += ["--python-version", PYTHON_VERSION, "--implementation", "cp"]
    command += ["-d", str(dest), "-r", str(requirements), "-c", str(constraint)]
    return command


def sdist_download_command(pip: Sequence[str], dest: Path, requirement: str) -> list[str]:
    return [
        *pip,
        "download",
        "--disable-pip-version-check",
        "--quiet",
        "--no-binary",
        ":all:",
        "--no-deps",
        "-d",
        str(dest),
        requirement,
    ]


# --- what ships: build flags and container settings ------------------------------------------------
def cuda_cmake_args(dockerfile: Path, architectures: str = MACHINE_ARCHITECTURES) -> str:
    """The CUDA stage's `LLAMA_CMAKE_ARGS` with `${CUDA_ARCHITECTURES}` set to `architectures`."""
    match = re.search(rf'AS {CUDA_STAGE}\n.*?ENV LLAMA_CMAKE_ARGS="([^"]+)"', dockerfile.read_text(), re.S)
    if match is None:
        raise PackError(f"{dockerfile} has no LLAMA_CMAKE_ARGS in its {CUDA_STAGE} stage")
    flags = match.group(1).replace("${CUDA_ARCHITECTURES}", architectures)
    if "$" in flags:
        raise PackError(f"unresolved variable in the CUDA build flags: {flags}")
    return flags


def gpu_environment(snapshot: Path) -> dict[str, str]:
    """GpuStack's container environment, as its synthesized template gives it to the model."""
    from decider_dev.image.template import model_environment

    return model_environment(json.loads(snapshot.read_text()))


# --- the trimmed sdist -----------------------------------------------------------------------------
def kept(member: str) -> bool:
    """Whether a path of the sdist (top directory included) is needed by a CUDA build."""
    parts = PurePosixPath(member).parts
    if ".git" in parts or (len(parts) > 1 and parts[1] in SDIST_TOP_DROPPED):
        return False
    try:
        at = parts.index("llama.cpp")
    except ValueError:
        return True
    if at < 1 or parts[at - 1] != "vendor":
        return True
    inner = parts[at + 1 :]
    if not inner:
        return True
    if inner[0] in SDIST_DROPPED:
        return False
    if inner[:2] == ("ggml", "src") and len(inner) > 2:
        name = inner[2]
        return not name.startswith("ggml-") or "." in name or name in GGML_BACKENDS_KEPT
    return True


def trim_sdist(source: Path, dest: Path) -> tuple[int, int]:
    """Rewrite `source` (a .tar.gz sdist) into `dest` without the members `kept` rejects.
    Returns (members kept, members dropped)."""
    kept_count = dropped = 0
    with tarfile.open(source, "r:gz") as src, tarfile.open(dest, "w:gz", compresslevel=9) as out:
        for member in src:
            if not kept(member.name):
                dropped += 1
                continue
            data = src.extractfile(member) if member.isfile() else None
            out.addfile(member, io.BytesIO(data.read()) if data is not None else None)
            kept_count += 1
    return kept_count, dropped


# --- sizes -----------------------------------------------------------------------------------------
def tree_files(repo: Path) -> list[Path]:
    """The files that travel without `carry`: tracked, and untracked but not ignored."""
    out = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout
    return [repo / name for name in out.decode().split("\0") if name]


def size_of(paths: Iterable[Path]) -> int:
    total = 0
    for path in paths:
        if path.is_file():
            total += path.stat().st_size
        elif path.is_dir():
            total += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return total


def check_budget(tree: int, parts: Sequence[Part], limit: int = TREE_LIMIT_BYTES) -> int:
    """The travelling total; PackError naming the parts when it is over `limit`."""
    total = tree + sum(part.size for part in parts)
    if total > limit:
        listing = ", ".join(f"{p.name} {mib(p.size)}" for p in sorted(parts, key=lambda p: -p.size))
        raise PackError(
            f"the travelling tree would be {mib(total)}, over {mib(limit)}: "
            f"working tree {mib(tree)}, {listing}"
        )
    return total


# --- packing ---------------------------------------------------------------------------------------
def run_command(command: Sequence[str]) -> None:
    subprocess.run(list(command), check=True)


def pack(
    repo: Path = REPO_ROOT,
    *,
    run: Runner = run_command,
    pip: Sequence[str] = (sys.executable, "-m", "pip"),
    freeze: Callable[[], str] | None = None,
    tokenizer_source: Callable[[], Path] | None = None,
) -> list[Part]:
    """Fill `repo/gpu-pack/`. Rerunnable: the wheels are fetched again (from pip's cache), the trimmed
    sdist and the tokenizer kept while their versions stand. Returns the pack's parts."""
    out = repo / PACK_DIR
    wheels = out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)  # no stale versions (pip's cache makes this cheap)
    wheels.mkdir(parents=True)
    requirements = out / "requirements.txt"
    requirements.write_text("\n".join(gpu_requirements(repo)) + "\n", encoding="utf-8")
    constraint = out / "constraints.txt"
    constraint.write_text(constraints((freeze or _pip_freeze)()), encoding="utf-8")
    run(wheel_download_command(pip, wheels, requirements, constraint))

    requirement = llama_cpp_requirement(repo)
    name, version = requirement.split("==")
    sdist = out / f"{name.replace('-', '_')}-{version}.tar.gz"
    for stale in out.glob(f"{name.replace('-', '_')}-*.tar.gz"):
        if stale != sdist:
            stale.unlink()
    if not sdist.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            run(sdist_download_command(pip, Path(tmp), requirement))
            found = sorted(Path(tmp).glob("*.tar.gz"))
            if len(found) != 1:
                raise PackError(f"pip download of {requirement} left {len(found)} sdists")
            partial = sdist.with_suffix(".partial")
            trim_sdist(found[0], partial)
            partial.replace(sdist)

    settings = out / "cmake-args"
    settings.write_text(cuda_cmake_args(repo / DOCKERFILE) + "\n", encoding="utf-8")
    environment = out / "serve-env.json"
    environment.write_text(
        json.dumps(gpu_environment(repo / GPU_SNAPSHOT), indent=1) + "\n", encoding="utf-8"
    )

    tokenizer = out / "tokenizer.gguf"
    if not tokenizer.is_file():
        from decider_dev.qwen35_gguf import write_tokenizer_only

        write_tokenizer_only(tokenizer, (tokenizer_source or _bundled_model)())

    return [
        Part("wheels", size_of([wheels])),
        Part("llama.cpp sdist", size_of([sdist])),
        Part("tokenizer", size_of([tokenizer])),
        Part("lists", size_of([requirements, constraint, settings, environment])),
    ]


def _pip_freeze() -> str:
    return subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def _bundled_model() -> Path:
    from decider.engine.model.bundled import smollm2_path

    return smollm2_path()


def instructions(total: int, parts: Sequence[Part], tree: int) -> str:
    listing = ", ".join(f"{part.name} {mib(part.size)}" for part in parts)
    return (
        f"{PACK_DIR}/ is ready: {listing}; with the working tree ({mib(tree)}) {mib(total)} travel, "
        f"of {mib(TREE_LIMIT_BYTES)}.\n"
        f'On the GPU machine (device tool: carry ["{PACK_DIR}"], timeout_s 600), run:\n'
        f"    {REMOTE_COMMAND}\n"
        "One call builds llama.cpp as the CUDA image does (sm_90), writes the model, starts `serve` with\n"
        "GpuStack's settings and measures; each step stops cleanly when its time is not left.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    try:
        parts = pack()
        tree = size_of(tree_files(REPO_ROOT))
        total = check_budget(tree, parts)
    except (PackError, subprocess.CalledProcessError) as exc:
        print(f"bench-gpu: {exc}", file=sys.stderr)
        return 1
    print(instructions(total, parts, tree), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
