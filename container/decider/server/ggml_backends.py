"""Register llama.cpp's dynamically loadable backends before a model is loaded.

The image builds llama.cpp with `GGML_BACKEND_DL=ON` and `GGML_CPU_ALL_VARIANTS=ON`: the CPU
kernels (one library per instruction-set level) and CUDA are separate shared libraries that
`ggml_backend_load_all_from_path` picks from at run time. llama-cpp-python does not call it
(abetlen/llama-cpp-python#2069), so without this step the model load fails with
"no backends are loaded". A build with statically linked backends (the local `make setup`
wheel) already has them registered, and this is a no-op there.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from pathlib import Path

from decider.errors import StartupError

log = logging.getLogger(__name__)

BACKEND_DIR_ENV = "GGML_BACKEND_DIR"


def llama_cpp_lib_dir() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise StartupError("llama-cpp-python is not installed")
    return Path(spec.origin).parent / "lib"


def _ggml() -> ctypes.CDLL:
    # Same soname as the copy libllama.so links against, so this is the already-loaded library.
    lib = ctypes.CDLL(str(llama_cpp_lib_dir() / "libggml.so"))
    lib.ggml_backend_reg_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_load_all_from_path.restype = None
    return lib


def ensure_backends() -> int:
    """Load every backend library found next to llama.cpp (or in `$GGML_BACKEND_DIR`) if none is
    registered yet; return the number of devices. Raises `StartupError` when none can be found."""
    import llama_cpp  # noqa: F401 - loads libllama.so and with it libggml.so

    lib = _ggml()
    if lib.ggml_backend_reg_count() == 0:
        directory = os.environ.get(BACKEND_DIR_ENV) or str(llama_cpp_lib_dir())
        log.info("loading ggml backends from %s", directory)
        lib.ggml_backend_load_all_from_path(directory.encode())
    devices = int(lib.ggml_backend_dev_count())
    if devices == 0:
        raise StartupError(
            f"no llama.cpp backend could be loaded (looked in {llama_cpp_lib_dir()}; "
            f"set {BACKEND_DIR_ENV} to the directory holding libggml-cpu-*.so)"
        )
    return devices
