"""Rules AWS enforces that moto, Stubber and the local stand-ins do not, as checks over synthesized
templates (a plain module: the stack tests import it).

- `canary_violations`: CanarySize / LinearStepSize "must be less than or equal to 50% of the variant's
  total instance count"
  (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_TrafficRoutingConfig.html), against
  the fewest instances the variant can run (its scalable target's MinCapacity).
- `rollback_readability_violations`: every rollback starts a fleet from the previous config, with the
  previous Model's execution role; after an update as CloudFormation applies it (the policy updated
  in place, or the role replaced), that role must still read the previous model and pull the previous
  image.
"""

from __future__ import annotations

import json
from typing import Any

from stack_helpers import resources


def _ref(value: Any) -> str | None:
    if isinstance(value, dict):
        if "Ref" in value:
            return value["Ref"]
        if "Fn::GetAtt" in value:
            return value["Fn::GetAtt"][0]
    return None


def canary_violations(template: dict[str, Any]) -> list[str]:
    problems = []
    targets = resources(template, "AWS::ApplicationAutoScaling::ScalableTarget")
    for logical, endpoint in resources(template, "AWS::SageMaker::Endpoint").items():
        policy = endpoint["Properties"].get("DeploymentConfig", {}).get("BlueGreenUpdatePolicy", {})
        routing = policy.get("TrafficRoutingConfiguration", {})
        step = routing.get("CanarySize") or routing.get("LinearStepSize")
        if step is None:
            continue
        config = template["Resources"][_ref(endpoint["Properties"]["EndpointConfigName"])]
        counts = [v["InitialInstanceCount"] for v in config["Properties"]["ProductionVariants"]]
        floor = min(counts)
        if targets:
            floor = min(int(t["Properties"]["MinCapacity"]) for t in targets.values())
        if step["Type"] == "INSTANCE_COUNT" and step["Value"] * 2 > floor:
            problems.append(
                f"{logical}: {routing['Type']} step {step['Value']} > 50% of the smallest fleet ({floor})"
            )
    return problems


def _role_policies(template: dict[str, Any], role: str) -> list[dict[str, Any]]:
    return [
        policy
        for policy in resources(template, "AWS::IAM::Policy").values()
        if any(_ref(r) == role for r in policy["Properties"].get("Roles", []))
    ]


def _grants(template: dict[str, Any], role: str, action: str) -> set[str]:
    granted: set[str] = set()
    for policy in _role_policies(template, role):
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]:
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            if action in actions:
                found = statement["Resource"]
                found = found if isinstance(found, list) else [found]
                granted |= {json.dumps(r, sort_keys=True) for r in found}
    return granted


def _retained(resource: dict[str, Any]) -> bool:
    return resource.get("DeletionPolicy") == "Retain" and resource.get("UpdateReplacePolicy") == "Retain"


def rollback_readability_violations(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """For each Model of `before`: can its role still read what it read, once `after` is applied?"""
    problems = []
    for model_id, model in resources(before, "AWS::SageMaker::Model").items():
        role = _ref(model["Properties"]["ExecutionRoleArn"])
        assert role is not None, f"{model_id}: its role is not in the template"
        if not _retained(model):
            problems.append(f"{model_id}: the Model itself is not retained")
        needed = {a: _grants(before, role, a) for a in ("s3:GetObject", "ecr:BatchGetImage")}
        if role in after["Resources"]:  # the same role, its policies updated in place
            for action, resources_before in needed.items():
                lost = resources_before - _grants(after, role, action)
                if lost:
                    problems.append(f"{model_id}: role {role} loses {action} on {sorted(lost)}")
            continue
        # The role leaves the template: CloudFormation deletes it (and its policies) unless retained.
        if not _retained(before["Resources"][role]):
            problems.append(f"{model_id}: role {role} is deleted by the update")
        for policy_id, policy in resources(before, "AWS::IAM::Policy").items():
            attached = any(_ref(r) == role for r in policy["Properties"].get("Roles", []))
            if attached and policy_id not in after["Resources"] and not _retained(policy):
                problems.append(f"{model_id}: policy {policy_id} of role {role} is deleted by the update")
    return problems
