"""Resource-level diff of two sets of CloudFormation templates ({stack: template}); pure, no I/O.

Replacement is decided from the resource schemas' createOnlyProperties (schemas.py) and then
propagated: a resource whose properties Ref/GetAtt a replaced resource sees a new value there,
so it is updated (or replaced, when that property is create-only) too. This is how a new
SageMaker Model shows up as an EndpointConfig replacement plus an in-place Endpoint update.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from decider_cli.infra_diff.schemas import create_only_properties, matches

Path = tuple[str | int, ...]
Templates = dict[str, dict[str, Any]]

RESOURCE_ATTRIBUTES = (
    "DependsOn",
    "Condition",
    "DeletionPolicy",
    "UpdateReplacePolicy",
    "UpdatePolicy",
    "CreationPolicy",
    "Metadata",
)
TEMPLATE_SECTIONS = ("Parameters", "Conditions", "Mappings", "Outputs", "Rules", "Transform")
# Properties that grant permissions (policy documents), on any resource type.
GRANT_PROPERTY_NAMES = frozenset(
    {
        "PolicyDocument",
        "AssumeRolePolicyDocument",
        "KeyPolicy",
        "RepositoryPolicyText",
        "PolicyText",
        "ManagedPolicyArns",
        "Policies",
        "PermissionsBoundary",
    }
)
# Properties that choose which role a resource runs as: a change there is an IAM change too.
ROLE_PROPERTY_NAMES = frozenset({"ExecutionRoleArn", "RoleArn", "ServiceRole", "Roles", "Role"})
# Resource-policy types outside AWS::IAM::*.
RESOURCE_POLICY_TYPES = frozenset(
    {
        "AWS::S3::BucketPolicy",
        "AWS::SQS::QueuePolicy",
        "AWS::SNS::TopicPolicy",
        "AWS::Lambda::Permission",
        "AWS::Logs::ResourcePolicy",
        "AWS::Events::EventBusPolicy",
        "AWS::SecretsManager::ResourcePolicy",
        "AWS::ECR::RegistryPolicy",
        "AWS::KMS::Key",
    }
)
ASSET_HASH = re.compile(r"[0-9a-f]{64}")
SUB_REFERENCE = re.compile(r"\$\{([A-Za-z0-9]+)(\.[A-Za-z0-9.]+)?\}")
SAGEMAKER_NOTES = {
    (
        "AWS::SageMaker::EndpointConfig",
        "replace",
    ): "new endpoint config: the endpoint runs UpdateEndpoint with its DeploymentConfig (blue/green)",
    (
        "AWS::SageMaker::Endpoint",
        "replace",
    ): "ENDPOINT REPLACED: a new endpoint is created, then the old one deleted (see below)",
    (
        "AWS::SageMaker::Endpoint",
        "modify",
    ): "in-place UpdateEndpoint: blue/green with the endpoint's DeploymentConfig and rollback alarms",
    ("AWS::SageMaker::Model", "replace"): "new model (new image, model data or environment)",
}


@dataclass
class PropertyChange:
    path: str
    old: Any
    new: Any
    replaces: bool = False
    note: str | None = None


@dataclass
class ResourceChange:
    stack: str
    logical_id: str
    type: str
    action: str  # "add" | "remove" | "modify" | "replace"
    changes: list[PropertyChange] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # why replace / why modified by reference
    may_replace: bool = False  # a create-only property reads an attribute that may change
    iam: bool = False
    policy_statements: list[str] = field(default_factory=list)  # "+ Allow …" / "- Allow …"
    note: str | None = None
    # What becomes of the old physical resource when it is removed or replaced: "retained" or "deleted"
    # (DeletionPolicy on removal, UpdateReplacePolicy on replacement), with the words for it in `fate`.
    old_resource: str | None = None
    fate: str | None = None


@dataclass
class SectionChange:
    stack: str
    section: str
    key: str
    action: str
    old: Any = None
    new: Any = None


@dataclass
class Refusal:
    """A change the service will refuse as one deploy, and what to do instead."""

    stack: str
    logical_id: str
    code: str
    message: str


@dataclass
class Report:
    resources: list[ResourceChange] = field(default_factory=list)
    sections: list[SectionChange] = field(default_factory=list)
    stacks_added: list[str] = field(default_factory=list)
    stacks_removed: list[str] = field(default_factory=list)
    warnings: list[Refusal] = field(default_factory=list)

    @property
    def has_changes(self) -> bool:
        return bool(self.resources or self.sections or self.stacks_added or self.stacks_removed)

    @property
    def replacements(self) -> list[ResourceChange]:
        return [r for r in self.resources if r.action == "replace"]

    @property
    def iam_changes(self) -> list[ResourceChange]:
        return [r for r in self.resources if r.iam]

    def to_json(self) -> dict[str, Any]:
        return {
            "has_changes": self.has_changes,
            "stacks_added": self.stacks_added,
            "stacks_removed": self.stacks_removed,
            "resources": [asdict(r) for r in self.resources],
            "sections": [asdict(s) for s in self.sections],
            "warnings": [asdict(w) for w in self.warnings],
        }


def render_path(path: Path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _is_intrinsic(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and next(iter(value)).startswith(("Fn::", "Ref"))


def leaf_changes(old: Any, new: Any, path: Path = ()) -> Iterator[tuple[Path, Any, Any]]:
    """(path, old, new) for every differing leaf; intrinsics and unequal-length lists are leaves."""
    if old == new:
        return
    if isinstance(old, dict) and isinstance(new, dict) and not _is_intrinsic(old) and not _is_intrinsic(new):
        for key in sorted(set(old) | set(new)):
            yield from leaf_changes(old.get(key), new.get(key), (*path, key))
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for index, (a, b) in enumerate(zip(old, new, strict=True)):
            yield from leaf_changes(a, b, (*path, index))
    else:
        yield path, old, new


def references(value: Any) -> set[tuple[str, str]]:
    """(logical id, "Ref" | "GetAtt") pairs a value points at through Ref, Fn::GetAtt or Fn::Sub."""
    found: set[tuple[str, str]] = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            if key == "Ref" and isinstance(inner, str) and not inner.startswith("AWS::"):
                found.add((inner, "Ref"))
            elif key == "Fn::GetAtt":
                target = inner[0] if isinstance(inner, list) else str(inner).split(".")[0]
                found.add((target, "GetAtt"))
            elif key == "Fn::Sub":
                text = inner[0] if isinstance(inner, list) else inner
                for match in SUB_REFERENCE.finditer(text):
                    if not match[1].startswith("AWS"):
                        found.add((match[1], "GetAtt" if match[2] else "Ref"))
                if isinstance(inner, list) and len(inner) > 1:
                    found.update(references(inner[1]))
            else:
                found.update(references(inner))
    elif isinstance(value, list):
        for inner in value:
            found.update(references(inner))
    return found


def _property_references(properties: dict[str, Any]) -> Iterator[tuple[Path, str, str]]:
    """(property path, referenced logical id, kind) at the finest path that holds the reference."""

    def walk(value: Any, path: Path) -> Iterator[tuple[Path, str, str]]:
        if _is_intrinsic(value) or not isinstance(value, dict | list):
            for target, kind in references(value):
                yield path, target, kind
        elif isinstance(value, dict):
            for key, inner in value.items():
                yield from walk(inner, (*path, key))
        else:
            for index, inner in enumerate(value):
                yield from walk(inner, (*path, index))

    yield from walk(properties, ())


def _replacing(resource_type: str, path: Path) -> bool:
    pointers = create_only_properties(resource_type)
    return bool(pointers) and any(matches(p, path) for p in pointers)


def _is_iam(resource_type: str, paths: list[Path], *, roles: bool = True) -> bool:
    """IAM types, resource policies, policy documents, and (for changes) which role a resource uses."""
    if resource_type.startswith("AWS::IAM::") or resource_type in RESOURCE_POLICY_TYPES:
        return True
    names = GRANT_PROPERTY_NAMES | ROLE_PROPERTY_NAMES if roles else GRANT_PROPERTY_NAMES
    return any(str(part) in names for path in paths for part in path)


def _statements(properties: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if isinstance(properties, dict):
        statement = properties.get("Statement")
        if isinstance(statement, list):
            found.extend(s for s in statement if isinstance(s, dict))
        elif isinstance(statement, dict):
            found.append(statement)
        for key, value in properties.items():
            if key != "Statement":
                found.extend(_statements(value))
    elif isinstance(properties, list):
        for value in properties:
            found.extend(_statements(value))
    return found


def _compact(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))


def describe_statement(statement: dict[str, Any]) -> str:
    actions = statement.get("Action", statement.get("NotAction", []))
    resources = statement.get("Resource", statement.get("NotResource", "—"))
    text = f"{statement.get('Effect', '?')} {_compact(actions)} on {_compact(resources)}"
    if "Principal" in statement:
        text += f" for {_compact(statement['Principal'])}"
    if "Condition" in statement:
        text += f" if {_compact(statement['Condition'])}"
    return text


def policy_statement_changes(old: Any, new: Any) -> list[str]:
    """Statement-level +/- lines between every policy document found in two property sets."""

    def canonical(statements: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {json.dumps(s, sort_keys=True): s for s in statements}

    before, after = canonical(_statements(old)), canonical(_statements(new))
    lines = [f"- {describe_statement(before[k])}" for k in before if k not in after]
    lines += [f"+ {describe_statement(after[k])}" for k in after if k not in before]
    return lines


def _note_for(change: PropertyChange) -> str | None:
    old, new = _compact(change.old) if change.old is not None else "", _compact(change.new or "")
    if (
        ASSET_HASH.search(old)
        and ASSET_HASH.search(new)
        and ASSET_HASH.findall(old) != ASSET_HASH.findall(new)
    ):
        return "asset hash changed: the asset's contents changed"
    return None


def _diff_resource(
    stack: str, logical_id: str, old: dict[str, Any], new: dict[str, Any]
) -> ResourceChange | None:
    resource_type = new.get("Type", "")
    if old.get("Type") != resource_type:
        change = ResourceChange(
            stack, logical_id, resource_type, "replace", reasons=[f"type changed from {old.get('Type')}"]
        )
        change.iam = _is_iam(resource_type, []) or _is_iam(old.get("Type", ""), [])
        return change
    changes: list[PropertyChange] = []
    paths: list[Path] = []
    for path, a, b in leaf_changes(old.get("Properties", {}), new.get("Properties", {})):
        paths.append(path)
        change = PropertyChange(render_path(path), a, b, replaces=_replacing(resource_type, path))
        change.note = _note_for(change)
        changes.append(change)
    for attribute in RESOURCE_ATTRIBUTES:
        for path, a, b in leaf_changes(old.get(attribute), new.get(attribute), (attribute,)):
            changes.append(
                PropertyChange(
                    render_path(path),
                    a,
                    b,
                    note="resource attribute; no resource update" if attribute == "Metadata" else None,
                )
            )
            changes[-1].note = _note_for(changes[-1]) or changes[-1].note
    if not changes:
        return None
    replaced = [c.path for c in changes if c.replaces]
    result = ResourceChange(stack, logical_id, resource_type, "replace" if replaced else "modify", changes)
    if replaced:
        result.reasons.append(f"create-only {', '.join(replaced)} changed")
    result.iam = _is_iam(resource_type, paths)
    if result.iam:
        result.policy_statements = policy_statement_changes(old.get("Properties"), new.get("Properties"))
    return result


def _changes_value(change: ResourceChange | None, kind: str) -> str | None:
    """Whether a Ref/GetAtt to a changed resource sees a new value: "yes", "maybe" or None."""
    if change is None or change.action in ("add", "remove"):
        return None
    if change.action == "replace":
        return "yes"
    custom = change.type.startswith("Custom::") or change.type == "AWS::CloudFormation::CustomResource"
    if change.may_replace or kind == "GetAtt" or custom:
        return "maybe"  # an updated resource's attributes (or a custom resource's id) may change
    return None


def _propagate(stack: str, new: dict[str, Any], by_id: dict[str, ResourceChange]) -> None:
    """Mark resources that reference a replaced (or possibly changed) resource as updated or replaced."""
    resources = new.get("Resources", {})
    changed = True
    while changed:
        changed = False
        for logical_id, resource in resources.items():
            current = by_id.get(logical_id)
            if current is not None and current.action in ("add", "replace"):
                continue
            resource_type = resource.get("Type", "")
            for path, target, kind in _property_references(resource.get("Properties", {})):
                effect = _changes_value(by_id.get(target), kind)
                if effect is None or target == logical_id:
                    continue
                replaces = _replacing(resource_type, path)
                if effect == "yes":
                    reason = f"{render_path(path)} references {target}, which is replaced"
                else:
                    reason = f"{render_path(path)} reads {kind} {target}, which changes: value may change"
                if current is None:
                    current = by_id[logical_id] = ResourceChange(stack, logical_id, resource_type, "modify")
                    changed = True
                if reason not in current.reasons:
                    current.reasons.append(reason)
                if replaces and effect == "yes" and current.action != "replace":
                    current.action = "replace"
                    changed = True
                elif replaces and effect == "maybe" and not current.may_replace:
                    current.may_replace = True
                    changed = True
                if _is_iam(resource_type, [path]):
                    current.iam = True


def diff_stack(
    stack: str, old: dict[str, Any], new: dict[str, Any]
) -> tuple[list[ResourceChange], list[SectionChange]]:
    old_resources, new_resources = old.get("Resources", {}), new.get("Resources", {})
    by_id: dict[str, ResourceChange] = {}
    for logical_id in sorted(set(old_resources) | set(new_resources)):
        if logical_id not in old_resources:
            resource = new_resources[logical_id]
            change = ResourceChange(stack, logical_id, resource.get("Type", ""), "add")
            change.iam = _is_iam(change.type, [(k,) for k in resource.get("Properties", {})], roles=False)
            if change.iam:
                change.policy_statements = policy_statement_changes(None, resource.get("Properties"))
            by_id[logical_id] = change
        elif logical_id not in new_resources:
            resource = old_resources[logical_id]
            change = ResourceChange(stack, logical_id, resource.get("Type", ""), "remove")
            change.iam = _is_iam(change.type, [(k,) for k in resource.get("Properties", {})], roles=False)
            if change.iam:
                change.policy_statements = policy_statement_changes(resource.get("Properties"), None)
            by_id[logical_id] = change
        else:
            modified = _diff_resource(stack, logical_id, old_resources[logical_id], new_resources[logical_id])
            if modified is not None:
                by_id[logical_id] = modified
    _propagate(stack, new, by_id)
    for change in by_id.values():
        change.note = SAGEMAKER_NOTES.get((change.type, change.action))
        if change.logical_id in old_resources and (
            change.action in ("remove", "replace") or change.may_replace
        ):
            before = old_resources[change.logical_id]
            change.old_resource, change.fate = old_resource_fate(before, change.action, change.may_replace)
        if change.type == "AWS::SageMaker::Endpoint" and change.action == "replace":
            change.note = endpoint_replacement_note(
                old_resources[change.logical_id].get("Properties", {}),
                new_resources[change.logical_id].get("Properties", {}),
            )
    sections = []
    for section in TEMPLATE_SECTIONS:
        before, after = old.get(section) or {}, new.get(section) or {}
        if not isinstance(before, dict) or not isinstance(after, dict):
            if before != after:
                sections.append(SectionChange(stack, section, "", "modify", before, after))
            continue
        for key in sorted(set(before) | set(after)):
            if before.get(key) != after.get(key):
                action = "add" if key not in before else "remove" if key not in after else "modify"
                sections.append(SectionChange(stack, section, key, action, before.get(key), after.get(key)))
    order = {"replace": 0, "remove": 1, "add": 2, "modify": 3}
    return sorted(by_id.values(), key=lambda c: (order[c.action], c.logical_id)), sections


# Properties that carry a resource's physical name, for saying which one a removal deletes.
NAME_PROPERTIES = (
    "EndpointName",
    "LogGroupName",
    "Name",
    "ModelName",
    "EndpointConfigName",
    "AlarmName",
    "TopicName",
    "FunctionName",
    "BucketName",
    "RoleName",
    "PolicyName",
    "ResourceId",
)
RETAINING = ("Retain", "RetainExceptOnCreate")


def physical_name(resource: dict[str, Any]) -> str | None:
    """The resource's fixed name, when the template spells it as a literal."""
    properties = resource.get("Properties") or {}
    return next((properties[k] for k in NAME_PROPERTIES if isinstance(properties.get(k), str)), None)


