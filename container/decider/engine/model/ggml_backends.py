"""Register llama.cpp's dynamically loadable backends before a model is loaded, and check them.

The image builds llama.cpp with `GGML_BACKEND_DL=ON` (and `GGML_CPU_ALL_VARIANTS=ON` on CPU): the
CPU kernels (one library per instruction-set level) and CUDA are separate shared libraries that
`ggml_backend_load_all_from_path` picks from at run time. llama-cpp-python does not call it
(abetlen/llama-cpp-python#2069), so without this step the model load fails with
"no backends are loaded". A build with statically linked backends (the local `make setup`
wheel) already has them registered, and loading is skipped there.

Several CPU variants (the CPU image): ggml would take the one whose score is highest, from the
CPU's feature bits. A host may advertise instructions it then refuses (a virtual machine that
reports AMX and raises SIGILL on its tile instructions), which would crash the server on its
first decode. So the best-scoring variant first decodes a few tokens of the model in a child
process; if that child dies or times out, the next variant is tried, and the one that decodes is
loaded (never one that crashed). This costs one extra model load at start-up (from the page cache
the server's own load then reads), and only once per host and image: the verdict is cached under
the CPU's flags, the libraries and the model (`DECIDER_CPU_PROBE_CACHE`).

The wheel stores `libggml.so`, `libggml.so.0` and `libggml.so.0.x.y` as three separate files
(wheels cannot hold symlinks), and each copy has its own backend registry: backends registered in
`libggml.so` are invisible to `libllama.so`, which links against the soname `libggml.so.0`. So ggml
is reached through libllama's own handle here: the dynamic linker then resolves every ggml symbol in
exactly the copy llama.cpp uses. (The image also turns the copies into symlinks; a local venv keeps
them.)
"""

from __future__ import annotations

import _ctypes
import argparse
import contextlib
import ctypes
import hashlib
import importlib.metadata
import importlib.util
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
from typing import Literal

from decider.errors import StartupError

log = logging.getLogger(__name__)

BACKEND_DIR_ENV = "GGML_BACKEND_DIR"
LIBLLAMA_NAMES = ("libllama.so", "libllama.dylib")
CUDA_LIBRARY = "libggml-cuda.so"
CPU_VARIANTS = "libggml-cpu-*.so"
PROBE_TIMEOUT_SECONDS = 300
# enum ggml_backend_dev_type (ggml-backend.h)
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
GPU_TYPES = frozenset({"gpu", "igpu"})


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    type: str  # cpu, gpu, igpu, accel, meta


@dataclass(frozen=True)
class Backends:
    """What llama.cpp can run on: its devices, and the backend libraries loaded from disk."""

    devices: tuple[Device, ...]
    libraries: tuple[str, ...]  # file names, e.g. ("libggml-cpu-haswell.so",); () when built in

    @property
    def has_gpu(self) -> bool:
        return any(device.type in GPU_TYPES for device in self.devices)

    def describe(self) -> str:
        """One line for the start-up log, e.g. `CPU (cpu: Intel Xeon …) from libggml-cpu-haswell.so`."""
        devices = ", ".join(f"{d.name} ({d.type}: {d.description})" for d in self.devices) or "none"
        return f"{devices} from {', '.join(self.libraries) or 'built-in backends'}"


def llama_cpp_lib_dir() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise StartupError("llama-cpp-python is not installed")
    return Path(spec.origin).parent / "lib"


def _ggml() -> ctypes.CDLL:
    """ggml as libllama sees it (see the module docstring)."""
    lib_dir = llama_cpp_lib_dir()
    path = next((lib_dir / name for name in LIBLLAMA_NAMES if (lib_dir / name).is_file()), None)
    if path is None:
        raise StartupError(f"libllama is missing from {lib_dir}")
    lib = ctypes.CDLL(str(path))  # already loaded by `import llama_cpp`: the same handle
    lib.ggml_backend_reg_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
        getattr(lib, name).restype = ctypes.c_char_p
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_load_all_from_path.restype = None
    lib.ggml_backend_load.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_load.restype = ctypes.c_void_p
    return lib


def variant_score(path: Path) -> int:
    """ggml's own score of a CPU variant on this host (0: it cannot run here at all). The library
    is closed again: only the variant chosen stays mapped (and named in the start-up log)."""
    try:
        variant = ctypes.CDLL(str(path))
    except OSError:
        return 0
    try:
        score = variant.ggml_backend_score
        score.restype = ctypes.c_int
        return int(score())
    except AttributeError:
        return 0
    finally:
        _ctypes.dlclose(variant._handle)


