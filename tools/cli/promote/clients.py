"""boto3 clients with retry settings shared by every command.

botocore reads `AWS_ENDPOINT_URL` (and `AWS_ENDPOINT_URL_<SERVICE>`) itself since 1.31.x, so pointing
`promote` at a local emulator needs no flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import boto3
import botocore.loaders
import botocore.session
from botocore.config import Config
from botocore.exceptions import NoRegionError, ProfileNotFound

from decider_cli.promote.errors import PromoteError
from decider_stacks.handlers.runtime_client import runtime_client

# Adaptive mode adds client-side rate limiting on top of standard retries (throttling, 5xx, timeouts).
CONTROL_PLANE_CONFIG = Config(
    retries={"mode": "adaptive", "max_attempts": 8},
    connect_timeout=10,
    read_timeout=60,
    user_agent_extra="promote/0.1",
)
# sagemaker-runtime: the deploy-time handlers' client (70 s read timeout, standard retries;
# stacks/handlers/runtime_client.py), with more attempts: no Lambda times `promote` out. 4 in all, as
# before (botocore's `max_attempts: 3` counts retries only).
RUNTIME_MAX_ATTEMPTS = 4


@cache
def _shared_loader() -> botocore.loaders.Loader:
    """One service-model loader per process: the SageMaker model is large and `main()` may run many times."""
    return botocore.loaders.create_loader()


@dataclass(frozen=True)
class AwsClients:
    sagemaker: Any
    runtime: Any
    cloudwatch: Any
    ecr: Any
    cloudformation: Any
    region: str


def make_clients(region: str | None, profile: str | None) -> AwsClients:
    """Build the clients from one session; errors become PromoteError with a hint."""
    try:
        core = botocore.session.Session(profile=profile)
        core.register_component("data_loader", _shared_loader())
        session = boto3.Session(botocore_session=core, region_name=region)
        if not session.region_name:
            raise PromoteError(
                "no_region",
                "no AWS region configured",
                hint="pass --region or set AWS_REGION / AWS_DEFAULT_REGION",
            )
        return AwsClients(
            sagemaker=session.client("sagemaker", config=CONTROL_PLANE_CONFIG),
            runtime=runtime_client(
                session, max_attempts=RUNTIME_MAX_ATTEMPTS, user_agent_extra="promote/0.1"
            ),
            cloudwatch=session.client("cloudwatch", config=CONTROL_PLANE_CONFIG),
            ecr=session.client("ecr", config=CONTROL_PLANE_CONFIG),
            cloudformation=session.client("cloudformation", config=CONTROL_PLANE_CONFIG),
            region=session.region_name,
        )
    except ProfileNotFound as exc:
        raise PromoteError("profile_not_found", str(exc), hint="check --profile / AWS_PROFILE") from exc
    except NoRegionError as exc:
        raise PromoteError("no_region", str(exc)) from exc
