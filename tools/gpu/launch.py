"""Run a benchmark on the GPU machine with a generated model standing in for the bundled one.

The bundled SmolLM2 (93 MB) does not fit the 64 MiB that travel, and the benchmarks look it up even
when `--model` is given (their default). Here that lookup answers the generated model instead. The
JevBench cases come from the `jevbench` wheel the pack carries, as everywhere else.

    python -m tools.gpu.launch engine|server MODEL.gguf [benchmark arguments...]
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = ("engine", "server")


def stand_in(model: Path) -> None:
    """Make `decider.engine.bundled.smollm2_path` answer `model` in this process."""
    import decider.engine.bundled as bundled

    def smollm2_path(*, verify: bool = True) -> Path:
        return model

    bundled.smollm2_path = smollm2_path  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] not in BENCHMARKS:
        usage = f"usage: python -m tools.gpu.launch {'|'.join(BENCHMARKS)} MODEL.gguf [args...]"
        print(usage, file=sys.stderr)
        return 2
    name, model, rest = args[0], Path(args[1]).resolve(), args[2:]
    if not model.is_file():
        print(f"{model} is not a file", file=sys.stderr)
        return 2
    stand_in(model)  # both before the benchmark module imports them
    module = importlib.import_module(f"tools.bench.{name}")
    return int(module.main(["--model", str(model), *rest]))


if __name__ == "__main__":
    sys.exit(main())