def old_resource_fate(resource: dict[str, Any], action: str, may_replace: bool = False) -> tuple[str, str]:
    """Whether CloudFormation keeps or deletes the old physical resource: on removal its DeletionPolicy
    decides, on replacement its UpdateReplacePolicy ("CloudFormation creates the replacement resource
    first [...] By default, CloudFormation then deletes the old resource", UpdateReplacePolicy attribute,
    https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/aws-attribute-updatereplacepolicy.html).
    Delete is the default of both."""
    attribute = "DeletionPolicy" if action == "remove" else "UpdateReplacePolicy"
    policy = resource.get(attribute)
    name = physical_name(resource)
    what = f"the old {resource.get('Type', 'resource')}" + (f" {name}" if name else "")
    when = "if it is replaced, " if action != "remove" and may_replace else ""
    if policy in RETAINING:
        return "retained", f"{when}{what} is RETAINED ({attribute}: {policy}): kept outside the stack"
    if policy == "Snapshot":
        return "deleted", f"{when}{what} is DELETED after a snapshot ({attribute}: Snapshot)"
    default = "" if policy else ", the default"
    after = " once its replacement exists" if action != "remove" else ""
    return "deleted", f"{when}{what} is DELETED{after} ({attribute}: {policy or 'Delete'}{default})"