@dataclass(frozen=True)
class ProbeResult:
    """How one CPU variant fared in the probe child, and what the probe cost."""

    outcome: Literal["works", "crashed", "timed_out", "failed"]  # failed: exited with an error
    seconds: float
    status: int | None = None  # the child's exit status (negative: the signal that killed it)

    def describe(self) -> str:
        if self.outcome == "crashed" and self.status is not None:
            signals = signal.valid_signals()
            return (
                f"crashed ({signal.Signals(-self.status).name if -self.status in signals else self.status})"
            )
        if self.outcome == "timed_out":
            return f"timed out after {self.seconds:.0f} s (not a crash: the host may only be slow)"
        return f"{self.outcome} (exit {self.status})" if self.outcome == "failed" else self.outcome


def probe_variant(path: Path, model: Path, timeout: float = PROBE_TIMEOUT_SECONDS) -> ProbeResult:
    """Decode a few tokens of `model` with the CPU variant `path` in a child process."""
    command = [sys.executable, "-m", __name__, "--probe", str(path), "--model", str(model)]
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return ProbeResult("timed_out", time.monotonic() - started)
    seconds = time.monotonic() - started
    if done.returncode == 0:
        return ProbeResult("works", seconds, 0)
    return ProbeResult("crashed" if done.returncode < 0 else "failed", seconds, done.returncode)


def probe_cache_key(variants: list[Path], model: Path) -> str:
    """What the verdict depends on: this CPU (model name and feature flags), the variant libraries,
    the model file (its tensor types pick the kernels) and llama-cpp-python's version."""
    cpu = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    parts = [cpu, importlib.metadata.version("llama-cpp-python")]
    for path in [*sorted(variants), model]:
        stat = path.stat()
        parts.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _cached_variant(cache: Path | None, key: str, directory: Path) -> Path | None:
    if cache is None:
        return None
    try:
        entry = json.loads(cache.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("variant"), str):
        return None
    path = directory / Path(entry["variant"]).name
    return path if path.is_file() else None


def _store_verdict(cache: Path | None, key: str, variant: Path) -> None:
    """Only a variant that decoded is remembered (a crash, a timeout or an error proves nothing to keep)."""
    if cache is None:
        return
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"key": key, "variant": variant.name}))
        partial.replace(cache)


def choose_cpu_variant(directory: Path, model: Path | None, cache: Path | None = None) -> Path | None:
    """The best-scoring CPU variant in `directory` that decodes `model` on this host.

    None, and ggml picks as it always does, when the directory holds at most one variant or no
    model is given. A variant whose probe crashed or timed out is never chosen; one whose probe
    failed with an error (a model llama.cpp cannot load) is chosen as it stands, and the real load
    then says why in its own words. A verdict is cached in `cache` (DECIDER_CPU_PROBE_CACHE) under
    everything it depends on, so a restart on the same host skips the probe."""
    scored = [(variant_score(path), path.name, path) for path in directory.glob(CPU_VARIANTS)]
    candidates = [path for score, _, path in sorted(scored, reverse=True) if score > 0]
    if len(candidates) < 2 or model is None:
        return None
    key = probe_cache_key(candidates, model)
    if (cached := _cached_variant(cache, key, directory)) is not None:
        log.info("CPU kernels %s: the cached verdict for this host (%s)", cached.name, cache)
        return cached
    started = time.monotonic()
    refused: list[str] = []
    for path in candidates:
        result = probe_variant(path, model)
        if result.outcome in ("works", "failed"):
            log.info(
                "CPU kernels %s chosen: probe %s, %.1f s for %d probe(s)",
                path.name,
                result.describe(),
                time.monotonic() - started,
                len(refused) + 1,
            )
            if result.outcome == "works":
                _store_verdict(cache, key, path)
            return path
        refused.append(f"{path.name} {result.describe()}")
        log.warning(
            "the CPU kernels %s %s on this host: trying the next variant", path.name, result.describe()
        )
    raise StartupError(f"no llama.cpp CPU variant in {directory} decodes on this host: {'; '.join(refused)}")


