"""The game day's scenarios: what the AWS documentation leaves open, tried on the scratch lab.

Each returns an `Outcome`: what the stacks assume, what happened, whether that settles the assumption
(True), contradicts it (False: `recover` says what to run or change) or could not be told (None).
docs/deploy.md lists each assumption as settled or open.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from decider_dev.gameday.lab import OTHER_INSTANCE, Lab, Variant

ROLLBACK_STATES = ("UPDATE_ROLLBACK_COMPLETE",)


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


def same_config_update(lab: Lab) -> Outcome:
    """UpdateEndpoint to the config the endpoint already runs."""
    assumption = (
        "SageMaker refuses UpdateEndpoint to the running config, so a rollback after SageMaker's own "
        "rollback needs the post-deploy check's parking (stacks/handlers/post_deploy_check.py)"
    )
    endpoint = lab.wait_endpoint()
    config = endpoint["EndpointConfigName"]
    try:
        lab.sagemaker.update_endpoint(EndpointName=lab.scratch.name, EndpointConfigName=config)
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


def guardrail_rollback_report(lab: Lab) -> Outcome:
    """What the CloudFormation Endpoint resource reports after SageMaker's auto-rollback."""
    assumption = (
        "after a blue/green update that SageMaker rolled back on an alarm, CloudFormation may report the "
        "update done while the endpoint runs the old config (hence Custom::PostDeployCheck)"
    )
    before = lab.wait_endpoint()["EndpointConfigName"]
    # The update also turns the rollback alarm to ALARM (missing data breaches): SageMaker's bake sees it.
    stack = lab.update(Variant(config="B", alarm_breaching=True))
    endpoint = lab.wait_endpoint()
    observed = _observed(stack, endpoint, before)
    if stack["StackStatus"] == "UPDATE_COMPLETE" and endpoint["EndpointConfigName"] == before:
        return Outcome("guardrail-rollback-report", assumption, observed, True)
    if stack["StackStatus"] in ROLLBACK_STATES:
        return Outcome(
            "guardrail-rollback-report",
            assumption,
            observed,
            False,
            "CloudFormation itself fails the update: the post-deploy check's config comparison is then a "
            "second guard; the parking still matters for the rollback that follows",
        )
    return Outcome("guardrail-rollback-report", assumption, observed, None)


def refused_update_rollback(lab: Lab) -> Outcome:
    """CloudFormation's rollback after SageMaker refuses UpdateEndpoint (an instance-type change while
    the variant is an autoscaling target, which the stacks' UpdateGuard refuses first)."""
    assumption = (
        "a refused UpdateEndpoint leaves the endpoint untouched and CloudFormation's rollback finishes "
        "(UPDATE_ROLLBACK_COMPLETE) even though the endpoint already runs the config it returns to"
    )
    before = lab.wait_endpoint()["EndpointConfigName"]
    stack = lab.update(Variant(config="C", instance_type=OTHER_INSTANCE))
    endpoint = lab.wait_endpoint()
    observed = _observed(stack, endpoint, before)
    if stack["StackStatus"] == "UPDATE_ROLLBACK_COMPLETE" and endpoint["EndpointConfigName"] == before:
        return Outcome("refused-update-rollback", assumption, observed, True)
    if stack["StackStatus"] == "UPDATE_ROLLBACK_FAILED":
        return Outcome(
            "refused-update-rollback",
            assumption,
            observed,
            False,
            f"aws cloudformation continue-update-rollback --stack-name {lab.scratch.name} "
            "--resources-to-skip Endpoint; then park refused updates too (post_deploy_check.park)",
        )
    return Outcome("refused-update-rollback", assumption, observed, None)


def failed_model_upgrade(lab: Lab) -> Outcome:
    """A model upgrade whose model cannot be downloaded, rolled back by CloudFormation."""
    assumption = (
        "a failed model upgrade rolls back to the previous config, whose fleet still reads the previous "
        "model with the previous Model's (retained) role"
    )
    before = lab.wait_endpoint()["EndpointConfigName"]
    missing = f"{lab.scratch.work_prefix}missing-model/"
    stack = lab.update(Variant(config="D", model_prefix=missing))
    endpoint = lab.wait_endpoint()
    observed = _observed(stack, endpoint, before)
    healthy = endpoint["EndpointStatus"] == "InService" and endpoint["EndpointConfigName"] == before
    if stack["StackStatus"] == "UPDATE_ROLLBACK_COMPLETE" and healthy:
        return Outcome("failed-model-upgrade", assumption, observed, True)
    return Outcome(
        "failed-model-upgrade",
        assumption,
        observed,
        False,
        f"aws cloudformation continue-update-rollback --stack-name {lab.scratch.name} --resources-to-skip "
        "Endpoint, then check the previous role's grants (docs/deploy.md, 'Rollbacks that finish')",
    )


