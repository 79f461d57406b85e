"""The diff engine on hand-built templates shaped like the CDK app's (fast; no synthesis)."""

from __future__ import annotations

import copy
import json

from rich.console import Console

from decider_cli.infra_diff.diff import diff_templates, leaf_changes, references
from decider_cli.infra_diff.render import show_report
from decider_cli.infra_diff.schemas import create_only_properties, matches

IMAGE_A = "123456789012.dkr.ecr.us-east-1.amazonaws.com/decider@sha256:" + "a" * 64
IMAGE_B = "123456789012.dkr.ecr.us-east-1.amazonaws.com/decider@sha256:" + "b" * 64


def _stack(
    image: str = IMAGE_A,
    instance_type: str = "ml.c7i.xlarge",
    actions: list[str] | None = None,
    endpoint_name: str = "decider-cpu",
) -> dict:
    return {
        "Resources": {
            "Role": {
                "Type": "AWS::IAM::Role",
                "Properties": {
                    "AssumeRolePolicyDocument": {
                        "Statement": [
                            {
                                "Effect": "Allow",
                                "Principal": {"Service": "sagemaker.amazonaws.com"},
                                "Action": "sts:AssumeRole",
                            }
                        ]
                    }
                },
            },
            "RolePolicy": {
                "Type": "AWS::IAM::Policy",
                "Properties": {
                    "PolicyName": "p",
                    "Roles": [{"Ref": "Role"}],
                    "PolicyDocument": {
                        "Statement": [
                            {"Effect": "Allow", "Action": actions or ["ecr:BatchGetImage"], "Resource": "*"}
                        ]
                    },
                },
            },
            "Model": {
                "Type": "AWS::SageMaker::Model",
                "Properties": {
                    "ExecutionRoleArn": {"Fn::GetAtt": ["Role", "Arn"]},
                    "PrimaryContainer": {"Image": image, "Environment": {"DECIDER_N_CTX": "8192"}},
                },
            },
            "Config": {
                "Type": "AWS::SageMaker::EndpointConfig",
                "Properties": {
                    "ProductionVariants": [
                        {
                            "VariantName": "AllTraffic",
                            "InstanceType": instance_type,
                            "InitialInstanceCount": 2,
                            "ModelName": {"Fn::GetAtt": ["Model", "ModelName"]},
                        }
                    ]
                },
            },
            "Alarm": {
                "Type": "AWS::CloudWatch::Alarm",
                "Properties": {"MetricName": "Invocation5XXErrors", "Threshold": 1},
            },
            "Endpoint": {
                "Type": "AWS::SageMaker::Endpoint",
                "Properties": {
                    "EndpointName": endpoint_name,
                    "EndpointConfigName": {"Fn::GetAtt": ["Config", "EndpointConfigName"]},
                    "DeploymentConfig": {
                        "AutoRollbackConfiguration": {"Alarms": [{"AlarmName": {"Ref": "Alarm"}}]}
                    },
                },
            },
        },
        "Parameters": {"BootstrapVersion": {"Type": "AWS::SSM::Parameter::Value<String>"}},
    }


def _by_id(report):
    return {c.logical_id: c for c in report.resources}


def test_schemas_from_cfn_lint_know_sagemaker_create_only_properties():
    assert ("ProductionVariants",) in create_only_properties("AWS::SageMaker::EndpointConfig")
    assert ("PrimaryContainer",) in create_only_properties("AWS::SageMaker::Model")
    assert create_only_properties("AWS::SageMaker::Endpoint") == (("EndpointName",),)
    assert create_only_properties("Custom::ImageBuild") == (("ServiceToken",),)  # cfn-lint generic schema
    assert matches(("ProductionVariants",), ("ProductionVariants", 0, "InstanceType"))
    assert matches(("A", "*", "B"), ("A", 3, "B")) and not matches(("A", "*", "B"), ("A", 3, "C"))


def test_identical_templates_have_no_changes():
    report = diff_templates({"CpuStack": _stack()}, {"CpuStack": copy.deepcopy(_stack())})
    assert not report.has_changes