def endpoint_replacement_note(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What replacing an AWS::SageMaker::Endpoint does: EndpointName is create-only."""
    before, after = old.get("EndpointName"), new.get("EndpointName")
    if isinstance(before, str) and before == after:
        return (
            f"ENDPOINT REPLACED under the same name {before}: CloudFormation refuses to replace a "
            "custom-named resource, so the update FAILS (AWS CloudFormation, custom naming: 'You can't "
            "perform an update that causes a custom-named resource to be replaced')"
        )
    return (
        f"ENDPOINT REPLACED: EndpointName is create-only, so CloudFormation CREATES {after} and, once the "
        f"stack update succeeds, DELETES {before} with its live traffic (clients calling {before} get "
        "errors from then on); its log group goes with it. The update guard refuses this unless "
        f"-c {_variant_key(str(before))}.replace_endpoint={before}"
    )


SCALING_UPDATE_STEPS = (
    "SageMaker fails UpdateEndpoint when it changes the instance type of (or removes) a variant that is "
    'registered with Application Auto Scaling (SageMaker, "Update endpoints that use auto scaling"). '
    "Deploy in three steps: 1) -c {variant}.autoscaling=false (deregisters the variant), 2) the new "
    "instance type with autoscaling still off, 3) -c {variant}.autoscaling=true"
)


def _literal(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _variant_instance_types(config: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """VariantName → the instance types it may run on (InstanceType, or its InstancePools in order)."""
    out: dict[str, tuple[str, ...]] = {}
    for variant in config.get("Properties", {}).get("ProductionVariants", []) or []:
        name = _literal(variant.get("VariantName"))
        if name is None:
            continue
        pools = variant.get("InstancePools") or []
        types = tuple(str(p.get("InstanceType")) for p in pools) or (str(variant.get("InstanceType")),)
        out[name] = types
    return out


def _scaled_variants(template: dict[str, Any]) -> set[tuple[str, str]]:
    """(endpoint name, variant name) pairs registered with Application Auto Scaling in a template."""
    found = set()
    for resource in template.get("Resources", {}).values():
        if resource.get("Type") != "AWS::ApplicationAutoScaling::ScalableTarget":
            continue
        props = resource.get("Properties", {})
        if props.get("ScalableDimension") != "sagemaker:variant:DesiredInstanceCount":
            continue
        match = re.fullmatch(r"endpoint/([^/]+)/variant/([^/]+)", _literal(props.get("ResourceId")) or "")
        if match:
            found.add((match[1], match[2]))
    return found


def _endpoint_configs(template: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Endpoint logical id → (endpoint name, endpoint-config logical id), for literal names."""
    out = {}
    for logical_id, resource in template.get("Resources", {}).items():
        if resource.get("Type") != "AWS::SageMaker::Endpoint":
            continue
        props = resource.get("Properties", {})
        name = _literal(props.get("EndpointName"))
        targets = [t for t, _ in references(props.get("EndpointConfigName"))]
        if name and len(targets) == 1:
            out[logical_id] = (name, targets[0])
    return out


def refusals(stack: str, old: dict[str, Any], new: dict[str, Any]) -> list[Refusal]:
    """Changes SageMaker refuses as one update: today, an instance-type change (or a removed variant)
    on a variant the *deployed* template registered with Application Auto Scaling. Removing the
    scalable target in the same deploy does not help: CloudFormation deletes it only after the update."""
    scaled = _scaled_variants(old)
    if not scaled:
        return []
    old_endpoints, new_endpoints = _endpoint_configs(old), _endpoint_configs(new)
    found = []
    for logical_id, (name, new_config_id) in new_endpoints.items():
        if logical_id not in old_endpoints or old_endpoints[logical_id][0] != name:
            continue
        before = _variant_instance_types(old["Resources"][old_endpoints[logical_id][1]])
        after = _variant_instance_types(new["Resources"].get(new_config_id, {}))
        for variant, types in sorted(before.items()):
            if (name, variant) not in scaled:
                continue
            key = _variant_key(name)
            if variant not in after:
                change = f"removes variant {name}/{variant}"
            elif after[variant] != types:
                was, now = ", ".join(types), ", ".join(after[variant])
                change = f"changes the instance type of {name}/{variant} ({was} → {now})"
            else:
                continue
            found.append(
                Refusal(
                    stack,
                    new_config_id,
                    "autoscaled_instance_type_change",
                    f"{change} while it is registered with Application Auto Scaling. "
                    + SCALING_UPDATE_STEPS.format(variant=key),
                )
            )
    return found


def _changed_keys(old: dict[str, Any], new: dict[str, Any]) -> str:
    return ", ".join(sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k)))


