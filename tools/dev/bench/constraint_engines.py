"""Constraint engines side by side (docs/structured-output.md): compile time and mask time per token
for llguidance and outlines-core on the same schemas and the same vocabulary.

Two steps, because the engines live in different environments (outlines-core is no dependency of
this project):

    .venv/bin/python -m decider_dev.bench.constraint_engines dump VOCAB.json  # SmolLM2's pieces (GGUF)
    PY -m decider_dev.bench.constraint_engines run VOCAB.json ENGINE CASE [--size N]
    .venv/bin/python -m decider_dev.bench.constraint_engines serving  # the server: ms/token, schema vs plain

`run` prints one JSON line: the compile time (schema to a ready matcher/index, first mask included),
then the mask time (the engine writing its bitmask; reading the bitmask in numpy is not counted) of
every step while it follows a valid answer (at each step the longest allowed
token that begins the rest of the answer), or the error. `--size 248320` pads the vocabulary with
made-up tokens (concatenations of two real pieces, seeded) to a Qwen3.5-sized one. Standard library
and numpy only here; each engine is imported only when asked for.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any


def anyof_ref_chain(depth: int) -> dict[str, Any]:
    """`anyOf` over look-alike objects, each reaching the next level again through `$ref`: the
    GBNF parser kept every alternative alive and doubled its stacks per level."""
    defs = {}
    for level in range(depth):
        inner = {"$ref": f"#/$defs/n{level + 1}"} if level + 1 < depth else {"type": "string"}
        defs[f"n{level}"] = {
            "anyOf": [
                {"type": "object", "properties": {"a": inner, "b": {"type": "integer"}}},
                {"type": "object", "properties": {"a": inner, "c": {"type": "integer"}}},
                {"type": "object", "properties": {"a": inner}},
            ]
        }
    return {"$ref": "#/$defs/n0", "$defs": defs}


ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "status": {"enum": ["open", "paid", "shipped", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 40}, "email": {"type": "string"}},
            "required": ["name", "email"],
        },
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer"},
                    "price": {"type": "number"},
                },
                "required": ["sku", "qty", "price"],
            },
            "maxItems": 20,
        },
        "note": {"type": "string"},
    },
    "required": ["id", "status", "customer", "lines"],
}

# name: (schema, a valid answer to follow)
CASES: dict[str, tuple[Any, str]] = {
    "simple_enum": (
        {
            "type": "object",
            "properties": {"colour": {"enum": ["red", "green", "blue"]}, "sure": {"type": "boolean"}},
            "required": ["colour", "sure"],
            "additionalProperties": False,
        },
        '{ "colour": "blue", "sure": true }',
    ),
    "order": (
        ORDER,
        '{ "id": "ABC-123456", "status": "paid", '
        '"customer": { "name": "Ava Smith", "email": "ava@example.com" }, '
        '"lines": [{ "sku": "X-1", "qty": 2, "price": 9.5 }, { "sku": "Y-22", "qty": 1, "price": 120 }] }',
    ),
    "nul_in_enum": ({"enum": ["a\u0000b", "c"]}, '"a\\u0000b"'),
    "deep_max_length": ({"type": "string", "maxLength": 200_000}, '"' + "x" * 300 + '"'),
    "nested_quantifiers": ({"type": "string", "pattern": "^((a{1000}){1000}){1000}$"}, '"' + "a" * 300),
    "anyof_ref_chain_40": (anyof_ref_chain(40), '{ "a": ' * 40 + '"x"' + " }" * 40),
    "lone_surrogate": ({"type": "string", "pattern": "^\ud800$"}, '"'),
}


def dump(path: str) -> None:
    """SmolLM2's pieces (llama_token_to_piece, special text included), control ids and end ids."""
    import llama_cpp

    from decider.engine.model.bundled import smollm2_path

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(smollm2_path()).encode(), params)
    vocab = llama_cpp.llama_model_get_vocab(model)
    import ctypes

    buf = ctypes.create_string_buffer(4096)
    pieces, special, eog = [], [], []
    for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
        pieces.append(buf.raw[:n])
        if llama_cpp.llama_vocab_get_attr(vocab, token) & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL:
            special.append(token)
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            eog.append(token)
    record = {"pieces": [piece.hex() for piece in pieces], "special": special, "eog": eog}
    Path(path).write_text(json.dumps(record))


def padded(vocab: dict[str, Any], size: int) -> dict[str, Any]:
    pieces = list(vocab["pieces"])
    seen = set(pieces)
    special = set(vocab["special"])
    plain = [p for i, p in enumerate(pieces) if i not in special and p]
    rng = random.Random(0)
    while len(pieces) < size:
        piece = rng.choice(plain) + rng.choice(plain)
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    return {**vocab, "pieces": pieces}