def test_new_image_replaces_model_and_config_and_updates_endpoint_in_place():
    report = diff_templates({"CpuStack": _stack()}, {"CpuStack": _stack(image=IMAGE_B)})
    changes = _by_id(report)
    assert set(changes) == {"Model", "Config", "Endpoint"}
    assert changes["Model"].action == "replace"
    assert (
        changes["Model"].changes[0].path == "PrimaryContainer.Image" and changes["Model"].changes[0].replaces
    )
    assert changes["Config"].action == "replace"
    assert changes["Config"].reasons == [
        "ProductionVariants[0].ModelName references Model, which is replaced"
    ]
    assert "blue/green" in changes["Config"].note
    assert changes["Endpoint"].action == "modify"
    assert "UpdateEndpoint" in changes["Endpoint"].note
    assert not report.iam_changes


def test_instance_type_change_is_a_config_replacement_only():
    report = diff_templates({"S": _stack()}, {"S": _stack(instance_type="ml.c7i.2xlarge")})
    changes = _by_id(report)
    assert changes["Config"].action == "replace"
    assert changes["Config"].changes[0].path == "ProductionVariants[0].InstanceType"
    assert changes["Endpoint"].action == "modify" and "Model" not in changes


def test_endpoint_name_change_is_an_endpoint_replacement():
    report = diff_templates({"S": _stack()}, {"S": _stack(endpoint_name="decider-cpu-2")})
    [endpoint] = report.replacements
    assert endpoint.logical_id == "Endpoint" and "ENDPOINT REPLACED" in endpoint.note


def test_iam_statement_changes_are_called_out():
    report = diff_templates({"S": _stack()}, {"S": _stack(actions=["ecr:BatchGetImage", "s3:GetObject"])})
    [policy] = report.iam_changes
    assert policy.logical_id == "RolePolicy" and policy.action == "modify"
    assert policy.policy_statements == [
        '- Allow ["ecr:BatchGetImage"] on *',
        '+ Allow ["ecr:BatchGetImage","s3:GetObject"] on *',
    ]


def test_added_removed_resources_and_sections():
    new = _stack()
    del new["Resources"]["Alarm"]
    new["Resources"]["Bucket"] = {"Type": "AWS::S3::Bucket", "Properties": {}}
    new["Outputs"] = {"EndpointName": {"Value": "decider-cpu"}}
    report = diff_templates({"S": _stack(), "Old": {"Resources": {}}}, {"S": new, "New": {"Resources": {}}})
    changes = _by_id(report)
    assert changes["Alarm"].action == "remove" and changes["Bucket"].action == "add"
    assert report.stacks_added == ["New"] and report.stacks_removed == ["Old"]
    assert [(s.section, s.key, s.action) for s in report.sections] == [("Outputs", "EndpointName", "add")]


def test_updated_custom_resource_attribute_may_replace_dependents():
    old = _stack()
    old["Resources"]["ImageBuild"] = {"Type": "Custom::ImageBuild", "Properties": {"SourceHash": "a" * 64}}
    old["Resources"]["Model"]["Properties"]["PrimaryContainer"]["Image"] = {
        "Fn::GetAtt": ["ImageBuild", "ImageUri"]
    }
    new = copy.deepcopy(old)
    new["Resources"]["ImageBuild"]["Properties"]["SourceHash"] = "c" * 64
    changes = _by_id(diff_templates({"S": old}, {"S": new}))
    assert changes["ImageBuild"].action == "modify"
    assert "asset hash changed" in changes["ImageBuild"].changes[0].note  # shown plainly, never masked
    assert changes["Model"].may_replace and changes["Config"].may_replace
    assert changes["Endpoint"].action == "modify"


def test_helpers():
    assert list(leaf_changes({"a": [1, 2]}, {"a": [1, 3]})) == [(("a", 1), 2, 3)]
    assert list(leaf_changes({"a": [1]}, {"a": [1, 2]})) == [(("a",), [1], [1, 2])]
    assert references({"Fn::Sub": "arn:${AWS::Partition}:s3:::${Bucket}/${Role.Arn}"}) == {
        ("Bucket", "Ref"),
        ("Role", "GetAtt"),
    }


def test_rendered_report_names_replacements_and_iam():
    report = diff_templates({"CpuStack": _stack()}, {"CpuStack": _stack(image=IMAGE_B, actions=["s3:*"])})
    console = Console(record=True, width=200)
    show_report(console, report, title="t")
    text = console.export_text()
    assert "REPLACE CpuStack/Config (AWS::SageMaker::EndpointConfig)" in text
    assert "REPLACE CpuStack/Model" in text and "IAM modify CpuStack/RolePolicy" in text
    assert IMAGE_A in text and IMAGE_B in text
    json.dumps(report.to_json())


