"""Repository paths the stacks package reads at synth time (never the working directory)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTAINER_DIR = ROOT / "container"
BUILDSPEC_DIR = ROOT / "buildspec"
HANDLERS_DIR = Path(__file__).resolve().parent / "handlers"
CDK_JSON = ROOT / "cdk.json"

# Never part of an asset: caches and build leftovers would change the asset hash (and so the image
# tag) without any change to the source.
ASSET_EXCLUDES = [
    "**/__pycache__",
    "**/*.pyc",
    "**/.pytest_cache",
    "**/.ruff_cache",
    "**/.hypothesis",
    "**/*.egg-info",
    "**/.mypy_cache",
    "**/.DS_Store",
    "build",
    "dist",
    ".venv",
]


def container_excludes() -> list[str]:
    """What the container source asset leaves out: our cache patterns plus container/.dockerignore
    (the image build would ignore those files anyway, so they must not change the tag either)."""
    patterns = set(ASSET_EXCLUDES)
    dockerignore = CONTAINER_DIR / ".dockerignore"
    if dockerignore.exists():
        for line in dockerignore.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "!")):
                patterns.add(line)
    return sorted(patterns)
