"""`decider_dev`: the project's own tooling (benchmarks, fuzzing, the image and GPU checks, the game
day, the demo). Users run the tools in `decider_cli` instead."""

from pathlib import Path

# The repository these tools work in (tools/dev/ is two folders below it): the container, the
# Dockerfile, the stacks' snapshots, .bench/ for cached models and results.
REPO_ROOT = Path(__file__).resolve().parents[2]
