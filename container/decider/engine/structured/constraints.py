"""Structured output: a chat's `response_format` as a token mask per step (llguidance).

One module owns constraints. A JSON schema (or `json_object`) comes in; `compile_constraint`
turns it into a `Constraint` on a worker thread while the request is planned; the chat's work
then asks it, on the engine thread, for the tokens allowed next (`Constraint.mask`, which sets
the others' logits to -inf before our sampler picks) and tells it the token it sampled
(`Constraint.accept`).

The engine is llguidance (Rust: an Earley parser over a lazily built regex lexer). It was made
for schemas nobody vetted: it reports errors instead of aborting, and it bounds its own work
with fuel (`LLParserLimits`): compile-time lexer fuel, lexer fuel and Earley items per step,
lexer states, grammar size. Nothing in this path can take the process down: no llama.cpp grammar
call is left (the GBNF sampler aborted the process on grammars with no way forward, recursed
without a bound and kept unbounded parse stacks; see docs/structured-output.md).

- **Vocabulary.** The mask is computed from the model's own vocabulary: every token's bytes from
  the GGUF (`llama_token_to_piece`), control tokens marked special (they are never allowed
  inside JSON), every end-of-generation token accepted as the end. Built once per loaded model
  (`vocabulary`) and cached; the server builds it while the model loads (decider.server.runtime).
- **Bounds.** A schema past a bound is a `ConstraintError` with code `response_format_too_complex`
  (422), `path` naming the field when it can be told; a keyword llguidance does not implement is
  `invalid_response_format` naming it. The first mask is computed while planning, so a schema
  whose first step already fails is refused before admission; a later step that fails (its
  fuel spent, or no token allowed) ends that chat with `ConstraintFailedError`, a typed error.
- **The schema as handed over** is decider.engine.structured.schema_rewrite's: `$ref`s checked against the
  schema (the server fetches nothing), and, without `json_schema.strict`, what llguidance refuses
  left out and the schema compiled again (at most MAX_REPAIRS times, each under the deadline).
- **Whitespace** between JSON tokens is what the GBNF path allowed (a schema: one optional space;
  `json_object`: one space, or a newline and up to 20 spaces or tabs), so greedy answers to simple
  schemas stay as they were and a small model cannot spin on blank lines.
"""

from __future__ import annotations

import ctypes
import json
import re
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llama_cpp
import llguidance
import numpy as np

from decider.engine.structured import schema_rewrite
from decider.engine.structured.schema_limits import GrammarLimitError, SchemaCheckError, check_schema
from decider.settings import GrammarLimits

Path = tuple[str | int, ...]

# Whitespace between JSON tokens, as the GBNF path allowed it: llama-cpp-python's schema converter
# had one optional space (`space ::= " "?`), llama.cpp's JSON grammar (json_object) one space or a
# newline and up to 20 spaces or tabs.
SCHEMA_OPTIONS: dict[str, Any] = {"whitespace_pattern": r"[ ]"}
JSON_OBJECT_OPTIONS: dict[str, Any] = {"whitespace_pattern": r"[ ]|\n[ \t]{0,20}"}
# Without `json_schema.strict: true`, what llguidance cannot enforce is left out rather than refused,
# as llama-server's converter leaves out what it does not know: keywords it does not implement
# (`uniqueItems`, `not`, `if`/`then`, `propertyNames`, `dependencies`: `lenient`), and `oneOf` taken
# as `anyOf` (`coerce_one_of`: the output matches one alternative at least, maybe more). Greedy
# output on a schema it enforces whole is the same either way. docs/structured-output.md.
BEST_EFFORT: dict[str, Any] = {"lenient": True, "coerce_one_of": True}
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
# best effort: how many times a refused schema is compiled again without the part refused
# (schema_rewrite.repair; each a compile, each under the request's deadline)
MAX_REPAIRS = 6

TOO_COMPLEX = "response_format_too_complex"
INVALID = "invalid_response_format"
UNSATISFIABLE = "response_format_unsatisfiable"
# llguidance's messages for a bound it hit (limits and fuel), as opposed to a schema it refuses
_LIMIT_MESSAGES = re.compile(
    r"too many|fuel|limit|too complex|too large|TooComplex|max_items|grammar size|lexer states|stack level",
    re.IGNORECASE,
)
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


