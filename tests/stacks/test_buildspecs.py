"""Run the buildspecs' commands locally, the way CodeBuild does (one bash shell per build, a failing
command fails the build), against fake `aws`, `curl` and `docker` that record their calls."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from decider_stacks.paths import BUILDSPEC_DIR

FAKE_AWS = r"""#!/usr/bin/env bash
echo "aws $*" >> "$CALLS"
# Objects put by `s3 cp` (or by a test) live in $STATE/objects/<key, / as %>, their sha256 metadata in
# <that>.sha; `staged_sha` stands for a staged GGUF under any key that is not an archive.
arg() {
  local want="$1"; shift
  while [[ $# -gt 1 ]]; do [[ "$1" == "$want" ]] && { echo "$2"; return; }; shift; done
}
obj() { mkdir -p "$STATE/objects"; echo "$STATE/objects/${1//\//%}"; }
case "$1 $2" in
  "s3api head-object")
    key="$(arg --key "$@")"; o="$(obj "$key")"
    [[ -f "$o" ]] && { cat "$o.sha" 2>/dev/null || echo None; exit 0; }
    [[ "$key" != *.tar.gz && -f "$STATE/staged_sha" ]] && cat "$STATE/staged_sha" && exit 0
    echo "Not Found" >&2; exit 254 ;;
  "s3 cp")
    if [[ "$3" == s3://* ]]; then key="${3#s3://*/}"; cp "$(obj "$key")" "$4"; exit 0; fi
    cp "$3" "$STATE/uploaded"; key="${4#s3://*/}"; cp "$3" "$(obj "$key")"
    meta="$(arg --metadata "$@")"; sha="${meta#*sha256=}"; echo "${sha%%,*}" > "$(obj "$key").sha"
    exit 0 ;;
  "s3 rm") key="${3#s3://*/}"; rm -f "$(obj "$key")" "$(obj "$key").sha"; exit 0 ;;
  "ecr get-login-password") echo "password"; exit 0 ;;
  "ecr describe-images")
    [[ -f "$STATE/digest" ]] && cat "$STATE/digest" && exit 0
    echo "ImageNotFound" >&2; exit 254 ;;
esac
echo "unexpected aws call: $*" >&2; exit 2
"""
FAKE_CURL = r"""#!/usr/bin/env bash
echo "curl $*" >> "$CALLS"
out=""; body=""; url=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --output) out="$2"; shift ;;
    --data-binary) body="$2"; shift ;;
    http*) url="$1" ;;
  esac
  shift
done
if [[ -n "$body" ]]; then  # a wait condition signal: PUT to the presigned URL
  [[ -f "$STATE/refuse_signal" ]] && exit 22
  printf '%s' "$body" > "$STATE/signal"; printf '%s' "$url" > "$STATE/signal_url"; exit 0
fi
cp "$STATE/download" "$out"
"""
FAKE_DOCKER = r"""#!/usr/bin/env bash
echo "docker $*" >> "$CALLS"
case "$1" in
  version) cat "$STATE/docker_version" 2>/dev/null || echo "23.0.6" ;;
  push) echo "sha256:$(printf 'f%.0s' {1..64})" > "$STATE/digest" ;;
  build) [[ -f "$STATE/fail_build" ]] && exit 1
         echo "DOCKER_BUILDKIT=$DOCKER_BUILDKIT" > "$STATE/build_env" ;;
