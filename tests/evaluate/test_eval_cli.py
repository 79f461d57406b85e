"""The whole CLI (run, report, compare, calibrate) against a small fake decision server over real HTTP.

The fake server answers deterministically from a hash of the question, with raw logits in the extension
block, and refuses choice questions with 3 options (422), so error recording is exercised end to end.
The real server is exercised in test_eval_e2e_server.py.
"""

import hashlib
import json
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from decider_cli.evaluate.cli import main
from decider_cli.evaluate.results import load_run


def fake_logits(text: str, n: int, bias: float) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [(digest[i] / 255.0) * 4.0 - 2.0 + (bias if i == 0 else 0.0) for i in range(n)]


def make_handler(bias: float, seen: list):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep test output quiet
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers.get("X-Amzn-SageMaker-Custom-Attributes"), body))
            answers = {}
            for key, q in body["questions"].items():
                if q["type"] == "choice" and len(q["criteria"]) == 3:
                    return self.reply(
                        422,
                        {
                            "error": {
                                "type": "invalid_request_error",
                                "code": "option_count_unsupported",
                                "message": "3 options",
                                "param": f"questions.{key}.criteria",
                            }
                        },
                    )
                labels = {"noul": ["true", "false"], "choice": list(q.get("criteria") or [])}.get(
                    q["type"], [str(i) for i in range(len(q.get("criteria") or []))]
                )
                z = fake_logits(q["instructions"] + key, len(labels), bias)
                exps = [math.exp(v) for v in z]
                probs = {label: e / sum(exps) for label, e in zip(labels, exps, strict=True)}
                ext = {"option_logits": dict(zip(labels, z, strict=True)), "temperature": 1.0}
                if q["type"] == "noul":
                    answers[key] = {"type": "noul", "noul": probs["true"], "extensions": ext}
                else:
                    answers[key] = {
                        "type": q["type"],
                        "probabilities": probs,
                        "confidence": 0.0,
                        "extensions": ext,
                    }
            return self.reply(200, {"model": f"fake@{bias}", "answers": answers, "usage": {}})

        def reply(self, status: int, payload: dict) -> None:
            raw = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    return Handler