class ConstraintError(ValueError):
    """A response format that cannot be used: `code` (TOO_COMPLEX, INVALID, UNSATISFIABLE) and
    `path`, where inside the schema (empty: the schema as a whole)."""

    def __init__(self, message: str, code: str, path: Path = ()) -> None:
        super().__init__(message)
        self.code = code
        self.path = path


class ConstraintFailedError(RuntimeError):
    """A step of a running chat the constraint could not take (its fuel spent, or no token left):
    that chat ends with this error; `code` as ConstraintError's."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


# --- the model's vocabulary ------------------------------------------------------------------------


@dataclass(frozen=True)
class Vocabulary:
    """The model's tokens as llguidance sees them (built once per model: `vocabulary`)."""

    tokenizer: Any  # llguidance.LLTokenizer
    n_vocab: int
    eog: tuple[int, ...]

    @property
    def mask_words(self) -> int:
        return (self.n_vocab + 31) // 32


class _TokenSource:
    """What llguidance's `TokenizerWrapper` reads: the pieces, the special ids, the end token and a
    tokenizer (bytes -> ids) for the rare grammar that needs one."""

    def __init__(
        self, pieces: list[bytes], special: list[int], eos: int, tokenize: Callable[[bytes], list[int]]
    ):
        self.tokens = pieces
        self.special_token_ids = special
        self.eos_token_id = eos
        self.bos_token_id = None
        self._tokenize = tokenize

    def __call__(self, data: bytes | str) -> list[int]:
        raw = data.encode("utf-8", errors="replace") if isinstance(data, str) else bytes(data)
        return list(self._tokenize(raw))


def vocabulary_from(
    pieces: list[bytes],
    special: list[int],
    eog: list[int],
    tokenize: Callable[[bytes], list[int]] | None = None,
) -> Vocabulary:
    """A Vocabulary from token bytes (`special`: control tokens, never allowed inside the output;
    `eog`: the tokens that end it). `tokenize` defaults to a greedy longest-match (tests)."""
    if not eog:
        raise ValueError("the vocabulary has no end-of-generation token")
    source = _TokenSource(pieces, special, eog[0], tokenize or _greedy(pieces, set(special)))
    tokenizer = llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(source), eos_token=list(eog), slices=llguidance.LLTokenizer.json_slices()
    )
    return Vocabulary(tokenizer, len(pieces), tuple(eog))


def _greedy(pieces: list[bytes], special: set[int]) -> Callable[[bytes], list[int]]:
    index = {piece: token for token, piece in enumerate(pieces) if piece and token not in special}
    longest = max((len(piece) for piece in index), default=1)

    def tokenize(data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            for size in range(min(longest, len(data) - i), 0, -1):
                token = index.get(data[i : i + size])
                if token is not None:
                    out.append(token)
                    i += size
                    break
            else:
                i += 1  # a byte no token spells: skipped
        return out

    return tokenize


def _llama_tokenize(runtime: Any) -> Callable[[bytes], list[int]]:
    """llama.cpp's tokenizer on the model's vocabulary (holding the runtime weakly)."""
    ref = weakref.ref(runtime)

    def tokenize(data: bytes) -> list[int]:
        owner = ref()
        if owner is None:
            return []
        return owner.tokenize(data.decode("utf-8", errors="replace"), special=False)

    return tokenize


def read_vocabulary(runtime: Any) -> Vocabulary:
    """The model's vocabulary from its GGUF: each token's bytes (`llama_token_to_piece`, special
    text included), control tokens (and user-defined `<...>` ones) special, every
    end-of-generation token an end. Runs on a worker thread beside the engine's: it reads the
    vocabulary only (no buffer or state of the runtime's is shared)."""
    pieces: list[bytes] = []
    special: list[int] = []
    eog: list[int] = []
    vocab = runtime.vocab
    buffer = ctypes.create_string_buffer(256)  # its own: runtime.piece's buffer is the engine thread's
    for token in range(runtime.n_vocab):
        attr = runtime.token_attr(token)
        n = llama_cpp.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, True)
        if n < 0:
            buffer = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, True)
        piece = buffer.raw[: max(n, 0)]
        if attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL or (
            attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">")
        ):
            special.append(token)
        if runtime.is_eog(token):
            eog.append(token)
        pieces.append(piece)
    return vocabulary_from(pieces, special, eog or [runtime.eos], _llama_tokenize(runtime))


