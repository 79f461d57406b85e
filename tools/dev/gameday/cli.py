"""`python -m decider_dev.gameday` (`make game-day`): the game day's scenarios on the app's own stacks,
in a scratch account.

    make game-day ACCOUNT=123456789012 REGION=eu-west-1 BUCKET=scratch-bucket \\
        IMAGE=123456789012.dkr.ecr.eu-west-1.amazonaws.com/decider@sha256:…

It uploads the bundled SmolLM2 to `s3://BUCKET/gameday/<run id>/model/` (and its Batch Transform
archive beside it), deploys ImageStack and CpuStack with the CDK CLI on the smallest CPU instance
(tools/dev/gameday/lab.py: only names, sizes and the prebuilt image and model are overridden), runs the
scenarios (tools/dev/gameday/scenarios.py), deletes both stacks and what they retained, and prints each
outcome against what the stacks assume, with the command to recover when an assumption is wrong. It
refuses to run when the credentials are for another account, where the app's stacks are deployed, or
where CDK is not bootstrapped. It costs about three instance-hours of the smallest type plus a
transform job.

Exit status: 0 when every assumption holds, 1 when one is wrong or could not be told, 2 on bad input.
"""

from __future__ import annotations

import argparse
import re
import secrets
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from decider.engine.model.bundled import SMOLLM2_FILE
from decider_dev.gameday.lab import (
    APP_STACKS,
    SMALLEST_INSTANCE,
    Cdk,
    Deploy,
    Lab,
    Scratch,
    describe_stack,
)
from decider_dev.gameday.scenarios import SCENARIOS, Outcome
from decider_stacks.config import IMAGE_URI_RE
from decider_stacks.handlers.sagemaker_json import SageMakerJson

EXIT_OK, EXIT_WRONG, EXIT_USAGE = 0, 1, 2
SERVICES = ("sts", "cloudformation", "sagemaker", "s3", "iam", "ecr")
BOOTSTRAP_STACK = "CDKToolkit"  # `cdk bootstrap`'s stack: cdk deploy uploads the handlers' assets there
HANGING = "hanging-canary"
BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


