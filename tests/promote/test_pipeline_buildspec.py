"""The CI example runs its stages in the promised order and uses only commands that exist."""

from __future__ import annotations

from pathlib import Path

import yaml

from tools.infra_diff.cli import build_parser as infra_diff_parser
from tools.promote.cli import build_parser as promote_parser

PIPELINE = Path(__file__).resolve().parents[2] / "buildspec" / "pipeline.yml"


def _commands() -> list[str]:
    spec = yaml.safe_load(PIPELINE.read_text())
    assert spec["version"] == 0.2
    return [
        c
        for phase in ("install", "pre_build", "build", "post_build")
        for c in spec["phases"][phase]["commands"]
    ]


def test_stages_run_in_order():
    text = "\n".join(_commands())
    steps = [
        "make test",
        "npx cdk synth",
        "infra-diff --base",
        "build_image cpu",
        "build_image cuda",
        "promote_variant CpuStack",
        "promote_variant GpuStack",
    ]
    positions = [text.index(step) for step in steps]
    assert positions == sorted(positions)
    function = text[text.index("promote_variant() {") :]
    inner = ["promote plan", "npx cdk deploy", "promote smoke"]
    assert [function.index(s) for s in inner] == sorted(function.index(s) for s in inner)


def test_pipeline_uses_existing_subcommands_and_flags():
    text = "\n".join(_commands())
    promote_commands = set(promote_parser()._subparsers._group_actions[0].choices)
    for line in text.splitlines():
        if "bin/promote " in line:
            assert line.split("bin/promote ")[1].split()[0] in promote_commands
    infra_flags = {opt for action in infra_diff_parser()._actions for opt in action.option_strings}
    for line in text.splitlines():
        if "bin/infra-diff " in line:
            used = [word for word in line.split() if word.startswith("-") and not word.startswith("->")]
            assert set(used) <= infra_flags | {">", "&&"}, line


def test_preflight_runs_before_any_deploy():
    text = "\n".join(_commands())
    assert text.index("bin/preflight") < text.index("npx cdk deploy")


def test_ci_images_get_the_build_arguments_of_the_config():
    """The CUDA image is compiled for the GPUs the config allows, as the deploy-time build does."""
    import subprocess

    from stacks.config import load_config
    from stacks.synth import cdk_json_context

    block = next(c for c in _commands() if "build_args()" in c)
    function = block[: block.index("build_image()")]
    repo = PIPELINE.parents[1]
    result = subprocess.run(
        ["bash", "-c", f"{function}\nbuild_args gpu"], capture_output=True, text=True, cwd=repo, timeout=120
    )
    assert result.returncode == 0, result.stderr
    expected = load_config(cdk_json_context()).gpu.docker_build_args
    assert result.stdout.split() == [f"--build-arg={k}={v}" for k, v in expected.items()]
    assert "DOCKER_BUILDKIT=1 docker build" in block
