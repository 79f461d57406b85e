"""How long the CI pipeline (buildspec/pipeline.yml) may run: the CodeBuild project's timeout must
cover it, or CodeBuild stops the build in the middle of a canary deploy.

    python -m decider_cli.promote.ci_budget          # minutes, from cdk.json (and -c overrides)

The build tests, builds both images, then deploys CpuStack and GpuStack one after the other. Each
deploy may last its blue/green update's MaximumExecutionTimeoutInSeconds, plus the post-deploy check
(a custom resource: at most PROVIDER_TOTAL_TIMEOUT_MINUTES) and a possible rollback of the same length
again. CodeBuild's own default timeout is 60 minutes, its maximum 2160 ("timeoutInMinutes", 5-2160,
https://docs.aws.amazon.com/codebuild/latest/APIReference/API_CreateProject.html).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from decider_stacks.config import PROVIDER_TOTAL_TIMEOUT_MINUTES, AppConfig, load_config
from decider_stacks.synth import context_with

TESTS_AND_IMAGES_MINUTES = 90  # make test, synth, diffs, both docker builds and pushes
CODEBUILD_MAX_MINUTES = 2160


def deploy_minutes(update_timeout_s: int) -> int:
    """One canary deploy at its worst: the update, the post-deploy check, then a rollback of the update."""
    update = math.ceil(update_timeout_s / 60)
    return 2 * update + PROVIDER_TOTAL_TIMEOUT_MINUTES


def pipeline_minutes(config: AppConfig) -> int:
    total = TESTS_AND_IMAGES_MINUTES + sum(
        deploy_minutes(variant.deployment.maximum_execution_timeout_s) for variant in (config.cpu, config.gpu)
    )
    return min(total, CODEBUILD_MAX_MINUTES)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ci-budget", description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--context", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    print(pipeline_minutes(load_config(context_with(args.context))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
