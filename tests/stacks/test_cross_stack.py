"""The endpoint stacks' weak references to ImageStack cannot silently break.

CpuStack/GpuStack read ImageStack's outputs with `Fn::GetStackOutput` (cdk.json:
`@aws-cdk/core:defaultCrossStackReferences: weak`). CloudFormation neither updates nor warns a consumer
when such an output changes, and a custom resource's `ServiceToken` cannot be updated at all. A
refactor that renames the provider function's logical id (so its output name and ARN) would deploy
ImageStack fine and then break every later update and the delete of both endpoint stacks (a missing
Lambda). So the provider's logical id and output are pinned here: a rename fails this test, and the
fix is a migration (docs/deploy.md, "Cross-stack references"), never a quiet update of these names.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytestmark = pytest.mark.cdk

# Pinned: changing either breaks every deployed endpoint stack (see the module docstring).
PROVIDER_FUNCTION = "BuildRunnerProviderframeworkonEvent700C605B"
PROVIDER_OUTPUT = "PublishOutputFnGetAttBuildRunnerProviderframeworkonEvent700C605BArn955BCB6A"
CUSTOM_RESOURCE_TYPES = {
    "Custom::BakeLoad",
    "Custom::ModelStaging",
    "Custom::ImageBuild",
    "Custom::DeployedImage",
    "Custom::PostDeployCheck",
    "Custom::UpdateGuard",
}


def _stack_outputs(value: Any) -> list[dict[str, Any]]:
    """Every Fn::GetStackOutput under `value`."""
    if isinstance(value, dict):
        if "Fn::GetStackOutput" in value:
            return [value["Fn::GetStackOutput"]]
        return [found for inner in value.values() for found in _stack_outputs(inner)]
    if isinstance(value, list):
        return [found for inner in value for found in _stack_outputs(inner)]
    return []


@pytest.mark.parametrize("stack", ["CpuStack", "GpuStack"])
def test_every_service_token_is_the_pinned_provider_output(synth, stack):
    template = synth.templates[stack]
    custom = {k: v for k, v in template["Resources"].items() if v["Type"].startswith("Custom::")}
    assert {v["Type"] for v in custom.values()} == CUSTOM_RESOURCE_TYPES
    for logical_id, resource in custom.items():
        token = resource["Properties"]["ServiceToken"]
        assert token == {
            "Fn::GetStackOutput": {
                "StackName": "ImageStack",
                "Region": {"Ref": "AWS::Region"},
                "OutputName": PROVIDER_OUTPUT,
            }
        }, f"{logical_id}: ServiceToken is {json.dumps(token)}"


def test_the_pinned_output_is_the_provider_function_and_it_is_never_replaced(synth):
    image = synth.templates["ImageStack"]
    assert image["Outputs"][PROVIDER_OUTPUT]["Value"] == {"Fn::GetAtt": [PROVIDER_FUNCTION, "Arn"]}
    function = image["Resources"][PROVIDER_FUNCTION]
    assert function["Type"] == "AWS::Lambda::Function"
    # FunctionName is create-only: setting or changing it would replace the function (a new ARN).
    assert "FunctionName" not in function["Properties"]


@pytest.mark.parametrize("stack", ["CpuStack", "GpuStack"])
def test_every_weak_reference_names_an_existing_imagestack_output(synth, stack):
    outputs = set(synth.templates["ImageStack"]["Outputs"])
    references = _stack_outputs(synth.templates[stack])
    assert references
    for reference in references:
        assert reference["StackName"] == "ImageStack"
        assert reference["OutputName"] in outputs, reference


def test_outputs_earlier_endpoint_stacks_read_are_kept(synth):
    """Endpoint stacks deployed before the provider took its recipes from ImageStack read three more
    outputs; a rollback of such a stack resolves them again (ImageStack._keep_earlier_outputs)."""
    from decider_stacks.image_stack import EARLIER_WEAK_OUTPUTS

    image = synth.templates["ImageStack"]
    kinds = {"image-project": "AWS::CodeBuild::Project", "model-project": "AWS::CodeBuild::Project"}
    kinds["repository"] = "AWS::ECR::Repository"
    for name, held in EARLIER_WEAK_OUTPUTS.items():
        value = image["Outputs"][name]["Value"]
        assert image["Resources"][value["Ref"]]["Type"] == kinds[held], name
