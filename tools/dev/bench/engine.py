"""Engine benchmark (`make bench-engine`): shared fan-out vs fresh prefill vs the text route, prompt
v2 vs v1, the batch-invariant opt-in vs the default kernels, choice questions with 128 and 255
options, and the admission estimate against measured times.

Two workloads, measured side by side in one run:

- W1: a stated subset of the JevBench-240 cases (each about 9 questions on a 250-650 token state).
- W2: one ~2,000-token state made of concatenated JevBench-240 case states, with 21 of their questions.

On the default engine (throughput kernels, prompt `decider-options-v1`), per workload: decisions/s
in fresh and shared mode and their ratio; the ideal ratio (fresh tokens / shared tokens); the
engine's shared-mode time against the physical limit (`engine_vs_limit`: the same tokens decoded by
llama.cpp alone as one plain sequence after the prompt head, `n_batch` tokens per decode, with its
throughput kernels, on a plain context of its own); and decisions/s against the text route, i.e.
one greedy chat completion per question that generates the option's letter, as a user of a chat
endpoint would.

Also on W1: a second engine with `decider-options-v2` (shared and fresh), for `v2_vs_v1` (v1 time /
v2 time), the token ratio and both versions' shared-vs-fresh max |Δp|. On W1 and W2: the
batch-invariant engine (`batch_invariant=True`, the opt-in) for `invariant_cost` (time invariant /
time default). ggml reads `GGML_CPU_TILED_MM_FORCE` once per process, at the first K-quant matmul,
and a batch-invariant engine sets it; so that engine always runs in a child process, and this one
never has it (exact for K-quant models such as Gemma 3, harmless for SmolLM2).
Then one choice question with 128 and with 255 options on one JevBench state (default engine), and
the admission check: three requests of about 500, 2,000 and 4,500 tokens, the scheduler's estimate
(fitted to every decode of the run) against the measured time (`admission_<n>` = estimate / time).

Every fresh question is an independent prefill, so on W2 fresh mode and the text route are timed on
the first few questions only (`--w2-sample`) and reported as rates.
The data set is JevBench (Apache-2.0): the `jevbench` package's cases (decider_cli.evaluate.jevbench).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from decider.engine import DecisionEngine
from decider.engine.model.bundled import smollm2_path
from decider.engine.model.modelfile import resolve_model_file
from decider.engine.model.native import ContextConfig, LlamaRuntime, Row
from decider.engine.model.prompt import PROMPT_V1, PROMPT_V2, SYSTEM_PROMPT
from decider.engine.works.decisions import DecisionPlanner
from decider.invariance import DEFAULT_UBATCH, BatchPolicy
from decider.schemas.decision import DecisionRequest, parse_decision_request
from decider.server.answers import decide
from decider.settings import Settings
from decider_cli.evaluate.jevbench import JEVBENCH_240_CASES
from decider_dev import REPO_ROOT
from decider_dev.bench.common import (
    NO_CACHES,
    Distributions,
    argmax_agreement,
    best_of,
    distributions,
    key_values,
    load_cases,
    max_abs_delta,
    model_settings,
    ratio,
    request_body,
    spread,
)

CASES = JEVBENCH_240_CASES
TEXT_ROUTE_MAX_TOKENS = 4  # a letter (1-2 tokens) plus end of turn
OPTION_COUNTS = (128, 255)
ADMISSION_TOKENS = (500, 2000, 4500)
TILED_ENV = "GGML_CPU_TILED_MM_FORCE"
HEAD_SEQ, RAW_SEQ = 0, 1  # the plain context's two sequences: the prompt head, and the timed tokens
# Option descriptions of the many-options question: short, distinct routing targets.
AREAS = (
    "Billing",
    "Refunds",
    "Login and access",
    "Data export",
    "Integrations",
    "Mobile app",
    "Performance",
    "Security review",
    "Account closure",
    "Plan changes",
    "Invoices",
    "Onboarding",
    "API errors",
    "Notifications",
    "Reporting",
    "Legal and privacy",
)


@dataclass(frozen=True)
class Workload:
    name: str
    bodies: list[dict[str, Any]]  # {"id", "state", "questions"}
    sample: int | None  # questions timed in fresh mode and on the text route (None: all)


@dataclass
class Timed:
    """One kind of run over a workload: best-of-repeats seconds summed over its requests."""

    seconds: float = 0.0
    questions: int = 0
    tokens: int = 0  # tokens the engine decodes (the plans' cost)
    answers: dict[str, Distributions] = field(default_factory=dict)  # request id -> distributions

    @property
    def rate(self) -> float:
        return ratio(self.questions, self.seconds)

    def add(self, part: Timed) -> None:
        """Count `part` (another request's run) in this one."""
        self.seconds += part.seconds
        self.questions += part.questions
        self.tokens += part.tokens
        self.answers.update(part.answers)


# --- workloads ------------------------------------------------------------------------------------
def build_w2(
    engine: DecisionEngine, cases: list[dict[str, Any]], target_tokens: int, questions: int
) -> dict[str, Any]:
    """One long state from consecutive case states, and `questions` questions taken from those cases."""
    parts: list[str] = []
    picked: dict[str, Any] = {}
    for case in cases:
        parts.append(case["state"])
        for key, question in case["questions"].items():
            picked[f"{case['id']}.{key}"] = question
        if engine.count_tokens("\n\n---\n\n".join(parts)) >= target_tokens and len(picked) >= questions:
            break
    return {
        "id": "W2",
        "state": "\n\n---\n\n".join(parts),
        "questions": dict(list(picked.items())[:questions]),
    }


def workloads(engine: DecisionEngine, args: argparse.Namespace) -> list[Workload]:
    cases = load_cases(CASES)
    w2 = build_w2(engine, cases, args.w2_tokens, args.w2_questions)
    return [Workload("W1", spread(cases, args.w1_cases), None), Workload("W2", [w2], args.w2_sample)]


def parse(body: dict[str, Any], limit: int | None = None, **fields: Any) -> DecisionRequest:
    request = parse_decision_request(request_body(body, **fields))
    if limit:
        request = request.model_copy(update={"questions": request.questions[:limit]})
    return request


# --- measurements ---------------------------------------------------------------------------------
def decide_run(
    engine: DecisionEngine, workload: Workload, mode: str, repeats: int, *, sampled: bool
) -> Timed:
    """`decide()` every request of the workload in `mode` (the first `sample` questions if `sampled`)."""
    out = Timed()
    for body in workload.bodies:
        request = parse(body, workload.sample if sampled else None, mode=mode)
        seconds, response = best_of(repeats, lambda request=request: decide(engine, request))
        out.seconds += seconds
        out.questions += len(request.questions)
        out.tokens += engine.plan_decision(request).cost_tokens
        out.answers[body["id"]] = distributions(response.to_wire())
    return out


def plain_sequence(engine: DecisionEngine, body: dict[str, Any]) -> list[int]:
    """The tokens shared mode decodes for a request (state prefix, then every question's tail)."""
    state = engine.plan_decision(parse(body, mode="shared")).states[0]
    return [*state.prefix, *(token for item in state.items for token in item.tokens)]


class PlainLlama:
    """llama.cpp alone, the limit: one plain context (two sequences, throughput kernels, llama.cpp's
    default micro-batch), the prompt head decoded once in HEAD_SEQ."""

    def __init__(self, settings: Settings, head: list[int]) -> None:
        policy = BatchPolicy(False, settings.logical_batch, min(DEFAULT_UBATCH, settings.logical_batch), 2)
        config = ContextConfig(settings.n_ctx, policy, settings.threads(), settings.n_gpu_layers, True)
        self.runtime = LlamaRuntime(resolve_model_file(settings), config)
        self.offset = len(head)
        for start in range(0, len(head), policy.step_tokens):
            self.runtime.decode([Row(HEAD_SEQ, head[start : start + policy.step_tokens], start)])

    def seconds(self, tokens: list[int]) -> float:
        """`tokens` as one plain sequence after the head, n_batch tokens per decode."""
        runtime, size = self.runtime, self.runtime.policy.step_tokens
        runtime.seq_copy(HEAD_SEQ, RAW_SEQ)
        try:
            started = time.perf_counter()
            for start in range(0, len(tokens), size):
                runtime.decode([Row(RAW_SEQ, tokens[start : start + size], self.offset + start)])
            return time.perf_counter() - started
        finally:
            runtime.seq_remove(RAW_SEQ)

    def close(self) -> None:
        self.runtime.close()


def shared_and_raw(
    engine: DecisionEngine, plain: PlainLlama, workload: Workload, repeats: int
) -> tuple[Timed, Timed]:
    """Shared mode and the plain-sequence limit, request by request in turn (side by side: a slow
    moment of the machine falls on both, not on one), each the best of `repeats`."""
    shared, raw = Timed(), Timed()
    for body in workload.bodies:
        one = Workload(workload.name, [body], workload.sample)
        shared.add(decide_run(engine, one, "shared", repeats, sampled=False))
        raw.add(raw_run(engine, plain, one, repeats))
    return shared, raw


def raw_run(engine: DecisionEngine, plain: PlainLlama, workload: Workload, repeats: int) -> Timed:
    out = Timed()
    for body in workload.bodies:
        tokens = plain_sequence(engine, body)
        out.seconds += min(plain.seconds(tokens) for _ in range(max(1, repeats)))
        out.tokens += len(tokens)
    return out


def text_route_run(engine: DecisionEngine, workload: Workload, repeats: int) -> Timed:
    """One greedy chat completion per question, generating the option letter (the chat-endpoint way)."""
    planner = engine.planner
    fmt = planner.builder.format
    out = Timed()
    for body in workload.bodies:
        request = parse(body, workload.sample)
        conversations = []
        for question in request.questions:
            labels = planner.labels.for_count(len(question.options))
            shown = [
                (label.text, DecisionPlanner._description(question, i, fmt)) for i, label in enumerate(labels)
            ]
            user = fmt.payload(request.state, question.instructions, shown)
            conversations.append(
                [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
            )

        def run(conversations: list[list[dict[str, str]]] = conversations) -> None:
            for messages in conversations:
                engine.generate(
                    messages,
                    max_tokens=TEXT_ROUTE_MAX_TOKENS,
                    temperature=0.0,
                    top_p=1.0,
                    stop=["\n"],
                    seed=0,
                )

        seconds, _ = best_of(repeats, run)
        out.seconds += seconds
        out.questions += len(conversations)
    return out


def many_options_body(case: dict[str, Any], count: int) -> dict[str, Any]:
    criteria = {
        f"queue_{i + 1:03d}": f"{AREAS[i % len(AREAS)]}, tier {i // len(AREAS) + 1}" for i in range(count)
    }
    question = {
        "type": "choice",
        "instructions": "Which queue should handle this case?",
        "criteria": criteria,
    }
    return {"id": f"options-{count}", "state": case["state"], "questions": {"queue": question}}


def options_run(engine: DecisionEngine, case: dict[str, Any], count: int, repeats: int) -> dict[str, Any]:
    """One choice question with `count` options on one state: time, tokens, readout, decodes.

    A model whose tokenizer verifies fewer labels than `count` gets a row of NaNs (not run)."""
    if count > engine.max_options:
        nan = math.nan
        unsupported = f"unsupported (max {engine.max_options})"
        return {"options": count, "seconds": nan, "tokens": 0, "readout": unsupported, "decodes": 0,
                "top_p": nan, "sum_p": nan}  # fmt: skip
    request = parse(many_options_body(case, count), extensions=True)
    seconds, response = best_of(repeats, lambda: decide(engine, request))
    answer = response.answers["queue"]
    return {
        "options": count,
        "seconds": seconds,
        "tokens": engine.plan_decision(request).cost_tokens,
        "readout": answer.extensions["readout"],
        "decodes": response.extensions["decodes"],
        "top_p": max(answer.probabilities.values()),
        "sum_p": sum(answer.probabilities.values()),
    }


def admission_run(engine: DecisionEngine, cases: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The scheduler's estimate for requests of about ADMISSION_TOKENS tokens, against their time."""
    rows = []
    for target in ADMISSION_TOKENS:
        body = build_w2(engine, cases, target, 3)
        request = parse(body)
        work = engine.decision_work(engine.plan_decision(request))
        predicted = engine._local.admission.costs.predict(work.cost)  # the decide() runs fitted it
        seconds, _ = best_of(1, lambda request=request: decide(engine, request))
        rows.append({"tokens": work.cost.tokens, "predicted": predicted, "seconds": seconds})
    return rows


# --- the batch-invariant engine, in a child process -------------------------------------------------
def invariant_worker(args: argparse.Namespace) -> int:
    """Child process: shared mode on W1 and W2, and the many-option questions, with the
    batch-invariant opt-in and, request by request in turn, with the default engine (side by side,
    so that `invariant_cost` does not depend on when the machine was busy); JSON out.

    Both engines share the process's kernel choice: exact for SmolLM2 (Q4_1 has no K-quant tiled
    path), while on a K-quant model the default engine here also runs the forced tiled matmul."""
    fields = {**model_settings(args, smollm2_path()), **NO_CACHES}
    engine = DecisionEngine.load(Settings(**fields, prompt_version=PROMPT_V1, batch_invariant=True))
    default = DecisionEngine.load(Settings(**fields, prompt_version=PROMPT_V1))
    loads = workloads(engine, args)
    for warm in (engine, default):
        decide(warm, parse(loads[0].bodies[0]))  # warm-up: graph allocation, page cache
    result: dict[str, Any] = {}
    for workload in loads:
        invariant, beside = Timed(), Timed()
        for body in workload.bodies:
            one = Workload(workload.name, [body], workload.sample)
            invariant.add(decide_run(engine, one, "shared", args.repeats, sampled=False))
            beside.add(decide_run(default, one, "shared", args.repeats, sampled=False))
        result[workload.name] = {"shared": asdict(invariant), "default_shared": asdict(beside)}
    result["options"] = []
    for count in OPTION_COUNTS:
        row = options_run(engine, loads[0].bodies[0], count, args.repeats)
        row["default_seconds"] = options_run(default, loads[0].bodies[0], count, args.repeats)["seconds"]
        result["options"].append(row)
    default.close()
    engine.close()
    args.worker_out.write_text(json.dumps(result))
    return 0


def run_invariant_child(argv: list[str]) -> tuple[dict[str, dict[str, Timed]], list[dict[str, Any]]]:
    """The batch-invariant engine's runs by workload, and its many-option rows (see `invariant_worker`)."""
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        out = Path(tmp) / "invariant.json"
        command = [sys.executable, "-m", "decider_dev.bench.engine", *argv, "--worker-out", str(out)]
        subprocess.run(command, cwd=REPO_ROOT, check=True)
        raw = json.loads(out.read_text())
    options = raw.pop("options")
    runs = {name: {kind: Timed(**timed) for kind, timed in kinds.items()} for name, kinds in raw.items()}
    return runs, options


@contextlib.contextmanager
def phase(console: Console, what: str) -> Iterator[None]:
    """Say what is being measured, and how long it took (for sizing the run)."""
    console.print(f"[dim]measuring {what}…[/]", end=" ")
    started = time.perf_counter()
    yield
    console.print(f"[dim]{time.perf_counter() - started:.0f} s[/]")


# --- output -------------------------------------------------------------------------------------------
def compare(a: dict[str, Distributions], b: dict[str, Distributions]) -> tuple[int, int, float]:
    """(argmax agreements, questions, max |Δp|) over the questions b holds for each request of a."""
    same = total = 0
    worst = 0.0
    for request_id, probs in b.items():
        mine = {key: a[request_id][key] for key in probs}
        agree, count = argmax_agreement(mine, probs)
        same, total = same + agree, total + count
        worst = max(worst, max_abs_delta(mine, probs))
    return same, total, worst


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the bundled SmolLM2)")
    parser.add_argument("--w1-cases", type=int, default=4, help="JevBench-240 cases in W1 (default 4)")
    parser.add_argument(
        "--w2-tokens", type=int, default=2000, help="W2 state tokens, at least (default 2000)"
    )
    parser.add_argument("--w2-questions", type=int, default=21, help="W2 questions (default 21)")
    parser.add_argument(
        "--w2-sample", type=int, default=2, help="W2 questions timed in fresh/text mode (default 2)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: W1 1 case, W2 ~800 tokens, 8 questions, sample 1"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="time each measurement N times, keep the fastest"
    )
    parser.add_argument("--threads", type=int, default=None, help="DECIDER_N_THREADS (default: cores)")
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument(
        "--hybrid-layers", type=int, default=16, help="the hybrid model's layers (default 16)"
    )
    parser.add_argument("--hybrid-embd", type=int, default=512, help="its width (default 512)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers to this file")
    parser.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.w1_cases, args.w2_tokens, args.w2_questions, args.w2_sample = 1, 800, 8, 1
    if args.worker_out:
        return invariant_worker(args)
    if os.environ.get(TILED_ENV):
        parser.error(f"{TILED_ENV} is set: the default engine would not run its own kernels; unset it")
    console = Console(width=200)

    settings = Settings(**model_settings(args, smollm2_path()), **NO_CACHES, prompt_version=PROMPT_V1)
    engine = DecisionEngine.load(settings)
    v2 = DecisionEngine.load(
        Settings(**model_settings(args, smollm2_path()), **NO_CACHES, prompt_version=PROMPT_V2)
    )
    plain = PlainLlama(settings, engine.head_tokens)
    w1, w2 = workloads(engine, args)
    console.print(
        f"model {engine.model_info.id}, {settings.threads()} threads, n_ctx {settings.n_ctx}, "
        f"n_batch {settings.n_batch}, n_ubatch {settings.micro_batch}, batch_invariant "
        f"{settings.batch_invariant}, n_gpu_layers {settings.n_gpu_layers}, "
        f"{platform.processor() or platform.machine()}"
    )
    console.print(f"W1: {len(w1.bodies)} JevBench-240 cases ({', '.join(c['id'] for c in w1.bodies)})")
    console.print(
        f"W2: one {engine.count_tokens(w2.bodies[0]['state'])}-token state, "
        f"{len(w2.bodies[0]['questions'])} questions; fresh and text route timed on the first "
        f"{w2.sample}; best of {args.repeats} per measurement"
    )
    for warm in (engine, v2):
        decide(warm, parse(w1.bodies[0]))  # warm-up: graph allocation, page cache

    runs: dict[str, dict[str, Timed]] = {}
    for workload in (w1, w2):
        with phase(console, f"{workload.name}: fresh, shared, raw prefill, text route"):
            shared, raw = shared_and_raw(engine, plain, workload, args.repeats)
            runs[workload.name] = {
                "fresh": decide_run(engine, workload, "fresh", args.repeats, sampled=True),
                "shared": shared,
                "raw": raw,
                "text": text_route_run(engine, workload, args.repeats),
                # fresh-mode tokens of the whole workload, for the ideal ratio (fresh may be sampled)
                "fresh_all": Timed(
                    tokens=sum(
                        engine.plan_decision(parse(b, mode="fresh")).cost_tokens for b in workload.bodies
                    )
                ),
            }
    with phase(console, f"W1 with {PROMPT_V2}: shared, fresh"):
        runs["W1"]["v2_shared"] = decide_run(v2, w1, "shared", args.repeats, sampled=False)
        runs["W1"]["v2_fresh"] = decide_run(v2, w1, "fresh", args.repeats, sampled=False)
    with phase(console, f"choice questions with {' and '.join(map(str, OPTION_COUNTS))} options"):
        options = [options_run(engine, w1.bodies[0], count, args.repeats) for count in OPTION_COUNTS]
    for row in options:  # what the same question costs with the compact prompt (planned, not run)
        if row["tokens"]:
            body = many_options_body(w1.bodies[0], row["options"])
            row["v2_tokens"] = v2.plan_decision(parse(body)).cost_tokens
    with phase(console, f"admission estimates at {', '.join(map(str, ADMISSION_TOKENS))} tokens"):
        admission = admission_run(engine, load_cases(CASES))
    plain.close()
    v2.close()
    engine.close()

    invariant: dict[str, dict[str, Timed]] | None = None
    if settings.n_gpu_layers == 0:
        with phase(console, "the batch-invariant opt-in (child process): W1, W2, many options"):
            invariant, invariant_options = run_invariant_child(argv)
        for row, other in zip(options, invariant_options, strict=True):
            row["invariant_seconds"] = other["seconds"]
            row["default_seconds_beside"] = other["default_seconds"]

    with phase(console, f"forward passes on a {args.hybrid_layers}x{args.hybrid_embd} qwen35 (hybrid): W1"):
        passes = hybrid_passes_run(w1, args.hybrid_layers, args.hybrid_embd)
    results = report(console, runs, invariant, options, admission, settings)
    results["hybrid_passes"] = passes
    print_passes(console, passes)
    if args.json:
        args.json.write_text(json.dumps({"model": engine.model_info.id, "results": results}, indent=2))
    print(last_line(results))
    print(passes_line(passes))
    return 0


def hybrid_passes_run(workload: Workload, layers: int, embd: int) -> dict[str, dict[str, float]]:
    """W1 on the hybrid model, with and without rows of one length per decode: llama.cpp's forward
    passes (micro-batches, counted inside llama.cpp), decodes, tokens and seconds (best of 2).
    `per_decode_vs_target`: the largest passes / (2 x ceil(tokens / n_ubatch)) over the decodes."""
    from decider_dev.bench.server import hybrid_model

    model = hybrid_model(layers, embd, smollm2_path())
    settings = Settings(model_path=model, **NO_CACHES)
    engine = DecisionEngine.load(settings, count_passes=True)
    runtime = engine.runtime
    n_ubatch = settings.micro_batch
    decide(engine, parse(workload.bodies[0]))  # warm-up, and starts the private scheduler
    real = runtime.decode
    out: dict[str, dict[str, float]] = {}
    try:
        for name, equal in (("equal_rows", True), ("rows_as_planned", False)):
            engine._local.loop.equal_rows = equal
            counts = {"decodes": 0, "tokens": 0, "passes": 0, "worst": 0.0}

            def counted(rows: list[Row], counts: dict[str, Any] = counts, **kwargs: Any) -> None:
                before = runtime.passes
                real(rows, **kwargs)
                tokens = sum(len(row.tokens) for row in rows)
                passes = runtime.passes - before
                counts["decodes"] += 1
                counts["tokens"] += tokens
                counts["passes"] += passes
                counts["worst"] = max(counts["worst"], passes / (2 * math.ceil(tokens / n_ubatch)))

            runtime.decode = counted  # type: ignore[method-assign]
            seconds, _ = best_of(2, lambda: [decide(engine, parse(body)) for body in workload.bodies])
            runtime.decode = real  # type: ignore[method-assign]
            out[name] = {
                "decodes": counts["decodes"] / 2,
                "tokens": counts["tokens"] / 2,
                "passes": counts["passes"] / 2,
                "per_decode_vs_target": counts["worst"],
                "seconds": seconds,
            }
    finally:
        runtime.decode = real  # type: ignore[method-assign]
        engine.close()
    return out


def print_passes(console: Console, passes: dict[str, dict[str, float]]) -> None:
    table = Table(title="W1 on the hybrid model: forward passes (llama.cpp micro-batches) per decode")
    for column in ("rows", "decodes", "tokens", "passes", "max passes / (2×⌈tokens/n_ubatch⌉)", "seconds"):
        table.add_column(column, justify="right")
    for name, row in passes.items():
        table.add_row(
            name, f"{row['decodes']:.0f}", f"{row['tokens']:.0f}", f"{row['passes']:.0f}",
            f"{row['per_decode_vs_target']:.2f}", f"{row['seconds']:.2f}",
        )  # fmt: skip
    table.caption = "target: ≤ 1.00 with equal rows (every decode within 2×⌈tokens/n_ubatch⌉ passes)"
    console.print(table)


def passes_line(passes: dict[str, dict[str, float]]) -> str:
    equal, planned = passes["equal_rows"], passes["rows_as_planned"]
    return key_values(
        (
            ("hybrid_w1_passes", f"{equal['passes']:.0f}"),
            ("hybrid_w1_decodes", f"{equal['decodes']:.0f}"),
            ("hybrid_passes_per_decode_vs_target", equal["per_decode_vs_target"]),
            ("hybrid_passes_as_planned", f"{planned['passes']:.0f}"),
            ("hybrid_as_planned_per_decode_vs_target", planned["per_decode_vs_target"]),
            ("hybrid_equal_rows_speedup", ratio(planned["seconds"], equal["seconds"])),
        )
    )


def report(
    console: Console,
    runs: dict[str, dict[str, Timed]],
    invariant_runs: dict[str, dict[str, Timed]] | None,
    options: list[dict[str, Any]],
    admission: list[dict[str, float]],
    settings: Settings,
) -> dict[str, Any]:
    """Print the tables; return every figure by workload."""
    results: dict[str, Any] = {}
    kernels = "batch-invariant" if settings.batch_invariant else "default kernels"
    deadline = settings.deadline_seconds
    table = Table(title=f"Decision engine ({kernels}, {PROMPT_V1}): shared vs fresh vs text route")
    columns = (
        "", "questions", "fresh tok", "shared tok", "fresh dec/s", "shared dec/s", "shared/fresh", "ideal",
        "of ideal", "raw prefill tok/s", "engine/limit", "text dec/s", "decision/text", "argmax agree",
        "max |Δp|",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for name in ("W1", "W2"):
        r = runs[name]
        shared, fresh, raw, text = r["shared"], r["fresh"], r["raw"], r["text"]
        agree, compared, delta = compare(shared.answers, fresh.answers)
        figures = {
            "fresh_dps": fresh.rate,
            "shared_dps": shared.rate,
            "text_dps": text.rate,
            "shared_vs_fresh": ratio(shared.rate, fresh.rate),
            "ideal": ratio(r["fresh_all"].tokens, shared.tokens),
            "raw_tps": ratio(raw.tokens, raw.seconds),
            "engine_vs_limit": ratio(shared.seconds, raw.seconds),
            "decision_vs_generation": ratio(shared.rate, text.rate),
            "shared_fresh_max_dp": delta,
        }
        results[name] = figures
        table.add_row(
            name, str(shared.questions), str(r["fresh_all"].tokens), str(shared.tokens),
            f"{fresh.rate:.2f}", f"{shared.rate:.2f}", f"{figures['shared_vs_fresh']:.2f}",
            f"{figures['ideal']:.2f}", f"{figures['shared_vs_fresh'] / figures['ideal']:.2f}",
            f"{figures['raw_tps']:.0f}", f"{figures['engine_vs_limit']:.2f}", f"{text.rate:.2f}",
            f"{figures['decision_vs_generation']:.1f}", f"{agree}/{compared}", f"{delta:.4f}",
        )  # fmt: skip
    console.print(table)

    invariant = Table(
        title="The batch-invariant opt-in vs the default, request by request in turn (child): shared mode"
    )
    for column in ("", "default s", "invariant s", "invariant_cost", "argmax agree", "max |Δp| default-inv"):
        invariant.add_column(column, justify="right")
    for name in ("W1", "W2"):
        if invariant_runs is None:
            results[name]["invariant_cost"] = math.nan
            continue
        inv = invariant_runs[name]["shared"]
        default = invariant_runs[name].get("default_shared", runs[name]["shared"])  # timed beside it
        agree, compared, delta = compare(default.answers, inv.answers)
        results[name]["invariant_cost"] = ratio(inv.seconds, default.seconds)
        results[name]["default_vs_invariant_max_dp"] = delta
        invariant.add_row(
            name, f"{default.seconds:.2f}", f"{inv.seconds:.2f}", f"{results[name]['invariant_cost']:.2f}",
            f"{agree}/{compared}", f"{delta:.4f}",
        )  # fmt: skip
    console.print(
        invariant if invariant_runs is not None else "[yellow]GPU layers: no batch-invariant mode[/]"
    )

    w1 = runs["W1"]
    versions = Table(title=f"Prompt {PROMPT_V2} vs {PROMPT_V1} on W1 ({kernels})")
    for column in (
        "prompt", "shared tok", "fresh tok", "shared s", "shared dec/s", "fresh dec/s", "argmax agree",
        "max |Δp| shared-fresh",
    ):  # fmt: skip
        versions.add_column(column, justify="right")
    for label, shared, fresh in (
        (PROMPT_V1, w1["shared"], w1["fresh"]),
        (PROMPT_V2, w1["v2_shared"], w1["v2_fresh"]),
    ):
        agree, compared, delta = compare(shared.answers, fresh.answers)
        versions.add_row(
            label, str(shared.tokens), str(fresh.tokens), f"{shared.seconds:.2f}", f"{shared.rate:.2f}",
            f"{fresh.rate:.2f}", f"{agree}/{compared}", f"{delta:.4f}",
        )  # fmt: skip
    same, total, _ = compare(w1["shared"].answers, w1["v2_shared"].answers)
    versions.caption = f"v1 and v2 pick the same option on {same}/{total} questions (shared mode)"
    console.print(versions)
    results["prompt"] = {
        "v2_vs_v1": ratio(w1["shared"].seconds, w1["v2_shared"].seconds),
        "v2_vs_v1_tokens": ratio(w1["shared"].tokens, w1["v2_shared"].tokens),
        "v2_vs_v1_fresh_tokens": ratio(w1["fresh"].tokens, w1["v2_fresh"].tokens),
        "v1_max_dp": compare(w1["shared"].answers, w1["fresh"].answers)[2],
        "v2_max_dp": compare(w1["v2_shared"].answers, w1["v2_fresh"].answers)[2],
        "v1_v2_argmax_agree": same / total if total else math.nan,
    }

    many = Table(
        title=f"One choice question with many options on one JevBench state ({kernels}, {PROMPT_V1})"
    )
    for column in (
        "options", "readout", "tokens", "decodes", "seconds", "tok/s", "p(top)", "Σp", "half deadline",
        "invariant s", "invariant_cost", f"tokens {PROMPT_V2}",
    ):  # fmt: skip
        many.add_column(column, justify="right")
    for row in options:
        inv = row.get("invariant_seconds", math.nan)
        row["invariant_cost"] = ratio(inv, row.get("default_seconds_beside", row["seconds"]))
        many.add_row(
            str(row["options"]), row["readout"], str(row["tokens"]), str(row["decodes"]),
            f"{row['seconds']:.2f}", f"{ratio(row['tokens'], row['seconds']):.0f}", f"{row['top_p']:.3f}",
            f"{row['sum_p']:.6f}", fits(row["seconds"], deadline / 2),
            f"{inv:.2f}", f"{row['invariant_cost']:.2f}", str(row.get("v2_tokens", "-")),
        )  # fmt: skip
        results[f"options_{row['options']}"] = row
    console.print(many)

    estimates = Table(
        title="Admission: the scheduler's estimate (fitted to this run's decodes) against the time"
    )
    for column in ("request tokens", "estimate s", "measured s", "estimate/measured"):
        estimates.add_column(column, justify="right")
    for row in admission:
        row["ratio"] = ratio(row["predicted"] or math.nan, row["seconds"])
        estimates.add_row(
            str(row["tokens"]),
            f"{row['predicted'] or math.nan:.2f}",
            f"{row['seconds']:.2f}",
            f"{row['ratio']:.2f}",
        )
    console.print(estimates)
    results["admission"] = admission
    return results


def fits(seconds: float, limit: float) -> str:
    if math.isnan(seconds):
        return "-"
    return f"yes (< {limit:g} s)" if seconds < limit else "NO"


def last_line(results: dict[str, Any]) -> str:
    parts = []
    for name in ("W1", "W2"):
        r = results[name]
        parts.append(name)
        parts.append(
            key_values(
                (key, r[key])
                for key in (
                    "shared_vs_fresh",
                    "ideal",
                    "engine_vs_limit",
                    "decision_vs_generation",
                    "invariant_cost",
                )
            )
        )
    prompt = results["prompt"]
    parts.append(
        key_values(
            [
                *((f"options_{n}_seconds", results[f"options_{n}"]["seconds"]) for n in OPTION_COUNTS),
                ("v2_vs_v1", prompt["v2_vs_v1"]),
                ("v2_vs_v1_tokens", prompt["v2_vs_v1_tokens"]),
            ]
        )
    )
    parts.append(
        key_values(
            (
                ("v2_max_dp_shared_fresh", prompt["v2_max_dp"]),
                ("v1_max_dp_shared_fresh", prompt["v1_max_dp"]),
            ),
            digits=4,
        )
    )
    parts.append(key_values((f"admission_{target}", row["ratio"]) for target, row in zip(
        ADMISSION_TOKENS, results["admission"], strict=True)))  # fmt: skip
    return " ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
