"""A caller's JSON schema as llguidance is handed it (decider.engine.structured.constraints compiles it).

Two kinds of rewrite, each keeping what the output must satisfy or narrowing it, except where
best effort is asked for (no `json_schema.strict`, BEST_EFFORT in constraints):

- `prepare`, always: `$schema` spelled as llguidance knows the drafts (`known_dialect`: any other
  spelling it would try to fetch), objects listing `properties` closed as the GBNF path read them
  (`closed_objects`), `format`s llguidance does not know left out as the annotations they are
  (`known_formats_only`), and every `$ref` checked against the schema itself. A `$ref` is
  percent-encoded where it is not a valid URI (`#/definitions/{name}`: JSON Pointer allows any
  key). One that names a document outside the schema (`http://json-schema.org/draft-07/schema`,
  a sibling file) or a pointer to nothing cannot be followed: the server fetches nothing. Strict:
  a `RewriteError` naming the `$ref`; best effort: the `$ref` is left out (that subschema allows
  any value), as llama-server's converter leaves out what it cannot resolve.
- `repair`, best effort only, after llguidance refused a schema: the part its message names is
  left out and the schema compiled again (bounded by constraints.MAX_REPAIRS). A `pattern` (or
  `patternProperties` name) in regex syntax it does not parse (look-around, backreferences); a
  `patternProperties` entry overlapping another name (it requires them disjoint; without the
  entry fewer names are allowed); a recursive `$ref` combined with other keywords, beside it or
  as an `allOf` member (JSON Schema before 2019-09 ignores the keywords beside it anyway).
  Strict: `strict_error` names the pattern instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, unquote, urldefrag, urljoin, urlsplit

import llguidance

Path = tuple[str | int, ...]

# the base of a schema without `$id` (llguidance's own is `json-schema:///`, which urljoin cannot join)
ROOT_BASE = "https://schema.invalid/root.json"

# kept beside a `$ref` when its siblings are left out: they hold or name subschemas others use
_STRUCTURAL = frozenset(("$ref", "$id", "id", "$anchor", "$schema", "$defs", "definitions"))


class RewriteError(ValueError):
    """A schema that cannot be used as it is (strict); `path` is where, inside the schema."""

    def __init__(self, message: str, path: Path = ()) -> None:
        super().__init__(message)
        self.path = path


def nodes(node: Any, path: Path = ()) -> Iterator[tuple[dict[str, Any], Path]]:
    """Every object in the schema (itself first) with its path, JSON values (`enum`, `const`,
    `default`, `examples`) excepted. Objects, not only subschemas by keyword: a `$ref` can point
    anywhere (`#/definitions/sla/threshold`), and llguidance compiles what it points to."""
    if isinstance(node, list):
        for index, item in enumerate(node):
            yield from nodes(item, (*path, index))
    elif isinstance(node, dict):
        yield node, path
        for key, value in node.items():
            if key not in _VALUES:
                yield from nodes(value, (*path, key))


def rebuild(node: Any, change: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A copy of the schema with `change` applied to every object (children first), JSON values
    excepted."""
    if isinstance(node, list):
        return [rebuild(item, change) for item in node]
    if not isinstance(node, dict):
        return node
    return change({key: value if key in _VALUES else rebuild(value, change) for key, value in node.items()})


# --- always -----------------------------------------------------------------------------------------


def prepare(schema: dict[str, Any], *, strict: bool) -> dict[str, Any]:
    """The schema llguidance compiles (see the module doc). RewriteError (strict only) for a `$ref`
    that cannot be followed."""
    return known_formats_only(closed_objects(followable_refs(known_dialect(schema), strict=strict)))


_DIALECT = re.compile(r"^https?://json-schema\.org/(draft-0[3-7]|draft/20\d\d-\d\d)/schema#?$")


def known_dialect(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with its `$schema` spelled as llguidance knows it (`http://json-schema.org/draft-07/schema#`,
    `https://json-schema.org/draft/2020-12/schema`), or without it when it names no draft
    (`http://json-schema.org/schema`): llguidance would try to fetch any other spelling."""
    dialect = schema.get("$schema")
    if not isinstance(dialect, str):
        return schema
    out = {key: value for key, value in schema.items() if key != "$schema"}
    draft = _DIALECT.match(dialect.strip())
    if draft:
        name = draft.group(1)
        out["$schema"] = (
            f"http://json-schema.org/{name}/schema#"
            if name.startswith("draft-0")
            else f"https://json-schema.org/{name}/schema"
        )
    return out


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists `properties` and
    says nothing of others, as the GBNF path read it (llama-cpp-python's converter allowed no
    other property there; JSON Schema allows any). What it allows is a subset of what the schema
    allows, so the output still validates. A schema with `allOf` anywhere is left as it is: its
    members are merged, and closing each would exclude the others' properties."""
    if "allOf" in json.dumps(schema):
        return schema
    return _close(schema)


# where closing stays a narrowing (not under `not` or `if`, where it would widen what passes)
_CLOSE_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_CLOSE_LISTS = ("anyOf", "oneOf", "prefixItems")
_CLOSE_SINGLES = ("items", "additionalProperties")


def _close(node: Any, here: bool = True) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    required = out.get("required")
    # members of an anyOf/oneOf beside the node's own object keywords are combined with them:
    # closing either side would refuse the other's names
    combined = any(isinstance(out.get(key), list) for key in ("anyOf", "oneOf")) and (
        "properties" in out or "required" in out
    )
    if (
        here
        and not combined
        and isinstance(out.get("properties"), dict)
        and "additionalProperties" not in out
        and ("patternProperties" not in out and "unevaluatedProperties" not in out)
        # a required name it does not list would be unsatisfiable once closed
        and not (isinstance(required, list) and any(name not in out["properties"] for name in required))
    ):
        out["additionalProperties"] = False
    for key in _CLOSE_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(child) for name, child in out[key].items()}
    for key in _CLOSE_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(child, here=not combined or key == "prefixItems") for child in out[key]]
    for key in _CLOSE_SINGLES:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key])
    return out


