"""Load evaluation items: JevBench cases (+ gold), labelled decisions, or Benchmark Heaven tasks.

Every format becomes a list of `EvalItem`s: one decision request (sent whole, as a user would) plus, per
question, its label set and its normalized gold label. Labels are strings: noul "true"/"false", choice the
option keys, score "0".."n-1". A gold of "unknown" is kept as `UNKNOWN`; no gold at all is `None`.

Formats (auto-detected per line, see `.drafts/evaluate.md`):
- JevBench case: {"id", "state", "questions", "domain"?, ...}; gold from `--gold` ({"id", "gold": {key: v}})
  or an inline "gold" object.
- Labelled decision: {"id"?, "domain"?, "request": {"state", "questions", ...}, "expected": {key: v}}.
- Benchmark Heaven task: {"id", "family", "state", "question", "expected"}; sent under the key "decision".
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decider_cli.evaluate.jevbench import gold_for

UNKNOWN = "unknown"
QUESTION_TYPES = ("noul", "choice", "score")
NOUL_LABELS = ("true", "false")
_NOUL_GOLD = {True: "true", False: "false", "true": "true", "false": "false", "yes": "true", "no": "false"}


class CaseFileError(ValueError):
    """A cases or gold file cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class QuestionSpec:
    key: str
    type: str
    labels: tuple[str, ...]


@dataclass
class EvalItem:
    item_id: str
    domain: str
    request: dict[str, Any]
    questions: list[QuestionSpec]
    gold: dict[str, str | None] = field(default_factory=dict)


def labels_for(question: Mapping[str, Any], where: str) -> QuestionSpec:
    """The label set of one question, validating only what the evaluation needs."""
    qtype = question.get("type")
    key = where.rsplit(".", 1)[-1]
    if qtype not in QUESTION_TYPES:
        raise CaseFileError(f"{where}: type must be one of {QUESTION_TYPES}, got {qtype!r}")
    criteria = question.get("criteria")
    if qtype == "noul":
        return QuestionSpec(key, qtype, NOUL_LABELS)
    if qtype == "choice":
        if not isinstance(criteria, Mapping) or len(criteria) < 2:
            raise CaseFileError(f"{where}: choice criteria must be an object with at least 2 options")
        return QuestionSpec(key, qtype, tuple(str(k) for k in criteria))
    if not isinstance(criteria, list) or len(criteria) < 2:
        raise CaseFileError(f"{where}: score criteria must be a list of at least 2 levels")
    return QuestionSpec(key, qtype, tuple(str(i) for i in range(len(criteria))))


def normalize_gold(spec: QuestionSpec, value: Any, where: str) -> str | None:
    """Map a gold value to one of the question's labels, `UNKNOWN`, or None (unlabelled)."""
    if value is None:
        return None
    if value == UNKNOWN:
        return UNKNOWN
    if spec.type == "noul":
        if isinstance(value, bool | str) and value in _NOUL_GOLD:
            return _NOUL_GOLD[value]
    elif spec.type == "choice":
        if isinstance(value, str) and value in spec.labels:
            return value
    elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(spec.labels):
        return str(value)
    raise CaseFileError(
        f"{where}: gold {value!r} is not valid for a {spec.type} question with labels {spec.labels}"
    )


