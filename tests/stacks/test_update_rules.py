"""The second deploy: every single setting change gives templates CloudFormation and SageMaker accept.

A property over the config keys, checked by synthesizing pairs (the baseline, and the app with one key
changed to another valid value) and comparing each endpoint stack as CloudFormation will update it:

1. a changed AWS::SageMaker::Endpoint ⇒ a new EndpointConfigName (its config is replaced, or has a
   new logical id): "To update an endpoint, you must create a new EndpointConfig" (UpdateEndpoint);
2. a changed Custom::ImageBuild ⇒ a new WaitConditionHandle: "to update a resource with a wait
   condition, associate the wait condition with a new WaitConditionHandle" (WaitCondition);
3. no custom resource's ServiceToken changes ("Updates are not supported").

CPU and GPU keys share a synth (their stacks do not read each other's settings); each synthesized
assembly is deleted once compared.
"""

from __future__ import annotations

import copy
import shutil
import time
from itertools import zip_longest

import pytest
from stack_helpers import acknowledgements, run_synth
from update_walk import ENVIRONMENT_KEYS, changed_context, config_keys, update_violations

from decider_stacks.config import load_config
from decider_stacks.synth import cdk_json_context

pytestmark = pytest.mark.cdk

# Keys no other value can be given to on their own in that variant (refused by the config).
NO_VALID_CHANGE = {
    "cpu.inference_ami_version",  # GPU only
    "gpu.volume_size_gb",  # NVMe types: refused
}
# The cases the issue names (they must be among the walked keys).
NAMED = {
    "cpu.autoscaling",
    "cpu.deployment.wait_interval_s",
    "cpu.deployment.traffic_routing",
    "cpu.image_build.compute_type",
    "gpu.deployment.termination_wait_s",
}


def test_the_rules_flag_an_endpoint_change_under_the_same_config():
    """The checker itself: the old behaviour (only DeploymentConfig changes) is a violation."""
    before = {
        "Resources": {
            "Config": {"Type": "AWS::SageMaker::EndpointConfig", "Properties": {"ProductionVariants": []}},
            "Endpoint": {
                "Type": "AWS::SageMaker::Endpoint",
                "Properties": {
                    "EndpointConfigName": {"Fn::GetAtt": ["Config", "EndpointConfigName"]},
                    "DeploymentConfig": {"BlueGreenUpdatePolicy": {"TerminationWaitInSeconds": 300}},
                },
            },
            "Handle": {"Type": "AWS::CloudFormation::WaitConditionHandle"},
            "Build": {
                "Type": "Custom::ImageBuild",
                "Properties": {"ServiceToken": "t", "ComputeType": "LARGE", "WaitHandle": {"Ref": "Handle"}},
            },
        }
    }
    after = copy.deepcopy(before)
    after["Resources"]["Endpoint"]["Properties"]["DeploymentConfig"]["BlueGreenUpdatePolicy"] = {
        "TerminationWaitInSeconds": 600
    }
    after["Resources"]["Build"]["Properties"]["ComputeType"] = "2XLARGE"
    after["Resources"]["Build"]["Properties"]["ServiceToken"] = "u"
    problems = update_violations("CpuStack", before, after)
    assert len(problems) == 3, problems
    assert (
        "DeploymentConfig" in problems[0] and "ComputeType" in problems[1] and "ServiceToken" in problems[2]
    )


def test_the_walk_s_unvalidated_synths_give_the_validated_templates(synth, tmp_path):
    """The walk synthesizes without cdk-nag, and so without recording acknowledgements
    (decider_stacks.nag.unvalidated): templates byte for byte those of the validated app."""
    unvalidated = run_synth(tmp_path / "unvalidated", nag=False)
    assert acknowledgements(synth.outdir) and not acknowledgements(unvalidated.outdir)
    for stack in synth.templates:
        assert unvalidated.raw(stack) == synth.raw(stack), stack


def test_every_single_setting_change_updates_cleanly(synth, tmp_path):
    baseline = load_config(cdk_json_context())
    keys = config_keys()
    contexts: dict[str, dict[str, str] | None] = {
        key: changed_context(key, baseline) for group in keys.values() for key in group
    }
    skipped = {key for key, ctx in contexts.items() if ctx is None}
    assert skipped == NO_VALID_CHANGE, "a key without a valid changed value: add one in update_walk.EXAMPLES"
    assert set(contexts) - skipped >= NAMED

    walked = [k for k in keys["cpu"] if contexts[k]], [k for k in keys["gpu"] if contexts[k]]
    jobs: list[tuple[dict[str, str], dict[str, str]]] = []  # (context, stack -> key)
    for cpu_key, gpu_key in zip_longest(*walked):
        context = {
            **(contexts[cpu_key] or {} if cpu_key else {}),
            **(contexts[gpu_key] or {} if gpu_key else {}),
        }
        jobs.append((context, {"CpuStack": cpu_key, "GpuStack": gpu_key}))
    for key in keys["app"]:
        if contexts[key]:
            jobs.append((contexts[key], {"CpuStack": key, "GpuStack": key}))

    problems: list[str] = []
    started = time.monotonic()
    for index, (context, checked) in enumerate(jobs):
        outdir = tmp_path / f"walk-{index}"
        after = run_synth(outdir, context, nag=False)  # compared, not validated: cdk-nag runs elsewhere
        for stack, key in checked.items():
            if key is None:
                continue
            before_template, after_template = synth.templates[stack], after.templates[stack]
            same = key not in ENVIRONMENT_KEYS
            for problem in update_violations(stack, before_template, after_template, same_environment=same):
                problems.append(
                    f"-c {' -c '.join(f'{k}={v}' for k, v in contexts[key].items())}: {stack}: {problem}"
                )
        shutil.rmtree(outdir, ignore_errors=True)
    elapsed = time.monotonic() - started
    assert not problems, "\n".join(problems)
    assert len(jobs) >= 40, f"only {len(jobs)} synths: did the key walk shrink?"
    print(f"{len(jobs)} synths for {len(contexts) - len(skipped)} keys in {elapsed:.0f} s")
