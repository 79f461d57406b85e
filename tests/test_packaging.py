"""The project installs under package names of its own, so other packages on a user's path cannot
shadow its tools, and trees of either layout (before and after the names) import their own code."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from decider_cli.infra_diff.tree_packages import link_packages, package_dirs, package_for_folder

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS = sorted(PYPROJECT["project"]["scripts"])


def _help_exit(main, args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    with pytest.raises(SystemExit) as done:
        main([*args, "--help"])
    return done.value.code, capsys.readouterr().out


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_command_of_every_script_prints_its_help(script: str, capsys: pytest.CaptureFixture) -> None:
    """argparse formats help strings with `%`: a literal one left unescaped crashed `--help` of one
    subcommand (`decide-eval check`) while the script's own help printed."""
    module, _, name = PYPROJECT["project"]["scripts"][script].partition(":")
    main = getattr(importlib.import_module(module), name)
    code, text = _help_exit(main, [], capsys)
    assert code == 0 and text
    usage = text.split("\n\n", 1)[0]
    commands = re.search(r"\{([\w,-]+)\}", usage)
    for command in commands[1].split(",") if commands else []:
        code, text = _help_exit(main, [command], capsys)
        assert code == 0 and text, command


def _folder_packages(name: str, folder: Path) -> set[str]:
    return {
        ".".join([name, *init.parent.relative_to(folder).parts])
        for init in folder.rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


def test_every_package_folder_is_listed_and_every_listed_package_is_a_folder() -> None:
    setuptools = PYPROJECT["tool"]["setuptools"]
    found = set()
    for name, folder in setuptools["package-dir"].items():
        found |= _folder_packages(name, REPO / folder)
    assert set(setuptools["packages"]) == found


def test_the_installed_names_are_the_project_s_own() -> None:
    assert set(package_dirs(REPO)) == {"decider_stacks", "decider_cli", "decider_dev"}
    assert not (REPO / "tools" / "__init__.py").exists()  # `tools` is a folder, not a package
    for script in SCRIPTS:  # what users run comes from decider_cli; the project's tooling is not a script
        assert PYPROJECT["project"]["scripts"][script].startswith("decider_cli."), script


def test_the_tools_run_beside_other_packages_named_tools_and_stacks(tmp_path: Path) -> None:
    """A CI image or notebook with its own `tools` and `stacks` first on the path: every script still
    starts (each one imports its whole command module for --help), and so does the CDK app."""
    for name in ("tools", "stacks"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the other {name} package')\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    bin_dir = Path(sys.executable).parent
    # The installed wrappers themselves, one after the other in one interpreter (a process each cost
    # ~1.5 s of imports apiece): a failed import is not cached, so each script meets the shadows.
    scripts = [str(bin_dir / script) for script in SCRIPTS]

    def python(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
        )

    done = python("-c", RUN_EACH_WITH_HELP, *scripts)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("--help: 0") == len(SCRIPTS), done.stderr[-2000:]
    done = python("-c", "import decider_stacks.assembly, decider_dev.bench.common")
    assert done.returncode == 0, done.stderr[-2000:]


# argv: the scripts' paths. Runs each as `SCRIPT --help` would, and says how it ended on stderr.
RUN_EACH_WITH_HELP = """
import runpy, sys
failed = 0
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code or 0
    except Exception as error:
        code = f"{type(error).__name__}: {error}"
    print(f"{script} --help: {code}", file=sys.stderr)
    failed += code != 0
sys.exit(1 if failed else 0)
"""


def test_a_tree_s_links_import_that_tree_and_an_older_tree_maps_nothing(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "stacks").mkdir(parents=True)
    (tree / "stacks" / "__init__.py").write_text("WHERE = 'copy'\n")
    (tree / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { decider_stacks = "stacks" }\npackages = ["decider_stacks"]\n'
    )
    assert package_for_folder(tree, "stacks") == "decider_stacks"
    links = link_packages(tree, tmp_path / "links")
    link_packages(tree, tmp_path / "links")  # made afresh: a second run replaces its links
    done = subprocess.run(
        [sys.executable, "-c", "import decider_stacks; print(decider_stacks.WHERE)"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(links)},
    )
    assert done.stdout.strip() == "copy", done.stderr  # the copy, ahead of the editable install

    old = tmp_path / "old"
    old.mkdir()
    (old / "pyproject.toml").write_text('[tool.setuptools.packages.find]\ninclude = ["stacks*", "tools*"]\n')
    assert package_dirs(old) == {} and package_for_folder(old, "stacks") is None
    assert list(link_packages(old, tmp_path / "old-links").iterdir()) == []


@pytest.mark.parametrize("args", [[], ["a", "b", "c"]])
def test_the_link_script_runs_by_path_and_says_how(args: list[str]) -> None:
    script = REPO / "tools" / "cli" / "infra_diff" / "tree_packages.py"
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "usage: tree_packages.py TREE LINKS_DIR" in done.stderr