def loaded_backend_paths() -> tuple[Path, ...]:
    """The ggml backend libraries mapped into this process (Linux; () elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ()
    paths = {Path(line.split()[-1]) for line in maps.splitlines() if "/libggml-" in line}
    return tuple(sorted(path for path in paths if not path.name.startswith("libggml-base")))


def loaded_backend_libraries() -> tuple[str, ...]:
    """File names of the ggml backend libraries mapped into this process (Linux; () elsewhere)."""
    return tuple(path.name for path in loaded_backend_paths())


def load_backend_files(paths: Sequence[Path]) -> None:
    """Register exactly these backend libraries (another process's choice, e.g. the server's for its
    load probe), unless backends are built in and already registered."""
    lib = _ggml()
    if lib.ggml_backend_reg_count() != 0:
        return
    for path in paths:
        if not lib.ggml_backend_load(str(path).encode()):
            raise StartupError(f"the ggml backend {path} does not load")


def _devices(lib: ctypes.CDLL) -> tuple[Device, ...]:
    devices = []
    for index in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(index)
        devices.append(
            Device(
                name=(lib.ggml_backend_dev_name(dev) or b"?").decode(errors="replace"),
                description=(lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace").strip(),
                type=DEVICE_TYPES.get(int(lib.ggml_backend_dev_type(dev)), "unknown"),
            )
        )
    return tuple(devices)


def ensure_backends(model: Path | None = None, *, cache: Path | None = None) -> Backends:
    """Load the backend libraries found next to llama.cpp (or in `$GGML_BACKEND_DIR`) unless
    backends are already registered; return what is available. With several CPU variants and a
    `model`, the CPU variant is the best one that decodes it here (see the module docstring).
    Raises `StartupError` when no device can be used."""
    import llama_cpp  # noqa: F401 - loads libllama.so and with it libggml

    lib = _ggml()
    directory = os.environ.get(BACKEND_DIR_ENV) or str(llama_cpp_lib_dir())
    if lib.ggml_backend_reg_count() == 0:
        log.debug("loading ggml backends from %s", directory)
        variant = choose_cpu_variant(Path(directory), model, cache)
        if variant is None:
            lib.ggml_backend_load_all_from_path(directory.encode())
        else:  # that CPU variant, and every other kind of backend ggml would load
            others = [
                path
                for path in sorted(Path(directory).glob("libggml-*.so"))
                if not path.name.startswith(("libggml-base", "libggml-cpu"))
            ]
            for path in (*others, variant):
                lib.ggml_backend_load(str(path).encode())
    backends = Backends(devices=_devices(lib), libraries=loaded_backend_libraries())
    if not backends.devices:
        raise StartupError(
            f"no llama.cpp backend could be loaded from {directory} "
            f"(set {BACKEND_DIR_ENV} to the directory holding libggml-cpu-*.so)"
        )
    return backends


def cuda_load_error(directory: Path) -> str:
    """Why the CUDA backend library in `directory` does not load, in a few words."""
    path = directory / CUDA_LIBRARY
    if not path.is_file():
        return f"this image has no CUDA backend ({CUDA_LIBRARY} is not in {directory}: a CPU image?)"
    try:
        ctypes.CDLL(str(path))
    except OSError as exc:  # typically: libcuda.so.1 missing = no NVIDIA driver mounted
        return f"{CUDA_LIBRARY} does not load ({' '.join(str(exc).split())})"
    return f"{CUDA_LIBRARY} loads but reports no CUDA device (no GPU visible to the container?)"


def require_gpu(backends: Backends, n_gpu_layers: int, *, setting: str = "DECIDER_N_GPU_LAYERS") -> None:
    """Refuse to start on CPU when GPU layers are requested: a GPU instance that silently computes
    on its CPU would be many times slower and still report healthy."""
    if n_gpu_layers == 0 or backends.has_gpu:
        return
    lib_dir = Path(os.environ.get(BACKEND_DIR_ENV) or llama_cpp_lib_dir())
    found = ", ".join(f"{d.name} ({d.type})" for d in backends.devices)
    raise StartupError(
        f"{setting}={n_gpu_layers} asks for GPU offload, but llama.cpp found no GPU device "
        f"(devices: {found}); {cuda_load_error(lib_dir)}. Run the CUDA image on a GPU instance, "
        f"or set {setting}=0 for CPU"
    )


def _probe(variant: Path, model: Path) -> None:
    """The child of `probe_variant`: only `variant` for the CPU, the model loaded, a batch decoded
    (long enough for the batched matmul kernels, where instruction sets such as AMX are used)."""
    import llama_cpp

    if not _ggml().ggml_backend_load(str(variant).encode()):
        raise SystemExit(f"{variant.name} does not load")
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=256, n_batch=128, n_threads=1, verbose=False)
    llm.eval(llm.tokenize(b"A probe of the CPU kernels on this host. " * 8)[:96])


if __name__ == "__main__":  # `python -m decider.engine.model.ggml_backends`: what this host offers
    parser = argparse.ArgumentParser(description="llama.cpp's backends on this host")
    parser.add_argument("--probe", type=Path, help="a CPU variant to try (internal: probe_variant)")
    parser.add_argument("--model", type=Path, help="the GGUF to decode with it")
    args = parser.parse_args()
    if args.probe is not None:
        _probe(args.probe, args.model)
    else:
        print(ensure_backends(args.model).describe())
