"""cdk-nag (AwsSolutions) on the app, with every acknowledgement reviewed; cfn-lint on every template."""

from __future__ import annotations

import json
import re

import pytest
from stack_helpers import STACKS, acknowledgements

pytestmark = pytest.mark.cdk

# Every acknowledged finding, by construct path and rule (finding detail stripped). A new
# acknowledgement must be added here on purpose, next to its reason in the stack code.
EXPECTED_ACKNOWLEDGEMENTS = {
    ("/CpuStack/Decider/Execution/Role", "AwsSolutions-IAM5"),
    ("/GpuStack/Decider/Execution/Role", "AwsSolutions-IAM5"),
    ("/GpuStack/Decider/Config", "HIPAA.Security-SageMakerEndpointConfigurationKMSKeyConfigured"),
    ("/GpuStack/Decider/Config", "NIST.800.53.R5-SageMakerEndpointConfigurationKMSKeyConfigured"),
    ("/GpuStack/Decider/Config", "PCI.DSS.321-SageMakerEndpointConfigurationKMSKeyConfigured"),
    ("/ImageStack/Store/AccessLogs", "AwsSolutions-S1"),
    ("/ImageStack/Builds/ImageBuild", "AwsSolutions-CB3"),
    ("/ImageStack/Builds/ImageBuild", "AwsSolutions-IAM5"),
    ("/ImageStack/Builds/ModelStaging", "AwsSolutions-IAM5"),
    ("/ImageStack/BuildRunner", "AwsSolutions-IAM4"),
    ("/ImageStack/BuildRunner", "AwsSolutions-IAM5"),
    ("/ImageStack/BuildRunner", "AwsSolutions-SF2"),
    ("/ImageStack/BuildRunner/OnEvent", "AwsSolutions-IAM5"),
    ("/ImageStack/BuildRunner/IsComplete", "AwsSolutions-IAM5"),
    ("/ImageStack/BuildRunner/Provider", "AwsSolutions-IAM5"),
}


def test_synth_passes_cdk_nag_with_no_unacknowledged_finding(synth):
    report = json.loads((synth.outdir / "validation-report.json").read_text())
    failures = [r for r in report["pluginReports"] if r.get("conclusion") == "failure"]
    assert failures == []


def test_every_acknowledgement_is_expected_and_has_a_specific_reason(synth):
    found = acknowledgements(synth.outdir)
    # The endpoint config's id carries the identity of its endpoint's settings (stacks/endpoint.py).
    # So does the execution role's: what it may read (the model, the image repository).
    paths = {
        (re.sub(r"/(Config|Role)[0-9A-F]{12}$", r"/\1", p), rule.split("[", 1)[0]) for p, rule, _ in found
    }
    assert paths == EXPECTED_ACKNOWLEDGEMENTS
    for path, rule, reason in found:
        assert len(reason) >= 40 and "TODO" not in reason, f"{path} {rule}: reason too vague: {reason!r}"
    # the wildcard acknowledgements name the exact finding, never the whole rule
    assert all("[" in rule for _, rule, _ in found if "IAM5" in rule or "IAM4" in rule)


def test_nag_runs_in_the_app_and_fails_synth_on_a_violation(tmp_path):
    """Proves the checks are live: an unlogged, non-TLS bucket added to CpuStack fails the synth.

    The same synth also runs the HIPAA pack to show that the CPU endpoint config has its KMS key
    and that the GPU one is acknowledged (NVMe), i.e. no KMS finding survives.
    """
    from aws_cdk import App, Validations
    from aws_cdk import aws_s3 as s3
    from cdk_nag import HIPAASecurityChecks

    from decider_stacks.assembly import build_app
    from decider_stacks.synth import CLI_CONTEXT, cdk_json_context

    app = App(outdir=str(tmp_path), context={**cdk_json_context(), **CLI_CONTEXT})
    decider = build_app(app)
    s3.Bucket(decider.cpu, "Unlogged")
    Validations.of(app).add_plugins(HIPAASecurityChecks(app))
    with pytest.raises(RuntimeError, match="ValidationFailed"):
        app.synth()
    report = json.loads((tmp_path / "validation-report.json").read_text())
    by_pack = {r["pluginName"]: r for r in report["pluginReports"]}
    aws_solutions = {
        (v["ruleName"], c["constructPath"])
        for v in by_pack["AwsSolutions"]["violations"]
        for c in v["violatingConstructs"]
    }
    assert aws_solutions == {
        ("AwsSolutions-S1", "CpuStack/Unlogged/Resource"),
        ("AwsSolutions-S10", "CpuStack/Unlogged/Resource"),
    }
    hipaa_rules = {v["ruleName"] for v in by_pack["HIPAA.Security"]["violations"]}
    assert "HIPAA.Security-SageMakerEndpointConfigurationKMSKeyConfigured" not in hipaa_rules


@pytest.mark.parametrize(
    ("variant", "stack"),
    [("synth", s) for s in STACKS] + [("synth_prebuilt", "CpuStack"), ("synth_prebuilt", "GpuStack")],
)
def test_cfn_lint_reports_no_errors(request, variant, stack):
    """cfn-lint on the default templates and the CI variant (prebuilt image/model, capture, LINEAR)."""
    from cfnlint.api import ManualArgs, lint

    synthesized = request.getfixturevalue(variant)
    template = (synthesized.outdir / f"{stack}.template.json").read_text()
    matches = lint(template, config=ManualArgs(regions=["us-east-1", "eu-west-1"]))
    errors = [m for m in matches if m.rule.id.startswith("E")]
    assert errors == [], "\n".join(f"{m.rule.id} {m.message} ({m.path})" for m in errors)


def test_cfn_lint_schemas_accept_the_capacity_properties_the_stacks_use():
    """The pinned cfn-lint (and so the CloudFormation schemas it ships) knows InstancePools,
    VariantInstanceProvisionTimeoutInSeconds, PREFIX_AWARE routing, the driver-580 AMI and
    RetainAllVariantProperties; test_cfn_lint_reports_no_errors lints templates that use them."""
    from cfnlint.schema import PROVIDER_SCHEMA_MANAGER

    from decider_stacks.config import INFERENCE_AMI_VERSIONS

    config = PROVIDER_SCHEMA_MANAGER.get_resource_schema("us-east-1", "AWS::SageMaker::EndpointConfig").schema
    variant = config["definitions"]["ProductionVariant"]["properties"]
    assert {
        "InstancePools",
        "VariantInstanceProvisionTimeoutInSeconds",
        "RoutingConfig",
        "VolumeSizeInGB",
    } <= set(variant)
    assert "PREFIX_AWARE" in config["definitions"]["RoutingConfig"]["properties"]["RoutingStrategy"]["enum"]
    assert set(INFERENCE_AMI_VERSIONS) <= set(variant["InferenceAmiVersion"]["enum"])
    endpoint = PROVIDER_SCHEMA_MANAGER.get_resource_schema("us-east-1", "AWS::SageMaker::Endpoint").schema
    assert {"RetainAllVariantProperties", "ExcludeRetainedVariantProperties"} <= set(endpoint["properties"])
    wait = PROVIDER_SCHEMA_MANAGER.get_resource_schema(
        "us-east-1", "AWS::CloudFormation::WaitCondition"
    ).schema
    assert wait["properties"]["Timeout"]["maximum"] == 43_200
