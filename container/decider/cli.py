"""`serve`: the container's command (SageMaker runs `docker run IMAGE serve`).

Settings come from the environment (`DECIDER_*`, `SAGEMAKER_BIND_TO_PORT`). An invalid setting,
or a model that cannot be loaded, is reported as ONE log line starting with `startup failed:`,
followed by a non-zero exit; `/ping` never reports healthy in that case.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import logging
import signal
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from decider import __version__
from decider.errors import EXIT_INVALID_SETTINGS
from decider.settings import Settings

PR_SET_PDEATHSIG = 1
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="serve",
        description="Serve typed decisions (/v1/systemone) and OpenAI chat from one GGUF model, "
        "with SageMaker's /ping and /invocations. Configure with DECIDER_* environment variables.",
    )
    parser.add_argument(
        "command",
        nargs="?",
        default="serve",
        choices=["serve", "engine"],
        help="optional; SageMaker starts containers as `docker run IMAGE serve`. `engine` is the child "
        "the front starts (DECIDER_SUPERVISE): the same server, on --socket",
    )
    parser.add_argument("--socket", help="engine: the Unix socket to serve on")
    parser.add_argument("--version", action="version", version=f"decider {__version__}")
    return parser.parse_args(argv)


def describe_settings_error(exc: ValidationError) -> str:
    """A pydantic error on Settings as one line naming the environment variables."""
    problems = []
    for error in exc.errors(include_url=False):
        loc = error.get("loc") or ()
        field = str(loc[0]) if loc else ""
        if field in Settings.model_fields:
            name = Settings.env_name(field)
        elif field:
            name = field
        else:
            name = "settings"
        value = error.get("input")
        secret = field == "api_key"  # never print a key, not even a rejected one
        shown = f"={value!r}" if field and not secret and not isinstance(value, dict) else ""
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        problems.append(f"{name}{shown}: {message}")
    return "invalid setting: " + "; ".join(problems)


def configure_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stdout, force=True)
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).setLevel(max(logging.INFO, logging.getLevelName(level.upper())))


def die_with_parent() -> None:
    """The engine child gets SIGTERM when the front is gone, however it went (Linux's
    PR_SET_PDEATHSIG; elsewhere the child outlives a killed front)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.command == "engine":
        if not args.socket:
            print("serve engine: --socket is required", file=sys.stderr)
            return EXIT_INVALID_SETTINGS
        die_with_parent()
    # A native crash (llama.cpp, CUDA) then leaves every thread's Python stack on stderr, which
    # SageMaker sends to CloudWatch with the rest of the log.
    faulthandler.enable(all_threads=True)
    configure_logging()
    log = logging.getLogger("decider.server")
    try:
        settings = Settings()
    except ValidationError as exc:
        log.error("startup failed: %s", describe_settings_error(exc))
        return EXIT_INVALID_SETTINGS
    configure_logging(settings.log_level)
    from decider.server.batch_settings import batch_settings  # SAGEMAKER_BATCH=true: the job's deadline

    try:
        settings = batch_settings(settings)
    except ValueError as exc:
        log.error("startup failed: %s", exc)
        return EXIT_INVALID_SETTINGS
    log.info(
        "decider %s starting on %s:%d (model %s, queue %d, deadline %gs)",
        __version__,
        settings.host,
        settings.port,
        settings.model_path,
        settings.queue_size,
        settings.deadline_seconds,
    )
    if args.command == "engine":
        from decider.server.serve import run  # imported late: keeps `serve --help` and setting errors fast

        return run(settings, uds=args.socket)
    if settings.supervise:
        from decider.server.supervisor import run_front  # never imports the engine

        return run_front(settings)
    from decider.server.serve import run

    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
