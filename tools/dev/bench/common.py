"""Pure helpers shared by the two benchmarks: JevBench workloads, answer comparison, timing, output.

The data set is JevBench (Apache-2.0; Copyright 2026 Chen Feng): the cases of the `jevbench` package
(decider_cli.evaluate.jevbench; its LICENSE and NOTICE are in tools/cli/evaluate/data/jevbench).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from decider_cli.evaluate.cases import load_items

T = TypeVar("T")
# The benchmarks time the same requests again and again (fresh against shared, one level after the
# other): with states and exact repeats kept across requests, every measurement after the first would
# be a replay. Only the levels that measure the caches themselves (bench-server's repeat levels) run
# with them.
NO_CACHES: dict[str, Any] = {"state_cache_seqs": 0, "repeat_cache_entries": 0}
Distributions = dict[str, list[float]]  # question key -> probabilities in option order


def load_cases(path: Path) -> list[dict[str, Any]]:
    """Every case as {"id", "state", "questions"} (read and checked by decide-eval's loader)."""
    return [{"id": item.item_id, **item.request} for item in load_items(path)]


def spread(cases: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """`count` cases spread evenly over the suite (deterministic)."""
    step = max(1, len(cases) // max(1, count))
    return cases[::step][:count]


def same_questions_group(cases: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The first `count` cases of the largest group sharing one exact question set (for the batch route)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for case in cases:
        groups.setdefault(json.dumps(case["questions"], sort_keys=True), []).append(case)
    largest = max(groups.values(), key=len)
    return largest[:count]


def request_body(case: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
    """A decision request for one case (state + questions), plus optional fields (mode, extensions…)."""
    return {"state": case["state"], "questions": case["questions"], **fields}


def answer_distribution(answer: Mapping[str, Any]) -> list[float]:
    """One wire answer's probabilities: noul as [p(true), p(false)], choice/score in option order."""
    if "noul" in answer:
        p = float(answer["noul"])
        return [p, 1.0 - p]
    return [float(v) for v in answer["probabilities"].values()]


def distributions(response: Mapping[str, Any]) -> Distributions:
    """Every answer of one wire response (`/v1/systemone` JSON, or `DecisionResponse.to_wire()`)."""
    return {key: answer_distribution(answer) for key, answer in response["answers"].items()}


def max_abs_delta(a: Distributions, b: Distributions) -> float:
    """Largest |Δp| over every option of every question both hold (they must hold the same ones)."""
    if a.keys() != b.keys():
        raise ValueError(f"different questions: {sorted(a.keys() ^ b.keys())}")
    worst = 0.0
    for key, probs in a.items():
        other = b[key]
        if len(probs) != len(other):
            raise ValueError(f"question {key!r}: {len(probs)} options against {len(other)}")
        worst = max(worst, *(abs(x - y) for x, y in zip(probs, other, strict=True)))
    return worst


def argmax_agreement(a: Distributions, b: Distributions) -> tuple[int, int]:
    """(questions whose most probable option is the same in both, questions compared)."""
    same = sum(probs.index(max(probs)) == b[key].index(max(b[key])) for key, probs in a.items())
    return same, len(a)


def run_clients_in_parallel(clients: int, client_loop: Callable[[], None]) -> float:
    """Run `client_loop` on `clients` threads at once; the wall seconds until the last one ends."""
    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def best_of(repeats: int, run: Callable[[], T]) -> tuple[float, T]:
    """Fastest of `repeats` runs (the least disturbed by other processes) and its result."""
    best: tuple[float, T] | None = None
    for _ in range(max(1, repeats)):
        started = time.perf_counter()
        result = run()
        elapsed = time.perf_counter() - started
        if best is None or elapsed < best[0]:
            best = (elapsed, result)
    assert best is not None
    return best


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when the denominator is zero or either side is NaN."""
    if not denominator or math.isnan(numerator) or math.isnan(denominator):
        return math.nan
    return numerator / denominator


def key_values(pairs: Iterable[tuple[str, float | str]], digits: int = 2) -> str:
    """`key=value` pairs for a machine-readable last line; floats with `digits` decimals, NaN as `nan`."""
    out = []
    for key, value in pairs:
        if isinstance(value, float):
            text = "nan" if math.isnan(value) else f"{value:.{digits}f}"
        else:
            text = str(value)
        out.append(f"{key}={text}")
    return " ".join(out)


def model_settings(args: Any, default_model: Path) -> dict[str, Any]:
    """The settings the benchmarks take from `--model`, `--n-gpu-layers` and `--threads` (the server
    gets them as DECIDER_*, an in-process engine as Settings fields)."""
    fields: dict[str, Any] = {"model_path": args.model or default_model, "n_gpu_layers": args.n_gpu_layers}
    if args.threads:
        fields["n_threads"] = args.threads
    return fields


def server_environment(fields: Mapping[str, Any]) -> dict[str, str]:
    """Settings fields (`model_settings`, NO_CACHES, …) as the DECIDER_* variables a server reads."""
    from decider.settings import Settings

    return {Settings.env_name(name): str(value) for name, value in fields.items()}


def unlabelled_metrics(metrics_text: str, names: Iterable[str]) -> dict[str, float]:
    """The unlabelled samples `names` from a Prometheus text exposition (/metrics); missing read 0."""
    values = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in values and not sample.labels:
                values[sample.name] = float(sample.value)
    return values
