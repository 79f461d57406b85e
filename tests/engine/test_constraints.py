"""The response_format constraint (decider.engine.structured.constraints, llguidance): a mask per step from a
schema, on a small made-up vocabulary and on SmolLM2's own (49,152 tokens, read from the GGUF).

Every refusal is a typed ConstraintError, every failed step a ConstraintFailedError: nothing a
schema holds can raise anything else, let alone end the process."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import numpy as np
import pytest

from decider.engine.structured import constraints, schema_rewrite
from decider.engine.structured.constraints import (
    INVALID,
    TOO_COMPLEX,
    ConstraintError,
    ConstraintFailedError,
    Vocabulary,
    compile_constraint,
    vocabulary_from,
)
from decider.settings import GrammarLimits, Settings

# a tiny vocabulary: 0 = end, 1 = a control token, then every byte JSON needs and a few words
WORDS = [b"red", b"green", b"blue", b"true", b"false", b'{"', b'":', b'",', b"colour", b"sure", b"abc"]
PIECES = [b"<|end|>", b"<|ctl|>", *[bytes([b]) for b in range(32, 127)], b"\n", *WORDS]
FAKE = vocabulary_from(PIECES, special=[0, 1], eog=[0])
COLOUR = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "sure": {"type": "boolean"}},
    "required": ["colour", "sure"],
}


def _token(vocab_pieces: list[bytes], piece: bytes) -> int:
    return vocab_pieces.index(piece)


def _generate(vocab: Vocabulary, pieces: list[bytes], schema: Any, *, seed: int, steps: int = 200) -> bytes:
    """Random tokens among the allowed ones until an end token: the bytes produced."""
    constraint = compile_constraint(vocab, schema)
    rng = random.Random(seed)
    out = b""
    for _ in range(steps):
        allowed = np.flatnonzero(constraint.prepare())
        # prefer an end once allowed, so that answers stay short
        ends = [int(t) for t in allowed if int(t) in vocab.eog]
        token = ends[0] if ends and rng.random() < 0.5 else int(rng.choice(allowed))
        if token in vocab.eog:
            return out
        constraint.accept(token)
        out += pieces[token]
    return out


def test_the_mask_allows_what_the_schema_allows_and_the_output_validates() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    for seed in range(5):
        text = _generate(FAKE, PIECES, COLOUR, seed=seed)
        answer = json.loads(text)
        jsonschema.validate(answer, COLOUR)
        assert set(answer) == {"colour", "sure"}  # objects are closed, as the GBNF path made them


def test_mask_sets_the_others_to_minus_infinity_and_never_allows_control_tokens() -> None:
    constraint = compile_constraint(FAKE, COLOUR)
    logits = np.zeros(len(PIECES), dtype=np.float32)
    constraint.mask(logits)
    allowed = np.flatnonzero(np.isfinite(logits))
    assert {PIECES[t] for t in allowed} == {b"{", b'{"'}
    assert np.isneginf(logits[1]) and np.isneginf(logits[0])


def test_json_object_and_the_end() -> None:
    constraint = compile_constraint(FAKE, None)
    for piece in (b"{", b"}"):
        assert constraint.prepare()[_token(PIECES, piece)]
        constraint.accept(_token(PIECES, piece))
    assert constraint.prepare()[0]  # the object is complete: the end token is allowed


def test_a_token_the_mask_did_not_allow_is_a_typed_failure() -> None:
    constraint = compile_constraint(FAKE, COLOUR)
    with pytest.raises(ConstraintFailedError):
        constraint.accept(_token(PIECES, b"x"))


@pytest.mark.parametrize(
    ("schema", "code", "path"),
    [
        ({"if": {"type": "string"}}, INVALID, ("if",)),
        ({"properties": {"a": {"type": "string", "if": {}}}}, INVALID, ("properties", "a", "if")),
        ({"$ref": "#/nope"}, INVALID, ("$ref",)),
        ({"items": {"$ref": "https://example.com/other.json"}}, INVALID, ("items", "$ref")),
        ({"type": "string", "pattern": "^(?=a)ab$"}, INVALID, ("pattern",)),
        ({"type": "string", "minLength": 3, "maxLength": 2}, INVALID, ()),
        ({"enum": ["x" * 70_000]}, TOO_COMPLEX, ()),
        ({"type": "string", "pattern": "\ud800"}, INVALID, ("pattern",)),
        ({"description": "ok", "properties": {"\udc00": {}}}, INVALID, ("properties", "\\udc00")),
        ({"enum": ["a", ["b", "\ud83d"]]}, INVALID, ("enum", 1, 1)),
    ],
)
def test_refusals_are_typed_and_name_the_field(schema: Any, code: str, path: tuple) -> None:
    """`strict`: a keyword llguidance does not enforce is refused, by name."""
    with pytest.raises(ConstraintError) as refused:
        compile_constraint(FAKE, schema, strict=True)
    assert (refused.value.code, refused.value.path) == (code, path), str(refused.value)
    assert str(refused.value).encode("utf-8")  # the message is text: it can be sent
    # what no mode can use is refused without `strict` too (best effort leaves out the rest:
    # test_schema_rewrite.py)
    if not any(word in json.dumps(schema) for word in ('"if"', "$ref", "(?=")):
        with pytest.raises(ConstraintError) as again:
            compile_constraint(FAKE, schema)
        assert again.value.code == code


@pytest.mark.parametrize(
    "schema",
    [
        {"if": {"type": "string"}, "then": {"minLength": 2}},
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        {"oneOf": [{"type": "string"}, {"type": "string", "minLength": 2}]},  # not disjoint
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "not": {"required": ["x"]}},
    ],
)
def test_without_strict_what_cannot_be_enforced_is_left_out(schema: Any) -> None:
    """Best effort, as llama-server's converter: the schema compiles, with the keyword left out."""
    compile_constraint(FAKE, schema)
    with pytest.raises(ConstraintError) as refused:
        compile_constraint(FAKE, schema, strict=True)
    assert refused.value.code == INVALID


