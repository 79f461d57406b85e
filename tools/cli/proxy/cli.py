"""`decider-proxy --endpoint NAME [--region R] [--port P]`: the container's API on localhost, in
front of a SageMaker endpoint (a sidecar, in the way of aws-sigv4-proxy).

    decider-proxy --endpoint decider-cpu --region eu-west-1 --port 8080 &
    openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="unused").decisions.create(...)

Credentials come from botocore's standard chain (environment, profile, SSO, instance role);
`AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME` overrides the runtime endpoint (a local stand-in in tests).
It binds to 127.0.0.1 by default: anything that can reach the port calls the endpoint with these
credentials.
"""

from __future__ import annotations

import argparse
import logging
import sys

from botocore.exceptions import BotoCoreError

from decider_cli.proxy.invoker import SageMakerInvoker, runtime_client
from decider_cli.proxy.server import create_proxy_app

log = logging.getLogger("decider.proxy")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="decider-proxy",
        description="Serve the decider HTTP API locally, forwarded to a SageMaker endpoint.",
    )
    parser.add_argument("--endpoint", required=True, help="SageMaker endpoint name")
    parser.add_argument("--region", default=None, help="AWS region (default: the standard chain)")
    parser.add_argument("--profile", default=None, help="AWS profile (default: the standard chain)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="listen port (default 8080)")
    parser.add_argument("--target-variant", default=None, help="TargetVariant of every call")
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=1,
        help="botocore attempts per call (default 1: clients retry what the error body calls retryable)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        client = runtime_client(args.region, profile=args.profile, max_attempts=args.max_attempts)
    except BotoCoreError as exc:  # no region, unknown profile
        print(f"decider-proxy: {exc}", file=sys.stderr)
        return 2
    invoker = SageMakerInvoker(args.endpoint, client=client, target_variant=args.target_variant)
    log.info(
        "forwarding http://%s:%d to SageMaker endpoint %s via %s",
        args.host,
        args.port,
        args.endpoint,
        client.meta.endpoint_url,
    )
    uvicorn.run(create_proxy_app(invoker), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
