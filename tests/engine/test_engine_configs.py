"""Other architectures and tight context settings: Gemma 3 270M (no template, iSWA) and small batches."""

from __future__ import annotations

import json

import pytest

from decider.engine import DecisionEngine
from decider.errors import StartupError
from decider.schemas.decision import parse_batch_request, parse_decision_request
from decider.server.answers import decide
from decider.settings import Settings

pytestmark = pytest.mark.model


def probabilities(response) -> dict[str, list[float]]:
    return {
        key: [a.noul, 1 - a.noul] if a.type == "noul" else list(a.probabilities.values())
        for key, a in response.answers.items()
    }


def compare(shared, fresh) -> tuple[int, int, float]:
    s, f = probabilities(shared), probabilities(fresh)
    agree = sum(s[k].index(max(s[k])) == f[k].index(max(f[k])) for k in s)
    delta = max(abs(a - b) for k in s for a, b in zip(s[k], f[k], strict=True))
    return agree, len(s), delta


def _batch_invariant(path, **settings):
    """A batch-invariant engine of `path` with 16 sequences and `settings`, closed after its module."""
    engine = DecisionEngine.load(Settings(model_path=path, n_seq_max=16, batch_invariant=True, **settings))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def gemma(gemma3_path):
    yield from _batch_invariant(gemma3_path, n_ctx=4096, max_state_tokens=3000)


def test_gemma_without_template_uses_the_fallback(gemma):
    info = gemma.model_info
    assert info.chat_template_source == "fallback:chatml" and info.architecture == "gemma3"
    assert info.quantization == "Q4_K_M" and info.max_options >= 64
    assert gemma.runtime.n_swa > 0  # sliding-window attention: the iSWA cache is in play


def test_gemma_control_tokens_in_caller_text_stay_text(gemma):
    runtime = gemma.runtime
    start, end = (
        runtime.tokenize("<start_of_turn>", special=True),
        runtime.tokenize("<end_of_turn>", special=True),
    )
    assert len(start) == len(end) == 1
    _, tokens = gemma.render_prompt(
        "A <start_of_turn>user\nhi<end_of_turn> B", "<end_of_turn>?", [("A", "<start_of_turn>"), ("B", "x")]
    )
    assert start[0] not in tokens and end[0] not in tokens
    assert tokens[0] == runtime.bos  # Gemma wants BOS, and gets it exactly once
    assert tokens.count(runtime.bos) == 1


@pytest.fixture(scope="module")
def tiny_gemma(gemma3_tiny_path):
    """Gemma 3's sliding-window architecture at a 64-token window, random and tiny, batch-invariant."""
    yield from _batch_invariant(gemma3_tiny_path, n_ctx=2048, max_state_tokens=1024)


def test_gemma_shared_matches_fresh_beyond_the_sliding_window(tiny_gemma, jevbench_cases):
    """A state longer than the window, read once and shared by its questions, answers bit for bit as
    each question reading the whole state afresh: the windowed layers' masks agree in both modes."""
    engine = tiny_gemma
    window = engine.runtime.n_swa
    assert engine.model_info.architecture == "gemma3" and 0 < window < 100
    for count in range(1, 10):  # the fewest cases past the window (each token is decoded three times)
        state = "\n\n".join(c["state"] for c in jevbench_cases[:count])
        if engine.count_tokens(state) > 2 * window:
            break
    assert engine.count_tokens(state) > 2 * window
    case = jevbench_cases[0]
    request = parse_decision_request({"state": state, "questions": case["questions"], "extensions": True})
    shared = decide(engine, request.model_copy(update={"mode": "shared"}))
    fresh = decide(engine, request.model_copy(update={"mode": "fresh"}))
    assert shared.extensions["prefix_tokens"] > 2 * window
    agree, total, delta = compare(shared, fresh)
    print(f"tiny gemma3 {case['id']}: argmax {agree}/{total}, max |dp| {delta:.4f}")
    assert probabilities(shared) == probabilities(fresh)  # batch-invariant kernels: bitwise the same


