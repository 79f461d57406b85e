"""Aggregate a run's rows into the numbers the terminal summary, the HTML report and `compare` show.

Rules (JevBench protocol):
- latency percentiles are over measured requests (errors included, warm-up excluded), per request;
- accuracy, Brier and ECE use answered questions with a known gold; a gold of "unknown" is counted apart
  and a server error is counted apart, never as a wrong answer;
- decisions/s = answered questions / wall time of the measured phase.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel

from decider_cli.evaluate.cases import UNKNOWN
from decider_cli.evaluate.metrics import (
    ReliabilityBin,
    brier,
    expected_calibration_error,
    mean,
    percentile,
    reliability_bins,
)
from decider_cli.evaluate.results import ResultRow, RunMeta

ABSTAIN_LOW, ABSTAIN_HIGH = 0.2, 0.8  # a noul with 0.2 < p(true) < 0.8 is an abstention (JevBench adapters)


def is_abstention(row: ResultRow) -> bool:
    """A noul answer inside the abstention band; other types never abstain."""
    return row.type == "noul" and row.probs is not None and ABSTAIN_LOW < row.probs["true"] < ABSTAIN_HIGH


class Latency(BaseModel):
    requests: int
    p50: float
    p95: float
    p99: float
    mean: float
    max: float
    server_p50: float | None  # server-side time, when the server reports it (extension block)
    first_request_s: float | None
    first_request_kind: str | None
    warmup_s: list[float]


class GroupScore(BaseModel):
    scored: int
    correct: int
    accuracy: float
    brier: float
    ece: float
    chance: float  # expected accuracy of a uniform random guess over the same questions


class Summary(BaseModel):
    target: str
    model: str | None
    latency: Latency
    wall_s: float
    decisions_per_s: float
    questions: int
    answered: int
    errors: int
    unknown_gold: int
    unlabelled: int
    overall: GroupScore
    by_type: dict[str, GroupScore]
    by_domain: dict[str, GroupScore]
    ordinal_mae: float
    score_questions: int
    noul_abstention_rate: float
    unknown_by_type: dict[str, int]
    unknown_mean_confidence: float
    unknown_noul_abstention_rate: float
    error_requests_by_code: dict[str, int]
    error_questions_by_code: dict[str, int]
    reliability: list[dict[str, Any]]
    aborted: str | None = None
    time_budget: str | None = None


def score_group(rows: list[ResultRow]) -> GroupScore:
    scored = [r for r in rows if r.scored]
    correct = sum(1 for r in scored if r.correct)
    return GroupScore(
        scored=len(scored),
        correct=correct,
        accuracy=correct / len(scored) if scored else math.nan,
        brier=mean([brier(r.probs, r.gold) for r in scored]),
        ece=expected_calibration_error([r.confidence for r in scored], [bool(r.correct) for r in scored]),
        chance=mean([1.0 / len(r.labels) for r in scored]),
    )


def _grouped(rows: Iterable[ResultRow], key: Callable[[ResultRow], str]) -> dict[str, GroupScore]:
    groups: dict[str, list[ResultRow]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    return {name: score_group(members) for name, members in sorted(groups.items())}


def latency_summary(meta: RunMeta) -> Latency:
    times = [r.latency_s for r in meta.requests]
    server = [r.server_s for r in meta.requests if r.server_s is not None]
    if meta.warmup:
        first, kind = meta.warmup[0].latency_s, "warm-up"
    elif meta.requests:
        first, kind = meta.requests[0].latency_s, "measured"
    else:
        first, kind = None, None
    return Latency(
        requests=len(times),
        p50=percentile(times, 50),
        p95=percentile(times, 95),
        p99=percentile(times, 99),
        mean=mean(times),
        max=max(times) if times else math.nan,
        server_p50=percentile(server, 50) if server else None,
        first_request_s=first,
        first_request_kind=kind,
        warmup_s=[r.latency_s for r in meta.warmup],
    )


def reliability_of(rows: list[ResultRow]) -> list[ReliabilityBin]:
    scored = [r for r in rows if r.scored]
    return reliability_bins([r.confidence for r in scored], [bool(r.correct) for r in scored])


def summarize(meta: RunMeta, rows: list[ResultRow]) -> Summary:
    answered = [r for r in rows if r.status == "ok"]
    unknown = [r for r in answered if r.gold == UNKNOWN]
    score_rows = [r for r in answered if r.scored and r.type == "score"]
    noul_scored = [r for r in answered if r.scored and r.type == "noul"]
    unknown_noul = [r for r in unknown if r.type == "noul"]
    error_requests = Counter(r.error_code for r in meta.requests if r.error_code)
    error_questions = Counter(r.error_code for r in rows if r.status == "error")
    return Summary(
        target=meta.target_description,
        model=meta.model,
        latency=latency_summary(meta),
        wall_s=meta.wall_s,
        decisions_per_s=len(answered) / meta.wall_s if meta.wall_s > 0 else math.nan,
        questions=len(rows),
        answered=len(answered),
        errors=len(rows) - len(answered),
        unknown_gold=len(unknown),
        unlabelled=sum(1 for r in answered if r.gold is None),
        overall=score_group(rows),
        by_type=_grouped(rows, lambda r: r.type),
        by_domain=_grouped(rows, lambda r: r.domain),
        ordinal_mae=mean([abs(r.expected_level - int(r.gold)) for r in score_rows]),
        score_questions=len(score_rows),
        noul_abstention_rate=mean([1.0 if is_abstention(r) else 0.0 for r in noul_scored]),
        unknown_by_type=dict(sorted(Counter(r.type for r in unknown).items())),
        unknown_mean_confidence=mean([r.confidence for r in unknown]),
        unknown_noul_abstention_rate=mean([1.0 if is_abstention(r) else 0.0 for r in unknown_noul]),
        error_requests_by_code=dict(error_requests.most_common()),
        error_questions_by_code=dict(error_questions.most_common()),
        reliability=[b.__dict__ for b in reliability_of(rows)],
        aborted=meta.aborted,
        time_budget=meta.time_budget,
    )


def fmt(value: float | None, digits: int = 3) -> str:
    """A number for display; 'n/a' for missing or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def headline(summary: Summary) -> str:
    """The last line `run` prints (times in seconds)."""
    lat = summary.latency
    return (
        f"p50={fmt(lat.p50)} p95={fmt(lat.p95)} accuracy={fmt(summary.overall.accuracy, 4)} "
        f"ece={fmt(summary.overall.ece, 4)}"
    )
