"""Golden templates (asset hashes masked) and synth determinism.

Snapshots make infrastructure changes readable in review: update them with
`.venv/bin/pytest tests/stacks --snapshot-update` and commit the diff under __snapshots__/.
"""

from __future__ import annotations

import pytest
from stack_helpers import STACKS, run_synth
from syrupy.extensions.json import JSONSnapshotExtension

pytestmark = pytest.mark.cdk


@pytest.fixture
def snapshot_json(snapshot):
    return snapshot.use_extension(JSONSnapshotExtension)


@pytest.mark.parametrize("stack", STACKS)
def test_template_matches_snapshot(synth, snapshot_json, stack):
    assert synth.masked(stack) == snapshot_json


def test_two_synths_are_byte_identical(synth, tmp_path):
    second = run_synth(tmp_path / "again")
    for stack in STACKS:
        assert second.raw(stack) == synth.raw(stack), f"{stack} differs between two synths"
    assert second.asset_labels() == synth.asset_labels()


def test_container_source_hash_ignores_caches(synth, tmp_path):
    """__pycache__ and friends in container/ must not change the image tag (no spurious rebuilds)."""
    from aws_cdk import App, Stack
    from aws_cdk import aws_s3_assets as s3_assets

    from decider_stacks.paths import CONTAINER_DIR, container_excludes

    cache = CONTAINER_DIR / "decider" / "__pycache__" / "zz_snapshot_probe.cpython-311.pyc"
    created_dir = not cache.parent.exists()
    cache.parent.mkdir(exist_ok=True)
    cache.write_bytes(b"probe")
    try:
        stack = Stack(App(outdir=str(tmp_path)), "Probe")
        asset = s3_assets.Asset(stack, "Source", path=str(CONTAINER_DIR), exclude=container_excludes())
        assert asset.asset_hash == synth.decider.image.source_hash
    finally:
        cache.unlink()
        if created_dir:
            cache.parent.rmdir()


def _of_type(template: dict, *cfn_types: str) -> list[str]:
    return [k for k, v in template["Resources"].items() if v["Type"] in cfn_types]


def _changed_resources(before: dict, after: dict) -> set[str]:
    keys = set(before["Resources"]) | set(after["Resources"])
    return {k for k in keys if before["Resources"].get(k) != after["Resources"].get(k)}


def test_container_change_rebuilds_only_the_image_and_copies_do_not(synth, tmp_path, monkeypatch):
    """Journey step 3: same bytes elsewhere (new mtimes, other modes) → same templates;
    one changed byte → a new image tag, and nothing else in the endpoint stacks changes."""
    import shutil

    from decider_stacks import image_stack
    from decider_stacks.paths import ASSET_EXCLUDES, CONTAINER_DIR

    copy = tmp_path / "container"
    shutil.copytree(CONTAINER_DIR, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    # a file of the package the image installs (not a local build/ folder, which the asset excludes)
    some_file = next(p for p in sorted((copy / "decider").rglob("*.py")) if p.stat().st_size > 0)
    some_file.chmod(0o600)
    monkeypatch.setattr(image_stack, "CONTAINER_DIR", copy)
    assert ASSET_EXCLUDES  # the copy skips what the asset excludes anyway

    same = run_synth(tmp_path / "same")
    for stack in STACKS:
        assert same.raw(stack) == synth.raw(stack), f"{stack}: an identical container must give an empty diff"

    some_file.write_text(some_file.read_text() + "\n# changed\n")
    changed = run_synth(tmp_path / "changed")
    new_hash = changed.decider.image.source_hash
    assert new_hash != synth.decider.image.source_hash
    for stack in ("CpuStack", "GpuStack"):
        before, after = synth.templates[stack], changed.templates[stack]
        (build_id,) = _of_type(after, "Custom::ImageBuild")
        (deployed_id,) = _of_type(after, "Custom::DeployedImage")
        # the build request, a new wait condition + handle (they cannot be updated) in place of the
        # old ones, and the image check that reads the new wait condition. Nothing else.
        waits = {
            *_of_type(
                before, "AWS::CloudFormation::WaitCondition", "AWS::CloudFormation::WaitConditionHandle"
            ),
            *_of_type(
                after, "AWS::CloudFormation::WaitCondition", "AWS::CloudFormation::WaitConditionHandle"
            ),
        }
        assert len(waits) == 4
        # and the update guard, whose Fingerprint follows the image tag: it runs before the build
        # (issue 33 §5), as it ran before on the endpoint config the new image makes.
        (guard_id,) = _of_type(after, "Custom::UpdateGuard")
        assert _changed_resources(before, after) == {build_id, deployed_id, guard_id, *waits}
        old_tag = before["Resources"][build_id]["Properties"]["ImageTag"]
        new_tag = after["Resources"][build_id]["Properties"]["ImageTag"]
        assert new_tag != old_tag
        assert new_tag.startswith("cpu-" if stack == "CpuStack" else "cuda-")
