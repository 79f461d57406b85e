"""Finding, checking and describing the GGUF file named by the settings."""

from __future__ import annotations

import re
from pathlib import Path

from decider.engine.model.bundled import SMOLLM2_FILE, SMOLLM2_SHA256, file_sha256
from decider.errors import StartupError
from decider.settings import Settings

GGUF_MAGIC = b"GGUF"
_QUANT_IN_NAME = re.compile(
    r"[._-]((?:I?Q\d(?:_[0-9A-Z]+)*)|F16|BF16|F32|TQ\d_\d|MXFP4(?:_MOE)?)$", re.IGNORECASE
)


def resolve_model_file(settings: Settings) -> Path:
    """The one GGUF to load: `model_path` itself, or the single (or named) .gguf inside it."""
    base = Path(settings.model_path)
    name_hint = settings.env_name("model_path")
    if base.is_file():
        if settings.model_file and base.name != settings.model_file:
            raise StartupError(f"{base} is a file but model_file names {settings.model_file!r}")
        path = base
    elif base.is_dir():
        if settings.model_file:
            path = base / settings.model_file
            if not path.is_file():
                raise StartupError(f"model file {path} does not exist ({settings.env_name('model_file')})")
        else:
            found = sorted(p for p in base.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
            if len(found) != 1:
                listed = ", ".join(p.name for p in found) or "none"
                raise StartupError(
                    f"{base} must hold exactly one .gguf file, found {len(found)} ({listed}); "
                    f"set {settings.env_name('model_file')} to choose one"
                )
            path = found[0]
    else:
        raise StartupError(f"model path {base} does not exist (set {name_hint})")
    check_gguf(path)
    return path


def check_gguf(path: Path) -> None:
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise StartupError(f"cannot read model file {path}: {exc.strerror or exc}") from exc
    if magic != GGUF_MAGIC:
        raise StartupError(f"{path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")


def verify_sha256(path: Path, settings: Settings) -> str:
    digest = file_sha256(path)
    if settings.model_sha256 and digest != settings.model_sha256:
        raise StartupError(
            f"{path} has sha256 {digest}, but {settings.env_name('model_sha256')} "
            f"requires {settings.model_sha256}"
        )
    if not settings.model_sha256 and path.name == SMOLLM2_FILE and digest != SMOLLM2_SHA256:
        raise StartupError(f"bundled model {path} is corrupt: sha256 {digest}, expected {SMOLLM2_SHA256}")
    return digest


def quantization_from_name(path: Path) -> str | None:
    match = _QUANT_IN_NAME.search(path.stem)
    return match.group(1).upper() if match else None


def display_name(path: Path) -> str:
    """File stem without its quantization suffix (`SmolLM2-135M-Instruct.Q4_1` → `SmolLM2-135M-Instruct`)."""
    return _QUANT_IN_NAME.sub("", path.stem) or path.stem