def batch_transform(lab: Lab) -> Outcome:
    """A Batch Transform job of the ModelDataUrl model over a small JSON Lines file."""
    assumption = (
        "a Model on model.tar.gz (ModelDataUrl) runs Batch Transform over JSON Lines: one output line per "
        "input line (decide-batch's contract)"
    )
    scratch = lab.scratch
    request = {
        "state": "I was charged twice.",
        "questions": {"refund": {"type": "noul", "instructions": "Refund?"}},
    }
    lines = [json.dumps({"id": i, **request}) for i in range(2)]
    key = f"{scratch.work_prefix}batch/input/requests.jsonl"
    lab.clients["s3"].put_object(Bucket=scratch.bucket, Key=key, Body=("\n".join(lines) + "\n").encode())
    lab.objects.append(key)
    name = f"{scratch.name}-batch"
    output = f"s3://{scratch.bucket}/{scratch.work_prefix}batch/output/"
    lab.sagemaker.create_transform_job(
        TransformJobName=name,
        ModelName=lab.output("TransformModelName"),
        BatchStrategy="MultiRecord",
        TransformInput={
            "DataSource": {
                "S3DataSource": {
                    "S3DataType": "S3Prefix",
                    "S3Uri": f"s3://{scratch.bucket}/{scratch.work_prefix}batch/input/",
                }
            },
            "ContentType": "application/jsonlines",
            "SplitType": "Line",
        },
        TransformOutput={"S3OutputPath": output, "Accept": "application/jsonlines", "AssembleWith": "Line"},
        TransformResources={"InstanceType": scratch.instance_type, "InstanceCount": 1},
        DataProcessing={"JoinSource": "Input"},
    )
    job = _wait_job(lab, name)
    if job["TransformJobStatus"] != "Completed":
        return Outcome(
            "batch-transform",
            assumption,
            f"{job['TransformJobStatus']}: {job.get('FailureReason', '')}",
            False,
            f"aws sagemaker describe-transform-job --transform-job-name {name}; check the job's logs in "
            "/aws/sagemaker/TransformJobs and the model.tar.gz layout (docs/batch.md)",
        )
    out_key = f"{scratch.work_prefix}batch/output/requests.jsonl.out"
    lab.objects.append(out_key)
    body = lab.clients["s3"].get_object(Bucket=scratch.bucket, Key=out_key)["Body"].read().decode()
    answered = [json.loads(line) for line in body.splitlines() if line.strip()]
    ok = len(answered) == len(lines) and all("answers" in (a.get("SageMakerOutput") or {}) for a in answered)
    return Outcome(
        "batch-transform",
        assumption,
        f"Completed; {len(answered)} output lines for {len(lines)} inputs",
        ok,
        "" if ok else "compare the output with tests/server/test_live_batch_transform.py's contract",
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
    name = f"{lab.scratch.name}-json"
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
    lab.seen.add(("EndpointConfig", name))
    copied = lab.sagemaker.describe_endpoint_config(EndpointConfigName=name)
    same = [{k: v[k] for k in keep if k in v} for v in copied["ProductionVariants"]] == variants
    return Outcome("signed-json-config", assumption, f"created {name}; variants equal: {same}", same)


def _observed(stack: dict[str, Any], endpoint: dict[str, Any], before: str) -> str:
    config = endpoint["EndpointConfigName"]
    which = "the previous config" if config == before else f"config {config}"
    reason = endpoint.get("FailureReason") or "no FailureReason"
    return f"stack {stack['StackStatus']}; endpoint {endpoint['EndpointStatus']} on {which} ({reason})"


def _wait_job(lab: Lab, name: str) -> dict[str, Any]:
    for _ in range(lab.max_polls):
        job = lab.sagemaker.describe_transform_job(TransformJobName=name)
        if job["TransformJobStatus"] in ("Completed", "Failed", "Stopped"):
            return job
        lab.sleep(lab.poll_s)
    raise TimeoutError(f"{name} still running after {lab.max_polls} polls")


# In this order: the guardrail scenario leaves the stack's template and the endpoint apart, so it is last.
SCENARIOS = {
    "same-config-update": same_config_update,
    "signed-json-config": signed_json_config,
    "batch-transform": batch_transform,
    "refused-update-rollback": refused_update_rollback,
    "failed-model-upgrade": failed_model_upgrade,
    "guardrail-rollback-report": guardrail_rollback_report,
}