def _read_jsonl(path: Path) -> Iterable[tuple[int, dict[str, Any]]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CaseFileError(f"{path}: cannot read ({exc.strerror})") from exc
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CaseFileError(f"{path}:{number}: not JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise CaseFileError(f"{path}:{number}: each line must be a JSON object")
        yield number, record


def load_gold(path: Path) -> dict[str, dict[str, Any]]:
    """JevBench gold file: one {"id", "gold": {key: value}} per line."""
    gold: dict[str, dict[str, Any]] = {}
    for number, record in _read_jsonl(path):
        if not isinstance(record.get("id"), str) or not isinstance(record.get("gold"), dict):
            raise CaseFileError(f"{path}:{number}: expected {{'id': str, 'gold': {{key: value}}}}")
        gold[record["id"]] = record["gold"]
    return gold


def default_gold_path(cases_path: Path) -> Path | None:
    """The gold labels that go with a JevBench cases file, when there are any
    (decider_cli.evaluate.jevbench)."""
    return gold_for(cases_path)


def _item_from_record(
    record: dict[str, Any], where: str, gold_by_id: Mapping[str, Mapping[str, Any]] | None
) -> EvalItem:
    if "request" in record:  # labelled decision
        request = record["request"]
        if not isinstance(request, dict):
            raise CaseFileError(f"{where}: 'request' must be an object")
        expected = record.get("expected") or {}
        item_id = str(record.get("id", where))
        domain = str(record.get("domain", "default"))
    elif "question" in record and "questions" not in record:  # Benchmark Heaven task
        request = {"state": record.get("state"), "questions": {"decision": record["question"]}}
        expected = {"decision": record.get("expected")}
        item_id = str(record.get("id", where))
        domain = str(record.get("family") or "default")
    else:  # JevBench case
        if "id" not in record:
            raise CaseFileError(f"{where}: a case needs an 'id' (or use the labelled format with 'request')")
        item_id = str(record["id"])
        request = {"state": record.get("state"), "questions": record.get("questions")}
        domain = str(record.get("domain", "default"))
        if gold_by_id is not None:
            if item_id not in gold_by_id:
                raise CaseFileError(f"{where}: case {item_id!r} has no entry in the gold file")
            expected = gold_by_id[item_id]
        else:
            expected = record.get("gold") or {}
    questions = request.get("questions")
    if not isinstance(questions, dict) or not questions:
        raise CaseFileError(f"{where}: 'questions' must be a non-empty object")
    if not isinstance(expected, dict):
        raise CaseFileError(f"{where}: expected answers must be an object keyed by question key")
    unknown_keys = set(expected) - set(questions)
    if unknown_keys:
        raise CaseFileError(f"{where}: expected answers for keys not in the request: {sorted(unknown_keys)}")
    specs = []
    gold: dict[str, str | None] = {}
    for key, question in questions.items():
        if not isinstance(question, Mapping):
            raise CaseFileError(f"{where}: questions.{key} must be an object")
        spec = labels_for(question, f"{where}: questions.{key}")
        spec = QuestionSpec(key, spec.type, spec.labels)
        specs.append(spec)
        gold[key] = normalize_gold(spec, expected.get(key), f"{where}: gold for {key!r}")
    return EvalItem(item_id, domain, dict(request), specs, gold)


def load_items(cases_path: Path, gold_path: Path | None = None) -> list[EvalItem]:
    """Every item of a cases file, in file order."""
    gold_by_id = load_gold(gold_path) if gold_path is not None else None
    items = [
        _item_from_record(record, f"{cases_path.name}:{number}", gold_by_id)
        for number, record in _read_jsonl(cases_path)
    ]
    if not items:
        raise CaseFileError(f"{cases_path}: no cases")
    seen: set[str] = set()
    for item in items:
        if item.item_id in seen:
            raise CaseFileError(f"{cases_path}: duplicate case id {item.item_id!r}")
        seen.add(item.item_id)
    return items


def select_items(items: list[EvalItem], *, limit: int | None, seed: int | None) -> list[EvalItem]:
    """The items to send: shuffled reproducibly when a seed is given, then the first `limit`.

    The same (file, seed, limit) gives the same items in the same order on every target.
    """
    chosen = list(items)
    if seed is not None:
        random.Random(seed).shuffle(chosen)
    return chosen[:limit] if limit is not None else chosen


def build_request(
    item: EvalItem,
    *,
    extensions: bool = True,
    model: str | None = None,
    permutations: int | None = None,
    mode: str | None = None,
) -> dict[str, Any]:
    """The body sent for one item: the case's request, asking for the extension block (raw logits)."""
    body = dict(item.request)
    if model is not None:
        body["model"] = model
    if extensions:
        body["extensions"] = True
    if permutations is not None:
        body["permutations"] = permutations
    if mode is not None:
        body["mode"] = mode
    return body
