"""A child process for tests/server/test_engine_failure.py: the real `serve.run` (uvicorn, the
SageMaker lifecycle) on a fake engine whose first decode kills the engine thread.

    python engine_crash_child.py PORT
"""

from __future__ import annotations

import logging
import sys

from server_fakes import FakeEngine

from decider.server.serve import run
from decider.settings import Settings


class EngineCrash(BaseException):
    """Not an Exception: nothing in the engine loop catches it, as with a bug that escapes it."""


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    engine = FakeEngine()

    def crash(*_: object, **__: object) -> None:
        raise EngineCrash("simulated fault in the engine loop")

    engine.runtime.decode = crash  # type: ignore[method-assign]
    settings = Settings.from_values(
        {"model_path": "/nonexistent/model.gguf", "host": "127.0.0.1", "port": int(sys.argv[1])}
    )
    return run(settings, loader=lambda _: engine)


if __name__ == "__main__":
    sys.exit(main())
