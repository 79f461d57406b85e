"""Offline synthesis of a source tree (the working tree or an extracted git revision).

Each tree is synthesized in its own Python subprocess (the current venv's interpreter, cwd = the
tree, the tree's own packages first on sys.path: `tree_packages`), so two revisions of `stacks/`
never share one import cache. The subprocess uses the tree's `synth.synthesize(outdir, context)`
(package `decider_stacks`, or `stacks` in trees from before the package names) when the tree has
it, and otherwise runs `app.py` the way the cdk CLI does (CDK_OUTDIR + CDK_CONTEXT_JSON). Templates
are then read from the cloud assembly's manifest, so both paths give the same result. No
credentials, no lookups.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decider_stacks import synth as stacks_synth

from .tree_packages import link_packages, package_for_folder

WORKER = Path(__file__).with_name("synth_worker.py")
STACK_ARTIFACT = "aws:cloudformation:stack"
NESTED_ASSEMBLY = "cdk:cloud-assembly"


class SynthError(RuntimeError):
    """Synthesis (or reading a revision) failed; the message carries the tail of the output."""


@dataclass(frozen=True)
class SynthJob:
    tree: Path
    outdir: Path
    context: dict[str, Any]


def cdk_json_context(tree: Path) -> dict[str, Any]:
    """The context the cdk CLI would pass: cdk.json's "context", then cdk.context.json on top."""
    context: dict[str, Any] = {}
    for name, key in (("cdk.json", "context"), ("cdk.context.json", None)):
        path = tree / name
        if path.is_file():
            data = json.loads(path.read_text())
            context.update(data.get(key, {}) if key else data)
    return context


def parse_context(pairs: list[str]) -> dict[str, str]:
    """`-c key=value` pairs as the cdk CLI passes them (decider_stacks.synth.parse_context);
    SynthError if bad."""
    try:
        return stacks_synth.parse_context(pairs)
    except ValueError as error:
        raise SynthError(str(error)) from None


def export_revision(repo: Path, revision: str, dest: Path) -> Path:
    """`git archive REV` extracted into dest (read-only for the repository: no worktree, no checkout)."""
    rev = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if rev.returncode != 0:
        raise SynthError(f"git revision {revision!r} not found in {repo} (no commits yet, or a typo?)")
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / "rev.tar"
    with archive.open("wb") as out:
        result = subprocess.run(
            ["git", "-C", str(repo), "archive", "--format=tar", rev.stdout.strip()],
            stdout=out,
            stderr=subprocess.PIPE,
            check=False,
        )
    if result.returncode != 0:
        raise SynthError(f"git archive {revision} failed: {result.stderr.decode().strip()}")
    tree = dest / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    archive.unlink()
    return tree


def start_synth(jobs: list[SynthJob], env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """Start one subprocess synthesizing every job of one tree (all jobs must share the tree)."""
    tree = jobs[0].tree
    payload = {
        "stacks_package": package_for_folder(tree, "stacks") or "stacks",
        "jobs": [{"outdir": str(j.outdir), "context": j.context} for j in jobs],
    }
    # The tree's own packages first: links named after the packages it maps (its `decider_stacks`),
    # the tree itself (a tree from before the package names), and its `container/` (the `decider`
    # settings the stacks validate against), all ahead of the editable installs of the working tree.
    links = link_packages(tree, jobs[0].outdir.with_name(jobs[0].outdir.name + ".packages"))
    paths = [str(links), str(tree)] + ([str(tree / "container")] if (tree / "container").is_dir() else [])
    child_env = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": os.pathsep.join(paths),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    child_env.pop("CDK_CONTEXT_JSON", None)
    child_env.pop("CDK_OUTDIR", None)
    return subprocess.Popen(
        [sys.executable, "-c", WORKER.read_text(), json.dumps(payload)],
        cwd=tree,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish_synth(
    process: subprocess.Popen[str], jobs: list[SynthJob], timeout: float
) -> list[dict[str, Any]]:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        process.kill()
        process.communicate()
        raise SynthError(f"synthesis of {jobs[0].tree} took longer than {timeout:.0f} s") from exc
    if process.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-25:])
        raise SynthError(f"synthesis of {jobs[0].tree} failed (exit {process.returncode}):\n{tail}")
    return [read_assembly(job.outdir) for job in jobs]


def read_assembly(outdir: Path, prefix: str = "") -> dict[str, Any]:
    """{stack artifact id: template} from a cloud assembly directory (nested assemblies as `Stage/Stack`)."""
    manifest = json.loads((outdir / "manifest.json").read_text())
    templates: dict[str, Any] = {}
    for artifact_id, artifact in manifest.get("artifacts", {}).items():
        properties = artifact.get("properties", {})
        if artifact.get("type") == STACK_ARTIFACT:
            templates[prefix + artifact_id] = json.loads((outdir / properties["templateFile"]).read_text())
        elif artifact.get("type") == NESTED_ASSEMBLY:
            templates.update(read_assembly(outdir / properties["directoryName"], f"{prefix}{artifact_id}/"))
    return templates


def synthesize_many(jobs: list[SynthJob], timeout: float = 600) -> list[dict[str, Any]]:
    """Synthesize all jobs, one subprocess per tree, the trees in parallel; results in job order."""
    by_tree: dict[Path, list[int]] = {}
    for index, job in enumerate(jobs):
        by_tree.setdefault(job.tree, []).append(index)
    running = [(indexes, start_synth([jobs[i] for i in indexes])) for indexes in by_tree.values()]
    results: list[dict[str, Any]] = [{} for _ in jobs]
    errors: list[str] = []
    for indexes, process in running:
        try:
            for index, templates in zip(
                indexes, finish_synth(process, [jobs[i] for i in indexes], timeout), strict=True
            ):
                results[index] = templates
        except SynthError as exc:
            errors.append(str(exc))
    if errors:
        raise SynthError("\n\n".join(errors))
    return results
