"""Replies become rows; rows become the summary (unknown golds, errors and abstentions by hand)."""

import pytest

from decider_cli.evaluate.cases import UNKNOWN, EvalItem, QuestionSpec
from decider_cli.evaluate.results import RequestRecord, RunMeta, logits_from_answer, rows_from_reply
from decider_cli.evaluate.summary import headline, is_abstention, summarize
from decider_cli.evaluate.targets import Reply

NOUL = QuestionSpec("n", "noul", ("true", "false"))
CHOICE = QuestionSpec("c", "choice", ("a", "b", "c"))
SCORE = QuestionSpec("s", "score", ("0", "1", "2"))


def item(item_id: str, domain: str, gold: dict) -> EvalItem:
    return EvalItem(item_id, domain, {"state": "s", "questions": {}}, [NOUL, CHOICE, SCORE], gold)


def answers(p_true: float, choice: dict, score: dict) -> dict:
    return {
        "model": "m@1",
        "answers": {
            "n": {"type": "noul", "noul": p_true},
            "c": {
                "type": "choice",
                "choice": max(choice, key=choice.get),
                "probabilities": choice,
                "confidence": 0.0,
            },
            "s": {"type": "score", "score": 0.0, "probabilities": score, "confidence": 0.0},
        },
    }


def meta_for(latencies: list[float], wall: float, errors: dict[int, str] | None = None) -> RunMeta:
    errors = errors or {}
    return RunMeta(
        target="t",
        target_description="t",
        cases_path="c",
        cases_sha256="0" * 64,
        gold_path=None,
        args={},
        started_at="now",
        wall_s=wall,
        requests=[
            RequestRecord(
                index=i, case_id=f"x{i}", latency_s=t, http_status=200, error_code=errors.get(i), questions=3
            )
            for i, t in enumerate(latencies)
        ],
        warmup=[RequestRecord(index=0, case_id="x0", latency_s=9.0, http_status=200, questions=3)],
    )


def test_summary_by_hand():
    item0 = item("x0", "d1", {"n": "true", "c": "a", "s": "2"})
    item1 = item("x1", "d2", {"n": "false", "c": UNKNOWN, "s": "0"})
    item2 = item("x2", "d2", {"n": "true", "c": "b", "s": "1"})
    rows = (
        rows_from_reply(
            item0,
            Reply(1.0, 200, answers(0.9, {"a": 0.6, "b": 0.3, "c": 0.1}, {"0": 0, "1": 0.5, "2": 0.5})),
            0,
        )
        + rows_from_reply(
            item1,
            Reply(2.0, 200, answers(0.7, {"a": 0.2, "b": 0.2, "c": 0.6}, {"0": 1.0, "1": 0, "2": 0})),
            1,
        )
        + rows_from_reply(item2, Reply(4.0, 422, None, "option_count_unsupported", "too many"), 2)
    )
    summary = summarize(meta_for([1.0, 2.0, 4.0], wall=7.0, errors={2: "option_count_unsupported"}), rows)

    # errors are recorded apart, never counted as wrong
    assert summary.errors == 3 and summary.answered == 6
    assert summary.error_requests_by_code == {"option_count_unsupported": 1}
    assert summary.error_questions_by_code == {"option_count_unsupported": 3}
    # unknown gold: answered but not scored
    assert summary.unknown_gold == 1 and summary.unknown_by_type == {"choice": 1}
    assert summary.unknown_mean_confidence == pytest.approx(0.6)
    # scored: x0 n (true, p=.9) ok; x0 c (a) ok; x0 s: argmax tie "1"/"2" -> "1" != "2" wrong;
    #         x1 n: p(true)=.7 -> true != false wrong; x1 s: 0 ok  => 3 / 5
    assert summary.overall.scored == 5 and summary.overall.correct == 3
    assert summary.overall.accuracy == pytest.approx(0.6)
    assert summary.by_type["noul"].accuracy == pytest.approx(0.5)
    assert summary.by_domain["d1"].accuracy == pytest.approx(2 / 3)
    # Brier: noul .02 + 1.0*... computed by hand
    briers = [0.1**2 * 2, 0.4**2 + 0.3**2 + 0.1**2, 0 + 0.5**2 + 0.5**2, 0.7**2 * 2, 0.0]
    assert summary.overall.brier == pytest.approx(sum(briers) / 5)
    # chance: noul 1/2 (x2), choice 1/3, score 1/3 (x2)
    assert summary.overall.chance == pytest.approx((0.5 * 2 + 1 / 3 * 3) / 5)
    # ordinal MAE: |1.5 - 2| and |0 - 0|
    assert summary.ordinal_mae == pytest.approx(0.25) and summary.score_questions == 2
    # x1 noul p=0.7 is an abstention, x0 noul p=0.9 is not
    assert summary.noul_abstention_rate == pytest.approx(0.5)
    # latency: warm-up excluded from percentiles, reported as first request
    assert summary.latency.p50 == pytest.approx(2.0) and summary.latency.first_request_s == 9.0
    assert summary.decisions_per_s == pytest.approx(6 / 7.0)
    assert headline(summary) == "p50=2.000 p95=3.800 accuracy=0.6000 ece=" + f"{summary.overall.ece:.4f}"


def test_invalid_or_missing_answers_are_errors_not_wrong():
    body = answers(
        0.5, {"a": 0.5, "b": 0.5}, {"0": 0.2, "1": 0.2, "2": 0.2}
    )  # choice lacks "c"; score sums to .6
    del body["answers"]["n"]
    rows = rows_from_reply(item("x", "d", {"n": "true", "c": "a", "s": "0"}), Reply(1.0, 200, body), 0)
    assert [(r.status, r.error_code) for r in rows] == [
        ("error", "missing_answer"),
        ("error", "invalid_answer"),
        ("error", "invalid_answer"),
    ]
    assert all(r.correct is None for r in rows)


def test_abstention_band_is_open():
    rows = rows_from_reply(
        item("x", "d", {}),
        Reply(1.0, 200, answers(0.2, {"a": 1, "b": 0, "c": 0}, {"0": 1, "1": 0, "2": 0})),
        0,
    )
    assert not is_abstention(rows[0])  # exactly 0.2 is outside (0.2, 0.8)
    assert not is_abstention(rows[1])  # choice never abstains


def test_logits_from_extension_block_dict_or_list():
    assert logits_from_answer({"extensions": {"option_logits": {"true": 1.5, "false": -2}}}, NOUL) == {
        "true": 1.5,
        "false": -2.0,
    }
    assert logits_from_answer(
        {"extensions": {"option_logits": [3, 2, 1], "option_keys": ["c", "b", "a"]}}, CHOICE
    ) == {
        "a": 1.0,
        "b": 2.0,
        "c": 3.0,
    }
    assert logits_from_answer({"extensions": {"option_logits": [0.1, 0.2, 0.3]}}, SCORE) == {
        "0": 0.1,
        "1": 0.2,
        "2": 0.3,
    }
    assert logits_from_answer({}, NOUL) is None
    assert (
        logits_from_answer({"extensions": {"option_logits": {"true": float("nan"), "false": 0}}}, NOUL)
        is None
    )
