"""The project carries the data its commands read: nothing outside the repository and its packages.

A user's plain clone has no `shared/` folder beside it (only our own machines and CI do), so no code,
test or build file may read one, and the demo's data must load from a copy of the tree with none.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from decider_cli.evaluate import jevbench
from decider_cli.evaluate.cases import default_gold_path, load_items
from decider_cli.infra_diff.tree_packages import link_packages
from decider_dev import demo

REPO = Path(__file__).resolve().parents[2]
GOLD_SHA256 = "25438a91d951ccc97fa05cc796fd74fec75f34ceae39c347f4e4ba6d4e3fe83a"
# What the project is made of: code, tests, build and CI files, and the docs a user reads.
SCANNED = (
    "Makefile",
    ".ci",
    "app.py",
    "cdk.json",
    "pyproject.toml",
    "README.md",
    "buildspec",
    "container",
    "docs",
    "stacks",
    "tests",
    "tools",
)
SUFFIXES = {".py", ".sh", ".md", ".yml", ".yaml", ".json", ".toml", ".txt", ".cfg", ""}
# A sibling folder named shared, by relative path or as a path component built in code. The
# patterns are assembled so that this file does not match itself.
SHARED = "shar" + "ed"
READS_SHARED = re.compile(
    r"\.\./"
    + SHARED
    + r"\b"  # the relative path
    + r"|/\s*[\"']"
    + SHARED
    + r"[\"']"  # a path component after a slash
    + r"|[\"']"
    + SHARED
    + r"[\"']\)?\s*/"  # or before one (a call's closing parenthesis between)
)


def _project_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        top = REPO / name
        candidates = [top] if top.is_file() else sorted(top.rglob("*"))
        files += [
            path
            for path in candidates
            if path.is_file()
            and path.suffix in SUFFIXES
            and "__pycache__" not in path.parts
            and "__snapshots__" not in path.parts
        ]
    return files


def test_no_code_test_or_doc_reads_a_shared_folder_beside_the_repository() -> None:
    files = _project_files()
    assert len(files) > 200  # the scan really saw the tree
    hits = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if READS_SHARED.search(line)
    ]
    assert not hits, "these lines name a shared/ folder a plain clone does not have:\n" + "\n".join(hits)


def test_the_pattern_catches_each_way_of_naming_the_folder() -> None:
    folder = SHARED
    for line in (
        f"read in place from ../{folder}/data",
        f'REPO_ROOT.parent / "{folder}" / "data"',
        f"Path('{folder}') / 'notes'",
    ):
        assert READS_SHARED.search(line), line
    for line in ('"AWS_SHARED_CREDENTIALS_FILE": "/dev/null"', "shared_config = x", "the shared prefix"):
        assert not READS_SHARED.search(line), line


def test_the_demo_reads_the_package_cases_and_the_repositorys_gold_copy() -> None:
    assert demo.DEFAULT_CASES == jevbench.JEVBENCH_240_CASES
    assert demo.DEFAULT_CASES.is_file(), jevbench.MISSING_HINT
    package = Path(jevbench.__file__).resolve().parent
    assert package.is_relative_to(REPO / "tools")
    assert "site-packages" in demo.DEFAULT_CASES.parts  # the installed `jevbench` package
    assert demo.DEFAULT_GOLD == jevbench.GOLD_240 and demo.DEFAULT_GOLD.is_relative_to(REPO)
    assert default_gold_path(demo.DEFAULT_CASES) == jevbench.GOLD_240
    assert hashlib.sha256(jevbench.GOLD_240.read_bytes()).hexdigest() == GOLD_SHA256
    for notice in jevbench.LICENSE_FILES:  # Apache-2.0: the licence and notice travel with the copy
        assert notice.is_file() and notice.stat().st_size > 0
    assert "Chen Feng" in (jevbench.DATA_DIR / "NOTICE").read_text()


def test_every_case_has_its_gold_labels(jevbench_cases: Path) -> None:
    items = load_items(jevbench_cases, jevbench.GOLD_240)
    assert len(items) == 240
    assert all(item.gold and set(item.gold) == {q.key for q in item.questions} for item in items)


def test_the_demo_data_loads_from_a_copy_of_the_tree_with_no_shared_folder(tmp_path: Path) -> None:
    """The demo's loader, run from a copy of `tools/` in a folder with no shared/ beside it."""
    clone = tmp_path / "clone"
    shutil.copytree(REPO / "tools", clone / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", clone)
    links = link_packages(clone, tmp_path / "packages")  # the copy's packages ahead of the checkout's
    assert not (tmp_path / SHARED).exists()
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "import decider_cli.evaluate.jevbench as data\n"
        "from decider_dev import demo\n"
        "from decider_cli.evaluate.cases import load_items\n"
        "items = load_items(demo.DEFAULT_CASES, demo.DEFAULT_GOLD)\n"
        "print(json.dumps({'module': data.__file__, 'gold': str(demo.DEFAULT_GOLD), 'items': len(items),\n"
        "                  'labelled': sum(bool(i.gold) for i in items)}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=clone,
        env={**os.environ, "PYTHONPATH": str(links)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(seen["module"]).resolve().is_relative_to(clone)  # the copy ran, not the checkout
    assert Path(seen["gold"]).resolve().is_relative_to(clone)
    assert seen["items"] == 240 and seen["labelled"] == 240