_cache: weakref.WeakKeyDictionary[Any, Vocabulary] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def vocabulary(runtime: Any) -> Vocabulary:
    """The llguidance vocabulary of a loaded model, built on first use and kept with it."""
    with _cache_lock:
        found = _cache.get(runtime)
        if found is None:
            found = _cache[runtime] = read_vocabulary(runtime)
        return found


# --- compiling a response format ------------------------------------------------------------------


def parser_limits(limits: GrammarLimits) -> Any:
    return llguidance.LLParserLimits(
        initial_lexer_fuel=limits.compile_fuel,
        step_lexer_fuel=limits.step_fuel,
        step_max_items=limits.step_items,
        max_lexer_states=limits.lexer_states,
        max_grammar_size=limits.grammar_size,
        verbose_errors=False,
    )


def compile_constraint(
    vocab: Vocabulary,
    schema: dict[str, Any] | None,
    limits: GrammarLimits | None = None,
    *,
    deadline: float | None = None,
    strict: bool = False,
) -> Constraint:
    """A Constraint for a JSON schema (None: `json_object`, any JSON object), its first mask
    computed. ConstraintError (or GrammarLimitError from the size checks) when it cannot be used;
    TimeoutError when `deadline` (time.monotonic) passes between phases. `strict` (the request's
    `json_schema.strict`): refuse what cannot be enforced instead of leaving it out (BEST_EFFORT)."""
    limits = limits or GrammarLimits()
    if schema is None:
        source, options = JSON_OBJECT_SCHEMA, JSON_OBJECT_OPTIONS
    else:
        try:  # what llguidance does not bound itself: size, lone surrogates
            check_schema(schema, limits)
            source = schema_rewrite.prepare(schema, strict=strict)
        except GrammarLimitError as exc:
            raise ConstraintError(str(exc), TOO_COMPLEX, exc.path) from None
        except (SchemaCheckError, schema_rewrite.RewriteError) as exc:
            raise ConstraintError(str(exc), INVALID, exc.path) from None
        options = SCHEMA_OPTIONS if strict else {**SCHEMA_OPTIONS, **BEST_EFFORT}
    _check_deadline(deadline)
    matcher = _matcher(vocab, source, options, limits)
    for _ in range(MAX_REPAIRS):
        if not matcher.is_error() or schema is None:
            break
        message = matcher.get_error()
        if strict:
            refusal = schema_rewrite.strict_error(source, message)
            if refusal is not None:
                raise ConstraintError(str(refusal), INVALID, refusal.path)
            break
        repaired = schema_rewrite.repair(source, message)
        if repaired is None:
            break
        source = repaired
        _check_deadline(deadline)
        matcher = _matcher(vocab, source, options, limits)
    if matcher.is_error():
        raise _compile_error(matcher.get_error(), source)
    _check_deadline(deadline)
    constraint = Constraint(vocab, matcher)
    try:
        constraint.prepare()
    except ConstraintFailedError as exc:
        raise ConstraintError(str(exc), exc.code) from None
    _check_deadline(deadline)
    return constraint


def _matcher(
    vocab: Vocabulary, schema: dict[str, Any], options: dict[str, Any], limits: GrammarLimits
) -> Any:
    grammar = llguidance.LLMatcher.grammar_from_lark(lark_grammar(schema, options))
    return llguidance.LLMatcher(vocab.tokenizer, grammar, log_level=0, limits=parser_limits(limits))