def _with_autoscaling(template: dict, endpoint_name: str = "decider-cpu") -> dict:
    template = copy.deepcopy(template)
    template["Resources"]["ScalableTarget"] = {
        "Type": "AWS::ApplicationAutoScaling::ScalableTarget",
        "Properties": {
            "ServiceNamespace": "sagemaker",
            "ResourceId": f"endpoint/{endpoint_name}/variant/AllTraffic",
            "ScalableDimension": "sagemaker:variant:DesiredInstanceCount",
            "MinCapacity": 2,
            "MaxCapacity": 4,
        },
    }
    return template


def test_instance_type_change_on_an_autoscaled_variant_warns_with_the_three_steps():
    old = _with_autoscaling(_stack())
    new = _with_autoscaling(_stack(instance_type="ml.c7i.8xlarge"))
    report = diff_templates({"CpuStack": old}, {"CpuStack": new})
    [warning] = report.warnings
    assert (warning.stack, warning.logical_id, warning.code) == (
        "CpuStack",
        "Config",
        "autoscaled_instance_type_change",
    )
    assert "decider-cpu/AllTraffic (ml.c7i.xlarge → ml.c7i.8xlarge)" in warning.message
    assert "-c cpu.autoscaling=false" in warning.message and "3) -c cpu.autoscaling=true" in warning.message
    assert report.to_json()["warnings"][0]["code"] == "autoscaled_instance_type_change"
    console = Console(record=True, width=400)
    show_report(console, report, title="t")
    text = console.export_text()
    assert "WARNING CpuStack/Config [autoscaled_instance_type_change]" in text and "1 warning(s)" in text


def test_dropping_autoscaling_in_the_same_deploy_still_warns():
    """CloudFormation deletes the scalable target only after the endpoint update."""
    report = diff_templates({"S": _with_autoscaling(_stack())}, {"S": _stack(instance_type="ml.c7i.8xlarge")})
    assert [w.code for w in report.warnings] == ["autoscaled_instance_type_change"]


def test_instance_pools_count_as_instance_types():
    old = _with_autoscaling(_stack())
    new = _with_autoscaling(_stack())
    variant = new["Resources"]["Config"]["Properties"]["ProductionVariants"][0]
    del variant["InstanceType"]
    variant["InstancePools"] = [
        {"InstanceType": "ml.c7i.xlarge", "Priority": 1},
        {"InstanceType": "ml.c6i.xlarge", "Priority": 2},
    ]
    [warning] = diff_templates({"S": old}, {"S": new}).warnings
    assert "(ml.c7i.xlarge → ml.c7i.xlarge, ml.c6i.xlarge)" in warning.message


def test_the_three_steps_themselves_do_not_warn():
    step_1 = _stack()  # autoscaling off, same instance type
    step_2 = _stack(instance_type="ml.c7i.8xlarge")
    step_3 = _with_autoscaling(step_2)
    assert not diff_templates({"S": _with_autoscaling(_stack())}, {"S": step_1}).warnings
    assert not diff_templates({"S": step_1}, {"S": step_2}).warnings
    assert not diff_templates({"S": step_2}, {"S": step_3}).warnings
    # and a new image on an autoscaled variant is allowed (SageMaker permits model changes)
    assert not diff_templates(
        {"S": step_3}, {"S": _with_autoscaling(_stack(image=IMAGE_B, instance_type="ml.c7i.8xlarge"))}
    ).warnings


def test_an_endpoint_change_under_the_same_config_warns():
    """UpdateEndpoint needs a new EndpointConfig: a DeploymentConfig-only change cannot deploy."""
    old, new = _stack(), _stack()
    new["Resources"]["Endpoint"]["Properties"]["DeploymentConfig"]["BlueGreenUpdatePolicy"] = {
        "TerminationWaitInSeconds": 600
    }
    [warning] = diff_templates({"CpuStack": old}, {"CpuStack": new}).warnings
    assert (warning.logical_id, warning.code) == ("Endpoint", "endpoint_update_without_new_config")
    assert "DeploymentConfig" in warning.message
    # with a new config (here: a new image), the same change deploys
    newer = _stack(image=IMAGE_B)
    newer["Resources"]["Endpoint"]["Properties"]["DeploymentConfig"] = new["Resources"]["Endpoint"][
        "Properties"
    ]["DeploymentConfig"]
    assert diff_templates({"CpuStack": old}, {"CpuStack": newer}).warnings == []


