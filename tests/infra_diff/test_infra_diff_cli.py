"""The CLI end to end on a tiny stand-in app (fast): git revisions, baselines, contexts, exit codes.

The stand-in `app.py` behaves like a CDK app under the cdk CLI: it reads CDK_OUTDIR and
CDK_CONTEXT_JSON and writes a cloud assembly (manifest.json + one template). The real app is
covered by test_infra_diff_real_app.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from decider_cli.infra_diff import cli

APP = """
import json, os, pathlib
context = json.loads(os.environ["CDK_CONTEXT_JSON"])
out = pathlib.Path(os.environ["CDK_OUTDIR"]); out.mkdir(parents=True, exist_ok=True)
image = context.get("cpu.image_uri", context["cpu"]["image_uri"])
template = {"Resources": {
  "Model": {"Type": "AWS::SageMaker::Model", "Properties": {"PrimaryContainer": {"Image": image}}},
  "Config": {"Type": "AWS::SageMaker::EndpointConfig", "Properties": {"ProductionVariants": [
      {"VariantName": "AllTraffic", "InstanceType": INSTANCE,
       "ModelName": {"Fn::GetAtt": ["Model", "ModelName"]}}]}},
  "Endpoint": {"Type": "AWS::SageMaker::Endpoint", "Properties": {"EndpointName": "decider-cpu",
      "EndpointConfigName": {"Fn::GetAtt": ["Config", "EndpointConfigName"]}}}}}
(out / "CpuStack.template.json").write_text(json.dumps(template))
(out / "manifest.json").write_text(json.dumps({"artifacts": {"CpuStack": {
    "type": "aws:cloudformation:stack", "properties": {"templateFile": "CpuStack.template.json"}}}}))
"""
IMAGE_A = "1.dkr.ecr.us-east-1.amazonaws.com/d@sha256:" + "a" * 64
IMAGE_B = "1.dkr.ecr.us-east-1.amazonaws.com/d@sha256:" + "b" * 64


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        check=True,
        capture_output=True,
    )


def _write_app(repo: Path, instance: str) -> None:
    (repo / "app.py").write_text(APP.replace("INSTANCE", repr(instance)))
    (repo / "cdk.json").write_text(
        json.dumps({"app": "python app.py", "context": {"cpu": {"image_uri": IMAGE_A}}})
    )


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    _write_app(tmp_path, "ml.c7i.xlarge")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "one")
    return tmp_path


def test_working_tree_against_head_shows_config_replacement(repo, capsys):
    assert cli.main(["--repo", str(repo), "--base", "HEAD"]) == cli.EXIT_OK
    assert "No differences" in capsys.readouterr().out
    _write_app(repo, "ml.c7i.2xlarge")
    assert cli.main(["--repo", str(repo), "--base", "HEAD", "--fail-on-change"]) == cli.EXIT_CHANGED
    out = capsys.readouterr().out
    assert "REPLACE CpuStack/Config" in out and "ProductionVariants[0].InstanceType" in out
    assert "ml.c7i.xlarge" in out and "ml.c7i.2xlarge" in out


def test_two_revisions_and_json(repo, capsys):
    _write_app(repo, "ml.c7i.4xlarge")
    _git(repo, "commit", "-q", "-am", "two")
    assert cli.main(["--repo", str(repo), "--base", "HEAD~1", "--head", "HEAD", "--json"]) == cli.EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["has_changes"]
    assert {(r["logical_id"], r["action"]) for r in report["resources"]} == {
        ("Config", "replace"),
        ("Endpoint", "modify"),
    }


def test_head_context_shows_what_a_cdk_deploy_override_changes(repo, capsys):
    code = cli.main(["--repo", str(repo), "--head-context", f"cpu.image_uri={IMAGE_B}", "--fail-on-change"])
    assert code == cli.EXIT_CHANGED
    out = capsys.readouterr().out
    assert "REPLACE CpuStack/Model" in out and "REPLACE CpuStack/Config" in out
    assert "in-place UpdateEndpoint" in out


def test_baseline_round_trip(repo, tmp_path, capsys):
    baseline = tmp_path / "baseline"
    assert cli.main(["--repo", str(repo), "--save-baseline", str(baseline)]) == cli.EXIT_OK
    assert (baseline / "CpuStack.template.json").is_file()
    assert cli.main(["--repo", str(repo), "--baseline", str(baseline), "--fail-on-change"]) == cli.EXIT_OK
    _write_app(repo, "ml.m7i.xlarge")
    assert (
        cli.main(["--repo", str(repo), "--baseline", str(baseline), "--fail-on-change"]) == cli.EXIT_CHANGED
    )
    assert "ml.m7i.xlarge" in capsys.readouterr().out


def test_errors_exit_2_with_a_message(repo, tmp_path, capsys):
    assert cli.main(["--repo", str(repo), "--base", "no-such-rev"]) == cli.EXIT_ERROR
    assert "not found" in capsys.readouterr().err
    assert cli.main(["--repo", str(repo), "--baseline", str(tmp_path / "nothing")]) == cli.EXIT_ERROR
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "baseline.json").write_text('{"stacks": ["CpuStack"]}')  # its template is missing
    assert cli.main(["--repo", str(repo), "--baseline", str(broken)]) == cli.EXIT_ERROR
    assert "not a readable baseline" in capsys.readouterr().err
    argv = ["--repo", str(repo), "--base", "HEAD", "--stack", "CpuStak", "--fail-on-change"]
    assert cli.main(argv) == cli.EXIT_ERROR
    assert "unknown --stack CpuStak (stacks: CpuStack)" in capsys.readouterr().err
    (repo / "app.py").write_text("raise SystemExit('boom: bad config')\n")
    assert cli.main(["--repo", str(repo), "--base", "HEAD"]) == cli.EXIT_ERROR
    assert "boom: bad config" in capsys.readouterr().err


def test_revision_without_app_shows_every_stack_added(tmp_path, capsys):
    _git(tmp_path, "init", "-q")
    (tmp_path / "README").write_text("empty\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "empty")
    _write_app(tmp_path, "ml.c7i.xlarge")
    assert cli.main(["--repo", str(tmp_path), "--base", "HEAD"]) == cli.EXIT_OK
    assert "stack added: CpuStack" in capsys.readouterr().out


def test_fail_on_warning_gates_a_change_sagemaker_would_refuse(repo, tmp_path, capsys):
    """The deployed baseline registers the variant with autoscaling; the head changes its type."""
    baseline = tmp_path / "deployed"
    assert cli.main(["--repo", str(repo), "--save-baseline", str(baseline)]) == cli.EXIT_OK
    template = json.loads((baseline / "CpuStack.template.json").read_text())
    template["Resources"]["Target"] = {
        "Type": "AWS::ApplicationAutoScaling::ScalableTarget",
        "Properties": {
            "ResourceId": "endpoint/decider-cpu/variant/AllTraffic",
            "ScalableDimension": "sagemaker:variant:DesiredInstanceCount",
        },
    }
    (baseline / "CpuStack.template.json").write_text(json.dumps(template))
    _write_app(repo, "ml.c7i.8xlarge")
    assert cli.main(["--repo", str(repo), "--baseline", str(baseline)]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "WARNING CpuStack/Config [autoscaled_instance_type_change]" in out
    assert (
        cli.main(["--repo", str(repo), "--baseline", str(baseline), "--fail-on-warning"]) == cli.EXIT_CHANGED
    )


SYNTH = """
import json
from {package}.instances import INSTANCE

