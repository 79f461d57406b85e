"""The CI example runs its stages in the promised order and uses only commands that exist."""

from __future__ import annotations

from pathlib import Path

import yaml

from decider_cli.infra_diff.cli import build_parser as infra_diff_parser
from decider_cli.promote.cli import build_parser as promote_parser

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
    inner = ["promote plan", "npx cdk deploy", "promote smoke", "buildspec/quality-gate.sh"]
    assert [function.index(s) for s in inner] == sorted(function.index(s) for s in inner)
    # an endpoint outside CDK: promote apply, then the same gate, which rolls back with promote rollback
    apply = text[text.index('if [[ -n "${APPLY_ENDPOINT:-}" ]]') :]
    assert apply.index("bin/promote apply") < apply.index("quality-gate.sh") < apply.index("promote rollback")


def test_the_quality_gate_uses_existing_decide_eval_subcommands_and_flags():
    from decider_cli.evaluate.cli import build_parser as eval_parser

    gate = (PIPELINE.parent / "quality-gate.sh").read_text()
    parser = eval_parser()
    commands = parser._subparsers._group_actions[0].choices
    used = [line.split('bin/decide-eval" ')[1] for line in gate.splitlines() if 'bin/decide-eval" ' in line]
    assert [u.split()[0] for u in used] == ["run", "check"]
    for line in used:
        sub = commands[line.split()[0]]
        flags = {opt for action in sub._actions for opt in action.option_strings}
        assert {w for w in line.split() if w.startswith("--")} <= flags, line


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

    from decider_stacks.config import load_config
    from decider_stacks.synth import cdk_json_context

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


# --- the image step with a stubbed `aws` and `docker` on the PATH ----------------------------------

FAKE_AWS = r"""#!/usr/bin/env bash
# ecr describe-images --repository-name R --image-ids imageTag=T ...: the digest of tags/<T>, else 254
echo "aws $*" >> "$FAKE_STATE/calls"
[[ "$1 $2" == "ecr describe-images" ]] || { echo "unexpected aws call: $*" >&2; exit 2; }
for arg in "$@"; do [[ "$arg" == imageTag=* ]] && tag="${arg#imageTag=}"; done
if [[ -f "$FAKE_STATE/tags/$tag" ]]; then cat "$FAKE_STATE/tags/$tag"; exit 0; fi
echo "An error occurred (ImageNotFoundException) when calling the DescribeImages operation" >&2
exit 254
"""
FAKE_DOCKER = r"""#!/usr/bin/env bash
# build: logged; push REPO:TAG: ImageTagAlreadyExistsException on an existing tag (IMMUTABLE), else stored
echo "docker $*" >> "$FAKE_STATE/calls"
case "$1" in
  build) exit 0 ;;
  push)
    tag="${2##*:}"
    if [[ -f "$FAKE_STATE/race/$tag" ]]; then cp "$FAKE_STATE/race/$tag" "$FAKE_STATE/tags/$tag"; fi
    if [[ -f "$FAKE_STATE/tags/$tag" ]]; then
      echo "tag invalid: The image tag '$tag' already exists and cannot be overwritten because" \
        "the repository is immutable (ImageTagAlreadyExistsException)" >&2
      exit 1
    fi
    printf 'sha256:%064d\n' "${#tag}" > "$FAKE_STATE/tags/$tag"; exit 0 ;;
  *) echo "unexpected docker call: $*" >&2; exit 2 ;;
esac
"""
REPOSITORY = "123456789012.dkr.ecr.us-east-1.amazonaws.com/decider"


def _image_step(tmp_path: Path, *, race: str | None = None, stubs: bool = True):
    """Runs the build phase's image block (both images) against the stubs; returns (result, calls)."""
    import os
    import subprocess

    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    for path in (bin_dir, state / "tags", state / "race"):
        path.mkdir(parents=True, exist_ok=True)
    for name, text in (("aws", FAKE_AWS), ("docker", FAKE_DOCKER)) if stubs else ():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    if race:  # another run pushes this tag between our check and our push
        (state / "race" / race).write_text("sha256:" + "e" * 64 + "\n")
    (state / "calls").write_text("")
    block = next(c for c in _commands() if "build_image()" in c)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_STATE": str(state),
        "IMAGE_REPOSITORY_URI": REPOSITORY,
        "COMMIT": "0123456789ab",
    }
    result = subprocess.run(
        ["bash", "-c", block], capture_output=True, text=True, cwd=PIPELINE.parents[1], env=env, timeout=120
    )
    return result, (state / "calls").read_text().splitlines()