def test_nested_quantifiers_are_lazy_and_bounds_are_typed() -> None:
    """`((a{1000}){1000}){1000}` (10^9 repetitions; the GBNF path had to refuse it) is built lazily:
    each step is quick. A schema past a bound is TOO_COMPLEX, never a hang or a crash."""
    schema = {"type": "string", "pattern": "^((a{1000}){1000}){1000}$"}
    start = time.perf_counter()
    constraint = compile_constraint(FAKE, schema)
    for piece in [b'"'] + [b"a"] * 20:
        assert constraint.prepare()[_token(PIECES, piece)]
        constraint.accept(_token(PIECES, piece))
    assert time.perf_counter() - start < 2
    wide = {"enum": [f"value-{i}" for i in range(3000)]}
    with pytest.raises(ConstraintError) as refused:
        compile_constraint(FAKE, wide, GrammarLimits(compile_fuel=1000))
    assert refused.value.code == TOO_COMPLEX
    compile_constraint(FAKE, wide)  # within the default bounds


def test_impossible_code_points_and_deep_bounds_compile() -> None:
    """What aborted llama.cpp's sampler (a NUL no token can spell, as JSON escapes it) or overflowed
    its parser (maxLength 200000) is an ordinary schema here."""
    for schema in (
        {"const": "a\u0000b"},
        {"enum": ["\u0000", "x"]},
        {"type": "string", "pattern": "^\\x00+$"},
        {"type": "string", "maxLength": 200_000},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 200_000},
    ):
        constraint = compile_constraint(FAKE, schema)
        assert constraint.prepare().any()
    text = _generate(FAKE, PIECES, {"const": "a\u0000b"}, seed=0)
    assert json.loads(text) == "a\u0000b"


def test_the_deadline_is_checked_between_phases() -> None:
    with pytest.raises(TimeoutError):
        compile_constraint(FAKE, COLOUR, deadline=time.monotonic() - 1)


