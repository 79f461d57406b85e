"""What llama.cpp's abort check costs a decode, with another thread busy in Python (issue 23 §2).

    python -m decider_dev.bench.abort_cost [--tokens 256] [--repeats 5] [--threads 2]

Times the same prefill decode of the bundled SmolLM2 three ways: no abort check at all, the
native flag the engine uses (decider.engine.model.abort_flag), and a Python callback after every graph
node (what the engine did before), each alone and while a second thread parses a 4 MB JSON body
in a loop. Prints the medians and each way's slowdown against no check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import llama_cpp

from decider.engine.model.bundled import smollm2_path
from decider.engine.model.native import ContextConfig, LlamaRuntime, Row
from decider.invariance import BatchPolicy


@contextmanager
def busy_parser(active: bool) -> Iterator[None]:
    """A thread that keeps parsing a ~4 MB JSON body (it holds the GIL most of the time)."""
    stop = threading.Event()
    body = json.dumps({"state": {"rows": ["x" * 60] * 60_000}})

    def parse() -> None:
        while not stop.is_set():
            json.loads(body)

    thread = threading.Thread(target=parse, daemon=True)
    if active:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if active:
            thread.join()


def time_ways(runtime: LlamaRuntime, repeats: int, ways: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Median seconds per way, the ways interleaved in every round (a shared machine drifts)."""
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, decode in ways.items():
            runtime.clear()
            started = time.perf_counter()
            decode()
            samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    policy = BatchPolicy(False, max(512, args.tokens), 512, 4)
    runtime = LlamaRuntime(smollm2_path(), ContextConfig(4096, policy, args.threads, 0, True))
    tokens = (runtime.tokenize("A request about a refund, an order and a delay. " * 200, special=False))[
        : args.tokens
    ]
    rows = [Row(1, tokens, 0)]
    python_checks = llama_cpp.ggml_abort_callback(lambda _data: False)

    def native() -> None:
        runtime.decode(rows, should_abort=lambda: False)

    def unchecked() -> None:
        runtime.decode(rows)

    def python_callback() -> None:  # the engine's former per-node Python callback
        llama_cpp.llama_set_abort_callback(runtime._ctx, python_checks, None)
        try:
            runtime.decode(rows)
        finally:
            llama_cpp.llama_set_abort_callback(runtime._ctx, runtime._abort.callback, runtime._abort.data)

    ways = {"no check": unchecked, "native flag": native, "python callback": python_callback}
    for busy in (False, True):
        with busy_parser(busy):
            results = time_ways(runtime, args.repeats, ways)
        base = results["no check"]
        label = "another thread parsing JSON" if busy else "alone"
        print(f"{len(tokens)}-token decode, {args.threads} threads, {label}:")
        for name, seconds in results.items():
            print(f"  {name:16s} {seconds * 1000:8.1f} ms  {seconds / base:5.2f}x")
    runtime.close()


if __name__ == "__main__":
    main()
