#!/usr/bin/env python3
"""CDK entry point (`npx cdk synth|diff|deploy`): ImageStack, CpuStack, GpuStack.

Configuration lives in cdk.json's context; override any key with `-c`, e.g.
`npx cdk deploy CpuStack -c cpu.instance_type=ml.c7i.2xlarge`. A bad value stops the synth with
one line per problem (exit status 2) before any construct is created.
"""

from __future__ import annotations

import sys
from typing import Any

from decider_stacks.config import ConfigError


def main(context: dict[str, Any] | None = None) -> int:
    """Synthesize the app; `context` adds to what the CDK CLI passes (used by the tests)."""
    from aws_cdk import App

    from decider_stacks.assembly import build_app

    try:
        decider = build_app(App(context=context) if context else None)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    decider.app.synth()
    return 0


if __name__ == "__main__":
    sys.exit(main())