def test_closed_objects_leave_allof_alone() -> None:
    assert schema_rewrite.closed_objects(COLOUR)["additionalProperties"] is False
    merged = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert schema_rewrite.closed_objects(merged) == merged
    kept = {"properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert schema_rewrite.closed_objects(kept) == kept


def test_unknown_formats_are_annotations() -> None:
    """llguidance refuses a `format` it does not know; JSON Schema makes `format` an annotation, and
    the GBNF path ignored the unknown ones: they are dropped (from schemas, never from values)."""
    schema = {
        "type": "object",
        "properties": {
            "link": {"type": "string", "format": "uri-reference"},
            "when": {"type": "string", "format": "date"},
            "format": {"const": {"format": "int64"}},
        },
    }
    kept = schema_rewrite.known_formats_only(schema)
    assert "format" not in kept["properties"]["link"] and kept["properties"]["when"]["format"] == "date"
    assert kept["properties"]["format"] == {"const": {"format": "int64"}}
    compile_constraint(FAKE, {"type": "string", "format": "no-such-format"})


def test_the_bounds_are_settings() -> None:
    assert Settings.from_values({}).grammar_limits == GrammarLimits()
    custom = Settings.from_values({"max_constraint_step_fuel": 5000}).grammar_limits
    assert custom.step_fuel == 5000


# --- SmolLM2's own vocabulary ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(engine: Any) -> tuple[Vocabulary, list[bytes]]:
    runtime = engine.runtime
    vocab = constraints.vocabulary(runtime)
    assert constraints.vocabulary(runtime) is vocab  # built once per model
    pieces = [runtime.piece(t, special=True) for t in range(runtime.n_vocab)]
    return vocab, pieces


@pytest.mark.model
def test_smollm2_vocabulary(smol: tuple[Vocabulary, list[bytes]]) -> None:
    vocab, pieces = smol
    assert vocab.n_vocab == 49152 and set(vocab.eog) >= {0, 2}
    constraint = compile_constraint(vocab, COLOUR)
    allowed = constraint.prepare()
    assert allowed.shape == (49152,)
    assert {pieces[t] for t in np.flatnonzero(allowed)} >= {b"{", b'{"'}
    assert not allowed[1] and not allowed[2]  # <|im_start|>, <|im_end|> inside JSON: never
    special = {t for t in range(vocab.n_vocab) if vocab.tokenizer.is_special_token(t)}
    assert {0, 1, 2} <= special
    plain = [t for t in range(vocab.n_vocab) if t not in special]
    assert all(vocab.tokenizer.decode_bytes([t]) == pieces[t] for t in plain)  # the GGUF's own bytes


@pytest.mark.model
def test_smollm2_random_walks_validate_and_masks_are_fast(smol: tuple[Vocabulary, list[bytes]]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    vocab, pieces = smol
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "n": {"type": "integer"},
        },
        "required": ["name", "tags", "n"],
    }
    for seed in range(3):
        text = _generate(vocab, pieces, schema, seed=seed, steps=120)
        try:
            answer = json.loads(text)
        except ValueError:
            continue  # cut by the step budget: nothing to validate
        jsonschema.validate(answer, schema)
    constraint = compile_constraint(vocab, schema)
    constraint.prepare()
    assert constraint.mask_seconds < 0.5


class _FailsAtStep:
    """A constraint that allows everything until step `at`, then fails as a spent fuel would."""

    def __init__(self, at: int, failure: ConstraintFailedError) -> None:
        self.at, self.failure, self.steps = at, failure, 0

    def mask(self, logits: np.ndarray) -> None:
        if self.steps >= self.at:
            raise self.failure

    def accept(self, token: int) -> None:
        self.steps += 1


@pytest.mark.model
@pytest.mark.parametrize("at", [0, 3])
def test_a_failed_step_ends_that_chat_with_a_typed_error_and_the_engine_goes_on(engine: Any, at: int) -> None:
    import dataclasses

    from decider.errors import RequestError

    messages = [{"role": "user", "content": "Say something."}]
    plan = engine.chat_plan(messages, max_tokens=8, max_tokens_cap=8, temperature=0.0)
    failure = ConstraintFailedError("the response_format allows no token here", constraints.UNSATISFIABLE)
    failing = dataclasses.replace(plan, constraint=_FailsAtStep(at, failure))
    with pytest.raises(RequestError) as ended:
        engine._run_local(engine.chat_work(failing), "chat")
    assert (ended.value.code, ended.value.status, ended.value.param) == (
        constraints.UNSATISFIABLE,
        422,
        "response_format",
    )
    text, finish, _usage = engine._run_local(engine.chat_work(plan), "chat")  # the next chat is served
    assert finish in ("stop", "length") and text


def test_an_object_requiring_a_name_it_does_not_list_is_not_closed() -> None:
    """Closing it (additionalProperties: false) would make the schema unsatisfiable (SchemaStore has 5)."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["name"]}
    assert "additionalProperties" not in schema_rewrite.closed_objects(schema)
    assert schema_rewrite.closed_objects({**schema, "required": ["a"]})["additionalProperties"] is False
    compile_constraint(FAKE, schema, strict=True)
