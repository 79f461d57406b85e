"""Confidence cut-points from a run's labelled answers: above which cut do answers meet a target accuracy?

For each question type (and each question key with enough labels), on the answers scored in the run:

- confidence is the documented `normalized-peak-v1` of the answer's probabilities,
  clamp((n·p_max − 1)/(n − 1), 0, 1) (the `confidence` field of choice and score answers; for a noul,
  whose answer is p(true), it is |2p − 1|);
- the cut-point is the lowest confidence c such that the answers with confidence >= c are right at least
  `target` of the time (and there are at least `min_accepted` of them): the largest coverage that meets the
  target in the run; `None` when no cut does (then no answer of that group should be trusted alone);
- it is checked out of fold as `calibrate` checks its temperature: k folds, the cut chosen on k−1 of them
  and applied to the held-out one, which gives the out-of-fold coverage and accuracy (with a Wilson interval);
- a bootstrap over the answers (resampled with replacement, the cut chosen again each time) gives the
  percentile intervals of the cut and of its coverage, and how often the target is reachable at all.

Written as `thresholds.json` in the run directory, for clients to load: it names the served model id and
prompt version the thresholds belong to (they do not carry over to another model, prompt or temperature).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from decider.engine.works.readout import CONFIDENCE_FORMULA, normalized_peak
from decider_cli.evaluate.cases import QUESTION_TYPES
from decider_cli.evaluate.results import ResultRow, RunMeta
from decider_cli.evaluate.summary import fmt

THRESHOLDS_FILE = "thresholds.json"
THRESHOLDS_FORMAT = "decider-thresholds-v1"
CURVE_POINTS = 200  # the curve kept in the file (and drawn in the report) is thinned to this many points
Z95 = 1.959963984540054
UNREACHABLE = 2.0  # a bootstrap resample in which no cut meets the target (above any confidence)


def row_confidence(row: ResultRow) -> float:
    """`normalized-peak-v1` of the row's probabilities (what the server reports as `confidence`)."""
    return normalized_peak([row.probs[label] for label in row.labels])


def choose_cut(
    confidences: np.ndarray, correct: np.ndarray, target: float, min_accepted: int
) -> tuple[float | None, int, int]:
    """(cut, accepted, right among accepted): the lowest cut whose accepted answers meet the target."""
    if confidences.size == 0:
        return None, 0, 0
    order = np.argsort(-confidences, kind="stable")
    ordered = confidences[order]
    right = np.cumsum(correct[order])
    counts = np.arange(1, ordered.size + 1)
    ends = np.flatnonzero(np.append(ordered[1:] != ordered[:-1], True))  # last index of each distinct value
    ok = (right[ends] >= target * counts[ends] - 1e-9) & (counts[ends] >= min_accepted)
    if not ok.any():
        return None, 0, 0
    end = ends[np.flatnonzero(ok)[-1]]
    return float(ordered[end]), int(counts[end]), int(right[end])


def coverage_curve(confidences: np.ndarray, correct: np.ndarray) -> list[tuple[float, float, float]]:
    """(coverage, accuracy of the accepted, cut) for every distinct cut, thinned to CURVE_POINTS."""
    if confidences.size == 0:
        return []
    order = np.argsort(-confidences, kind="stable")
    ordered = confidences[order]
    right = np.cumsum(correct[order])
    counts = np.arange(1, ordered.size + 1)
    ends = np.flatnonzero(np.append(ordered[1:] != ordered[:-1], True))
    if ends.size > CURVE_POINTS:
        ends = ends[np.unique(np.linspace(0, ends.size - 1, CURVE_POINTS).round().astype(int))]
    n = ordered.size
    return [
        (round(float(counts[e] / n), 5), round(float(right[e] / counts[e]), 5), round(float(ordered[e]), 5))
        for e in ends
    ]


