"""`make bench-host-tier`: would a host-memory tier for kept states pay (llama-server's `--cache-ram`)?

A kept state that the in-context cache evicts (`DECIDER_STATE_CACHE_CELLS`, a quarter of n_ctx) is
prefilled again when it is asked again. A host tier would instead save the sequence's memory with
`llama_state_seq_get_data` when it is evicted and restore it with `llama_state_seq_set_data` on the
next ask. This measures, side by side in one process, for each model and state length:

- `prefill_s`: the state prefilled from nothing (the cost of a miss today);
- `save_s` / `restore_s`: the sequence written to host memory and read back into another sequence,
  through what the server runs (`LlamaRuntime.seq_save` / `seq_restore`). Both run on the engine
  thread, so `save_s` is also the gap an eviction puts in every other request's decoding;
- `bytes`: the host memory one kept state takes;
- `restore_diff` / `reprefill_diff`: the largest |Δ logit| of the next token after the restore, and
  after a second prefill, against the first (with the default kernels a token's result depends on
  its batch company: a restore must be as close as a second prefill is; with `--invariant` both
  must be 0).

One line per model and length:
    host_tier model=… tokens=… prefill_s=… save_s=… restore_s=… bytes=… prefill_vs_save_restore=…
      restore_diff=… reprefill_diff=…

`--qwen35-4b` adds the production model's own shape (tools/dev/qwen35_gguf.py QWEN35_4B, random weights,
~2.5 GB written once under .bench/): its ~50 MiB of recurrent state per sequence is what a save copies.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from decider.engine.engine import DecisionEngine
from decider.engine.model.bundled import smollm2_path
from decider.engine.model.native import LlamaRuntime, OutputSpec, Row
from decider.settings import Settings
from decider_dev.bench.common import NO_CACHES
from decider_dev.bench.server import BENCH_DIR, hybrid_model

TEXT = "The payout failed again and the customer wrote to support about the refund. "
READ = OutputSpec(token_ids=tuple(range(64)), logsumexp=True)


def prefill(runtime: LlamaRuntime, seq: int, tokens: list[int]) -> None:
    step = runtime.policy.step_tokens
    for start in range(0, len(tokens), step):
        runtime.decode([Row(seq, tokens[start : start + step], start)])


def next_logits(runtime: LlamaRuntime, seq: int, tokens: list[int]) -> np.ndarray:
    row = Row(seq, [tokens[0]], len(tokens), READ)
    runtime.decode([row])
    assert row.result is not None
    return row.result.logits


def measure(path: Path, n_tokens: int, threads: int | None, *, invariant: bool = False) -> dict[str, float]:
    settings = Settings(model_path=path, n_threads=threads, batch_invariant=invariant, **NO_CACHES)
    engine = DecisionEngine.load(settings)
    try:
        runtime = engine.runtime
        tokens = runtime.tokenize(TEXT * (n_tokens // 8 + 1), special=False)[:n_tokens]
        started = time.perf_counter()
        prefill(runtime, 1, tokens)
        prefill_s = time.perf_counter() - started

        started = time.perf_counter()
        saved = runtime.seq_save(1)  # what an eviction runs (decider.engine.memory.prefix_cache)
        save_s = time.perf_counter() - started

        first = next_logits(runtime, 1, tokens)
        started = time.perf_counter()
        if not runtime.seq_restore(2, saved):
            raise RuntimeError("seq_restore could not place the saved state")
        restore_s = time.perf_counter() - started
        restored = next_logits(runtime, 2, tokens)
        prefill(runtime, 3, tokens)
        again = next_logits(runtime, 3, tokens)
        return {
            "prefill_s": prefill_s,
            "save_s": save_s,
            "restore_s": restore_s,
            "bytes": float(len(saved)),
            "restore_diff": float(np.max(np.abs(first - restored))),
            "reprefill_diff": float(np.max(np.abs(first - again))),
        }
    finally:
        engine.close()


def qwen35_4b(tokenizer: Path) -> Path:
    """Qwen3.5-4B's shape with random weights (written once under .bench/)."""
    from decider_dev.qwen35_gguf import QWEN35_4B, write_qwen35

    path = BENCH_DIR / "qwen35-4b-random-Q4_1.gguf"
    if not path.is_file():
        BENCH_DIR.mkdir(exist_ok=True)
        partial = path.with_suffix(".partial")
        write_qwen35(partial, tokenizer, shape=QWEN35_4B)
        partial.rename(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[500, 2000], help="state lengths")
    parser.add_argument("--threads", type=int, default=None, help="default: DECIDER_N_THREADS's default")
    parser.add_argument(
        "--invariant",
        action="store_true",
        help="batch-invariant kernels (SmolLM2 only): both diffs must be 0",
    )
    parser.add_argument("--hybrid-layers", type=int, default=16)
    parser.add_argument("--hybrid-embd", type=int, default=512)
    parser.add_argument(
        "--qwen35-4b", action="store_true", help="also the production model's shape (random weights)"
    )
    args = parser.parse_args(argv)
    smollm2 = smollm2_path()
    models = (
        {"smollm2": smollm2}
        if args.invariant
        else {
            "smollm2": smollm2,
            f"qwen35-{args.hybrid_layers}x{args.hybrid_embd}": hybrid_model(
                args.hybrid_layers, args.hybrid_embd, smollm2
            ),
        }
    )
    if args.qwen35_4b and not args.invariant:
        models["qwen35-4b"] = qwen35_4b(smollm2)
    for name, path in models.items():
        for n in args.tokens:
            r = measure(path, n, args.threads, invariant=args.invariant)
            ratio = r["prefill_s"] / max(r["save_s"] + r["restore_s"], 1e-9)
            print(
                f"host_tier model={name} tokens={n} prefill_s={r['prefill_s']:.3f} save_s={r['save_s']:.4f} "
                f"restore_s={r['restore_s']:.4f} bytes={int(r['bytes'])} prefill_vs_save_restore={ratio:.0f} "
                f"restore_diff={r['restore_diff']:.3g} reprefill_diff={r['reprefill_diff']:.3g}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
