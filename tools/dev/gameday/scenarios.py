"""The game day's scenarios: what the AWS documentation leaves open, tried on the app's own stacks.

Each returns an `Outcome`: what the stacks assume, what happened, whether that settles the assumption
(True), contradicts it (False: `recover` says what to run or change) or could not be told (None).
Scenarios that change the stack deploy it again with `-c` overrides (lab.Lab.deploy), so what they see
is what a user's `cdk deploy` gets: the update guard, the bake load, the post-deploy check and parking.
docs/deploy.md lists each assumption as settled or open.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from decider_dev.gameday.lab import ENDPOINT_STACK, OTHER_INSTANCE, Deploy, Lab, context_args, tool_argv
from decider_stacks.client_access import batch_prefix
from decider_stacks.config import TRANSFORM_MODEL_OUTPUT

# A refusal the update guard owns comes before UpdateEndpoint: seconds of Lambda, then the rollback of
# a stack whose endpoint never moved. Ten minutes is generous; the image build it must not wait for
# takes up to hours.
REFUSAL_BUDGET_S = 600
# What the scenarios change with `-c`, on top of the last deploy that held (tests/gameday synthesizes
# each). A container setting gives a new Model and endpoint config, so a blue/green update.
OTHER_INSTANCE_TYPE = {"cpu.instance_type": OTHER_INSTANCE}
BATCH_ON = {"cpu.batch_transform": "true"}
BATCH_OFF_AND_NEW_CONFIG = {"cpu.batch_transform": "false", "cpu.container.max_chat_tokens": "512"}
OTHER_CONFIG = {"cpu.container.max_chat_tokens": "768"}
# A new config whose ModelLatency p90 rollback alarm (1 ms) trips on the bake load's requests: CloudWatch
# alarms cannot be forced for long (SetAlarmState "returns to their actual state quickly, often within
# seconds"), and no one may publish into AWS/SageMaker, so the alarm trips on real metrics. The alarm's
# threshold changes first (the Endpoint refers to it), and the rollback restores it.
TRIPPED_ROLLBACK = {**OTHER_CONFIG, "cpu.alarms.latency_p90_ms": "1"}


@dataclass(frozen=True)
class Outcome:
    scenario: str
    assumption: str
    observed: str
    settled: bool | None
    recover: str = ""

    @property
    def verdict(self) -> str:
        return {True: "holds", False: "WRONG", None: "unknown"}[self.settled]


def _error(error: ClientError) -> str:
    details = error.response.get("Error", {})
    return f"{details.get('Code')}: {details.get('Message', '')}"


def _observed(deploy: Deploy, endpoint: dict[str, Any], before: str) -> str:
    config = endpoint["EndpointConfigName"]
    which = "the previous config" if config == before else f"config {config}"
    text = f"{deploy.line}; endpoint {endpoint['EndpointStatus']} on {which}"
    return f"{text}; {deploy.reason}" if deploy.reason else text


def _untouched(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """The endpoint was not updated in between (same config, same LastModifiedTime)."""
    return all(before.get(key) == after.get(key) for key in ("EndpointConfigName", "LastModifiedTime"))


def _continue_rollback(lab: Lab) -> str:
    return (
        f"aws cloudformation continue-update-rollback --stack-name {ENDPOINT_STACK} --resources-to-skip "
        f"Endpoint (docs/deploy.md, 'Rollbacks that finish'); then the logs of {lab.endpoint_name}'s "
        "post-deploy check"
    )


def second_deploy(lab: Lab) -> Outcome:
    """The same `cdk deploy` again."""
    assumption = "a deploy without a change changes nothing: no endpoint update, no new config"
    before = lab.wait_endpoint()
    deploy = lab.deploy({})
    after = lab.wait_endpoint()
    observed = _observed(deploy, after, before["EndpointConfigName"])
    if deploy.exit_code == 0 and _untouched(before, after):
        return Outcome("second-deploy", assumption, observed, True)
    return Outcome(
        "second-deploy",
        assumption,
        observed,
        False,
        "infra-diff against the deployed template shows what the synth changes on its own (a timestamp, "
        "an asset hash): make it stable",
    )


def same_config_update(lab: Lab) -> Outcome:
    """UpdateEndpoint to the config the endpoint already runs."""
    assumption = (
        "SageMaker refuses UpdateEndpoint to the running config, so a rollback after SageMaker's own "
        "rollback needs the post-deploy check's parking (stacks/handlers/post_deploy_check.py)"
    )
    config = lab.wait_endpoint()["EndpointConfigName"]
    try:
        lab.sagemaker.update_endpoint(EndpointName=lab.endpoint_name, EndpointConfigName=config)
    except ClientError as error:
        return Outcome("same-config-update", assumption, f"refused: {_error(error)}", True)
    after = lab.wait_endpoint()
    return Outcome(
        "same-config-update",
        assumption,
        f"accepted; the endpoint ended {after['EndpointStatus']} on {after['EndpointConfigName']}",
        False,
        "parking is then unneeded (but harmless): CloudFormation's own rollback can reach the previous "
        "config; note it in docs/deploy.md and keep the check",
    )


def signed_json_config(lab: Lab) -> Outcome:
    """CreateEndpointConfig sent as signed JSON (the post-deploy check's parking path), not by botocore."""
    assumption = (
        "SageMaker accepts a CreateEndpointConfig body sent as JSON with a hand-made SigV4 signature "
        "(stacks/handlers/sagemaker_json.py), so parking copies fields the Lambda's botocore does not know"
    )
    live = lab.sagemaker.describe_endpoint_config(
        EndpointConfigName=lab.wait_endpoint()["EndpointConfigName"]
    )
    keep = ("VariantName", "ModelName", "InstanceType", "InitialInstanceCount", "InitialVariantWeight")
    variants = [{k: v[k] for k in keep if k in v} for v in live["ProductionVariants"]]
    name = f"{lab.endpoint_name}-json"
    try:
        lab.clients["sagemaker-json"].call(
            "CreateEndpointConfig", {"EndpointConfigName": name, "ProductionVariants": variants}
        )
    except ClientError as error:
        return Outcome(
            "signed-json-config",
            assumption,
            f"refused: {_error(error)}",
            False,
            "parking then fails at once with both reasons; fall back to the DescribeEndpointConfig copy "
            "(post_deploy_check.park without properties) or bundle a pinned boto3 with the handlers",
        )
    lab.seen.add(("AWS::SageMaker::EndpointConfig", name))
    copied = lab.sagemaker.describe_endpoint_config(EndpointConfigName=name)
    same = [{k: v[k] for k in keep if k in v} for v in copied["ProductionVariants"]] == variants
    return Outcome("signed-json-config", assumption, f"created {name}; variants equal: {same}", same)


def _refused_before_the_endpoint(
    lab: Lab, scenario: str, assumption: str, changes: dict[str, str]
) -> Outcome:
    """A deploy the update guard must refuse: fast, rolled back, the endpoint never touched."""
    before = lab.wait_endpoint()
    deploy = lab.deploy(changes)
    after = lab.wait_endpoint()
    observed = _observed(deploy, after, before["EndpointConfigName"])
    if deploy.ok:
        return Outcome(
            scenario, assumption, observed, False, "the guard let it through: see UpdateGuard's logs"
        )
    if deploy.status == "UPDATE_ROLLBACK_FAILED":
        return Outcome(scenario, assumption, observed, False, _continue_rollback(lab))
    by_guard = "(Custom::UpdateGuard)" in deploy.reason
    fast = deploy.seconds <= REFUSAL_BUDGET_S
    if deploy.status == "UPDATE_ROLLBACK_COMPLETE" and _untouched(before, after) and by_guard and fast:
        return Outcome(scenario, assumption, observed, True)
    return Outcome(
        scenario,
        assumption,
        observed,
        False if deploy.status == "UPDATE_ROLLBACK_COMPLETE" else None,
        f"refused by another resource or after {REFUSAL_BUDGET_S} s: the guard must own this refusal "
        "(stacks/handlers/update_guard.py)",
    )


def guard_refuses_early(lab: Lab) -> Outcome:
    """An instance-type change while the variant is an autoscaling target."""
    return _refused_before_the_endpoint(
        lab,
        "guard-refuses-early",
        "the update guard refuses what UpdateEndpoint would refuse (a new instance type under "
        f"autoscaling) within {REFUSAL_BUDGET_S} s, and the rollback finishes with the endpoint untouched",
        OTHER_INSTANCE_TYPE,
    )


def rename_refused(lab: Lab) -> Outcome:
    """A new endpoint_name on the deployed stack, without replace_endpoint."""
    return _refused_before_the_endpoint(
        lab,
        "rename-refused",
        "renaming the endpoint without replace_endpoint is refused before CloudFormation creates the new "
        "endpoint and deletes the live one",
        {"cpu.endpoint_name": f"{lab.endpoint_name}-renamed"},
    )


def _batch_on(lab: Lab) -> str | None:
    """Turn batch_transform on unless the last deploy did; what happened when it could not."""
    if lab.context.items() >= BATCH_ON.items():
        return None
    deploy = lab.deploy(BATCH_ON)
    return None if deploy.ok else f"turning batch_transform on failed: {deploy.line}; {deploy.reason}"


def batch_transform(lab: Lab) -> Outcome:
    """`decide-batch submit` of a small JSON Lines file through the stack's TransformModel."""
    assumption = (
        "with batch_transform on, decide-batch runs a transform job of the stack's TransformModel (the "
        "archive beside the model prefix, through ModelDataUrl): one output line per input line"
    )
    failed = _batch_on(lab)
    if failed is not None:
        return Outcome("batch-transform", assumption, failed, False, "see the stack's events")
    bucket = lab.scratch.artifacts_bucket
    prefix = batch_prefix(lab.endpoint_name)
    request = {
        "state": "I was charged twice.",
        "questions": {"refund": {"type": "noul", "instructions": "Refund?"}},
    }
    lines = [json.dumps({"id": i, **request}) for i in range(2)]
    key = f"{prefix}input/requests.jsonl"
    lab.clients["s3"].put_object(Bucket=bucket, Key=key, Body=("\n".join(lines) + "\n").encode())
    job = f"{lab.endpoint_name}-batch"
    argv = [*lab.aws_args, "submit", "--variant", "cpu", "--job-name", job, "--wait"]
    argv += ["--input", f"s3://{bucket}/{prefix}input/", "--output", f"s3://{bucket}/{prefix}output/"]
    exit_code = lab.run_tool(tool_argv("decide-batch", [*argv, *context_args(lab.context)]))
    if exit_code != 0:
        return Outcome(
            "batch-transform",
            assumption,
            f"decide-batch submit exited {exit_code}",
            False,
            f"decide-batch status {job}; the job's logs in /aws/sagemaker/TransformJobs (docs/batch.md)",
        )
    body = lab.clients["s3"].get_object(Bucket=bucket, Key=f"{prefix}output/requests.jsonl.out")["Body"]
    answered = [json.loads(line) for line in body.read().decode().splitlines() if line.strip()]
    ok = len(answered) == len(lines) and all("answers" in (a.get("SageMakerOutput") or {}) for a in answered)
    return Outcome(
        "batch-transform",
        assumption,
        f"Completed; {len(answered)} output lines for {len(lines)} inputs",
        ok,
        "" if ok else "compare the output with tests/server/test_live_batch_transform.py's contract",
    )


def prune_keeps_transform_model(lab: Lab) -> Outcome:
    """`promote prune --keep 0` on the endpoint while batch_transform is on."""
    assumption = (
        "promote prune leaves the stack's TransformModel, so decide-batch keeps working after clean-up"
    )
    failed = _batch_on(lab)
    if failed is not None:
        return Outcome("prune-keeps-transform-model", assumption, failed, None)
    model = lab.output(TRANSFORM_MODEL_OUTPUT)
    if model is None:
        observed = f"{ENDPOINT_STACK} has no {TRANSFORM_MODEL_OUTPUT} output with batch_transform on"
        return Outcome(
            "prune-keeps-transform-model", assumption, observed, False, "see stacks/endpoint_stack.py"
        )
    argv = ["prune", "--endpoint", lab.endpoint_name, "--keep", "0", *lab.aws_args]
    exit_code = lab.run_tool(tool_argv("promote", argv))
    try:
        lab.sagemaker.describe_model(ModelName=model)
    except ClientError as error:
        return Outcome(
            "prune-keeps-transform-model",
            assumption,
            f"promote prune exited {exit_code}; {model}: {_error(error)}",
            False,
            f"cdk deploy {ENDPOINT_STACK} -c cpu.batch_transform=false, then =true, recreates it; fix "
            "tools/cli/promote/prune.py",
        )
    return Outcome(
        "prune-keeps-transform-model",
        assumption,
        f"promote prune exited {exit_code}; {model} is still there",
        True,
    )


def batch_off_then_update(lab: Lab) -> Outcome:
    """batch_transform off, in the same deploy as a new endpoint config (a fleet that downloads the model)."""
    assumption = (
        "the archive lies outside the prefix the endpoint mounts, so a new fleet starts after "
        "batch_transform is turned off and its grant goes"
    )
    before = lab.wait_endpoint()["EndpointConfigName"]
    deploy = lab.deploy(BATCH_OFF_AND_NEW_CONFIG)
    endpoint = lab.wait_endpoint()
    observed = _observed(deploy, endpoint, before)
    moved = endpoint["EndpointStatus"] == "InService" and endpoint["EndpointConfigName"] != before
    if deploy.ok and moved:
        return Outcome("batch-off-then-update", assumption, observed, True)
    return Outcome(
        "batch-off-then-update",
        assumption,
        observed,
        False,
        "look for AccessDenied in the endpoint's FailureReason: an object under the model prefix the role "
        "no longer reads (buildspec/model.yml, decider_stacks.config.archive_key)",
    )


def _rolled_back(lab: Lab, scenario: str, assumption: str, deploy: Deploy, before: str) -> Outcome:
    """A deploy that must fail on the endpoint and roll back to a fleet serving the previous config."""
    endpoint = lab.wait_endpoint()
    observed = _observed(deploy, endpoint, before)
    serving = endpoint["EndpointStatus"] == "InService" and lab.on_config(endpoint, before)
    if deploy.status == "UPDATE_ROLLBACK_COMPLETE" and serving:
        return Outcome(scenario, assumption, observed, True)
    if deploy.ok:
        recover = (
            "the update went through: nothing failed it (see the endpoint's FailureReason and the rollback "
            f"alarms' history); deploy without this scenario's overrides to put {lab.endpoint_name} back"
        )
        return Outcome(scenario, assumption, observed, False, recover)
    if deploy.status == "UPDATE_ROLLBACK_FAILED" or not serving:
        return Outcome(scenario, assumption, observed, False, _continue_rollback(lab))
    return Outcome(scenario, assumption, observed, None)


def failed_model_upgrade(lab: Lab) -> Outcome:
    """A model upgrade whose model prefix is empty."""
    assumption = (
        "a failed model upgrade rolls back to the previous config, whose fleet still reads the previous "
        "model with the previous Model's (retained) role"
    )
    before = lab.wait_endpoint()["EndpointConfigName"]
    missing = f"s3://{lab.scratch.bucket}/{lab.scratch.work_prefix}missing-model/"
    deploy = lab.deploy({"cpu.model_s3_uri": missing})
    return _rolled_back(lab, "failed-model-upgrade", assumption, deploy, before)


def hanging_canary(lab: Lab) -> Outcome:
    """An image that answers /ping and hangs on /invocations."""
    assumption = (
        "a canary that hangs makes the bake load and the post-deploy check fail within their Lambdas' time "
        "and park the endpoint, so the rollback finishes (UPDATE_ROLLBACK_COMPLETE, not _FAILED)"
    )
    if lab.scratch.hanging_image is None:
        return Outcome(
            "hanging-canary",
            assumption,
            "not run: no --hanging-image (build one with tools/dev/gameday/hang/)",
            None,
        )
    before = lab.wait_endpoint()["EndpointConfigName"]
    deploy = lab.deploy({"cpu.image_uri": lab.scratch.hanging_image})
    return _rolled_back(lab, "hanging-canary", assumption, deploy, before)


def alarm_rollback_parks(lab: Lab) -> Outcome:
    """A new config whose own latency rollback alarm trips on the bake load's real traffic."""
    assumption = (
        "when SageMaker rolls an update back on an alarm, the post-deploy check sees the previous config "
        "live, fails the update and parks, so CloudFormation's rollback finishes"
    )
    before = lab.wait_endpoint()["EndpointConfigName"]
    deploy = lab.deploy(TRIPPED_ROLLBACK)
    return _rolled_back(lab, "alarm-rollback-parks", assumption, deploy, before)


# In this order: each starts from where the one before left the stack (refusals leave it as it was).
SCENARIOS: dict[str, Callable[[Lab], Outcome]] = {
    "second-deploy": second_deploy,
    "same-config-update": same_config_update,
    "signed-json-config": signed_json_config,
    "guard-refuses-early": guard_refuses_early,
    "rename-refused": rename_refused,
    "batch-transform": batch_transform,
    "prune-keeps-transform-model": prune_keeps_transform_model,
    "batch-off-then-update": batch_off_then_update,
    "failed-model-upgrade": failed_model_upgrade,
    "hanging-canary": hanging_canary,
    "alarm-rollback-parks": alarm_rollback_parks,
}
