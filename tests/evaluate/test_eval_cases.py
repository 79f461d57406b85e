"""Loading JevBench cases + gold, labelled decisions and Benchmark Heaven tasks."""

import json

import pytest

from decider_cli.evaluate.cases import (
    UNKNOWN,
    CaseFileError,
    build_request,
    default_gold_path,
    load_items,
    select_items,
)


def test_jevbench_cases_and_gold_load_with_the_documented_counts(jevbench_cases):
    gold_path = default_gold_path(jevbench_cases)
    assert gold_path is not None and gold_path.name == "gold.jsonl"
    items = load_items(jevbench_cases, gold_path)
    assert len(items) == 240
    golds = [(q.type, item.gold[q.key]) for item in items for q in item.questions]
    assert len(golds) == 2240
    assert sum(1 for _, g in golds if g == UNKNOWN) == 302
    assert sum(1 for t, g in golds if t == "noul" and g in ("true", "false")) == 1152
    first = items[0]
    assert first.item_id == "customer_support-037" and first.domain == "customer_support"
    assert first.gold["deadline_given"] == "true" and first.gold["churn_risk"] == "1"
    assert first.gold["primary_team"] == "engineering"
    # the request is exactly the case's state and questions, in order
    assert list(first.request) == ["state", "questions"]
    assert [q.key for q in first.questions] == list(first.request["questions"])


def test_select_items_is_reproducible_and_respects_limit(jevbench_cases):
    items = load_items(jevbench_cases)
    a = select_items(items, limit=10, seed=7)
    b = select_items(items, limit=10, seed=7)
    assert [i.item_id for i in a] == [i.item_id for i in b]
    assert len({i.domain for i in a}) > 1  # shuffled across domains
    assert [i.item_id for i in select_items(items, limit=3, seed=None)] == [i.item_id for i in items[:3]]


def test_labelled_decisions_format(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {
            "id": "t1",
            "domain": "support",
            "request": {
                "state": "Refund please, it broke.",
                "questions": {
                    "refund": {"type": "noul", "instructions": "Refund asked?"},
                    "team": {
                        "type": "choice",
                        "instructions": "Team?",
                        "criteria": {"billing": "$", "tech": None},
                    },
                    "anger": {
                        "type": "score",
                        "instructions": "Anger?",
                        "criteria": ["calm", "civil", "angry"],
                    },
                },
                "permutations": 2,
            },
            "expected": {"refund": "yes", "team": "billing", "anger": 2},
        },
        {"request": {"state": "x", "questions": {"q": {"type": "noul", "instructions": "?"}}}},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    items = load_items(path)
    assert items[0].gold == {"refund": "true", "team": "billing", "anger": "2"}
    assert items[0].questions[2].labels == ("0", "1", "2")
    assert items[1].gold == {"q": None} and items[1].domain == "default"
    body = build_request(items[0], model="jev-latest")
    assert body["extensions"] is True and body["permutations"] == 2 and body["model"] == "jev-latest"
    assert "extensions" not in items[0].request  # the item itself is not modified


def test_benchmark_heaven_task_format(tmp_path):
    path = tmp_path / "bh.jsonl"
    record = {
        "id": "n",
        "family": "policy",
        "state": "s",
        "split": "public",
        "group": None,
        "question": {"type": "noul", "instructions": "q", "criteria": {"true": "PASS", "false": "FAIL"}},
        "labels": ["no", "yes"],
        "expected": "yes",
    }
    path.write_text(json.dumps(record) + "\n")
    (item,) = load_items(path)
    assert item.request["questions"] == {"decision": record["question"]}
    assert item.gold == {"decision": "true"} and item.domain == "policy"


@pytest.mark.parametrize(
    ("question", "expected", "message"),
    [
        ({"type": "choice", "instructions": "?", "criteria": {"a": "", "b": ""}}, "c", "not valid"),
        ({"type": "score", "instructions": "?", "criteria": ["lo", "hi"]}, True, "not valid"),
        ({"type": "score", "instructions": "?", "criteria": ["lo", "hi"]}, 2, "not valid"),
        ({"type": "noul", "instructions": "?"}, "maybe", "not valid"),
        ({"type": "rank", "instructions": "?"}, None, "type must be one of"),
    ],
)
def test_invalid_gold_or_question_is_a_clear_error(tmp_path, question, expected, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"request": {"state": "s", "questions": {"q": question}}, "expected": {"q": expected}})
    )
    with pytest.raises(CaseFileError, match=message):
        load_items(path)


def test_file_errors_name_the_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"id": "a", "state": "s", "questions": {"q": {"type": "noul"}}}\nnot json\n')
    with pytest.raises(CaseFileError, match=r"broken.jsonl:2: not JSON"):
        load_items(path)
    with pytest.raises(CaseFileError, match="cannot read"):
        load_items(tmp_path / "missing.jsonl")
    gold = tmp_path / "gold.jsonl"
    gold.write_text(json.dumps({"id": "other", "gold": {}}) + "\n")
    path.write_text('{"id": "a", "state": "s", "questions": {"q": {"type": "noul"}}}\n')
    with pytest.raises(CaseFileError, match="no entry in the gold file"):
        load_items(path, gold)