def update_refusals(
    stack: str, old: dict[str, Any], new: dict[str, Any], replaced: set[str], *, same_environment: bool = True
) -> list[Refusal]:
    """Updates CloudFormation or SageMaker cannot carry out, for any resource of these kinds:

    - an AWS::SageMaker::Endpoint whose properties change while its EndpointConfigName does not
      ("To update an endpoint, you must create a new EndpointConfig", SageMaker UpdateEndpoint);
    - a resource that passes a WaitConditionHandle on (e.g. Custom::ImageBuild) and changes beside the
      same handle ("associate the wait condition with a new WaitConditionHandle", WaitCondition);
    - a custom resource whose ServiceToken changes ("Updates are not supported"). Not checked across
      environments (`same_environment=False`: pinning an account or region is a new deploy there)."""
    found: list[Refusal] = []
    old_resources, new_resources = old.get("Resources", {}), new.get("Resources", {})
    for logical_id, resource in new_resources.items():
        before = old_resources.get(logical_id)
        if before is None or before.get("Type") != resource.get("Type"):
            continue
        props, old_props = resource.get("Properties", {}), before.get("Properties", {})
        if props == old_props:
            continue
        if resource["Type"] == "AWS::SageMaker::Endpoint":
            old_configs = {t for t, _ in references(old_props.get("EndpointConfigName"))}
            new_configs = {t for t, _ in references(props.get("EndpointConfigName"))}
            same_literal = old_props.get("EndpointConfigName") == props.get("EndpointConfigName")
            if same_literal and not (new_configs & replaced) and (old_configs == new_configs):
                found.append(
                    Refusal(
                        stack,
                        logical_id,
                        "endpoint_update_without_new_config",
                        f"{logical_id} changes ({_changed_keys(old_props, props)}) under the same endpoint "
                        "config: UpdateEndpoint needs a new EndpointConfig and refuses the one the endpoint "
                        "runs. Change the endpoint config too (this app names it after the endpoint's "
                        "settings), or roll the endpoint change out with the next config change",
                    )
                )
        handles = {
            t
            for t, kind in references(props)
            if kind == "Ref"
            and new_resources.get(t, {}).get("Type") == "AWS::CloudFormation::WaitConditionHandle"
        }
        if handles and handles == {t for t, _ in references(old_props)} & handles:
            found.append(
                Refusal(
                    stack,
                    logical_id,
                    "wait_handle_reused",
                    f"{logical_id} changes ({_changed_keys(old_props, props)}) beside the same, already "
                    f"signalled {', '.join(sorted(handles))}: its wait condition needs a new handle",
                )
            )
        token = props.get("ServiceToken")
        if same_environment and token is not None and token != old_props.get("ServiceToken"):
            found.append(
                Refusal(
                    stack,
                    logical_id,
                    "service_token_changed",
                    f"{logical_id}: ServiceToken changes, which CloudFormation does not support; keep the "
                    "provider's logical id and output (tests/stacks/test_cross_stack.py pins them)",
                )
            )
    return found


