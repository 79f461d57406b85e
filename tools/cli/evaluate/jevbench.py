"""Where the project reads JevBench (Apache-2.0): the one owner of those paths.

- **Cases** come from the `jevbench` package (PyPI, pinned in requirements.txt), whose suites ship
  as package data: `jevbench/suites/jevbench-240/cases.jsonl`, the Jev `POST /v1/systemone` request
  shape. The package is located without importing it (its modules pull in an HTTP client).
- **Gold labels** are not in the package. `data/jevbench/gold.jsonl` beside this module is a copy of
  `data/gold.jsonl` from the JevBench repository (github.com/JevBench/jevbench, commit
  1a3a115105872691137f6c7a7bcc83be95d7ebac), with JevBench's `LICENSE` and `NOTICE` beside it, as
  Apache-2.0 allows.

Nothing here reads outside the repository and its installed packages.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "jevbench"
SUITE = "jevbench-240"
DATA_DIR = Path(__file__).resolve().parent / "data" / "jevbench"
GOLD_240 = DATA_DIR / "gold.jsonl"
LICENSE_FILES = (DATA_DIR / "LICENSE", DATA_DIR / "NOTICE")
MISSING_HINT = (
    "the JevBench cases come from the `jevbench` package (pinned in requirements.txt): run `make setup`"
)


def _package_dir() -> Path | None:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def suite_cases(suite: str = SUITE) -> Path:
    """The installed suite's `cases.jsonl`. When the package is missing, a path that does not exist
    (callers check `is_file()` and print `MISSING_HINT`)."""
    package = _package_dir() or Path(f"<{PACKAGE} is not installed>")
    return package / "suites" / suite / "cases.jsonl"


JEVBENCH_240_CASES = suite_cases()


def gold_for(cases_path: Path) -> Path | None:
    """The gold labels of a JevBench cases file: the repository's copy for the installed
    jevbench-240 suite, else JevBench's own layout (suites/<suite>/cases.jsonl has its gold in
    data/gold.jsonl two levels up), else None."""
    resolved = cases_path.resolve()
    if resolved == JEVBENCH_240_CASES.resolve() and GOLD_240.is_file():
        return GOLD_240
    candidate = resolved.parent.parent.parent / "data" / "gold.jsonl"
    return candidate if cases_path.name == "cases.jsonl" and candidate.is_file() else None