class GameDayError(Exception):
    """A reason not to run (the message says which)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="game-day", description=__doc__.split("\n\n")[0])
    parser.add_argument("--account", required=True, help="the scratch account's id (checked against STS)")
    parser.add_argument("--region", required=True)
    parser.add_argument("--profile")
    parser.add_argument("--image", required=True, help="the serving image, <repo>@sha256:<digest>")
    parser.add_argument("--bucket", required=True, help="a scratch bucket the model is uploaded to")
    parser.add_argument(
        "--hanging-image",
        help="an image that answers /ping and hangs on /invocations (tools/dev/gameday/hang/), "
        "for the hanging-canary scenario",
    )
    parser.add_argument("--instance-type", default=SMALLEST_INSTANCE)
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="default: all")
    return parser


def _exists(clients: dict[str, Any], name: str) -> bool:
    stack = describe_stack(clients["cloudformation"], name)
    return stack is not None and stack["StackStatus"] != "DELETE_COMPLETE"


def check_account(clients: dict[str, Any], scratch: Scratch) -> None:
    caller = clients["sts"].get_caller_identity()["Account"]
    if caller != scratch.account:
        raise GameDayError(
            f"the credentials are for account {caller}, not the scratch account {scratch.account}"
        )
    for name in APP_STACKS:
        if _exists(clients, name):
            raise GameDayError(
                f"{scratch.account} runs the app ({name} exists): a game day runs in a scratch account"
            )
    if not _exists(clients, BOOTSTRAP_STACK):
        raise GameDayError(
            f"{scratch.account} is not bootstrapped for CDK in {scratch.region}: run "
            f"npx cdk bootstrap aws://{scratch.account}/{scratch.region} first"
        )
    # SageMaker reads model data only from a bucket in the endpoint's region; GetBucketLocation
    # answers no LocationConstraint for us-east-1.
    try:
        location = clients["s3"].get_bucket_location(Bucket=scratch.bucket).get("LocationConstraint")
    except ClientError as error:
        raise GameDayError(f"s3://{scratch.bucket}: {error}") from None
    if (location or "us-east-1") != scratch.region:
        raise GameDayError(
            f"s3://{scratch.bucket} is in {location or 'us-east-1'}; the game day runs in {scratch.region}, "
            "and SageMaker reads model data only from a bucket in its own region"
        )


def run(lab: Lab, names: Sequence[str], gguf: Path, out: Callable[[str], None]) -> list[Outcome]:
    """Stage the model, deploy the stacks, run the scenarios in order, always tear down."""
    outcomes: list[Outcome] = []
    try:
        out(f"uploading {lab.scratch.model_file} to {lab.scratch.model_s3_uri} …")
        lab.stage_model(gguf)
        out(f"deploying ImageStack and CpuStack ({lab.scratch.name} on {lab.scratch.instance_type}) …")
        created = lab.create()
        outcomes.append(first_deploy(created))
        if not created.ok:
            return outcomes
        for name in names:
            out(f"scenario {name} …")
            try:
                outcomes.append(SCENARIOS[name](lab))
            except (ClientError, BotoCoreError, TimeoutError) as error:
                outcomes.append(
                    Outcome(name, SCENARIOS[name].__doc__ or name, f"could not run: {error}", None)
                )
    finally:
        out("tearing down both stacks and what they retained …")
        for problem in lab.teardown():
            out(f"  left behind: {problem}")
    return outcomes


def first_deploy(created: Deploy) -> Outcome:
    return Outcome(
        "first-deploy",
        "ImageStack and CpuStack deploy into a bootstrapped account with a prebuilt image and model",
        f"{created.line}; {created.reason}" if created.reason else created.line,
        created.ok,
        "" if created.ok else "the stacks' events name the failed resource; the scenarios did not run",
    )


def report(outcomes: list[Outcome], out: Callable[[str], None]) -> None:
    for outcome in outcomes:
        out(f"[{outcome.verdict}] {outcome.scenario}")
        out(f"    assumed:  {outcome.assumption}")
        out(f"    observed: {outcome.observed}")
        if outcome.settled is not True and outcome.recover:
            out(f"    recover:  {outcome.recover}")


def scenario_names(
    asked: list[str] | None, hanging_image: str | None, out: Callable[[str], None]
) -> list[str]:
    """The scenarios to run: those asked for, else all; `hanging-canary` needs a hanging image."""
    if asked and HANGING in asked and hanging_image is None:
        raise GameDayError(f"{HANGING} needs --hanging-image (tools/dev/gameday/hang/)")
    if asked:
        return asked
    if hanging_image is None:
        out(f"{HANGING} skipped: no --hanging-image (tools/dev/gameday/hang/)")
        return [name for name in SCENARIOS if name != HANGING]
    return list(SCENARIOS)


def bundled_model() -> Path:
    """The bundled SmolLM2 GGUF, its sha256 checked."""
    from decider.engine.model.bundled import BundledModelError, smollm2_path

    try:
        return smollm2_path()
    except BundledModelError as error:
        raise GameDayError(f"the bundled model: {error}") from None


def main(
    argv: Sequence[str] | None = None,
    clients: dict[str, Any] | None = None,
    lab_options: dict[str, Any] | None = None,
) -> int:
    args = build_parser().parse_args(argv)

    def out(line: str) -> None:
        print(line, flush=True)

    images = [args.image, *([args.hanging_image] if args.hanging_image else [])]
    if not all(IMAGE_URI_RE.match(image) for image in images) or not BUCKET_RE.match(args.bucket):
        print(
            "game-day: --image and --hanging-image must be <repo>@sha256:<digest>, --bucket a bucket name",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        names = scenario_names(args.scenario, args.hanging_image, out)
        scratch = Scratch(
            run_id=secrets.token_hex(3),
            account=args.account,
            region=args.region,
            image=args.image,
            bucket=args.bucket,
            model_file=SMOLLM2_FILE,
            instance_type=args.instance_type,
            hanging_image=args.hanging_image,
        )
        if clients is None:
            session = boto3.Session(region_name=args.region, profile_name=args.profile)
            clients = {name: session.client(name) for name in SERVICES}
            clients["sagemaker-json"] = SageMakerJson(session)
        check_account(clients, scratch)
        gguf = bundled_model()
        lab = Lab(clients, scratch, Cdk(args.region, args.profile), **(lab_options or {}))
        outcomes = run(lab, names, gguf, out)
    except GameDayError as error:
        print(f"game-day: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (ClientError, BotoCoreError) as error:
        print(f"game-day: {error}", file=sys.stderr)
        return EXIT_WRONG
    report(outcomes, out)
    return EXIT_OK if outcomes and all(o.settled is True for o in outcomes) else EXIT_WRONG