def _variant_key(endpoint_name: str) -> str:
    """The cdk.json key (`cpu` / `gpu`) an endpoint name suggests, else a placeholder."""
    lowered = endpoint_name.lower()
    return next((key for key in ("gpu", "cpu") if key in lowered), "<variant>")


def diff_templates(old: Templates, new: Templates, stacks: list[str] | None = None) -> Report:
    report = Report()
    names = sorted(set(old) | set(new))
    if stacks:
        names = [n for n in names if n in stacks]
    for stack in names:
        if stack not in old:
            report.stacks_added.append(stack)
        elif stack not in new:
            report.stacks_removed.append(stack)
        resources, sections = diff_stack(stack, old.get(stack, {}), new.get(stack, {}))
        report.resources.extend(resources)
        report.sections.extend(sections)
        report.warnings.extend(refusals(stack, old.get(stack, {}), new.get(stack, {})))
        replaced = {r.logical_id for r in resources if r.action == "replace"}
        report.warnings.extend(update_refusals(stack, old.get(stack, {}), new.get(stack, {}), replaced))
        report.warnings.extend(endpoint_deletions(stack, resources, old.get(stack, {})))
    return report


def endpoint_deletions(stack: str, resources: list[ResourceChange], old: dict[str, Any]) -> list[Refusal]:
    """A live endpoint this deploy deletes (renamed, replaced or removed): named, with what goes with it."""
    found = []
    old_resources = old.get("Resources", {})
    for change in resources:
        if (
            change.type != "AWS::SageMaker::Endpoint"
            or change.fate is None
            or change.old_resource != "deleted"
        ):
            continue
        if change.action not in ("remove", "replace"):
            continue
        name = physical_name(old_resources[change.logical_id]) or change.logical_id
        gone = [  # what is named after the endpoint and deleted with it (its log group, its SSM record …)
            c.fate
            for c in resources
            if c.logical_id != change.logical_id
            and c.fate
            and c.old_resource == "deleted"
            and c.action in ("remove", "replace")
            and not c.type.startswith("Custom::")
            and name in (physical_name(old_resources[c.logical_id]) or "")
        ]
        found.append(
            Refusal(
                stack,
                change.logical_id,
                "endpoint_deleted",
                f"this deploy DELETES the endpoint {name}"
                + (f" ({change.note})" if change.action == "replace" and change.note else "")
                + (f". Deleted with it: {'; '.join(gone)}" if gone else ""),
            )
        )
    return found