# the `format`s llguidance constrains (1.9.1); it refuses any other
FORMATS = frozenset(
    ("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid")
)
_VALUES = frozenset(("enum", "const", "default", "examples"))  # JSON values, not schemas


def known_formats_only(schema: Any) -> Any:
    """The schema without the `format`s llguidance does not know (`uri-reference`, `int64`, …): JSON
    Schema makes `format` an annotation unless a validator opts in, and the GBNF path ignored the ones
    it did not know; llguidance would refuse the whole schema."""

    def drop(node: dict[str, Any]) -> dict[str, Any]:
        known = not isinstance(node.get("format"), str) or node["format"] in FORMATS
        return node if known else {key: value for key, value in node.items() if key != "format"}

    return rebuild(schema, drop)


def followable_refs(schema: dict[str, Any], *, strict: bool) -> dict[str, Any]:
    """The schema with every `$ref` a valid URI that resolves inside it (module doc)."""
    documents = _documents(schema)
    problems: dict[Path, str] = {}

    def visit(node: dict[str, Any], path: Path, base: str) -> dict[str, Any]:
        if isinstance(node.get("$id"), str):
            base = _join(base, node["$id"])
        out = dict(node)
        for key, value in node.items():
            if key in _VALUES:
                continue
            if isinstance(value, dict):
                out[key] = visit(value, (*path, key), base)
            elif isinstance(value, list):
                out[key] = [
                    visit(item, (*path, key, index), base) if isinstance(item, dict) else item
                    for index, item in enumerate(value)
                ]
        ref = node.get("$ref")
        if isinstance(ref, str):
            encoded = _encode(ref)
            problem = _unfollowable(encoded, base, documents)
            if problem is None:
                out["$ref"] = encoded
            else:
                problems[(*path, "$ref")] = problem
                del out["$ref"]
        return out

    root_base = _join(ROOT_BASE, schema["$id"]) if isinstance(schema.get("$id"), str) else ROOT_BASE
    rewritten = visit(schema, (), urldefrag(root_base)[0])
    if strict and problems:
        path, problem = next(iter(problems.items()))
        raise RewriteError(problem, path)
    return rewritten


def _documents(schema: dict[str, Any]) -> dict[str, Any]:
    """The documents a `$ref` can name inside the schema: the root and every subschema with an
    `$id` of its own, by absolute URI without fragment."""
    found: dict[str, Any] = {}

    def visit(node: Any, base: str) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item, base)
        elif isinstance(node, dict):
            if isinstance(node.get("$id"), str):
                base = urldefrag(_join(base, node["$id"]))[0]
                found.setdefault(base, node)
            for key, value in node.items():
                if key not in _VALUES:
                    visit(value, base)

    found[ROOT_BASE] = schema
    visit(schema, ROOT_BASE)
    return found


def _join(base: str, ref: str) -> str:
    if ref.startswith("#"):
        return urldefrag(base)[0] + ref
    if urlsplit(ref).scheme:
        return ref
    return urljoin(base, ref)


def _encode(ref: str) -> str:
    """`ref` as a valid URI reference: characters a URI cannot hold (`{`, `}`, spaces, …)
    percent-encoded, what is already encoded kept."""
    document, hash_sign, fragment = ref.partition("#")
    document = quote(document, safe=":/?[]@!$&'()*+,;=-._~%")
    fragment = quote(fragment, safe="/?:@!$&'()*+,;=-._~%")
    return f"{document}{hash_sign}{fragment}"


def _unfollowable(ref: str, base: str, documents: dict[str, Any]) -> str | None:
    """Why `ref` (seen under `base`) cannot be followed inside the schema, or None."""
    target = _join(base, ref)
    document, fragment = urldefrag(target)
    if document not in documents:
        shown = ref if ref.split("#")[0] else target
        return (
            f"$ref {shown!r} names a document outside the schema: the server fetches nothing; "
            "put what it names under $defs"
        )
    if fragment.startswith("/") and not _has_pointer(documents[document], fragment):
        return f"$ref {ref!r} points to nothing in the schema"
    return None