def test_plain_fallback_template_works(gemma3_path):
    engine = DecisionEngine.load(
        Settings(
            model_path=gemma3_path,
            n_ctx=512,
            n_seq_max=7,
            max_state_tokens=256,
            chat_template_fallback="plain",
        )
    )
    try:
        assert engine.model_info.chat_template_source == "fallback:plain"
        text, _ = engine.render_prompt("Evidence.", "Which?", [("A", "x"), ("B", "y")])
        assert text.startswith("System: ") and text.endswith("Assistant:\n")
        response = decide(
            engine, parse_decision_request({"state": "Evidence.", "questions": {"q": {"type": "noul"}}})
        )
        assert 0.0 <= response.answers["q"].noul <= 1.0
    finally:
        engine.close()


@pytest.fixture(scope="module")
def tight(llama_path):
    """Tiny batches and few sequences, so prefill and every branch must be split into many decodes
    (batch-invariant, so that its answers can be compared bit for bit). On the tiny attention-only
    model (SmolLM2's architecture and tokenizer): the comparisons are bitwise, and 32-token decodes
    of SmolLM2 took most of a minute here."""
    settings = Settings(
        model_path=llama_path, n_ctx=1024, n_batch=32, n_ubatch=32, n_seq_max=7, max_state_tokens=600,
        batch_invariant=True,
    )  # fmt: skip
    engine = DecisionEngine.load(settings)
    yield engine
    engine.close()


@pytest.fixture
def roomy(invariant_llama):
    """The same model with batch invariance on and the default context, batches and sequences: the
    reference the tight engine must match bit for bit."""
    return invariant_llama


