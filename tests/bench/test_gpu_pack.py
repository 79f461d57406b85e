"""`make bench-gpu`, the part that runs here: what is packed, the trimmed sdist, the size budget, the
printed command, the launcher's stand-in model, the remote script's first checks. No downloads:
pip is a fake that writes the files it would have fetched."""

from __future__ import annotations

import io
import json
import re
import subprocess
import tarfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import pytest

from decider_dev.gpu import pack

REPO = pack.REPO_ROOT
SDIST_TOP = "llama_cpp_python-0.3.36"


def test_the_gpu_venv_gets_the_pinned_runtime_and_benchmark_packages_not_llama_cpp() -> None:
    requirements = pack.gpu_requirements()
    names = [line.split("==")[0] for line in requirements]
    assert all("==" in line for line in requirements)
    runtime = pack.pins(REPO / "container" / "requirements.txt")
    assert set(runtime) - {"llama-cpp-python"} <= set(names) and "llama-cpp-python" not in names
    assert {"rich", "httpx", "gguf", "PyYAML", "scikit-build-core"} <= set(names)
    assert pack.llama_cpp_requirement() == f"llama-cpp-python=={runtime['llama-cpp-python']}"


def test_constraints_are_this_venv_s_versions_without_editables_and_llama_cpp() -> None:
    freeze = "-e git+x#egg=decider\nnumpy==2.4.6\nllama_cpp_python==0.3.36\nrich==15.0.0\n# note\n"
    assert pack.constraints(freeze) == "numpy==2.4.6\nrich==15.0.0\n"


def test_wheels_are_fetched_as_cpython_312_manylinux_binaries() -> None:
    command = pack.wheel_download_command(["pip"], Path("w"), Path("r.txt"), Path("c.txt"))
    assert command[:2] == ["pip", "download"] and "--only-binary=:all:" in command
    assert command[command.index("--python-version") + 1] == "3.12"
    platforms = {command[i + 1] for i, arg in enumerate(command) if arg == "--platform"}
    assert platforms and all(p.endswith("x86_64") and p.startswith("manylinux") for p in platforms)
    assert command[-4:] == ["-r", "r.txt", "-c", "c.txt"]
    sdist = pack.sdist_download_command(["pip"], Path("d"), "llama-cpp-python==0.3.36")
    assert sdist[-1] == "llama-cpp-python==0.3.36" and {"--no-binary", ":all:", "--no-deps"} <= set(sdist)


def _glibc(tag: str) -> tuple[int, int]:
    if tag.startswith("manylinux2014"):
        return (2, 17)
    major, minor = re.match(r"manylinux_(\d+)_(\d+)_", tag).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def test_the_pack_admits_the_platform_of_every_binary_wheel_this_venv_runs() -> None:
    """`make bench-gpu` failed (ResolutionImpossible) once llguidance came in: its wheels are
    manylinux_2_31, and the pack asked pip for 2_28 at most."""
    newest = max(_glibc(tag) for tag in pack.PLATFORMS)
    for requirement in pack.gpu_requirements():
        name = requirement.split("==")[0]
        try:
            wheel = metadata.distribution(name).read_text("WHEEL") or ""
        except metadata.PackageNotFoundError:
            continue  # a build requirement this venv does not hold
        platforms = {line.split("-")[-1] for line in wheel.splitlines() if line.startswith("Tag:")}
        for platform in (p for p in platforms if p.startswith("manylinux")):
            assert _glibc(platform) <= newest, (name, platform)