def lark_grammar(schema: dict[str, Any], options: dict[str, Any]) -> str:
    """The llguidance grammar for a prepared schema: its JSON Schema support (`%json`) with our
    `options` (the caller's own `x-guidance` options are replaced), and `no_forcing`: every token
    whose bytes fit is allowed, as the GBNF sampler allowed them. (By default llguidance allows
    only the canonical tokenization of bytes the grammar forces, e.g. `colour` but not `c` after
    `{ "`; that changes greedy answers.)"""
    text = json.dumps({**schema, "x-guidance": options}, ensure_ascii=True)
    return f'%llguidance {{"no_forcing": true}}\nstart: %json {text}\n'


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError("the request passed its deadline while its response_format was compiled")


def _compile_error(message: str, schema: Any) -> ConstraintError:
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    unimplemented = _UNIMPLEMENTED.search(first)
    if unimplemented:
        keys = [k.strip().strip('"') for k in unimplemented.group(1).split(",") if k.strip()]
        path = find_key(schema, keys[0]) if keys else ()
        return ConstraintError(
            f"JSON schema keyword(s) not supported: {', '.join(keys)}", INVALID, path or ()
        )
    if _LIMIT_MESSAGES.search(first):
        return ConstraintError(
            f"the JSON schema is too complex for the response_format bounds: {first}", TOO_COMPLEX
        )
    return ConstraintError(f"the JSON schema cannot be used: {first}", INVALID)


def find_key(schema: Any, key: str) -> Path | None:
    """Where `key` first appears as a keyword in the schema (document order), or None."""
    stack: list[tuple[Any, Path]] = [(schema, ())]
    while stack:
        node, path = stack.pop(0)
        if isinstance(node, dict):
            if key in node:
                return (*path, key)
            stack.extend((child, (*path, k)) for k, child in node.items() if isinstance(child, dict | list))
        elif isinstance(node, list):
            stack.extend((child, (*path, i)) for i, child in enumerate(node))
    return None


# --- one chat's constraint ------------------------------------------------------------------------


class Constraint:
    """One chat's constraint state: the next mask, and the tokens taken so far."""

    def __init__(self, vocab: Vocabulary, matcher: Any) -> None:
        self.vocab = vocab
        self._matcher = matcher
        self._bits = np.zeros(vocab.mask_words, dtype=np.int32)
        self._ready = False  # the mask in _bits is for the current state
        self.mask_seconds = 0.0  # time spent computing masks (tests, metrics)

    def prepare(self) -> np.ndarray:
        """Compute the mask for the next token (once per state): a bool per token.
        ConstraintFailedError when the engine hit a bound, or allows no token at all."""
        if not self._ready:
            start = time.perf_counter()
            self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            self.mask_seconds += time.perf_counter() - start
            if self._matcher.is_error():
                raise _step_error(self._matcher.get_error())
            self._ready = True
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab.n_vocab].view(bool)
        if not allowed.any():
            raise ConstraintFailedError(
                "the response_format allows no token here: no output can satisfy it", UNSATISFIABLE
            )
        return allowed

    def mask(self, logits: np.ndarray) -> None:
        """Set the logits of every token not allowed next to -inf, in place (before sampling)."""
        allowed = self.prepare()
        n = min(logits.shape[0], allowed.shape[0])
        np.putmask(logits[:n], ~allowed[:n], -np.inf)
        if logits.shape[0] > n:  # padding rows of the model's output beyond the vocabulary
            logits[n:] = -np.inf

    def accept(self, token: int) -> None:
        """Advance by the sampled token (one the last mask allowed)."""
        self._ready = False
        if not self._matcher.consume_token(token):
            raise _step_error(self._matcher.get_error() or f"token {token} is not allowed here")

    @property
    def done(self) -> bool:
        """Nothing but the end can follow."""
        return bool(self._matcher.is_stopped())


def _step_error(message: str) -> ConstraintFailedError:
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    if _LIMIT_MESSAGES.search(first):
        return ConstraintFailedError(
            f"the response_format needed more work per token than allowed: {first}", TOO_COMPLEX
        )
    return ConstraintFailedError(f"the response_format cannot go on: {first}", UNSATISFIABLE)
