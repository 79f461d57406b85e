"""A source tree's own packages made importable from that tree, without installing it.

The project's packages are named apart from its folders (pyproject.toml's `[tool.setuptools]`
`package-dir`: `decider_stacks` is stacks/, `decider_cli` tools/cli/, `decider_dev` tools/dev/). An
editable install maps those names to the working tree only, so whatever imports another tree's code
(infra-diff's synth of a git revision, the GPU check's venv) puts a folder of links named after the
packages first on its path. A tree from before that layout maps nothing: its `stacks/` and `tools/`
import from the tree's root as they are.

Standard library only: the GPU check runs this file by path, before anything is installed:
    python3 tools/cli/infra_diff/tree_packages.py TREE LINKS_DIR
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def package_dirs(tree: Path) -> dict[str, Path]:
    """{top-level package name: its folder} the tree's pyproject.toml maps; {} when it maps none."""
    pyproject = tree / "pyproject.toml"
    if not pyproject.is_file():
        return {}
    setuptools = tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {})
    mapping = setuptools.get("package-dir", {})
    return {name: tree / folder for name, folder in mapping.items() if name and "." not in name}


def link_packages(tree: Path, links: Path) -> Path:
    """`links`/NAME → the tree's folder for each mapped package (made afresh); put `links` first on
    sys.path (PYTHONPATH) and the tree's packages win over any installed ones."""
    links.mkdir(parents=True, exist_ok=True)
    for name, folder in package_dirs(tree).items():
        link = links / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(folder.resolve(), target_is_directory=True)
    return links


def package_for_folder(tree: Path, folder: str) -> str | None:
    """The package name the tree gives `folder` (e.g. "stacks"), if it maps one."""
    wanted = (tree / folder).resolve()
    return next((name for name, path in package_dirs(tree).items() if path.resolve() == wanted), None)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {Path(sys.argv[0]).name} TREE LINKS_DIR")
    print(link_packages(Path(sys.argv[1]), Path(sys.argv[2])))