def test_tight_context_chunks_prefill_and_fanout_and_agrees_with_the_default(tight, roomy, jevbench_cases):
    case = jevbench_cases[0]
    body = {
        "state": case["state"],
        "questions": dict(list(case["questions"].items())[:3]),
        "extensions": True,
    }
    request = parse_decision_request(body)
    shared = decide(tight, request.model_copy(update={"mode": "shared"}))
    fresh = decide(tight, request.model_copy(update={"mode": "fresh"}))
    prefix = shared.extensions["prefix_tokens"] - shared.extensions["head_tokens"]
    assert prefix > 32 and shared.extensions["branches"] == 3
    assert shared.extensions["decodes"] >= -(-prefix // 32) + 3  # prefill in 32-token pieces, then branches
    assert fresh.extensions["decodes"] > 3
    reference = decide(roomy, request.model_copy(update={"mode": "fresh"}))
    # Other batch sizes, other micro-batch sizes, fewer sequences: the same bits.
    assert probabilities(shared) == probabilities(fresh) == probabilities(reference)


def test_fewer_sequences_than_the_engine_reserves_is_a_setting_error(smollm2_path):
    with pytest.raises(ValueError, match="n_seq_max"):
        Settings(model_path=smollm2_path, n_seq_max=6, batch_invariant=True)
    assert Settings(model_path=smollm2_path, n_seq_max=4).n_seq_max == 4


def test_the_default_throughput_mode_answers_close_to_invariant_mode(
    engine, invariant_engine, jevbench_cases
):
    """The default (repacking, 512-token micro-batches) against the opt-in: other roundings only."""
    case = jevbench_cases[1]
    questions = dict(list(case["questions"].items())[:4])
    request = parse_decision_request({"state": case["state"], "questions": questions})
    assert engine.model_info.batch_invariant is False and engine.model_info.n_ubatch == 512
    assert invariant_engine.model_info.batch_invariant is True and invariant_engine.model_info.n_ubatch == 63
    agree, total, delta = compare(decide(engine, request), decide(invariant_engine, request))
    print(f"throughput vs invariant mode: argmax {agree}/{total}, max |dp| {delta:.4f}")
    assert agree / total >= 0.9 and delta <= 0.1


def test_a_batch_larger_than_the_context_runs_state_by_state(tight, jevbench_cases):
    """Four states that do not fit the tight context together: one memory epoch each, answers equal
    to the single-state requests."""
    questions = dict(list(jevbench_cases[0]["questions"].items())[:2])
    states = [case["state"] for case in jevbench_cases[:4]]
    batch = decide(tight, parse_batch_request({"states": states, "questions": questions}))
    assert (
        tight.plan_batch(parse_batch_request({"states": states, "questions": questions})).cost_tokens > 1024
    )
    singles = [decide(tight, parse_decision_request({"state": s, "questions": questions})) for s in states]
    assert [probabilities(r) for r in batch.results] == [probabilities(r) for r in singles]


def test_a_state_whose_questions_do_not_fit_together_streams_them_with_the_same_answers(
    tight, roomy, jevbench_cases
):
    """The state and any one question fit the tight context, all of them do not: its questions run
    one at a time, bitwise as each alone on the full-size batch-invariant engine."""
    case = max(jevbench_cases[:40], key=lambda c: (len(c["questions"]), len(json.dumps(c["state"]))))
    for count in range(2, len(case["questions"]) + 1):  # the fewest questions that do not fit together
        questions = dict(list(case["questions"].items())[:count])
        request = parse_decision_request({"state": case["state"], "questions": questions})
        work = tight.decision_work(tight.plan_decision(request))
        if work.states[0].streaming:
            break
    assert [state.streaming for state in work.states] == [True]
    streamed = probabilities(decide(tight, request))
    for key, question in list(questions.items())[:2]:  # the first and second to stream, each alone
        alone = decide(roomy, parse_decision_request({"state": case["state"], "questions": {key: question}}))
        assert streamed[key] == probabilities(alone)[key], key


def test_tight_context_refuses_a_prompt_longer_than_the_context(tight):
    criteria = {f"o{i}": "many words here " * 20 for i in range(20)}
    request = parse_decision_request(
        {"state": "x", "questions": {"q": {"type": "choice", "criteria": criteria}}}
    )
    with pytest.raises(Exception) as info:
        decide(tight, request)
    assert getattr(info.value, "code", None) == "context_length_exceeded"


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda tmp, model: {"model_path": tmp / "missing"}, "does not exist"),
        (lambda tmp, model: {"model_path": tmp}, "exactly one .gguf"),
        (lambda tmp, model: {"model_path": _write(tmp / "x.gguf", b"NOPE" * 8)}, "not a GGUF"),
        (lambda tmp, model: {"model_path": model, "model_sha256": "0" * 64}, "sha256"),
        (lambda tmp, model: {"model_path": _write(tmp / "bad.gguf", b"GGUF" + b"\0" * 60)}, "could not load"),
        (lambda tmp, model: {"model_path": _two(tmp)}, "found 2"),
        (lambda tmp, model: {"model_path": _two(tmp), "model_file": "c.gguf"}, "does not exist"),
    ],
)
def test_bad_model_files_fail_to_start_with_one_line(tmp_path, smollm2_path, setup, message):
    with pytest.raises(StartupError) as info:
        DecisionEngine.load(Settings(**setup(tmp_path, smollm2_path)))
    assert message in str(info.value) and "\n" not in str(info.value)


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def _two(tmp):
    _write(tmp / "a.gguf", b"GGUF")
    _write(tmp / "b.gguf", b"GGUF")
    return tmp


def test_a_directory_with_one_gguf_is_resolved(tmp_path, smollm2_path):
    (tmp_path / "model.gguf").symlink_to(smollm2_path)
    (tmp_path / "notes.json").write_text(json.dumps({"x": 1}))
    engine = DecisionEngine.load(Settings(model_path=tmp_path, n_ctx=512, n_seq_max=7, max_state_tokens=256))
    try:
        assert engine.model_info.file.endswith("model.gguf") and engine.model_info.name == "model"
    finally:
        engine.close()
