"""Limits on a chat's `response_format` JSON schema, checked before any grammar is built.

llama.cpp's GBNF parser recurses once per nested group and has no depth limit: the grammar
llama.cpp's own converter makes from `{"type": "string", "maxLength": 200000}` nests 200,000
groups, and parsing it overflows the thread's stack (SIGSEGV, the whole server gone). Measured
here: about 480 bytes of stack per level, so ~17,000 levels crash a thread with the default 8 MiB
stack and ~2,500 one with 1 MiB. The converter itself (pure Python) can also be made to build
gigabytes: nested regex quantifiers multiply (`((a{1000}){1000}){1000}`), and each object's
optional properties cost it quadratic work.

So, in order, each check cheaper than what it protects:
1. the schema's own size (`max_schema_bytes`);
2. its repetition budget: the sum over every `minLength` / `maxLength` / `minItems` / `maxItems`
   and every regex quantifier (expanded as the converter expands them) of what it asks for
   (`max_schema_repetition`), and the optional properties of each object (`max_schema_optional_properties`);
3. after conversion, the grammar's size (`max_grammar_bytes`) and the deepest nesting of its groups
   (`max_grammar_depth`, default 1024: a sixteenth of what crashes a default thread, and still safe
   on a 1 MiB stack, as tests/server/test_grammar_limits.py shows in a child process).

A schema beyond a limit is a `GrammarLimitError` naming the field (`path`), which the server
answers as 422 `response_format_too_complex`.
"""

from __future__ import annotations

import json
from typing import Any

from decider.settings import GrammarLimits

Path = tuple[str | int, ...]
BOUND_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems")


class GrammarLimitError(ValueError):
    """A schema, or the grammar made from it, beyond a limit; `path` is where, inside the schema."""

    def __init__(self, message: str, path: Path = ()) -> None:
        super().__init__(message)
        self.path = path


def check_schema(schema: Any, limits: GrammarLimits) -> None:
    """Refuse a schema whose grammar would be too large to build or to parse (see the module doc)."""
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > limits.schema_bytes:
        raise GrammarLimitError(
            f"the JSON schema is {size} bytes; at most {limits.schema_bytes} are allowed "
            "(DECIDER_MAX_SCHEMA_BYTES)"
        )
    used = 0
    stack: list[tuple[Any, Path]] = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend(reversed([(child, (*path, i)) for i, child in enumerate(node)]))
            continue
        if not isinstance(node, dict):
            continue
        for key in BOUND_KEYWORDS:
            used += _bound_cost(node.get(key))
            _check_budget(used, limits, (*path, key))
        _check_satisfiable_bounds(node, path)
        _check_no_nul(node, path)
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            used += pattern_cost(pattern)
            _check_budget(used, limits, (*path, "pattern"))
        _check_optional_properties(node, limits, path)
        children = [(child, (*path, key)) for key, child in node.items() if isinstance(child, dict | list)]
        stack.extend(reversed(children))  # walked in document order: the first field past the budget


def _check_satisfiable_bounds(node: dict[str, Any], path: Path) -> None:
    """A minimum above its maximum builds a grammar llama.cpp's sampler aborts the process on
    ("Unexpected empty grammar stack"): refused here."""
    for low, high in (
        ("minLength", "maxLength"),
        ("minItems", "maxItems"),
        ("minProperties", "maxProperties"),
    ):
        lo, hi = node.get(low), node.get(high)
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            raise GrammarLimitError(f"{low} {lo} is above {high} {hi}: no value can match", (*path, low))


def _check_no_nul(node: dict[str, Any], path: Path) -> None:
    """A NUL character in an `enum` or `const` string ends the grammar text early in llama.cpp (a C
    string), and its sampler then aborts the process: refused here."""
    values = list(node.get("enum") or []) if isinstance(node.get("enum"), list) else []
    if "const" in node:
        values.append(node["const"])
    for value in values:
        if _has_nul(value):
            raise GrammarLimitError(
                "a NUL character in an enum or const value is not supported", (*path, "enum")
            )


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