def test_a_changed_request_beside_the_same_wait_handle_and_a_changed_service_token_warn():
    def with_build(compute: str, token: str) -> dict:
        template = _stack()
        template["Resources"]["Handle"] = {"Type": "AWS::CloudFormation::WaitConditionHandle"}
        template["Resources"]["Build"] = {
            "Type": "Custom::ImageBuild",
            "Properties": {"ServiceToken": token, "ComputeType": compute, "WaitHandle": {"Ref": "Handle"}},
        }
        return template

    report = diff_templates({"S": with_build("LARGE", "t1")}, {"S": with_build("2XLARGE", "t2")})
    assert sorted(w.code for w in report.warnings) == ["service_token_changed", "wait_handle_reused"]
    renamed = with_build("2XLARGE", "t1")
    renamed["Resources"]["Handle2"] = renamed["Resources"].pop("Handle")
    renamed["Resources"]["Build"]["Properties"]["WaitHandle"] = {"Ref": "Handle2"}
    assert diff_templates({"S": with_build("LARGE", "t1")}, {"S": renamed}).warnings == []


def _with_logs(template: dict, endpoint_name: str) -> dict:
    template = copy.deepcopy(template)
    template["Resources"]["Logs"] = {
        "Type": "AWS::Logs::LogGroup",
        "Properties": {"LogGroupName": f"/aws/sagemaker/Endpoints/{endpoint_name}"},
        "DeletionPolicy": "Delete",
        "UpdateReplacePolicy": "Delete",
    }
    for logical in ("Model", "Config"):
        template["Resources"][logical] |= {"DeletionPolicy": "Retain", "UpdateReplacePolicy": "Retain"}
    return template


def test_a_rename_names_the_endpoint_it_deletes_and_the_fate_of_every_removed_resource():
    """Issue 33 §3: EndpointName is create-only: CloudFormation creates the new endpoint and then deletes
    the old one (UpdateReplacePolicy Delete, the default), with its log group. infra-diff names the
    endpoint that disappears, and says of every removed or replaced resource whether it is kept."""
    old = _with_logs(_stack(), "decider-cpu")
    new = _with_logs(_stack(endpoint_name="decider-cpu-async", image=IMAGE_B), "decider-cpu-async")
    new["Resources"]["Config2"] = new["Resources"].pop("Config")  # the config under a new logical id
    new["Resources"]["Endpoint"]["Properties"]["EndpointConfigName"] = {
        "Fn::GetAtt": ["Config2", "EndpointConfigName"]
    }
    report = diff_templates({"CpuStack": old}, {"CpuStack": new})
    changes = _by_id(report)
    endpoint = changes["Endpoint"]
    assert endpoint.action == "replace" and endpoint.old_resource == "deleted"
    assert "fails" not in endpoint.note.lower()  # a renamed endpoint is replaced, not refused
    assert "CREATES decider-cpu-async" in endpoint.note and "DELETES decider-cpu " in endpoint.note
    assert "replace_endpoint=decider-cpu" in endpoint.note
    assert changes["Logs"].old_resource == "deleted" and "/aws/sagemaker/Endpoints/decider-cpu " in (
        changes["Logs"].fate
    )
    assert changes["Config"].action == "remove" and changes["Config"].old_resource == "retained"
    assert "DeletionPolicy: Retain" in changes["Config"].fate
    assert changes["Model"].action == "replace" and changes["Model"].old_resource == "retained"
    assert all(
        c.old_resource in ("retained", "deleted")
        for c in report.resources
        if c.action in ("remove", "replace")
    )
    [warning] = [w for w in report.warnings if w.code == "endpoint_deleted"]
    assert "DELETES the endpoint decider-cpu" in warning.message
    assert "/aws/sagemaker/Endpoints/decider-cpu" in warning.message
    console = Console(record=True, width=400)
    show_report(console, report, title="t")
    text = console.export_text()
    assert "[endpoint_deleted]" in text and "is RETAINED (DeletionPolicy: Retain)" in text


def test_a_replacement_under_the_same_endpoint_name_is_said_to_fail():
    old, new = _stack(), _stack()
    new["Resources"]["Endpoint"]["Properties"]["Tags"] = [{"Key": "k", "Value": "v"}]
    note = diff_templates({"S": old}, {"S": new})  # no create-only change: no replacement
    assert not note.replacements
    from decider_cli.infra_diff.diff import endpoint_replacement_note

    assert "FAILS" in endpoint_replacement_note({"EndpointName": "e"}, {"EndpointName": "e"})