def wilson(successes: int, total: int) -> tuple[float, float] | None:
    """95 % Wilson score interval of a proportion; None without trials."""
    if total == 0:
        return None
    p = successes / total
    denominator = 1 + Z95**2 / total
    center = (p + Z95**2 / (2 * total)) / denominator
    half = Z95 * math.sqrt(p * (1 - p) / total + Z95**2 / (4 * total**2)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


class GroupThreshold(BaseModel):
    group: str  # "type" or "key"
    name: str
    type: str
    labelled: int
    accuracy_all: float  # accuracy of every labelled answer of the group (coverage 1)
    threshold: float | None  # accept an answer when its confidence >= threshold; None: the target is not met
    coverage: float  # share of the group's answers at or above the cut, in the run
    accuracy_above: float | None  # accuracy of those answers, in the run
    oof_coverage: float
    oof_accuracy: float | None
    oof_accuracy_interval: tuple[float, float] | None  # 95 % Wilson interval
    threshold_interval: tuple[float | None, float | None] | None  # bootstrap 2.5 / 97.5 %; None = unreachable
    coverage_interval: tuple[float, float] | None
    reachable_share: float  # share of bootstrap resamples in which some cut meets the target
    curve: list[tuple[float, float, float]]  # (coverage, accuracy, cut)
    note: str | None = None


class Thresholds(BaseModel):
    format: str = THRESHOLDS_FORMAT
    model: str | None
    prompt_version: str | None
    served_temperatures: dict[str, float | None]
    confidence: str = CONFIDENCE_FORMULA
    confidence_note: str = (
        "choice and score: the answer's `confidence`; noul: |2·noul − 1|. Accept an answer when its "
        "confidence >= threshold; a null threshold means no cut met the target (trust no answer of it alone)."
    )
    target_accuracy: float
    min_accepted: int
    min_key_labels: int
    folds: int
    bootstrap: int
    seed: int
    run: str
    cases_sha256: str
    created_at: str
    types: dict[str, GroupThreshold]
    keys: dict[str, GroupThreshold]
    skipped_keys: dict[str, int]  # key -> labelled answers (fewer than min_key_labels)


def _oof(
    conf: np.ndarray, ok: np.ndarray, *, target: float, min_accepted: int, folds: int, seed: int
) -> tuple[int, int]:
    """(accepted, right) over the held-out folds, each fold cut with the cut chosen on the others."""
    order = list(range(conf.size))
    random.Random(seed).shuffle(order)
    k = max(2, min(folds, conf.size))
    accepted = right = 0
    for fold in range(k):
        held = np.array(order[fold::k], dtype=int)
        train = np.array([i for n, i in enumerate(order) if n % k != fold], dtype=int)
        cut, _, _ = choose_cut(conf[train], ok[train], target, max(1, min_accepted * (k - 1) // k))
        if cut is None or held.size == 0:
            continue
        mask = conf[held] >= cut
        accepted += int(mask.sum())
        right += int(ok[held][mask].sum())
    return accepted, right


def group_threshold(
    group: str,
    name: str,
    qtype: str,
    rows: Sequence[ResultRow],
    *,
    target: float,
    min_accepted: int,
    folds: int,
    bootstrap: int,
    seed: int,
) -> GroupThreshold:
    conf = np.array([row_confidence(r) for r in rows], dtype=float)
    ok = np.array([bool(r.correct) for r in rows], dtype=bool)
    n = conf.size
    cut, accepted, right = choose_cut(conf, ok, target, min_accepted)
    oof_accepted, oof_right = _oof(conf, ok, target=target, min_accepted=min_accepted, folds=folds, seed=seed)
    rng = np.random.default_rng(seed)
    cuts, coverages = [], []
    for _ in range(bootstrap):
        pick = rng.integers(0, n, n)
        b_cut, b_accepted, _ = choose_cut(conf[pick], ok[pick], target, min_accepted)
        cuts.append(UNREACHABLE if b_cut is None else b_cut)
        coverages.append(b_accepted / n)
    reachable = float(np.mean(np.array(cuts) < UNREACHABLE)) if cuts else 0.0
    if cuts:
        lo, hi = np.percentile(cuts, [2.5, 97.5], method="lower")  # an observed cut, or UNREACHABLE
        threshold_interval = (
            None if lo >= UNREACHABLE else round(float(lo), 4),
            None if hi >= UNREACHABLE else round(float(hi), 4),
        )
        c_lo, c_hi = np.percentile(coverages, [2.5, 97.5])
        coverage_interval = (round(float(c_lo), 4), round(float(c_hi), 4))
    else:
        threshold_interval, coverage_interval = None, None
    note = None
    if cut is None:
        note = f"no cut reaches accuracy {target:g} on {n} labelled answers"
    elif bootstrap and reachable < 0.95:
        note = f"the target is reached in only {reachable:.0%} of bootstrap resamples: gather more labels"
    return GroupThreshold(
        group=group,
        name=name,
        type=qtype,
        labelled=n,
        accuracy_all=float(ok.mean()) if n else math.nan,
        threshold=None if cut is None else round(cut, 6),
        coverage=accepted / n if n else 0.0,
        accuracy_above=right / accepted if accepted else None,
        oof_coverage=oof_accepted / n if n else 0.0,
        oof_accuracy=oof_right / oof_accepted if oof_accepted else None,
        oof_accuracy_interval=wilson(oof_right, oof_accepted),
        threshold_interval=threshold_interval,
        coverage_interval=coverage_interval,
        reachable_share=reachable,
        curve=coverage_curve(conf, ok),
        note=note,
    )


def _prompt_version(rows: Sequence[ResultRow]) -> str | None:
    versions = set()
    for row in rows:
        ext = (row.answer or {}).get("extensions")
        if isinstance(ext, dict) and isinstance(ext.get("prompt_version"), str):
            versions.add(ext["prompt_version"])
    if len(versions) > 1:
        return "mixed: " + ", ".join(sorted(versions))
    return next(iter(versions), None)


def compute_thresholds(
    run: str,
    meta: RunMeta,
    rows: Sequence[ResultRow],
    *,
    target: float = 0.95,
    min_accepted: int = 10,
    min_key_labels: int = 50,
    folds: int = 5,
    bootstrap: int = 1000,
    seed: int = 0,
) -> Thresholds:
    if not 0 < target <= 1:
        raise ValueError("the target accuracy must be in (0, 1]")
    scored = [r for r in rows if r.scored]
    options = {
        "target": target,
        "min_accepted": min_accepted,
        "folds": folds,
        "bootstrap": bootstrap,
        "seed": seed,
    }
    types = {
        qtype: group_threshold("type", qtype, qtype, members, **options)
        for qtype in QUESTION_TYPES
        if (members := [r for r in scored if r.type == qtype])
    }
    by_key: dict[tuple[str, str], list[ResultRow]] = {}
    for row in scored:
        by_key.setdefault((row.key, row.type), []).append(row)
    keys, skipped = {}, {}
    for (key, qtype), members in sorted(by_key.items()):
        name = key if sum(1 for k, _ in by_key if k == key) == 1 else f"{key} ({qtype})"
        if len(members) >= min_key_labels:
            keys[name] = group_threshold("key", name, qtype, members, **options)
        else:
            skipped[name] = len(members)
    served: dict[str, float | None] = {}
    for qtype in types:
        values = {r.temperature for r in scored if r.type == qtype}
        served[qtype] = values.pop() if len(values) == 1 else None
    return Thresholds(
        model=meta.model,
        prompt_version=_prompt_version(rows),
        served_temperatures=served,
        target_accuracy=target,
        min_accepted=min_accepted,
        min_key_labels=min_key_labels,
        folds=folds,
        bootstrap=bootstrap,
        seed=seed,
        run=run,
        cases_sha256=meta.cases_sha256,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        types=types,
        keys=keys,
        skipped_keys=skipped,
    )


def _interval(values: tuple[float | None, float | None] | None, digits: int = 3) -> str:
    if values is None:
        return "n/a"
    lo, hi = values
    return f"{'never' if lo is None else fmt(lo, digits)}–{'never' if hi is None else fmt(hi, digits)}"


THRESHOLD_COLUMNS = (
    "group",
    "n",
    "acc. all",
    "cut",
    "coverage",
    "acc. ≥ cut",
    "OOF cov.",
    "OOF acc. (95% CI)",
    "cut 95% CI",
    "cov. 95% CI",
)


def threshold_cells(g: GroupThreshold) -> list[str]:
    return [
        g.name if g.group == "type" else f"key {g.name}",
        str(g.labelled),
        fmt(g.accuracy_all),
        "none" if g.threshold is None else fmt(g.threshold),
        fmt(g.coverage),
        fmt(g.accuracy_above),
        fmt(g.oof_coverage),
        f"{fmt(g.oof_accuracy)} ({_interval(g.oof_accuracy_interval)})"
        if g.oof_accuracy is not None
        else "n/a",
        _interval(g.threshold_interval),
        _interval(g.coverage_interval),
    ]


def print_thresholds(t: Thresholds, console: Console) -> None:
    console.rule("decide-eval thresholds")
    console.print(
        f"model {t.model or 'n/a'}, prompt {t.prompt_version or 'n/a'}, confidence {t.confidence}; "
        f"target accuracy {t.target_accuracy:g}; OOF = {t.folds}-fold (seed {t.seed}), "
        f"CI = {t.bootstrap} bootstrap resamples"
    )
    title = "Confidence cut-points (accept an answer when confidence ≥ cut)"
    table = Table(title=title, title_justify="left")
    for column in THRESHOLD_COLUMNS:
        table.add_column(column, justify="right")
    for g in [*t.types.values(), *t.keys.values()]:
        table.add_row(*threshold_cells(g))
    console.print(table)
    for g in [*t.types.values(), *t.keys.values()]:
        if g.note:
            console.print(f"{g.name}: {g.note}")
    if t.skipped_keys:
        listed = ", ".join(f"{k} ({n})" for k, n in list(t.skipped_keys.items())[:8])
        more = f", … {len(t.skipped_keys) - 8} more" if len(t.skipped_keys) > 8 else ""
        console.print(
            f"{len(t.skipped_keys)} question keys have fewer than {t.min_key_labels} labels "
            f"(no per-key cut): {listed}{more}",
            soft_wrap=True,
        )


def write_thresholds(run_dir: Path, t: Thresholds) -> Path:
    path = run_dir / THRESHOLDS_FILE
    path.write_text(t.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return path


def load_thresholds(run_dir: Path) -> Thresholds | None:
    path = run_dir / THRESHOLDS_FILE
    if not path.is_file():
        return None
    try:
        return Thresholds.model_validate_json(path.read_text(encoding="utf-8"))
    except ValueError:
        return None