def _bound_cost(value: Any) -> int:
    if isinstance(value, int | float) and value > 0:
        return int(min(value, 2**62))
    return 0


def _check_budget(used: int, limits: GrammarLimits, path: Path) -> None:
    if used > limits.repetition:
        raise GrammarLimitError(
            f"the JSON schema asks for {used} or more repetitions (minLength, maxLength, minItems, maxItems "
            f"and pattern quantifiers, added up); at most {limits.repetition} are allowed "
            "(DECIDER_MAX_SCHEMA_REPETITION)",
            path,
        )


def _check_optional_properties(node: dict[str, Any], limits: GrammarLimits, path: Path) -> None:
    properties = node.get("properties")
    if not isinstance(properties, dict):
        return
    required = node.get("required")
    required_names = (
        set(required) if isinstance(required, list) and all(isinstance(r, str) for r in required) else set()
    )
    optional = sum(1 for name in properties if name not in required_names)
    if optional > limits.optional_properties:
        raise GrammarLimitError(
            f"this object has {optional} optional properties; at most {limits.optional_properties} are "
            "allowed (DECIDER_MAX_SCHEMA_OPTIONAL_PROPERTIES): list the others in `required`",
            (*path, "properties"),
        )


def pattern_cost(pattern: str) -> int:
    """How many atoms a regex expands to when quantifiers are written out (as llama.cpp's converter
    does): literals and classes count 1, a group the sum of its parts, `{m,n}` multiplies by the
    larger bound. An over-estimate (alternatives are added up), capped at 2**62."""
    frames: list[int] = [0]
    last = 0  # the cost of the atom a quantifier would apply to
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "\\":
            last = 1
            frames[-1] += 1
            i += 2
            continue
        if char == "[":
            j = i + 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            last = 1
            frames[-1] += 1
            i = j + 1
            continue
        if char == "(":
            frames.append(0)
            last = 0
        elif char == ")":
            inner = frames.pop() if len(frames) > 1 else 0
            last = max(inner, 1)
            frames[-1] += last
        elif char == "{":
            end = pattern.find("}", i)
            bounds = pattern[i + 1 : end].split(",") if end > i else []
            numbers = [int(part) for part in (b.strip() for b in bounds) if part.isdigit()]
            if end > i and numbers:
                factor = max(max(numbers), 1)
                frames[-1] = min(frames[-1] + last * (factor - 1), 2**62)
                i = end + 1
                continue
            last = 1
            frames[-1] += 1
        elif char in "|^$*+?":
            pass
        else:
            last = 1
            frames[-1] += 1
        i += 1
    return min(sum(frames), 2**62)


def check_grammar_text(grammar: str, limits: GrammarLimits) -> None:
    """Refuse GBNF too large, or nested too deep, for llama.cpp's parser (before it sees it)."""
    if len(grammar) > limits.grammar_bytes:
        raise GrammarLimitError(
            f"the grammar made from this JSON schema is {len(grammar)} bytes; at most "
            f"{limits.grammar_bytes} are allowed (DECIDER_MAX_GRAMMAR_BYTES)"
        )
    depth = grammar_depth(grammar)
    if depth > limits.grammar_depth:
        raise GrammarLimitError(
            f"the grammar made from this JSON schema nests {depth} groups deep; at most "
            f"{limits.grammar_depth} are allowed (DECIDER_MAX_GRAMMAR_DEPTH): lower maxLength, maxItems "
            "or the nesting of pattern groups"
        )


def grammar_depth(grammar: str) -> int:
    """The deepest nesting of `(` groups in GBNF text (string literals and classes skipped)."""
    depth = deepest = 0
    i, n = 0, len(grammar)
    while i < n:
        char = grammar[i]
        if char in '"[':
            close = '"' if char == '"' else "]"
            i += 1
            while i < n and grammar[i] != close:
                i += 2 if grammar[i] == "\\" else 1
        elif char == "#":
            while i < n and grammar[i] != "\n":
                i += 1
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(0, depth - 1)
        i += 1
    return deepest
