"""`python -m decider_dev.gameday` (`make game-day`): run the game day's scenarios in a scratch account.

    make game-day ACCOUNT=123456789012 REGION=eu-west-1 \\
        IMAGE=123456789012.dkr.ecr.eu-west-1.amazonaws.com/decider@sha256:… \\
        MODEL_S3_URI=s3://scratch-bucket/models/smol/

It creates one stack `gameday-<run id>` on the smallest CPU instance (tools/dev/gameday/lab.py), runs the
scenarios (tools/dev/gameday/scenarios.py), deletes the stack and what it retained, and prints each outcome
against what the stacks assume, with the command to recover when an assumption is wrong. It refuses to
run when the credentials are for another account, or in an account where the app's stacks are deployed.
It costs about two instance-hours of the smallest type plus a transform job.

Exit status: 0 when every assumption holds, 1 when one is wrong or could not be told, 2 on bad input.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Callable, Sequence
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from decider_dev.gameday.lab import SMALLEST_INSTANCE, Lab, Scratch
from decider_dev.gameday.scenarios import SCENARIOS, Outcome
from decider_stacks.config import IMAGE_URI_RE, S3_PREFIX_RE, load_config
from decider_stacks.handlers.sagemaker_json import SageMakerJson
from decider_stacks.synth import cdk_json_context

EXIT_OK, EXIT_WRONG, EXIT_USAGE = 0, 1, 2
APP_STACKS = ("ImageStack", "CpuStack", "GpuStack")
SERVICES = ("sts", "cloudformation", "sagemaker", "s3", "iam", "cloudwatch")


class GameDayError(Exception):
    """A reason not to run (the message says which)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="game-day", description=__doc__.split("\n\n")[0])
    parser.add_argument("--account", required=True, help="the scratch account's id (checked against STS)")
    parser.add_argument("--region", required=True)
    parser.add_argument("--profile")
    parser.add_argument("--image", required=True, help="the serving image, <repo>@sha256:<digest>")
    parser.add_argument(
        "--model-s3-uri", required=True, help="s3://bucket/prefix/ with the GGUF and model.tar.gz"
    )
    parser.add_argument("--model-file", help="the GGUF's name in the prefix (default: cdk.json's model.file)")
    parser.add_argument("--instance-type", default=SMALLEST_INSTANCE)
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="default: all")
    return parser


def check_account(clients: dict[str, Any], account: str) -> None:
    caller = clients["sts"].get_caller_identity()["Account"]
    if caller != account:
        raise GameDayError(f"the credentials are for account {caller}, not the scratch account {account}")
    for name in APP_STACKS:
        try:
            stacks = clients["cloudformation"].describe_stacks(StackName=name)["Stacks"]
        except ClientError:
            continue
        if stacks and stacks[0]["StackStatus"] != "DELETE_COMPLETE":
            raise GameDayError(
                f"{account} runs the app ({name} exists): a game day runs in a scratch account"
            )


def run(lab: Lab, names: Sequence[str], out: Callable[[str], None]) -> list[Outcome]:
    """Create the lab, run the scenarios in order, always tear down; one Outcome per scenario."""
    outcomes: list[Outcome] = []
    try:
        out(f"creating {lab.scratch.name} on {lab.scratch.instance_type} …")
        stack = lab.create()
        if stack["StackStatus"] != "CREATE_COMPLETE":
            raise GameDayError(f"{lab.scratch.name} ended {stack['StackStatus']}: see its events")
        for name in names:
            out(f"scenario {name} …")
            try:
                outcomes.append(SCENARIOS[name](lab))
            except (ClientError, BotoCoreError, TimeoutError) as error:
                outcomes.append(
                    Outcome(name, SCENARIOS[name].__doc__ or name, f"could not run: {error}", None)
                )
    finally:
        out(f"tearing down {lab.scratch.name} …")
        for problem in lab.teardown():
            out(f"  left behind: {problem}")
    return outcomes


def report(outcomes: list[Outcome], out: Callable[[str], None]) -> None:
    for outcome in outcomes:
        out(f"[{outcome.verdict}] {outcome.scenario}")
        out(f"    assumed:  {outcome.assumption}")
        out(f"    observed: {outcome.observed}")
        if outcome.settled is not True and outcome.recover:
            out(f"    recover:  {outcome.recover}")


def main(
    argv: Sequence[str] | None = None, clients: dict[str, Any] | None = None, lab_options: dict | None = None
) -> int:
    args = build_parser().parse_args(argv)

    def out(line: str) -> None:
        print(line, flush=True)

    if not IMAGE_URI_RE.match(args.image) or not S3_PREFIX_RE.match(args.model_s3_uri):
        print(
            "game-day: --image must be <repo>@sha256:<digest>, --model-s3-uri s3://bucket/prefix/",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        if clients is None:
            session = boto3.Session(region_name=args.region, profile_name=args.profile)
            clients = {name: session.client(name) for name in SERVICES}
            clients["sagemaker-json"] = SageMakerJson(session)
        check_account(clients, args.account)
        scratch = Scratch(
            run_id=secrets.token_hex(3),
            image=args.image,
            model_s3_uri=args.model_s3_uri,
            model_file=args.model_file or load_config(cdk_json_context()).model.file,
            instance_type=args.instance_type,
        )
        outcomes = run(Lab(clients, scratch, **(lab_options or {})), args.scenario or list(SCENARIOS), out)
    except GameDayError as error:
        print(f"game-day: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (ClientError, BotoCoreError) as error:
        print(f"game-day: {error}", file=sys.stderr)
        return EXIT_WRONG
    report(outcomes, out)
    return EXIT_OK if outcomes and all(o.settled is True for o in outcomes) else EXIT_WRONG