esac
exit 0
"""


def buildspec_script(name: str) -> tuple[str, list[str]]:
    """The buildspec as one bash script (phases in order) and its exported variable names."""
    spec = yaml.safe_load((BUILDSPEC_DIR / name).read_text())
    lines = []
    for phase in ("install", "pre_build", "build", "post_build"):
        for command in spec["phases"].get(phase, {}).get("commands", []):
            lines.append(command)
            lines.append(f'rc=$?; if [ $rc -ne 0 ]; then echo "FAILED in {phase}: rc=$rc" >&2; exit $rc; fi')
    exported = spec["env"]["exported-variables"]
    # CodeBuild sets env.variables before the first phase.
    variables = [f"export {k}={shlex.quote(str(v))}" for k, v in spec["env"].get("variables", {}).items()]
    lines = variables + lines
    lines += [f'echo "EXPORT {v}=${{{v}}}"' for v in exported]
    return "\n".join(lines), exported


@pytest.fixture
def sandbox(tmp_path: Path):
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    for name, body in {"aws": FAKE_AWS, "curl": FAKE_CURL, "docker": FAKE_DOCKER}.items():
        tool = bin_dir / name
        tool.write_text(body)
        tool.chmod(0o755)
    return tmp_path


def run(sandbox: Path, name: str, env: dict[str, str], cwd: Path | None = None):
    script, _ = buildspec_script(name)
    calls = sandbox / "calls.log"
    calls.touch()
    full_env = {
        "PATH": f"{sandbox / 'bin'}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "STATE": str(sandbox / "state"),
        "CODEBUILD_BUILD_SUCCEEDING": "1",
        "HOME": str(sandbox),
        "TMPDIR": str(sandbox),
        **env,
    }
    result = subprocess.run(
        ["bash", "-c", script], env=full_env, cwd=cwd or sandbox, capture_output=True, text=True, timeout=60
    )
    exported = dict(
        line.removeprefix("EXPORT ").split("=", 1)
        for line in result.stdout.splitlines()
        if line.startswith("EXPORT ")
    )
    return result, exported, calls.read_text().splitlines()


GGUF = b"GGUF" + b"\x00" * 1000


def model_env(content: bytes = GGUF, size: int | None = None) -> dict[str, str]:
    return {
        "ARTIFACTS_BUCKET": "artifacts",
        "MODEL_PREFIX": "models/org/repo/" + "a" * 40 + "/abc/",
        "MODEL_REPOSITORY": "org/repo",
        "MODEL_REVISION": "a" * 40,
        "MODEL_FILE": "model.gguf",
        "MODEL_SIZE_BYTES": str(len(content) if size is None else size),
        "MODEL_SHA256": hashlib.sha256(content).hexdigest(),
    }


def test_model_is_downloaded_verified_and_uploaded_with_its_hash(sandbox):
    (sandbox / "state" / "download").write_bytes(GGUF)
    result, exported, calls = run(sandbox, "model.yml", model_env())
    assert result.returncode == 0, result.stderr
    assert (sandbox / "state" / "uploaded").read_bytes() == GGUF
    (curl,) = [c for c in calls if c.startswith("curl")]
    assert "https://huggingface.co/org/repo/resolve/" + "a" * 40 + "/model.gguf" in curl
    (upload,) = [c for c in calls if c.startswith("aws s3 cp")]
    assert f"sha256={hashlib.sha256(GGUF).hexdigest()}" in upload
    assert exported["MODEL_S3_URI"] == "s3://artifacts/models/org/repo/" + "a" * 40 + "/abc/"


def test_model_with_the_wrong_sha256_is_never_uploaded(sandbox):
    (sandbox / "state" / "download").write_bytes(GGUF[:-1] + b"\x01")
    result, _, calls = run(sandbox, "model.yml", model_env())
    assert result.returncode != 0
    assert "sha256 mismatch" in result.stdout
    assert not any(c.startswith("aws s3 cp") for c in calls)


def test_model_with_the_wrong_size_fails_before_hashing(sandbox):
    (sandbox / "state" / "download").write_bytes(GGUF)
    result, _, calls = run(sandbox, "model.yml", model_env(size=len(GGUF) + 1))
    assert result.returncode != 0
    assert "!= pinned" in result.stdout + result.stderr
    assert not any(c.startswith("aws s3 cp") for c in calls)


def test_model_already_staged_is_not_downloaded_again(sandbox):
    env = model_env()
    (sandbox / "state" / "staged_sha").write_text(env["MODEL_SHA256"])
    result, exported, calls = run(sandbox, "model.yml", env)
    assert result.returncode == 0, result.stderr
    assert not any(c.startswith("curl") for c in calls)
    assert exported["MODEL_S3_URI"].startswith("s3://artifacts/")


def staged_keys(sandbox: Path) -> dict[str, Path]:
    objects = sandbox / "state" / "objects"
    return {p.name.replace("%", "/"): p for p in objects.glob("*") if p.suffix != ".sha"}


def test_the_batch_transform_archive_is_staged_beside_the_prefix_the_endpoint_mounts(sandbox):
    """Issue 33 §2: S3Prefix mounts every object under the model prefix, so the archive goes to the
    sibling `<prefix>-batch-transform/`, and one an earlier version left in the prefix is removed: the
    prefix holds the GGUF alone, which is what the volume estimate counts."""
    import tarfile

    from decider_stacks.config import load_config, mounted_model_bytes
    from decider_stacks.synth import cdk_json_context

    env = model_env()
    prefix = env["MODEL_PREFIX"]
    archive = prefix.rstrip("/") + "-batch-transform/model.tar.gz"
    (sandbox / "state" / "download").write_bytes(GGUF)
    objects = sandbox / "state" / "objects"
    objects.mkdir()
    (objects / f"{prefix}model.tar.gz".replace("/", "%")).write_bytes(b"an earlier version's archive")
    result, _, calls = run(sandbox, "model.yml", {**env, "MODEL_ARCHIVE_KEY": archive})
    assert result.returncode == 0, result.stdout + result.stderr
    keys = staged_keys(sandbox)
    assert [k for k in keys if k.startswith(prefix)] == [prefix + "model.gguf"]
    assert f"aws s3 rm s3://artifacts/{prefix}model.tar.gz --only-show-errors" in calls
    with tarfile.open(keys[archive]) as tar:
        assert tar.getnames() == ["model.gguf"] and tar.extractfile("model.gguf").read() == GGUF
    assert (objects / (archive.replace("/", "%") + ".sha")).read_text().strip() == env["MODEL_SHA256"]
    mounted = sum(path.stat().st_size for key, path in keys.items() if key.startswith(prefix))
    assert mounted == len(GGUF)  # the estimate's premise: the mounted prefix holds the GGUF alone
    model = load_config(cdk_json_context()).model
    assert mounted_model_bytes(model, batch_transform=True) == model.size_bytes


def test_an_archive_key_under_the_mounted_prefix_is_refused(sandbox):
    env = model_env()
    result, _, calls = run(
        sandbox, "model.yml", {**env, "MODEL_ARCHIVE_KEY": env["MODEL_PREFIX"] + "x.tar.gz"}
    )
    assert result.returncode != 0 and "outside MODEL_PREFIX" in result.stdout
    assert not any(c.startswith(("curl", "aws s3 cp")) for c in calls)


def test_model_requires_a_full_sha256(sandbox):
    env = {**model_env(), "MODEL_SHA256": "13c16f42a983"}
    result, _, calls = run(sandbox, "model.yml", env)
    assert result.returncode != 0
    assert not any(c.startswith("curl") for c in calls)


HANDLE = (
    "https://cloudformation-waitcondition-us-east-1.s3.amazonaws.com/arn%3Aaws%3Ahandle?X-Amz-Signature=abc"
)
IMAGE_ENV = {
    "REPOSITORY_URI": "123456789012.dkr.ecr.us-east-1.amazonaws.com/decider",
    "IMAGE_TAG": "cpu-" + "c" * 64,
    "VARIANT": "cpu",
    "WAIT_HANDLE_URL": HANDLE,
}


@pytest.fixture
def context_dir(sandbox):
    source = sandbox / "src"
    source.mkdir()
    (source / "Dockerfile").write_text("FROM scratch\n")
    return source


def test_image_is_built_with_buildkit_pushed_by_tag_exported_and_signalled_by_digest(sandbox, context_dir):
    result, exported, calls = run(sandbox, "image.yml", IMAGE_ENV, cwd=context_dir)
    assert result.returncode == 0, result.stderr
    (build,) = [shlex.split(c) for c in calls if c.startswith("docker build")]
    assert "VARIANT=cpu" in build and f"{IMAGE_ENV['REPOSITORY_URI']}:{IMAGE_ENV['IMAGE_TAG']}" in build
    assert "--progress=plain" in build
    assert (sandbox / "state" / "build_env").read_text().strip() == "DOCKER_BUILDKIT=1"
    assert any(c == f"docker push {IMAGE_ENV['REPOSITORY_URI']}:{IMAGE_ENV['IMAGE_TAG']}" for c in calls)
    digest = "sha256:" + "f" * 64
    assert exported["IMAGE_DIGEST"] == digest
    # the wait condition gets the documented signal, with the image by digest as its data
    signal = json.loads((sandbox / "state" / "signal").read_text())
    assert signal == {
        "Status": "SUCCESS",
        "Reason": f"built {IMAGE_ENV['IMAGE_TAG']}",
        "UniqueId": "image",
        "Data": f"{IMAGE_ENV['REPOSITORY_URI']}@{digest}",
    }
    assert (sandbox / "state" / "signal_url").read_text() == HANDLE
    (put,) = [c for c in calls if c.startswith("curl") and "-X PUT" in c]
    assert "-H Content-Type:" in put


def test_an_unsignalled_build_fails(sandbox, context_dir):
    (sandbox / "state" / "refuse_signal").touch()
    result, _, _ = run(sandbox, "image.yml", IMAGE_ENV, cwd=context_dir)
    assert result.returncode != 0
    assert "could not signal the wait condition" in result.stdout


def test_a_docker_without_buildkit_stops_before_building(sandbox, context_dir):
    (sandbox / "state" / "docker_version").write_text("18.06.3\n")
    result, _, calls = run(sandbox, "image.yml", IMAGE_ENV, cwd=context_dir)
    assert result.returncode != 0
    assert "has no BuildKit" in result.stdout
    assert not any(c.startswith("docker build") for c in calls)


def test_extra_build_args_reach_docker_build(sandbox, context_dir):
    env = {**IMAGE_ENV, "EXTRA_BUILD_ARGS": "PYTHON_IMAGE=public.ecr.aws/docker/library/python:3.11\nX=a b"}
    result, _, calls = run(sandbox, "image.yml", env, cwd=context_dir)
    assert result.returncode == 0, result.stderr
    (build,) = [c for c in calls if c.startswith("docker build")]
    assert "--build-arg PYTHON_IMAGE=public.ecr.aws/docker/library/python:3.11 --build-arg X=a b" in build


def test_existing_tag_is_not_rebuilt_but_signalled(sandbox, context_dir):
    (sandbox / "state" / "digest").write_text("sha256:" + "e" * 64)
    result, exported, calls = run(sandbox, "image.yml", IMAGE_ENV, cwd=context_dir)
    assert result.returncode == 0, result.stderr
    assert not any(c.startswith(("docker build", "docker push")) for c in calls)
    assert exported["IMAGE_DIGEST"] == "sha256:" + "e" * 64
    assert json.loads((sandbox / "state" / "signal").read_text())["Data"].endswith("@sha256:" + "e" * 64)


def test_cuda_architectures_reach_docker_build_as_one_argument(sandbox, context_dir):
    env = {**IMAGE_ENV, "VARIANT": "cuda", "EXTRA_BUILD_ARGS": "CUDA_ARCHITECTURES=86;89"}
    result, _, calls = run(sandbox, "image.yml", env, cwd=context_dir)
    assert result.returncode == 0, result.stderr
    (build,) = [shlex.split(c) for c in calls if c.startswith("docker build")]
    assert build[build.index("CUDA_ARCHITECTURES=86;89") - 1] == "--build-arg"


@pytest.mark.parametrize("variant", ["", "gpu", "latest"])
def test_unknown_variant_fails_before_building(sandbox, context_dir, variant):
    result, _, calls = run(sandbox, "image.yml", {**IMAGE_ENV, "VARIANT": variant}, cwd=context_dir)
    assert result.returncode != 0
    assert not any(c.startswith("docker build") for c in calls)


def test_failed_docker_build_pushes_and_signals_nothing(sandbox, context_dir):
    """The FAILURE signal comes from the build watcher (the build's state-change event)."""
    (sandbox / "state" / "fail_build").touch()
    result, _, calls = run(sandbox, "image.yml", IMAGE_ENV, cwd=context_dir)
    assert result.returncode != 0
    assert not any(c.startswith("docker push") for c in calls)
    assert not (sandbox / "state" / "signal").exists()