class LLGuidance:
    def __init__(self, vocab: dict[str, Any]) -> None:
        import llguidance
        import numpy as np

        self.llg, self.np = llguidance, np
        pieces, special = vocab["pieces"], vocab["special"]

        class Source:
            tokens = pieces
            special_token_ids = special
            eos_token_id = vocab["eog"][0]
            bos_token_id = None

            def __call__(self, data: bytes) -> list[int]:
                return []

        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(Source()),
            eos_token=vocab["eog"],
            slices=llguidance.LLTokenizer.json_slices(),
        )
        self.vocab_seconds = time.perf_counter() - start
        self.n = len(pieces)
        self.bits = np.zeros((self.n + 31) // 32, dtype=np.int32)

    def compile(self, schema: Any) -> Any:
        lark = (
            '%llguidance {"no_forcing": true}\nstart: %json '
            + json.dumps({**schema, "x-guidance": {"whitespace_pattern": "[ ]"}})
            + "\n"
        )
        matcher = self.llg.LLMatcher(self.tokenizer, self.llg.LLMatcher.grammar_from_lark(lark), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error().splitlines()[0])
        return matcher

    def fill(self, matcher: Any) -> None:
        matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        if matcher.is_error():
            raise ValueError(matcher.get_error().splitlines()[0])

    def accept(self, matcher: Any, token: int) -> None:
        if not matcher.consume_token(token):
            raise ValueError(matcher.get_error().splitlines()[0])


class OutlinesCore:
    def __init__(self, vocab: dict[str, Any]) -> None:
        import numpy as np
        import outlines_core

        self.oc, self.np = outlines_core, np
        start = time.perf_counter()
        mapping: dict[bytes, list[int]] = {}
        eos = vocab["eog"][0]
        for token, piece in enumerate(vocab["pieces"]):
            if token in vocab["special"] or token == eos or not piece:
                continue
            mapping.setdefault(piece, []).append(token)
        self.vocabulary = outlines_core.Vocabulary(eos, mapping)
        self.vocab_seconds = time.perf_counter() - start
        self.n = len(vocab["pieces"])
        self.bits = np.zeros((self.n + 31) // 32, dtype=np.int32)

    def compile(self, schema: Any) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="[ ]?")
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def fill(self, guide: Any) -> None:
        guide.write_mask_into(self.bits.ctypes.data, self.bits.size, 4)

    def accept(self, guide: Any, token: int) -> None:
        guide.advance(token, return_tokens=False)


ENGINES = {"llguidance": LLGuidance, "outlines-core": OutlinesCore}


def allowed_tokens(engine: Any) -> Any:
    """The tokens set in the engine's last bitmask (numpy; not part of the timed mask)."""
    np = engine.np
    return np.flatnonzero(np.unpackbits(engine.bits.view(np.uint8), bitorder="little")[: engine.n])


def run(vocab_path: str, engine_name: str, case: str, size: int | None) -> dict[str, Any]:
    vocab = json.loads(Path(vocab_path).read_text())
    vocab["pieces"] = [bytes.fromhex(piece) for piece in vocab["pieces"]]
    if size:
        vocab = padded(vocab, size)
    pieces = vocab["pieces"]
    engine = ENGINES[engine_name](vocab)
    schema, answer = CASES[case]
    target = answer.encode("utf-8")
    result: dict[str, Any] = {"engine": engine_name, "case": case, "vocab": len(pieces)}
    result["vocab_ms"] = round(engine.vocab_seconds * 1e3, 1)
    start = time.perf_counter()
    try:
        state = engine.compile(schema)
        engine.fill(state)
    except Exception as exc:  # an engine's refusal is a result here
        result.update(compile_ms=round((time.perf_counter() - start) * 1e3, 2), error=str(exc)[:160])
        return result
    result["compile_ms"] = round((time.perf_counter() - start) * 1e3, 2)
    allowed = allowed_tokens(engine)
    times, position = [], 0
    try:
        while position < len(target):
            rest = target[position:]
            fits = [int(t) for t in allowed if pieces[t] and rest.startswith(pieces[t])]
            if not fits:
                result["stuck_at"] = position
                break
            token = max(fits, key=lambda t: len(pieces[t]))
            engine.accept(state, token)
            position += len(pieces[token])
            begin = time.perf_counter()
            engine.fill(state)
            times.append(time.perf_counter() - begin)
            allowed = allowed_tokens(engine)
    except Exception as exc:
        result["error"] = str(exc)[:160]
    if times:
        ordered = sorted(times)
        result.update(
            steps=len(times),
            mask_mean_us=round(1e6 * sum(times) / len(times), 1),
            mask_p50_us=round(1e6 * ordered[len(ordered) // 2], 1),
            mask_max_us=round(1e6 * ordered[-1], 1),
        )
    return result


SERVING_SCHEMA = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}}


def serving(repeats: int) -> dict[str, Any]:
    """The server's time per generated token (median of `repeats` greedy 40-token chats), with the
    tags schema (`response_format`) and without, on the bundled model with one inference thread."""
    import httpx

    from decider_dev.local_server import run_local_server

    result: dict[str, Any] = {}
    messages = [{"role": "user", "content": "List tags for a blog post about cooking."}]
    with run_local_server({"DECIDER_N_THREADS": "1"}) as server:
        url = f"{server.base_url}/v1/chat/completions"
        for label, schema in (("schema", SERVING_SCHEMA), ("plain", None)):
            body: dict[str, Any] = {"messages": messages, "max_tokens": 40, "temperature": 0}
            if schema is not None:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "t", "schema": schema},
                }
            per_token = []
            for _ in range(repeats):
                start = time.monotonic()
                answer = httpx.post(url, json=body, timeout=120).json()
                per_token.append((time.monotonic() - start) / answer["usage"]["completion_tokens"])
            result[f"{label}_ms_per_token"] = round(1e3 * sorted(per_token)[len(per_token) // 2], 2)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    dumping = commands.add_parser("dump")
    dumping.add_argument("path")
    running = commands.add_parser("run")
    running.add_argument("vocab")
    running.add_argument("engine", choices=sorted(ENGINES))
    running.add_argument("case", choices=sorted(CASES))
    running.add_argument("--size", type=int, default=None)
    served = commands.add_parser("serving")
    served.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)
    if args.command == "dump":
        dump(args.path)
    elif args.command == "serving":
        print(json.dumps(serving(args.repeats)), flush=True)
    else:
        print(json.dumps(run(args.vocab, args.engine, args.case, args.size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
