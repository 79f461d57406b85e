"""The main job's cheap parts: its sample request is valid, and missing data is a clear error."""

from decider.schemas.decision import parse_decision_request
from decider_dev import demo


def test_sample_request_is_a_valid_decision_request():
    request = parse_decision_request(demo.SAMPLE_REQUEST)
    assert [q.key for q in request.questions] == ["team", "anger", "refund"]
    assert [q.type for q in request.questions] == ["choice", "score", "noul"]


def test_missing_jevbench_data_is_reported_before_starting_anything(tmp_path, capsys):
    code = demo.main(["--cases", str(tmp_path / "none.jsonl"), "--gold", str(tmp_path / "none.jsonl")])
    assert code == 2
    assert "JevBench data not found" in capsys.readouterr().out


def test_default_data_paths_point_at_the_packaged_cases_and_the_gold_copy():
    assert demo.DEFAULT_CASES.parts[-4:] == ("jevbench", "suites", "jevbench-240", "cases.jsonl")
    assert demo.DEFAULT_GOLD.parts[-3:] == ("data", "jevbench", "gold.jsonl")
    assert demo.DEFAULT_OUT.parent.name == "runs"  # git-ignored