@pytest.mark.parametrize(
    ("member", "kept"),
    [
        (f"{SDIST_TOP}/pyproject.toml", True),
        (f"{SDIST_TOP}/CMakeLists.txt", True),
        (f"{SDIST_TOP}/llama_cpp/llama_cpp.py", True),
        (f"{SDIST_TOP}/vendor/llama.cpp/CMakeLists.txt", True),
        (f"{SDIST_TOP}/vendor/llama.cpp/src/models/qwen35.cpp", True),
        (f"{SDIST_TOP}/vendor/llama.cpp/common/common.cpp", True),
        (f"{SDIST_TOP}/vendor/llama.cpp/vendor/nlohmann/json.hpp", True),
        (f"{SDIST_TOP}/vendor/llama.cpp/ggml/src/ggml.c", True),
        (f"{SDIST_TOP}/vendor/llama.cpp/ggml/src/ggml-backend-dl.h", True),
        (f"{SDIST_TOP}/vendor/llama.cpp/ggml/src/ggml-cuda/fattn.cu", True),
        (f"{SDIST_TOP}/vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp", True),
        (f"{SDIST_TOP}/vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp", False),
        (f"{SDIST_TOP}/vendor/llama.cpp/ggml/src/ggml-hip/CMakeLists.txt", False),
        (f"{SDIST_TOP}/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf", False),
        (f"{SDIST_TOP}/vendor/llama.cpp/docs/build.md", False),
        (f"{SDIST_TOP}/vendor/llama.cpp/tools/mtmd/mtmd.cpp", False),
        (f"{SDIST_TOP}/vendor/llama.cpp/tests/test-backend-ops.cpp", False),
        (f"{SDIST_TOP}/.git/modules/vendor/llama.cpp/objects/pack/p.pack", False),
        (f"{SDIST_TOP}/examples/server/server.py", False),
    ],
)
def test_the_sdist_keeps_what_a_cuda_build_reads(member: str, kept: bool) -> None:
    assert pack.kept(member) is kept


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as out:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    return path


def test_trimming_rewrites_the_sdist_with_the_kept_members_and_their_bytes(tmp_path: Path) -> None:
    members = {
        f"{SDIST_TOP}/pyproject.toml": b"[build-system]\n",
        f"{SDIST_TOP}/vendor/llama.cpp/src/llama.cpp": b"// source\n",
        f"{SDIST_TOP}/vendor/llama.cpp/docs/huge.png": b"\0" * 50_000,
    }
    source = _tar(tmp_path / "in.tar.gz", members)
    assert pack.trim_sdist(source, tmp_path / "out.tar.gz") == (2, 1)
    with tarfile.open(tmp_path / "out.tar.gz") as trimmed:
        names = trimmed.getnames()
        assert names == list(members)[:2]
        handle = trimmed.extractfile(names[1])
        assert handle is not None and handle.read() == b"// source\n"


def test_an_oversized_pack_is_refused_naming_its_parts() -> None:
    parts = [pack.Part("wheels", 30 * 2**20), pack.Part("llama.cpp sdist", 40 * 2**20)]
    with pytest.raises(pack.PackError) as refused:
        pack.check_budget(2**20, parts)
    assert "71.0 MiB, over 64.0 MiB" in str(refused.value) and "llama.cpp sdist 40.0 MiB" in str(
        refused.value
    )
    assert pack.check_budget(2**20, parts[:1]) == 31 * 2**20


def test_the_real_tree_leaves_room_for_the_pack() -> None:
    """The budget arithmetic on this working tree and the sizes the pack had when written
    (wheels 25.1, sdist 3.5, tokenizer 1.7, cases 0.8 MiB), with a quarter of margin."""
    tree = pack.size_of(pack.tree_files(REPO))
    assert not any(path.is_relative_to(REPO / pack.PACK_DIR) for path in pack.tree_files(REPO))
    measured = [
        pack.Part(name, int(size * 2**20)) for name, size in (("w", 25.1), ("s", 3.5), ("t", 1.7), ("c", 0.8))
    ]
    total = pack.check_budget(tree, measured)
    assert total * 1.25 < pack.TREE_LIMIT_BYTES