def test_the_image_step_builds_pushes_and_prints_both_digests(tmp_path):
    result, calls = _image_step(tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        f"CPU_IMAGE={REPOSITORY}@sha256:" in result.stdout
        and f"GPU_IMAGE={REPOSITORY}@sha256:" in result.stdout
    )
    assert [c.split()[1] for c in calls if c.startswith("docker")] == ["build", "push", "build", "push"]


def test_a_rerun_on_the_same_commit_reuses_the_pushed_tags(tmp_path):
    """IMMUTABLE tags: a second run (after a failed GPU promotion, say) must not push again."""
    first, _ = _image_step(tmp_path)
    assert first.returncode == 0, first.stderr
    second, calls = _image_step(tmp_path)
    assert second.returncode == 0, second.stderr
    assert not [c for c in calls if c.startswith("docker")], calls  # no build, no push
    assert "cpu-0123456789ab exists as sha256:" in second.stderr
    assert [line for line in second.stdout.splitlines() if "_IMAGE=" in line] == [
        line for line in first.stdout.splitlines() if "_IMAGE=" in line
    ]


def test_a_tag_pushed_by_a_concurrent_run_is_used(tmp_path):
    result, _ = _image_step(tmp_path, race="cpu-0123456789ab")
    assert result.returncode == 0, result.stderr
    assert f"CPU_IMAGE={REPOSITORY}@sha256:{'e' * 64}" in result.stdout
    assert "was pushed by another run" in result.stderr


def test_a_failed_push_of_a_new_tag_stops_the_pipeline(tmp_path):
    _image_step(tmp_path)  # creates the stubs
    (tmp_path / "bin" / "docker").write_text(
        '#!/usr/bin/env bash\necho "docker $*" >> "$FAKE_STATE/calls"\n'
        '[[ "$1" == build ]] && exit 0\nexit 1\n'
    )
    for tag in (tmp_path / "state" / "tags").iterdir():
        tag.unlink()
    result, calls = _image_step(tmp_path, stubs=False)
    assert result.returncode != 0
    assert "docker push of cpu-0123456789ab failed" in result.stderr
    assert not [c for c in calls if "cuda" in c]  # the GPU image is never built


def _timeout_step(tmp_path: Path, minutes: str):
    """The first pre_build step against an `aws` stub whose build has `minutes` of timeout."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "aws").write_text(f"#!/usr/bin/env bash\necho '{minutes}'\n")
    (bin_dir / "aws").chmod(0o755)
    block = next(c for c in _commands() if "ci_budget" in c)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CODEBUILD_BUILD_ID": "ci-project:42"}
    return subprocess.run(
        ["bash", "-c", block], capture_output=True, text=True, cwd=PIPELINE.parents[1], env=env, timeout=120
    )


def test_the_build_refuses_a_project_timeout_shorter_than_its_two_canary_deploys(tmp_path):
    from decider_cli.promote import ci_budget
    from decider_stacks.config import load_config
    from decider_stacks.synth import cdk_json_context

    text = "\n".join(_commands())
    assert (
        text.index("decider_cli.promote.ci_budget") < text.index("make test") < text.index("npx cdk deploy")
    )
    needed = ci_budget.pipeline_minutes(load_config(cdk_json_context()))
    assert needed > 60  # CodeBuild's default timeout cannot hold the pipeline
    short = _timeout_step(tmp_path / "short", "60")
    assert short.returncode == 1
    assert f"times out after 60 min; the pipeline with two canary deploys may need {needed}" in short.stdout
    assert f"update-project --name ci-project --timeout-in-minutes {needed}" in short.stdout
    assert _timeout_step(tmp_path / "long", str(needed)).returncode == 0