def _has_pointer(document: Any, pointer: str) -> bool:
    node = document
    for raw in pointer.split("/")[1:]:
        token = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return False
    return True


# --- best effort, after llguidance refused the schema -----------------------------------------------

MAX_PATTERN_CHECKS = 128  # distinct regexes compiled alone per repair (each ~1-2 ms)
_REGEX_ERROR = re.compile(r"regex parse error|lookarounds? not supported|in regex /", re.IGNORECASE)
_OVERLAP = re.compile(r"patternProperty regexes /(.*)/ and /(.*)/ are not disjoint")
_CIRCULAR = re.compile(r"circular references with sibling keys are not supported: (\S*)")


def repair(schema: dict[str, Any], message: str) -> dict[str, Any] | None:
    """The schema without the part llguidance's `message` refused (module doc); None when the
    message names nothing that can be left out."""
    if _REGEX_ERROR.search(message):
        return _without_patterns(schema, set(bad_patterns(schema)))
    overlap = _OVERLAP.search(message)
    if overlap:
        return _without_pattern_property(schema, overlap.group(1)) or _without_pattern_property(
            schema, overlap.group(2)
        )
    circular = _CIRCULAR.search(message)
    if circular:
        changed = rebuild(schema, _unrolled(unquote(circular.group(1).partition("#")[2])))
        return changed if changed != schema else None
    return None


def strict_error(schema: dict[str, Any], message: str) -> RewriteError | None:
    """For a schema sent with `strict`: the refusal naming the part llguidance's message refers
    to, where it can be found (a pattern), or None."""
    if _REGEX_ERROR.search(message):
        for regex, path in bad_patterns(schema).items():
            return RewriteError(
                f"pattern {regex!r} uses regex syntax the constraint engine does not support "
                "(look-around, backreferences)",
                path,
            )
    return None


def bad_patterns(schema: dict[str, Any]) -> dict[str, Path]:
    """Each regex of the schema (`pattern`, `patternProperties` names) llguidance cannot parse,
    with the first place it appears. Each distinct regex is compiled once, alone (~1-2 ms), the
    first MAX_PATTERN_CHECKS of them: past those the schema is refused as llguidance refused it."""
    found: dict[str, Path] = {}
    checked: dict[str, bool] = {}
    for node, path in nodes(schema):
        regexes = []
        if isinstance(node.get("pattern"), str):
            regexes.append((node["pattern"], (*path, "pattern")))
        if isinstance(node.get("patternProperties"), dict):
            regexes.extend((name, (*path, "patternProperties", name)) for name in node["patternProperties"])
        for regex, where in regexes:
            if regex not in checked:
                if len(checked) >= MAX_PATTERN_CHECKS:
                    return found
                checked[regex] = _parses(regex)
            if not checked[regex]:
                found.setdefault(regex, where)
    return found


def _parses(regex: str) -> bool:
    text = json.dumps({"type": "string", "pattern": regex}, ensure_ascii=True)
    grammar = llguidance.LLMatcher.grammar_from_lark(f"start: %json {text}\n")
    return not llguidance.LLMatcher.validate_grammar(grammar)


def _without_patterns(schema: dict[str, Any], bad: set[str]) -> dict[str, Any] | None:
    if not bad:
        return None

    def drop(node: dict[str, Any]) -> dict[str, Any]:
        if isinstance(node.get("pattern"), str) and node["pattern"] in bad:
            del node["pattern"]
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {
                name: child for name, child in node["patternProperties"].items() if name not in bad
            }
        return node

    return rebuild(schema, drop)


def _without_pattern_property(schema: dict[str, Any], regex: str) -> dict[str, Any] | None:
    def drop(node: dict[str, Any]) -> dict[str, Any]:
        if isinstance(node.get("patternProperties"), dict) and regex in node["patternProperties"]:
            node["patternProperties"] = {k: v for k, v in node["patternProperties"].items() if k != regex}
        return node

    changed = rebuild(schema, drop)
    return changed if changed != schema else None


def _unrolled(fragment: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A change that leaves out where the recursive `$ref` to `fragment` is combined with other
    keywords: the keywords beside it, and its place as an `allOf` member (llguidance merges
    those into one node with siblings)."""

    def names_it(node: Any) -> bool:
        ref = node.get("$ref") if isinstance(node, dict) else None
        return isinstance(ref, str) and unquote(ref.partition("#")[2]) == fragment

    def change(node: dict[str, Any]) -> dict[str, Any]:
        if isinstance(node.get("allOf"), list):
            node["allOf"] = [{} if names_it(member) else member for member in node["allOf"]]
        if names_it(node):
            return {key: value for key, value in node.items() if key in _STRUCTURAL}
        return node

    return change
