"""`decide-batch`: decisions in bulk with SageMaker Batch Transform, over JSON Lines.

    decide-batch submit --variant cpu --input s3://bucket/tickets/ --output s3://bucket/decided/ --wait
    decide-batch status decide-cpu-20261201-120000 [--wait]
    decide-batch fetch  decide-cpu-20261201-120000 [--dest out/]
    decide-batch local  --url http://127.0.0.1:8080 --input tickets.jsonl --output decided.jsonl
    decide-batch async  --variant cpu --input request.json --wait      # an invocation=async endpoint

Each input line is one decision request (`/v1/systemone`; extra fields such as an `id` are kept by
the join). `submit` starts a transform job from the variant's Batch Transform Model (the stack
output `TransformModelName`; a Model loading its data through ModelDataSource is refused) on the
variant's instance type; `status` prints progress (input objects written);
`fetch` downloads the output and summarises it (answered, per-record errors by code, decisions per
second). `local` runs the same contract against a local server or container with the stand-in of
the service (`decider_cli.batch.standin`). Deployed with `-c <variant>.batch_transform=true`, the stack's
execution role (which the job runs as) may read `s3://<artifacts bucket>/batch/<endpoint>/input/` and
write `…/batch/<endpoint>/output/` (docs/batch.md); other locations need a grant of their own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from decider_cli.batch.async_job import artifacts_bucket, input_uri, wait_for_answer
from decider_cli.batch.async_job import submit as submit_async
from decider_cli.batch.jobs import (
    DEFAULT_TIMEOUT_SECONDS,
    BatchError,
    JobSpec,
    check_transformable,
    default_job_name,
    fetch,
    gpu_transform_ami,
    progress,
    summarize,
    transform_job_request,
    transform_model_of_stack,
)
from decider_cli.batch.standin import TransformFailedError, run_local_transform
from decider_stacks.config import VARIANTS, ConfigError, load_config
from decider_stacks.synth import context_with

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
CLIENT_CONFIG = Config(retries={"mode": "adaptive", "max_attempts": 8}, user_agent_extra="decide-batch/0.1")
POLL_SECONDS = 30.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decide-batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--region", help="AWS region (default: the profile's / AWS_REGION)")
    parser.add_argument("--profile", help="AWS named profile")
    commands = parser.add_subparsers(dest="command", required=True)

    submit = commands.add_parser("submit", help="start a transform job from the variant's Model")
    submit.add_argument("--variant", choices=VARIANTS, required=True)
    submit.add_argument("--input", required=True, help="s3:// prefix of JSON Lines objects")
    submit.add_argument("--output", required=True, help="s3:// prefix for the .out objects")
    submit.add_argument("--job-name", help="default decide-<variant>-<UTC time>")
    submit.add_argument(
        "--model", help="a Model on a ModelDataUrl .tar.gz (default: the stack's output TransformModelName)"
    )
    submit.add_argument("--instance-type", help="default: the variant's instance_type")
    submit.add_argument("--instance-count", type=int, default=1)
    submit.add_argument(
        "--timeout", type=int, default=DEFAULT_TIMEOUT_SECONDS, help="per invocation, 1-3600 s"
    )
    submit.add_argument("--max-retries", type=int, default=1, help="per invocation, 0-3")
    submit.add_argument("--max-payload-mb", type=int, help="default: the container's /execution-parameters")
    submit.add_argument("--no-join", action="store_true", help="JoinSource=None: output lines alone")
    submit.add_argument(
        "--wait", action="store_true", help="print progress until the job ends, then summarise"
    )
    submit.add_argument("-c", "--context", action="append", default=[], metavar="KEY=VALUE")

    status = commands.add_parser("status", help="status and progress of a job")
    status.add_argument("job")
    status.add_argument("--wait", action="store_true")

    fetch_cmd = commands.add_parser("fetch", help="download and summarise a Completed job's output")
    fetch_cmd.add_argument("job")
    fetch_cmd.add_argument("--dest", type=Path, help="write the .out objects under this directory")
    fetch_cmd.add_argument("--json", action="store_true", help="print the summary as JSON")

    one = commands.add_parser("async", help="one request file through an async endpoint (invocation=async)")
    target = one.add_mutually_exclusive_group(required=True)
    target.add_argument("--variant", choices=VARIANTS)
    target.add_argument("--endpoint", help="an async endpoint's name")
    one.add_argument("--input", type=Path, required=True, help="the request body (JSON)")
    one.add_argument("--route", default="/v1/systemone", help="the container route (CustomAttributes)")
    one.add_argument(
        "--input-location", help="s3:// key to upload to (default: the artifacts bucket's async/)"
    )
    one.add_argument(
        "--timeout", type=int, help="InvocationTimeoutSeconds (default: the variant's, else 3600)"
    )
    one.add_argument("--wait", action="store_true", help="wait for the answer and print it")
    one.add_argument("-c", "--context", action="append", default=[], metavar="KEY=VALUE")

    local = commands.add_parser("local", help="run the Batch Transform contract against a local server")
    local.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8080")
    local.add_argument("--input", type=Path, required=True)
    local.add_argument("--output", type=Path, required=True)
    local.add_argument("--no-join", action="store_true")
    local.add_argument("--max-payload-mb", type=int)
    local.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT_SECONDS)
    return parser


def make_clients(region: str | None, profile: str | None) -> dict[str, Any]:
    session = boto3.Session(region_name=region, profile_name=profile)
    if not session.region_name:
        raise BatchError("no AWS region: pass --region or set AWS_REGION")
    return {
        name: session.client(name, config=CLIENT_CONFIG)
        for name in ("sagemaker", "s3", "sagemaker-runtime", "sts", "cloudformation")
    }


def wait(
    clients: dict[str, Any],
    name: str,
    out: Callable[[str], None],
    *,
    poll_seconds: float = POLL_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    last = ""
    while True:
        state = progress(clients["sagemaker"], clients["s3"], name)
        if state.line() != last:
            out(f"{name}: {state.line()}")
            last = state.line()
        if state.done:
            return state.status
        sleep(poll_seconds)


def _summarise(
    clients: dict[str, Any], name: str, out: Callable[[str], None], dest: Path | None = None
) -> None:
    summary, objects = fetch(clients["sagemaker"], clients["s3"], name)
    for line in summary.lines():
        out(line)
    if dest is not None:
        for key, data in objects:
            target = dest / key
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        out(f"{len(objects)} output objects written under {dest}")


def _submit(args: argparse.Namespace, clients: dict[str, Any], out: Callable[[str], None]) -> int:
    variant = load_config(context_with(args.context)).variant(args.variant)
    model_name = args.model or transform_model_of_stack(clients["cloudformation"], args.variant)
    check_transformable(clients["sagemaker"], model_name)
    instance_type = args.instance_type or variant.instance_type
    spec = JobSpec(
        name=args.job_name or default_job_name(args.variant),
        model_name=model_name,
        input_uri=args.input,
        output_uri=args.output,
        instance_type=instance_type,
        instance_count=args.instance_count,
        timeout_seconds=args.timeout,
        max_retries=args.max_retries,
        max_payload_mb=args.max_payload_mb,
        join_input=not args.no_join,
        tags={"decide-batch:variant": args.variant, "promote:endpoint": variant.endpoint_name},
        ami_version=gpu_transform_ami(instance_type, variant.cuda_architectures),
    )
    clients["sagemaker"].create_transform_job(**transform_job_request(spec))
    out(f"started {spec.name}: model {model_name} on {spec.instance_count} x {spec.instance_type}")
    if not args.wait:
        out(f"follow it with: decide-batch status {spec.name} --wait")
        return EXIT_OK
    status = wait(clients, spec.name, out)
    if status != "Completed":
        return EXIT_FAILED
    _summarise(clients, spec.name, out)
    return EXIT_OK


def _async(args: argparse.Namespace, clients: dict[str, Any], out: Callable[[str], None]) -> int:
    config = load_config(context_with(args.context))
    timeout = args.timeout or DEFAULT_TIMEOUT_SECONDS
    endpoint = args.endpoint
    if args.variant:
        variant = config.variant(args.variant)
        if variant.invocation != "async":
            raise BatchError(
                f"the {args.variant} variant is real-time; deploy it with -c {args.variant}.invocation=async"
            )
        endpoint = variant.endpoint_name
        timeout = args.timeout or variant.async_inference.invocation_timeout_s
    location = args.input_location
    if location is None:
        account = clients["sts"].get_caller_identity()["Account"]
        region = clients["s3"].meta.region_name
        location = input_uri(artifacts_bucket(config.project, account, region), endpoint)
    invocation = submit_async(
        clients["sagemaker-runtime"],
        clients["s3"],
        endpoint=endpoint,
        body=args.input.read_bytes(),
        location=location,
        route=args.route,
        timeout_seconds=timeout,
    )
    out(
        f"submitted {invocation.inference_id or '(no id)'}: "
        f"{invocation.input_location} -> {invocation.output_location}"
    )
    if not args.wait:
        return EXIT_OK
    ok, body = wait_for_answer(clients["s3"], invocation, timeout_seconds=timeout + 120)
    out(body.decode(errors="replace"))
    return EXIT_OK if ok else EXIT_FAILED


def _local(args: argparse.Namespace, out: Callable[[str], None]) -> int:
    result = run_local_transform(
        args.url,
        args.input.read_bytes(),
        join_input=not args.no_join,
        max_payload_mb=args.max_payload_mb,
        timeout_seconds=args.timeout,
    )
    args.output.write_bytes(result.output)
    out(
        f"{len(result.lines)} records in {result.invocations} invocations "
        f"(parameters {json.dumps(result.parameters, sort_keys=True)}) -> {args.output}"
    )
    for line in summarize(result.lines, joined=not args.no_join, seconds=result.seconds).lines():
        out(line)
    return EXIT_OK


def main(argv: Sequence[str] | None = None, clients: dict[str, Any] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def out(line: str) -> None:
        print(line, flush=True)

    try:
        if args.command == "local":
            return _local(args, out)
        clients = clients or make_clients(args.region, args.profile)
        if args.command == "submit":
            return _submit(args, clients, out)
        if args.command == "async":
            return _async(args, clients, out)
        if args.command == "status":
            if args.wait:
                return EXIT_OK if wait(clients, args.job, out) == "Completed" else EXIT_FAILED
            state = progress(clients["sagemaker"], clients["s3"], args.job)
            out(f"{args.job}: {state.line()}")
            return EXIT_OK if state.status != "Failed" else EXIT_FAILED
        if args.json:
            summary, _ = fetch(clients["sagemaker"], clients["s3"], args.job)
            out(json.dumps(summary.as_dict(), sort_keys=True))
            return EXIT_OK
        _summarise(clients, args.job, out, args.dest)
        return EXIT_OK
    except (BatchError, ConfigError) as exc:
        print(f"decide-batch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TransformFailedError as exc:
        print(f"decide-batch: the job would fail on SageMaker: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (ClientError, BotoCoreError) as exc:
        print(f"decide-batch: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
