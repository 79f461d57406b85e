"""One results row per question, and how a server reply becomes rows.

Files in a run directory:
- `results.jsonl`: one `ResultRow` per question, in send order.
- `run.json`: `RunMeta` (target, inputs, arguments, every request's latency, warm-up, wall time).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from decider_cli.evaluate.cases import UNKNOWN, EvalItem, QuestionSpec
from decider_cli.evaluate.metrics import argmax_label, expected_level, top_confidence
from decider_cli.evaluate.targets import Reply

RESULTS_FILE = "results.jsonl"
RUN_FILE = "run.json"
PROBABILITY_SUM_TOLERANCE = 0.02  # JevBench's headline metric renormalizes sums within a 2 % band


class ResultRow(BaseModel):
    index: int = Field(description="Position of the request in the run (same order on every target).")
    case_id: str
    key: str
    type: str
    domain: str
    latency_s: float = Field(description="Caller wall time of the whole request this question was part of.")
    http_status: int | None
    status: Literal["ok", "error"]
    error_code: str | None = None
    error_message: str | None = None
    labels: list[str]
    probs: dict[str, float] | None = None
    logits: dict[str, float] | None = Field(None, description="Raw option logits from the extension block.")
    temperature: float | None = Field(None, description="Readout temperature the server reported.")
    predicted: str | None = None
    confidence: float | None = Field(None, description="Top-label probability.")
    expected_level: float | None = Field(None, description="Score only: sum_i i * p_i.")
    gold: str | None = Field(None, description="Gold label, 'unknown', or null when unlabelled.")
    correct: bool | None = None
    answer: dict[str, Any] | None = None

    @property
    def scored(self) -> bool:
        """Counts toward accuracy, Brier and ECE: answered, with a known gold label."""
        return self.status == "ok" and self.gold is not None and self.gold != UNKNOWN


class RequestRecord(BaseModel):
    index: int
    case_id: str
    latency_s: float
    http_status: int | None
    error_code: str | None = None
    questions: int
    server_s: float | None = Field(
        None, description="Server-side time from the extension block, if reported."
    )


class RunMeta(BaseModel):
    tool: str = "decide-eval"
    target: str
    target_description: str
    cases_path: str
    cases_sha256: str
    gold_path: str | None
    args: dict[str, Any]
    model: str | None = None
    started_at: str
    finished_at: str | None = None
    wall_s: float = 0.0
    concurrency: int = 1
    warmup: list[RequestRecord] = Field(default_factory=list)
    requests: list[RequestRecord] = Field(default_factory=list)
    aborted: str | None = None
    time_budget: str | None = None


def probabilities_from_answer(answer: Mapping[str, Any], spec: QuestionSpec) -> dict[str, float]:
    """The answer's probability vector over the question's labels; ValueError when malformed."""
    if answer.get("type") not in (None, spec.type):
        raise ValueError(f"answer type {answer.get('type')!r} does not match question type {spec.type!r}")
    if spec.type == "noul":
        p_true = answer.get("noul")
        if not isinstance(p_true, int | float) or isinstance(p_true, bool):
            raise ValueError("noul answer without a numeric 'noul'")
        probs = {"true": float(p_true), "false": 1.0 - float(p_true)}
    else:
        raw = answer.get("probabilities")
        if not isinstance(raw, Mapping):
            raise ValueError(f"{spec.type} answer without 'probabilities'")
        if set(raw) != set(spec.labels):
            raise ValueError(f"probability keys {sorted(raw)} differ from the labels {sorted(spec.labels)}")
        probs = {label: raw[label] for label in spec.labels}
        if any(not isinstance(p, int | float) or isinstance(p, bool) for p in probs.values()):
            raise ValueError("non-numeric probability")
        probs = {label: float(p) for label, p in probs.items()}
    if any(not math.isfinite(p) or p < -1e-9 or p > 1 + 1e-9 for p in probs.values()):
        raise ValueError("probability outside [0, 1]")
    total = sum(probs.values())
    if abs(total - 1.0) > PROBABILITY_SUM_TOLERANCE:
        raise ValueError(f"probabilities sum to {total:.4f}")
    return {label: min(1.0, max(0.0, p / total)) for label, p in probs.items()}


_NOUL_LOGIT_KEYS = {"true": ("true", "yes", "A"), "false": ("false", "no", "B")}


def logits_from_answer(answer: Mapping[str, Any], spec: QuestionSpec) -> dict[str, float] | None:
    """Raw option logits from the opt-in extension block, keyed by label; None when absent.

    Accepts `option_logits` as {option key: logit} (what decider sends) or as a list aligned with
    `option_keys`, else with the question's labels (noul options may be true/false, yes/no or A/B).
    """
    ext = answer.get("extensions")
    if not isinstance(ext, Mapping):
        return None
    raw = ext.get("option_logits", ext.get("logits"))
    if isinstance(raw, list):
        ids = ext.get("option_keys") or list(spec.labels)
        if not isinstance(ids, list) or len(ids) != len(raw):
            return None
        raw = dict(zip((str(i) for i in ids), raw, strict=True))
    if not isinstance(raw, Mapping):
        return None
    logits: dict[str, float] = {}
    for label in spec.labels:
        names = _NOUL_LOGIT_KEYS[label] if spec.type == "noul" else (label,)
        value = next((raw[n] for n in names if n in raw), None)
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            return None
        logits[label] = float(value)
    return logits


def _temperature_from_answer(answer: Mapping[str, Any]) -> float | None:
    ext = answer.get("extensions")
    value = ext.get("temperature") if isinstance(ext, Mapping) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def rows_from_reply(item: EvalItem, reply: Reply, index: int) -> list[ResultRow]:
    """One row per question of the item. A failed request gives error rows (not wrong answers)."""
    rows = []
    answers = reply.body.get("answers") if reply.ok and reply.body is not None else None
    for spec in item.questions:
        base = {
            "index": index,
            "case_id": item.item_id,
            "key": spec.key,
            "type": spec.type,
            "domain": item.domain,
            "latency_s": reply.latency_s,
            "http_status": reply.status,
            "labels": list(spec.labels),
            "gold": item.gold.get(spec.key),
        }
        if not reply.ok:
            rows.append(
                ResultRow(
                    **base, status="error", error_code=reply.error_code, error_message=reply.error_message
                )
            )
            continue
        answer = answers.get(spec.key) if isinstance(answers, Mapping) else None
        if not isinstance(answer, Mapping):
            rows.append(
                ResultRow(
                    **base,
                    status="error",
                    error_code="missing_answer",
                    error_message=f"no answer for question {spec.key!r}",
                )
            )
            continue
        try:
            probs = probabilities_from_answer(answer, spec)
        except ValueError as exc:
            rows.append(
                ResultRow(
                    **base,
                    status="error",
                    error_code="invalid_answer",
                    error_message=str(exc),
                    answer=dict(answer),
                )
            )
            continue
        predicted = argmax_label(probs)
        gold = base["gold"]
        rows.append(
            ResultRow(
                **base,
                status="ok",
                probs=probs,
                logits=logits_from_answer(answer, spec),
                temperature=_temperature_from_answer(answer),
                predicted=predicted,
                confidence=top_confidence(probs),
                expected_level=expected_level(probs) if spec.type == "score" else None,
                correct=None if gold in (None, UNKNOWN) else predicted == gold,
                answer=dict(answer),
            )
        )
    return rows


def write_rows(path: Path, rows: list[ResultRow]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(row.model_dump_json(exclude_none=False) + "\n")


class RunDirError(ValueError):
    """A run directory is missing or unreadable."""


def load_run(run_dir: Path) -> tuple[RunMeta, list[ResultRow]]:
    results, meta = run_dir / RESULTS_FILE, run_dir / RUN_FILE
    if not results.is_file() or not meta.is_file():
        raise RunDirError(f"{run_dir}: not a decide-eval run directory (needs {RESULTS_FILE} and {RUN_FILE})")
    try:
        run_meta = RunMeta.model_validate_json(meta.read_text(encoding="utf-8"))
        rows = [
            ResultRow.model_validate(json.loads(line))
            for line in results.read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
    except ValueError as exc:
        raise RunDirError(f"{run_dir}: cannot read the run ({exc})") from exc
    return run_meta, rows