class FakePip:
    """Stands in for pip: writes the wheel and the sdist it was asked for."""

    def __init__(self, sdist_members: dict[str, bytes]) -> None:
        self.commands: list[list[str]] = []
        self.sdist_members = sdist_members

    def __call__(self, command: Sequence[str]) -> None:
        command = list(command)
        self.commands.append(command)
        dest = Path(command[command.index("-d") + 1])
        if "--only-binary=:all:" in command:
            (dest / "numpy-2.4.6-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"w" * 1000)
        else:
            _tar(dest / f"{SDIST_TOP}.tar.gz", self.sdist_members)


def test_packing_fills_the_pack_and_prints_the_one_command(tmp_path: Path, smollm2_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "container").mkdir(parents=True)
    for name in (
        "requirements.txt",
        "container/requirements.txt",
        "container/Dockerfile",
        str(pack.GPU_SNAPSHOT),
    ):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text((REPO / name).read_text())
    fake = FakePip({f"{SDIST_TOP}/pyproject.toml": b"x", f"{SDIST_TOP}/vendor/llama.cpp/docs/a.md": b"y"})
    parts = pack.pack(
        repo,
        run=fake,
        pip=["pip"],
        freeze=lambda: "numpy==2.4.6\n",
        tokenizer_source=lambda: smollm2_path,
    )
    out = repo / pack.PACK_DIR
    assert len(fake.commands) == 2 and (out / "wheels").is_dir()
    assert (out / "constraints.txt").read_text() == "numpy==2.4.6\n"
    assert "llama-cpp-python" not in (out / "requirements.txt").read_text()
    with tarfile.open(out / f"{SDIST_TOP}.tar.gz") as trimmed:
        assert trimmed.getnames() == [f"{SDIST_TOP}/pyproject.toml"]
    assert "jevbench==" in (out / "requirements.txt").read_text()  # its wheel carries the cases
    tokenizer = pack.size_of([out / "tokenizer.gguf"])
    assert 1_000_000 < tokenizer < 3_000_000  # SmolLM2's tokenizer without its 93 MB of weights
    assert [part.name for part in parts][:3] == ["wheels", "llama.cpp sdist", "tokenizer"]
    assert (out / "cmake-args").read_text().strip() == pack.cuda_cmake_args(REPO / pack.DOCKERFILE)
    assert json.loads((out / "serve-env.json").read_text())["DECIDER_N_GPU_LAYERS"] == "-1"
    stale = out / "llama_cpp_python-0.3.35.tar.gz"
    stale.write_bytes(b"old")
    (out / "wheels" / "numpy-1.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"old")
    pack.pack(
        repo,
        run=fake,
        pip=["pip"],
        freeze=lambda: "",
        tokenizer_source=lambda: smollm2_path,
    )
    assert len(fake.commands) == 3  # the trimmed sdist and the tokenizer are kept; the wheels fetched again
    assert not stale.exists() and [p.name for p in (out / "wheels").iterdir()] == [
        "numpy-2.4.6-cp312-cp312-manylinux_2_28_x86_64.whl"
    ]
    text = pack.instructions(pack.check_budget(0, parts), parts, 0)
    assert f"    {pack.REMOTE_COMMAND}\n" in text and 'carry ["gpu-pack"]' in text


def test_the_remote_script_builds_what_ships_and_measures_in_one_call() -> None:
    script = (REPO / "tools" / "dev" / "gpu" / "remote.sh").read_text()
    subprocess.run(["bash", "-n", str(REPO / "tools" / "dev" / "gpu" / "remote.sh")], check=True)
    # the CUDA image's own flags and library layout, never a native build for the test machine's CPU
    assert 'CMAKE_FLAGS=$(cat "$PACK/cmake-args")' in script and "CMAKE_ARGS=$CMAKE_FLAGS " in script
    assert "GGML_NATIVE=ON" not in script and "march=native" not in script
    assert 'container/llama-libs.sh" "$site"' in script and "--no-index" in script
    steps = [line.split()[1] for line in script.splitlines() if line.lstrip().startswith("step ")]
    assert steps == ["probe", "serve", "limit", "gpu-answers", "cpu-answers", "parity"]
    assert pack.REMOTE_COMMAND == "bash tools/dev/gpu/remote.sh"
    assert "/gpu-pack/" in (REPO / ".gitignore").read_text() and "/.gpu/" in (REPO / ".gitignore").read_text()


def test_the_pack_builds_with_the_cuda_image_s_flags_for_the_machine_s_gpu() -> None:
    flags = pack.cuda_cmake_args(REPO / pack.DOCKERFILE)
    dockerfile = (REPO / pack.DOCKERFILE).read_text()
    assert (
        flags.replace("-DCMAKE_CUDA_ARCHITECTURES=90", "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}")
        in dockerfile
    )
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_BACKEND_DL=ON" in flags and "-DGGML_CUDA=ON" in flags
    assert "$" not in flags


def test_the_pack_runs_serve_with_gpu_stack_s_container_settings() -> None:
    env = pack.gpu_environment(REPO / pack.GPU_SNAPSHOT)
    assert env["DECIDER_N_GPU_LAYERS"] == "-1" and env["DECIDER_FLASH_ATTN"] == "true"
    assert env["DECIDER_LOAD_PROBE"] == "true"


def _stand_in_tools(bin_dir: Path) -> None:
    """nvcc, cmake, ninja and python3.12 that only answer --version (nothing else is reached)."""
    bin_dir.mkdir(parents=True)
    for tool in ("nvcc", "cmake", "ninja", "python3.12", "nvidia-smi"):
        path = bin_dir / tool
        path.write_text("#!/bin/sh\necho 'stand-in 1.0'\n")
        path.chmod(0o755)


def test_the_remote_script_stops_cleanly_before_a_step_its_time_cannot_hold(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "tools" / "dev" / "gpu").mkdir(parents=True)
    (tree / "tools" / "dev" / "gpu" / "remote.sh").write_text(
        (REPO / "tools" / "dev" / "gpu" / "remote.sh").read_text()
    )
    (tree / "gpu-pack" / "wheels").mkdir(parents=True)
    (tree / "gpu-pack" / "cmake-args").write_text("-DGGML_CUDA=ON\n")
    _stand_in_tools(tmp_path / "bin")
    env = {
        "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
        "BENCH_GPU_BUDGET_S": "30",
        "OUT": str(tmp_path / "out"),
    }
    (tmp_path / "out").mkdir()
    done = subprocess.run(
        ["bash", str(tree / "tools" / "dev" / "gpu" / "remote.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stopping before the venv: about 60 s needed" in done.stdout, done.stdout


def test_the_remote_script_without_a_pack_says_so(tmp_path: Path) -> None:
    copy = tmp_path / "tree" / "tools" / "dev" / "gpu"
    copy.mkdir(parents=True)
    (copy / "remote.sh").write_text((REPO / "tools" / "dev" / "gpu" / "remote.sh").read_text())
    done = subprocess.run(["bash", str(copy / "remote.sh")], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "gpu-pack is missing" in done.stderr


def test_the_measurements_serve_the_generated_model_with_the_stack_s_settings_and_the_probe_s_overrides(
    tmp_path: Path,
) -> None:
    from decider_dev.gpu import measure

    env_file = tmp_path / "serve-env.json"
    env_file.write_text(json.dumps(pack.gpu_environment(REPO / pack.GPU_SNAPSHOT)))
    model = tmp_path / "models" / "m.gguf"
    env = measure.serve_environment(env_file, model, tmp_path)
    assert env["DECIDER_MODEL_PATH"] == str(model.parent) and env["DECIDER_MODEL_FILE"] == "m.gguf"
    assert "DECIDER_MODEL_SHA256" not in env and env["DECIDER_N_GPU_LAYERS"] == "-1"
    (tmp_path / measure.OVERRIDES).write_text(json.dumps({"LD_PRELOAD": "libstdc++.so.6"}))
    assert measure.serve_environment(env_file, model, tmp_path)["LD_PRELOAD"] == "libstdc++.so.6"
    assert measure.percentile([3.0, 1.0, 2.0, 4.0], 50) in (2.0, 3.0) and measure.percentile([5.0], 95) == 5.0
    assert measure.DIAGNOSES[0][0] == "preload_libstdcxx"
