"""The image's run-time backend path: ggml reached in the copy libllama uses, and the GPU check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from decider.engine.model.ggml_backends import (
    CUDA_LIBRARY,
    Backends,
    Device,
    ProbeResult,
    choose_cpu_variant,
    cuda_load_error,
    ensure_backends,
    require_gpu,
)
from decider.errors import StartupError
from decider.server.runtime import describe_failure, load_engine
from decider.settings import Settings

CPU = Device("CPU", "Some CPU", "cpu")
GPU = Device("CUDA0", "NVIDIA L4", "gpu")

# Run in a fresh interpreter: opening the wheel's other libggml copy would otherwise stay loaded in
# the test session. Prints the addresses `ggml_backend_reg_count` resolves to.
PROBE = """
import ctypes, json, sys
from pathlib import Path
import llama_cpp
from decider.engine.model.ggml_backends import _ggml, llama_cpp_lib_dir

def address(lib):
    return ctypes.cast(lib.ggml_backend_reg_count, ctypes.c_void_p).value

maps = Path("/proc/self/maps").read_text().splitlines()
mapped = sorted({line.split()[-1] for line in maps if "/libggml.so" in line})
through_llama = address(_ggml())
plain = llama_cpp_lib_dir() / "libggml.so"
print(json.dumps({"mapped": mapped, "through_llama": through_llama,
                  "in_mapped": address(ctypes.CDLL(mapped[0])),
                  "in_plain_name": address(ctypes.CDLL(str(plain))),
                  "plain_is_mapped": plain.samefile(mapped[0])}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps (Linux)")
def test_ggml_is_reached_in_the_copy_libllama_links_against() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    probe = json.loads(result.stdout)
    assert len(probe["mapped"]) == 1, probe  # `import llama_cpp` maps exactly one libggml
    assert probe["through_llama"] == probe["in_mapped"], probe
    if not probe["plain_is_mapped"]:
        # The wheel's separate libggml.so copy has its own registry: the bug this module avoids.
        assert probe["in_plain_name"] != probe["through_llama"], probe


def test_ensure_backends_finds_a_cpu_device() -> None:
    backends = ensure_backends()
    assert any(device.type == "cpu" for device in backends.devices), backends
    assert "CPU" in backends.describe()
    if sys.platform.startswith("linux"):
        assert any(name.startswith("libggml-cpu") for name in backends.libraries), backends


def test_no_gpu_requested_is_fine_on_cpu() -> None:
    require_gpu(Backends(devices=(CPU,), libraries=("libggml-cpu-haswell.so",)), 0)


def test_gpu_layers_on_a_gpu_are_fine() -> None:
    require_gpu(Backends(devices=(GPU, CPU), libraries=("libggml-cuda.so",)), -1)


@pytest.mark.parametrize("layers", [-1, 999, 12])
def test_gpu_layers_without_a_gpu_stop_start_up_with_one_line(layers: int) -> None:
    with pytest.raises(StartupError) as refused:
        require_gpu(Backends(devices=(CPU,), libraries=("libggml-cpu-haswell.so",)), layers)
    line = describe_failure(refused.value)
    assert "\n" not in line
    assert f"DECIDER_N_GPU_LAYERS={layers}" in line
    assert "no GPU device" in line and "CPU (cpu)" in line
    assert "DECIDER_N_GPU_LAYERS=0" in line  # says how to run on CPU on purpose


def test_cuda_load_error_names_the_cause(tmp_path: Path) -> None:
    assert "no CUDA backend" in cuda_load_error(tmp_path)
    (tmp_path / CUDA_LIBRARY).write_bytes(b"not a shared library")
    assert "does not load" in cuda_load_error(tmp_path)


def test_load_engine_refuses_gpu_layers_on_this_cpu_build(smollm2_path: Path) -> None:
    # The production loader runs the check before the model is read: no silent CPU fallback.
    with pytest.raises(StartupError, match="asks for GPU offload"):
        load_engine(Settings(model_path=smollm2_path, n_gpu_layers=-1))


def _variants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scores: dict[str, int], exits: dict[str, Any]):
    """Fake CPU variant files with ggml scores, and the probe's exit status for each (None: it times out)."""
    from decider.engine.model import ggml_backends

    for name in scores:
        (tmp_path / f"libggml-cpu-{name}.so").write_bytes(b"")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(
        ggml_backends, "variant_score", lambda path: scores[path.stem.removeprefix("libggml-cpu-")]
    )
    probed: list[str] = []

    def probe(path: Path, model: Path) -> ProbeResult:
        name = path.stem.removeprefix("libggml-cpu-")
        probed.append(name)
        status = exits[name]
        if status is None:
            return ProbeResult("timed_out", 300.0)
        outcome = "works" if status == 0 else "crashed" if status < 0 else "failed"
        return ProbeResult(outcome, 0.5, status)

    monkeypatch.setattr(ggml_backends, "probe_variant", probe)
    return probed


def test_a_cpu_variant_that_crashes_the_probe_gives_way_to_the_next(tmp_path, monkeypatch, caplog):
    """A host that advertises AMX and refuses it (SIGILL) gets the next-best kernels, not a crash."""
    probed = _variants(tmp_path, monkeypatch, {"sapphirerapids": 90, "zen4": 80, "x64": 1, "none": 0}, {
        "sapphirerapids": -4, "zen4": 0, "x64": 0,
    })  # fmt: skip
    chosen = choose_cpu_variant(tmp_path, tmp_path / "model.gguf")
    assert chosen == tmp_path / "libggml-cpu-zen4.so" and probed == ["sapphirerapids", "zen4"]
    assert "libggml-cpu-sapphirerapids.so crashed (SIGILL) on this host" in caplog.text


def test_a_probe_that_times_out_is_not_called_a_crash_and_is_not_chosen(tmp_path, monkeypatch, caplog):
    probed = _variants(tmp_path, monkeypatch, {"icelake": 50, "haswell": 20, "x64": 1}, {
        "icelake": None, "haswell": 0, "x64": 0,
    })  # fmt: skip
    assert choose_cpu_variant(tmp_path, tmp_path / "model.gguf") == tmp_path / "libggml-cpu-haswell.so"
    assert probed == ["icelake", "haswell"]
    assert "icelake.so timed out after 300 s (not a crash" in caplog.text and "crashed" not in caplog.text


def test_a_failed_variant_is_never_chosen(tmp_path, monkeypatch):
    """The best variant crashes, the next exits with an error (the model does not load): the next is
    loaded as it stands (the real load says why), never ggml's own pick, which is the crashing one."""
    model = tmp_path / "model.gguf"
    probed = _variants(tmp_path, monkeypatch, {"icelake": 50, "haswell": 20, "x64": 1}, {
        "icelake": -4, "haswell": 1, "x64": 0,
    })  # fmt: skip
    assert choose_cpu_variant(tmp_path, model) == tmp_path / "libggml-cpu-haswell.so"
    assert probed == ["icelake", "haswell"]


def test_the_cpu_probe_without_a_choice_to_make(tmp_path, monkeypatch):
    model = tmp_path / "model.gguf"
    probed = _variants(tmp_path, monkeypatch, {"icelake": 50, "x64": 1}, {"icelake": 1, "x64": 0})
    assert choose_cpu_variant(tmp_path, None) is None and probed == []  # no model: no probe
    for path in tmp_path.glob("*.so"):
        path.unlink()
    probed = _variants(tmp_path, monkeypatch, {"x64": 1}, {"x64": -4})
    assert choose_cpu_variant(tmp_path, model) is None and probed == []  # one variant: nothing to choose
    probed = _variants(tmp_path, monkeypatch, {"x64": 1, "sse42": 2}, {"x64": -4, "sse42": None})
    with pytest.raises(
        StartupError, match=r"no llama\.cpp CPU variant .*sse42.*timed out.*x64.*crashed \(SIGILL\)"
    ):
        choose_cpu_variant(tmp_path, model)


def test_the_verdict_is_cached_for_this_host_libraries_and_model(tmp_path, monkeypatch):
    model, cache = tmp_path / "model.gguf", tmp_path / "cache" / "cpu-variant.json"
    scores = {"sapphirerapids": 90, "zen4": 80, "x64": 1}
    probed = _variants(tmp_path, monkeypatch, scores, {"sapphirerapids": -4, "zen4": 0, "x64": 0})
    chosen = tmp_path / "libggml-cpu-zen4.so"
    assert choose_cpu_variant(tmp_path, model, cache) == chosen and len(probed) == 2
    assert choose_cpu_variant(tmp_path, model, cache) == chosen and len(probed) == 2  # no probe: cached
    model.write_bytes(b"GGUF, another model")  # what the verdict depends on changed: probed again
    assert choose_cpu_variant(tmp_path, model, cache) == chosen and len(probed) == 4
    cache.write_text("not json")
    assert choose_cpu_variant(tmp_path, model, cache) == chosen and len(probed) == 6
    probed.clear()
    exits = {"sapphirerapids": -4, "zen4": 1, "x64": 0}  # an error verdict is not remembered
    other = tmp_path / "other-cache.json"
    probed = _variants(tmp_path, monkeypatch, scores, exits)
    assert choose_cpu_variant(tmp_path, model, other) == chosen and not other.exists()


def test_the_probe_child_times_out_as_a_timeout(tmp_path, monkeypatch):
    from decider.engine.model import ggml_backends

    monkeypatch.setattr(ggml_backends.sys, "executable", "/bin/sleep")  # `sleep -m …` fails at once
    assert ggml_backends.probe_variant(tmp_path / "x.so", tmp_path / "m.gguf").outcome == "failed"
    script = tmp_path / "slow"
    script.write_text("#!/bin/sh\nsleep 5\n")
    script.chmod(0o755)
    monkeypatch.setattr(ggml_backends.sys, "executable", str(script))
    result = ggml_backends.probe_variant(tmp_path / "x.so", tmp_path / "m.gguf", timeout=0.2)
    assert result.outcome == "timed_out" and 0.2 <= result.seconds < 3