@pytest.fixture
def fake_server():
    servers = []

    def start(bias: float = 0.0):
        seen: list = []
        server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(bias, seen))
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", seen

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def labelled_file(tmp_path, n: int = 40):
    rows = []
    for i in range(n):
        options = (
            {"a": "first", "b": "second", "c": "third"}
            if i == 3
            else {"a": "1", "b": "2", "c": "3", "d": "4"}
        )
        rows.append(
            {
                "id": f"case-{i}",
                "domain": "alpha" if i % 2 else "beta",
                "request": {
                    "state": f"state {i}",
                    "questions": {
                        "flag": {"type": "noul", "instructions": f"flag {i}?"},
                        "pick": {"type": "choice", "instructions": f"pick {i}", "criteria": options},
                        "level": {
                            "type": "score",
                            "instructions": f"level {i}",
                            "criteria": ["lo", "mid", "hi"],
                        },
                    },
                },
                "expected": {"flag": i % 2 == 0, "pick": "a" if i % 3 else "unknown", "level": i % 3},
            }
        )
    path = tmp_path / "labelled.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_run_report_compare_calibrate(fake_server, tmp_path, capsys):
    url_a, seen_a = fake_server(0.0)
    url_b, _ = fake_server(1.5)
    cases = labelled_file(tmp_path)
    run_a, run_b = tmp_path / "a", tmp_path / "b"

    assert (
        main(
            [
                "run",
                "--target",
                url_a,
                "--cases",
                str(cases),
                "--out",
                str(run_a),
                "--warmup",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.startswith("p50=") and " p95=" in last and " accuracy=" in last and " ece=" in last
    assert "option_count_unsupported" in out
    # warm-up + 40 requests, whole cases, through /invocations with the route, asking for extensions
    assert len(seen_a) == 42
    path, attrs, body = seen_a[-1]
    assert (path, attrs) == ("/invocations", "route=/v1/systemone")
    assert body["extensions"] is True and list(body["questions"]) == ["flag", "pick", "level"]

    meta, rows = load_run(run_a)
    assert len(meta.requests) == 40 and len(meta.warmup) == 2 and meta.model == "fake@0.0"
    assert len(rows) == 120
    errors = [r for r in rows if r.status == "error"]
    assert {(r.case_id, r.error_code, r.http_status) for r in errors} == {
        ("case-3", "option_count_unsupported", 422)
    }
    assert all(r.correct is None for r in errors)  # not counted as wrong
    assert all(r.logits is not None for r in rows if r.status == "ok")
    for name in (
        "report.html",
        "latency.png",
        "reliability.png",
        "summary.json",
        "results.jsonl",
        "run.json",
    ):
        assert (run_a / name).is_file(), name
    html = (run_a / "report.html").read_text()
    assert "data:image/png;base64," in html and "Reliability" in html

    # an existing run is not overwritten by accident
    assert main(["run", "--target", url_a, "--cases", str(cases), "--out", str(run_a), "--no-progress"]) == 2

    assert (
        main(
            [
                "run",
                "--target",
                url_b,
                "--cases",
                str(cases),
                "--out",
                str(run_b),
                "--concurrency",
                "4",
                "--route",
                "direct",
                "--no-progress",
            ]
        )
        == 0
    )
    capsys.readouterr()

    assert main(["report", str(run_a)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == last

    assert main(["compare", str(run_a), str(run_b), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "argmax agreement" in out and "Questions where the argmax differs" in out
    comparison = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert comparison["same_order"] is True and comparison["common_questions"] == 117
    assert 0 < len(comparison["flips"]) < 117
    assert all(f["argmax_a"] != f["argmax_b"] for f in comparison["flips"])
    assert (tmp_path / "cmp" / "compare.html").is_file()

    assert main(["calibrate", str(run_a), "--min-samples", "20"]) == 0
    out = capsys.readouterr().out
    assert "ECE before" in out
    calibration = json.loads((run_a / "calibration.json").read_text())
    assert [t["type"] for t in calibration["types"]] == ["noul", "choice", "score"]
    for env_name in calibration["env"]:
        assert env_name in out and env_name.startswith("DECIDER_TEMPERATURE_")
    if calibration["cdk_command"]:
        assert calibration["cdk_command"].startswith("npx cdk deploy CpuStack -c cpu.container.temperature_")


def test_unreachable_target_stops_after_three_transport_errors(tmp_path, capsys):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = tmp_path / "dead"
    code = main(
        [
            "run",
            "--target",
            f"http://127.0.0.1:{port}",
            "--cases",
            str(labelled_file(tmp_path, 10)),
            "--out",
            str(run),
            "--warmup",
            "0",
            "--no-progress",
        ]
    )
    assert code == 1
    meta, rows = load_run(run)
    assert len(meta.requests) == 3 and "transport failures in a row" in meta.aborted
    assert {r.error_code for r in rows} == {"connection_error"}
    assert "run stopped early" in capsys.readouterr().out


def test_bad_input_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    assert (
        main(["run", "--target", "http://127.0.0.1:1", "--cases", str(bad), "--out", str(tmp_path / "o")])
        == 2
    )
    assert "bad.jsonl:1: not JSON" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2


def test_time_box_and_an_empty_run_do_not_crash(fake_server, tmp_path, capsys):
    url, seen = fake_server(0.0)
    run = tmp_path / "boxed"
    code = main(
        [
            "run",
            "--target",
            url,
            "--cases",
            str(labelled_file(tmp_path, 5)),
            "--out",
            str(run),
            "--warmup",
            "0",
            "--max-seconds",
            "0",
            "--no-progress",
        ]
    )
    assert code == 0 and seen == []
    out = capsys.readouterr().out
    assert "0 of 5 cases sent" in out
    assert out.strip().splitlines()[-1] == "p50=n/a p95=n/a accuracy=n/a ece=n/a"
    assert (run / "report.html").is_file()
