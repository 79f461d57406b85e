"""`make bench-kv-span`: what other sequences' memory cells cost a decode that never attends them.

llama.cpp's attention visits every cell up to the highest one in use (`n_kv`), masked or not, so
cells held by other requests make every decode slower. This is why the scheduler starts a new unit
only while the started ones leave less than a micro-batch to decode (`Step.may_start`,
docs/engine.md). Side by side in one process, rounds alternating: a state of `--state` tokens fanned
out to 8 branches of `--branch` tokens (one decode), with 0, 2,000 and 6,000 cells held by other
sequences (a fresh fan-out each time: only the other cells differ).

One line:
    kv_span others_2000_vs_0=… others_6000_vs_0=… fanout_seconds_0=… tokens=…
"""

from __future__ import annotations

import argparse
import statistics
import time

from decider.engine.engine import DecisionEngine
from decider.engine.model.bundled import smollm2_path
from decider.engine.model.native import LlamaRuntime, Row
from decider.settings import Settings
from decider_dev.bench.common import NO_CACHES, key_values

TEXT = "The payout failed again and the customer wrote to support about the refund. "
BRANCHES = range(2, 10)  # the fan-out's sequences; the state is sequence 1, the others from 20
OTHERS = (0, 2000, 6000)


def fill(runtime: LlamaRuntime, tokens: list[int], cells: int) -> list[int]:
    """Hold `cells` cells in other sequences (rows of at most 500 tokens); their ids."""
    seqs: list[int] = []
    while cells > 0:
        n = min(cells, 500)
        seq = 20 + len(seqs)
        runtime.decode([Row(seq, tokens[:n], 0)])
        seqs.append(seq)
        cells -= n
    return seqs


def fanout_seconds(runtime: LlamaRuntime, state: list[int], branch: list[int]) -> float:
    runtime.decode([Row(1, state, 0)])
    for seq in BRANCHES:
        runtime.seq_copy(1, seq)
    started = time.perf_counter()
    runtime.decode([Row(seq, branch, len(state)) for seq in BRANCHES])
    elapsed = time.perf_counter() - started
    for seq in (1, *BRANCHES):
        runtime.seq_remove(seq)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--state", type=int, default=300, help="state tokens (default 300)")
    parser.add_argument("--branch", type=int, default=60, help="tokens per branch (default 60)")
    args = parser.parse_args(argv)
    engine = DecisionEngine.load(Settings(model_path=smollm2_path(), **NO_CACHES))
    try:
        runtime = engine.runtime
        tokens = runtime.tokenize(TEXT * 200, special=False)
        state, branch = tokens[: args.state], tokens[args.state : args.state + args.branch]
        fanout_seconds(runtime, state, branch)  # warm-up
        seconds: dict[int, list[float]] = {others: [] for others in OTHERS}
        for _ in range(args.rounds):
            for others in OTHERS:
                held = fill(runtime, tokens, others)
                seconds[others].append(fanout_seconds(runtime, state, branch))
                for seq in held:
                    runtime.seq_remove(seq)
    finally:
        engine.close()
    base = statistics.median(seconds[0])
    pairs = [(f"others_{n}_vs_0", f"{statistics.median(seconds[n]) / base:.3f}") for n in OTHERS[1:]]
    pairs += [("fanout_seconds_0", f"{base:.3f}"), ("tokens", str(len(BRANCHES) * len(branch)))]
    print("kv_span " + key_values(pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