def synthesize(outdir, context):
    outdir.mkdir(parents=True, exist_ok=True)
    template = {{"Resources": {{"Config": {{"Type": "AWS::SageMaker::EndpointConfig", "Properties": {{
        "ProductionVariants": [{{"VariantName": "AllTraffic", "InstanceType": INSTANCE}}]}}}}}}}}
    (outdir / "CpuStack.template.json").write_text(json.dumps(template))
    (outdir / "manifest.json").write_text(json.dumps({{"artifacts": {{"CpuStack": {{
        "type": "aws:cloudformation:stack", "properties": {{"templateFile": "CpuStack.template.json"}}}}}}}}))
"""


def _write_stacks(repo: Path, package: str, instance: str) -> None:
    (repo / "app.py").write_text("raise SystemExit('the synth goes through stacks/synth.py')\n")
    (repo / "cdk.json").write_text(json.dumps({"app": "python app.py", "context": {}}))
    (repo / "stacks").mkdir(exist_ok=True)
    (repo / "stacks" / "__init__.py").write_text("")
    (repo / "stacks" / "synth.py").write_text(SYNTH.format(package=package))
    (repo / "stacks" / "instances.py").write_text(f"INSTANCE = {instance!r}\n")
    if package != "stacks":
        (repo / "pyproject.toml").write_text(f'[tool.setuptools]\npackage-dir = {{ {package} = "stacks" }}\n')


def test_a_revision_from_before_the_package_names_diffs_against_one_after(tmp_path, capsys):
    """The base names its CDK package `stacks`, the head `decider_stacks` (package-dir): each tree's
    synth imports that tree's own modules, not the installed `decider_stacks` of this checkout."""
    _git(tmp_path, "init", "-q")
    _write_stacks(tmp_path, "stacks", "ml.c7i.xlarge")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "before the package names")
    _write_stacks(tmp_path, "decider_stacks", "ml.c7i.2xlarge")
    assert cli.main(["--repo", str(tmp_path), "--base", "HEAD", "--fail-on-change"]) == cli.EXIT_CHANGED
    out = capsys.readouterr().out
    assert "REPLACE CpuStack/Config" in out and "ml.c7i.xlarge" in out and "ml.c7i.2xlarge" in out
