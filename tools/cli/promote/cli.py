"""`promote` command line: plan / apply / rollback / smoke / status / prune."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from botocore.exceptions import BotoCoreError, ClientError
from rich.console import Console
from rich.markup import escape

from decider_cli.promote import deploy, guards, live, render
from decider_cli.promote.clients import AwsClients, make_clients
from decider_cli.promote.errors import EXIT_OK, EXIT_REFUSED, DeploymentFailedError, PromoteError
from decider_cli.promote.prune import execute_prune, plan_prune
from decider_cli.promote.smoke import run_smoke
from decider_cli.promote.spec import (
    Overrides,
    Promotion,
    compute_promotion,
    parse_env_pairs,
    pick_variant,
    require_digest,
)

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--region", help="AWS region (default: the profile's / AWS_REGION)")
    parser.add_argument("--profile", help="AWS named profile")
    parser.add_argument("--endpoint", required=True, help="SageMaker endpoint name")


def _add_change_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--image", help="container image pinned by digest: <repo>@sha256:<64 hex>")
    parser.add_argument("--model-s3", help="s3://bucket/prefix/ (uncompressed) or s3://…/model.tar.gz")
    parser.add_argument("--instance-type", help="e.g. ml.c7i.xlarge")
    parser.add_argument("--count", type=int, help="initial instance count of the variant")
    parser.add_argument("--env", action="append", default=[], metavar="K=V", help="set a container env var")
    parser.add_argument(
        "--unset-env", action="append", default=[], metavar="K", help="remove a container env var"
    )
    parser.add_argument("--variant", help="production variant to change (needed when the config has several)")
    parser.add_argument(
        "--alarm",
        action="append",
        default=[],
        metavar="NAME",
        help="CloudWatch alarm for auto-rollback (repeat, 1-10)",
    )
    parser.add_argument(
        "--allow-firing-alarms",
        action="store_true",
        help="do not refuse when a rollback alarm is already in ALARM",
    )


def _add_wait_options(parser: argparse.ArgumentParser, *, default_timeout: int) -> None:
    parser.add_argument(
        "--timeout-minutes",
        type=int,
        default=default_timeout,
        help="how long to wait for the update (also MaximumExecutionTimeoutInSeconds)",
    )
    parser.add_argument("--poll-seconds", type=float, default=30.0, help="DescribeEndpoint polling interval")
    parser.add_argument("--skip-smoke", action="store_true", help="do not run the smoke tests afterwards")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="promote",
        description="Promote SageMaker endpoint configs with canary guardrails.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser(
        "plan", help="show the field-by-field change and check the guardrails; changes nothing"
    )
    _add_common(plan)
    _add_change_options(plan)

    apply = sub.add_parser("apply", help="create content-named model/config and UpdateEndpoint with a canary")
    _add_common(apply)
    _add_change_options(apply)
    _add_wait_options(apply, default_timeout=90)
    apply.add_argument("--canary-percent", type=int, default=10, help="canary capacity percent (1-50)")
    apply.add_argument(
        "--wait-minutes", type=int, default=10, help="canary bake time before full shift (0-60)"
    )
    apply.add_argument(
        "--no-auto-rollback", action="store_true", help="allow an update without rollback alarms"
    )
    apply.add_argument(
        "--no-rollback-on-smoke-failure",
        action="store_true",
        help="leave the new config live when the smoke tests fail",
    )
    apply.add_argument(
        "--force", action="store_true", help="break-glass: act on a CloudFormation-managed endpoint"
    )

    rollback = sub.add_parser("rollback", help="return to the config recorded as the rollback target")
    _add_common(rollback)
    _add_wait_options(rollback, default_timeout=60)
    rollback.add_argument(
        "--no-revert-on-smoke-failure",
        action="store_true",
        help="leave the rollback target live when its smoke tests fail",
    )
    rollback.add_argument(
        "--force", action="store_true", help="break-glass: act on a CloudFormation-managed endpoint"
    )

    smoke = sub.add_parser("smoke", help="one decision call and one chat call through sagemaker-runtime")
    _add_common(smoke)

    status = sub.add_parser("status", help="endpoint status, config, rollback target and owner")
    _add_common(status)

    prune = sub.add_parser("prune", help="delete old unused configs/models promote created for the endpoint")
    _add_common(prune)
    prune.add_argument(
        "--keep", type=int, required=True, help="unused configs to keep besides live + rollback"
    )
    prune.add_argument("--dry-run", action="store_true", help="only show what would be deleted")
    return parser


def _overrides(args: argparse.Namespace) -> Overrides:
    return Overrides(
        image=args.image,
        model_s3=args.model_s3,
        instance_type=args.instance_type,
        count=args.count,
        env=parse_env_pairs(args.env),
        unset_env=tuple(args.unset_env),
        variant=args.variant,
    )


def _promotion(clients: AwsClients, endpoint: live.LiveEndpoint, overrides: Overrides) -> Promotion:
    config = live.require_config(clients.sagemaker, endpoint.config_name)
    variant = pick_variant(config, overrides.variant)
    model = live.require_model(clients.sagemaker, variant["ModelName"])
    return compute_promotion(endpoint.name, config, model, overrides)


def cmd_plan(clients: AwsClients, args: argparse.Namespace) -> int:
    endpoint = live.describe_endpoint(clients.sagemaker, args.endpoint)
    render.show_endpoint(console, endpoint)
    overrides = _overrides(args)
    promotion = _promotion(clients, endpoint, overrides)
    render.show_plan(console, promotion)
    problems: list[PromoteError] = []
    checks = [
        ("image pinned by digest", lambda: require_digest(promotion.image)),
        ("endpoint idle", lambda: guards.require_idle(endpoint)),
    ]
    if args.alarm:
        checks.append(
            (
                "rollback alarms exist",
                lambda: guards.require_alarms(
                    clients.cloudwatch, args.alarm, allow_firing=args.allow_firing_alarms
                ),
            )
        )
    for label, check in checks:
        try:
            check()
            console.print(f"  [green]✓[/] {label}")
        except PromoteError as exc:
            console.print(f"  [red]✗[/] {label}: {escape(exc.message)}")
            problems.append(exc)
    if endpoint.cfn_stack:
        console.print(
            f"Owned by CloudFormation stack [bold]{endpoint.cfn_stack}[/]; promote it with:\n  "
            f"{escape(guards.cdk_command(endpoint.cfn_stack, overrides))}",
            soft_wrap=True,
        )
    if problems:
        raise problems[0]
    return EXIT_OK


def _settings(args: argparse.Namespace) -> deploy.GuardrailSettings:
    return deploy.GuardrailSettings(
        canary_percent=args.canary_percent,
        wait_minutes=args.wait_minutes,
        timeout_minutes=args.timeout_minutes,
        alarms=tuple(args.alarm),
        auto_rollback=not args.no_auto_rollback,
    )


def _require_owner_or_force(
    endpoint: live.LiveEndpoint, overrides: Overrides, args: argparse.Namespace, *, action: str
) -> None:
    """Refuse a CloudFormation-managed endpoint; with --force, go on but say what it costs."""
    guards.require_not_cfn_managed(endpoint, overrides, force=args.force, action=action)
    if endpoint.cfn_stack:
        console.print(
            f"[yellow]warning[/]: --force on an endpoint of stack {endpoint.cfn_stack}: this drifts the "
            "stack; the next `cdk deploy` returns the endpoint to the stack's config"
        )


def cmd_apply(clients: AwsClients, args: argparse.Namespace) -> int:
    endpoint = live.describe_endpoint(clients.sagemaker, args.endpoint)
    render.show_endpoint(console, endpoint)
    overrides = _overrides(args)
    _require_owner_or_force(endpoint, overrides, args, action="apply")
    guards.require_idle(endpoint)
    promotion = _promotion(clients, endpoint, overrides)
    require_digest(promotion.image)
    render.show_plan(console, promotion)
    take_count = args.count is not None
    if not promotion.changed:
        previous = deploy.in_flight_from(endpoint.tags, promotion.config_name)
        if previous is None:
            console.print("[green]Already live[/]: nothing created, no update started.")
            return EXIT_OK
        # An earlier apply's update finished after its caller stopped waiting (a CI timeout): what
        # it did not do yet, the smoke checks and the rollback target, is done now.
        console.print(
            f"[green]Already live[/] from an apply that did not finish ({previous} → "
            f"{promotion.config_name}): smoke checks and rollback target now"
        )
        return _after_update(clients, endpoint, promotion, previous, args, take_count=take_count)
    settings = _settings(args)
    if settings.auto_rollback:
        guards.require_alarms(
            clients.cloudwatch, list(settings.alarms), allow_firing=args.allow_firing_alarms
        )
    deploy_config = deploy.deployment_config(settings)

    _protect(clients, promotion.image)
    for created in deploy.ensure_resources(clients.sagemaker, promotion):
        console.print(f"created {created}")
    previous = endpoint.config_name
    deploy.mark_in_flight(clients.sagemaker, endpoint.arn, previous, promotion.config_name)
    deploy.start_update(
        clients.sagemaker, endpoint.name, promotion.config_name, deploy_config, take_count=take_count
    )
    console.print(
        f"UpdateEndpoint started: canary {settings.canary_percent}% for {settings.wait_minutes} min, "
        f"auto-rollback on {', '.join(settings.alarms) or 'nothing'}"
        + (f", instance count {args.count}" if take_count else "")
    )
    outcome = _wait(clients, endpoint.name, promotion.config_name, settings.alarms, args)
    _raise_unless_succeeded(outcome, endpoint.name)  # alarm rollback or timeout: no tag is touched
    return _after_update(clients, endpoint, promotion, previous, args, take_count=take_count)


def _after_update(
    clients: AwsClients,
    endpoint: live.LiveEndpoint,
    promotion: Promotion,
    previous: str,
    args: argparse.Namespace,
    *,
    take_count: bool,
) -> int:
    """The new config is live: smoke it, record the rollback target, or revert."""
    console.print(f"[green]Live[/]: {endpoint.name} runs {promotion.config_name}")
    # The rollback target is recorded only once the new config has proved itself (or is left live
    # on purpose): a failed apply must never make itself the target of `promote rollback`.
    if args.skip_smoke or _smoke_passes(clients, endpoint.name):
        _record_target(clients, endpoint, previous)
        deploy.clear_in_flight(clients.sagemaker, endpoint.arn)
        return EXIT_OK
    if args.no_rollback_on_smoke_failure:
        _record_target(clients, endpoint, previous)
        deploy.clear_in_flight(clients.sagemaker, endpoint.arn)
        raise DeploymentFailedError(
            "smoke_failed",
            "smoke tests failed; new config left live as asked",
            hint=f"promote rollback --endpoint {endpoint.name}  (returns to {previous})",
        )
    console.print(f"Smoke tests failed: reverting to {previous}")
    # the revert takes the previous config's count back when the apply changed it
    deploy.start_update(clients.sagemaker, endpoint.name, previous, None, take_count=take_count)
    back = _wait(clients, endpoint.name, previous, (), args)
    deploy.clear_in_flight(clients.sagemaker, endpoint.arn)
    if not back.succeeded:  # still on (or near) the failed config: let `promote rollback` finish the job
        _record_target(clients, endpoint, previous)
        raise DeploymentFailedError(
            "revert_failed",
            f"smoke tests failed on {promotion.config_name} and the revert to {previous} did not "
            f"complete ({back.status})",
            hint=f"promote rollback --endpoint {endpoint.name}  (returns to {previous})",
        )
    raise DeploymentFailedError(
        "smoke_failed",
        f"smoke tests failed on {promotion.config_name}; reverted to {previous}, which is live again "
        "(the rollback target is unchanged)",
    )


def cmd_rollback(clients: AwsClients, args: argparse.Namespace) -> int:
    endpoint = live.describe_endpoint(clients.sagemaker, args.endpoint)
    render.show_endpoint(console, endpoint)
    _require_owner_or_force(endpoint, Overrides(), args, action="rollback")
    guards.require_idle(endpoint)
    target = endpoint.rollback_config
    if not target:
        raise PromoteError(
            "no_rollback_target",
            f"endpoint {endpoint.name!r} has no {live.TAG_ROLLBACK} tag",
            hint="only endpoints promoted by `promote apply` record a rollback target",
        )
    if target == endpoint.config_name:
        console.print(f"[green]Already on the rollback target[/] {target}.")
        return EXIT_OK
    live.require_config(clients.sagemaker, target)
    left = endpoint.config_name
    deploy.start_update(clients.sagemaker, endpoint.name, target, None)
    console.print(f"UpdateEndpoint started: {left} → {target} (blue/green, all at once)")
    outcome = _wait(clients, endpoint.name, target, (), args)
    _raise_unless_succeeded(outcome, endpoint.name)
    if args.skip_smoke or _smoke_passes(clients, endpoint.name):
        _record_target(clients, endpoint, left)
        console.print(
            f"[green]Rolled back[/]: {endpoint.name} runs {target}; `promote rollback` again returns "
            f"to {left}"
        )
        return EXIT_OK
    if args.no_revert_on_smoke_failure:
        _record_target(clients, endpoint, left)
        raise DeploymentFailedError(
            "smoke_failed", f"smoke tests failed after rolling back to {target}; left live as asked"
        )
    console.print(f"Smoke tests failed on {target}: returning to {left}")
    deploy.start_update(clients.sagemaker, endpoint.name, left, None)
    back = _wait(clients, endpoint.name, left, (), args)
    if not back.succeeded:
        _record_target(clients, endpoint, left)
        raise DeploymentFailedError(
            "revert_failed",
            f"smoke tests failed on {target} and the return to {left} did not complete ({back.status})",
            hint=f"promote rollback --endpoint {endpoint.name}  (returns to {left})",
        )
    raise DeploymentFailedError(
        "smoke_failed",
        f"smoke tests failed on the rollback target {target}; returned to {left}, which is live again",
    )


def _record_target(clients: AwsClients, endpoint: live.LiveEndpoint, config_name: str) -> None:
    deploy.record_rollback_target(clients.sagemaker, endpoint.arn, config_name)
    console.print(f"rollback target: {config_name}")


def _protect(clients: AwsClients, image: str) -> None:
    """Tag the promoted image keep-<digest> so the ECR lifecycle never expires it (best effort)."""
    note = deploy.protect_image(clients.ecr, image)
    console.print(note if note.startswith("kept") else f"[yellow]warning[/]: {escape(note)}")


def cmd_smoke(clients: AwsClients, args: argparse.Namespace) -> int:
    if not _smoke_passes(clients, args.endpoint):
        raise PromoteError("smoke_failed", f"smoke tests failed on {args.endpoint}")
    return EXIT_OK


def cmd_status(clients: AwsClients, args: argparse.Namespace) -> int:
    render.show_endpoint(console, live.describe_endpoint(clients.sagemaker, args.endpoint))
    return EXIT_OK


def cmd_prune(clients: AwsClients, args: argparse.Namespace) -> int:
    if args.keep < 0:
        raise PromoteError("bad_keep", "--keep must be ≥ 0")
    try:
        endpoint: live.LiveEndpoint | None = live.describe_endpoint(clients.sagemaker, args.endpoint)
    except PromoteError as exc:
        if exc.code != "endpoint_not_found":
            raise
        endpoint = None
        console.print(
            f"endpoint {args.endpoint} does not exist: pruning the models and configs it left "
            "(a deleted stack retains them)"
        )
    plan = plan_prune(clients.sagemaker, args.endpoint, endpoint, args.keep, clients.cloudformation)
    render.show_prune(console, plan, dry_run=args.dry_run)
    if not args.dry_run:
        execute_prune(clients.sagemaker, plan)
        console.print(f"deleted {len(plan.delete_configs)} config(s), {len(plan.delete_models)} model(s)")
    return EXIT_OK


def _wait(
    clients: AwsClients, endpoint: str, target: str, alarms: tuple[str, ...], args: argparse.Namespace
) -> deploy.Outcome:
    return deploy.wait_for_update(
        clients.sagemaker,
        clients.cloudwatch,
        endpoint,
        target,
        alarms=alarms,
        timeout_s=args.timeout_minutes * 60,
        poll_s=args.poll_seconds,
        console=console,
    )


def _raise_unless_succeeded(outcome: deploy.Outcome, endpoint: str) -> None:
    if outcome.succeeded:
        return
    reason = outcome.failure_reason or "no FailureReason given"
    if outcome.firing_alarms:
        reason += f"; alarms in ALARM: {', '.join(outcome.firing_alarms)}"
    if outcome.timed_out:
        raise DeploymentFailedError(
            "update_timeout",
            f"{endpoint} still {outcome.status} after the timeout ({reason})",
            hint=f"watch it with `promote status --endpoint {endpoint}`",
        )
    if outcome.rolled_back:
        raise DeploymentFailedError(
            "rolled_back",
            f"update rolled back: {endpoint} is on {outcome.config_name}, not "
            f"{outcome.target_config} ({reason})",
        )
    raise DeploymentFailedError("update_failed", f"{endpoint} is {outcome.status} ({reason})")


def _smoke_passes(clients: AwsClients, endpoint: str) -> bool:
    results = run_smoke(clients.runtime, endpoint)
    render.show_smoke(console, results)
    return all(result.ok for result in results)


COMMANDS = {
    "plan": cmd_plan,
    "apply": cmd_apply,
    "rollback": cmd_rollback,
    "smoke": cmd_smoke,
    "status": cmd_status,
    "prune": cmd_prune,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        clients = make_clients(args.region, args.profile)
        return COMMANDS[args.command](clients, args)
    except PromoteError as exc:
        render.show_error(err_console, exc)
        return exc.exit_code
    except ClientError as exc:
        error = exc.response.get("Error", {})
        render.show_error(err_console, PromoteError(f"aws_{error.get('Code', 'error')}", str(exc)))
        return EXIT_REFUSED
    except BotoCoreError as exc:
        render.show_error(err_console, PromoteError("aws_client_error", str(exc)))
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
