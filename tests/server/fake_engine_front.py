"""The real front (decider.server.supervisor.run_front's server) over tests/server/fake_engine_child.py,
for tests/server/test_supervisor.py.

    python fake_engine_front.py PORT

`$FAKE_FRONT_SETTINGS`: a JSON object of settings over the ones below.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from decider.server.supervisor import run_front
from decider.settings import Settings

CHILD = Path(__file__).with_name("fake_engine_child.py")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s", stream=sys.stdout)
    settings = Settings.from_values(
        {
            "model_path": "/nonexistent/model.gguf",
            "host": "127.0.0.1",
            "port": int(sys.argv[1]),
            "deadline_seconds": 10,
            **json.loads(os.environ.get("FAKE_FRONT_SETTINGS", "{}")),
        }
    )
    return run_front(settings, command=lambda socket: [sys.executable, str(CHILD), socket])


if __name__ == "__main__":
    sys.exit(main())
