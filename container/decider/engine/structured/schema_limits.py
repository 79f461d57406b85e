"""What a chat's `response_format` JSON schema is checked for before the constraint engine sees it.

The constraint engine (llguidance, decider.engine.structured.constraints) bounds its own work: compile-time
and per-token fuel, lexer states, grammar size, and it reports what it cannot do instead of
crashing. It does not bound what it is handed, and it reads JSON text strictly. So only two checks
are left here, each cheaper than what it protects:
1. the schema's own size (`max_schema_bytes`), before it is serialized for the engine;
2. text that is not Unicode: a lone surrogate (`"\\ud800"`, which JSON allows and Python keeps)
   anywhere in the schema, in a key or a value. The engine's JSON reader refuses it with a message
   that names no field; here it is a 422 `invalid_response_format` naming where it is.

A schema beyond the size limit is a `GrammarLimitError` (422 `response_format_too_complex`); a lone
surrogate a `SchemaTextError` (422 `invalid_response_format`); both carry `path`, where inside the
schema.
"""

from __future__ import annotations

import json
from typing import Any

from decider.settings import GrammarLimits

Path = tuple[str | int, ...]


class SchemaCheckError(ValueError):
    """A schema refused before compiling; `path` is where, inside the schema."""

    def __init__(self, message: str, path: Path = ()) -> None:
        super().__init__(message)
        self.path = path


class GrammarLimitError(SchemaCheckError):
    """A schema beyond a size limit (422 `response_format_too_complex`)."""


class SchemaTextError(SchemaCheckError):
    """A schema holding text that is not Unicode (422 `invalid_response_format`)."""


def check_schema(schema: Any, limits: GrammarLimits) -> None:
    """Refuse a schema too large, or holding a lone surrogate (see the module doc)."""
    surrogate = find_surrogate(schema)
    if surrogate is not None:
        raise SchemaTextError(
            "the JSON schema holds an unpaired surrogate code point (not Unicode text)", surrogate
        )
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > limits.schema_bytes:
        raise GrammarLimitError(
            f"the JSON schema is {size} bytes; at most {limits.schema_bytes} are allowed "
            "(DECIDER_MAX_SCHEMA_BYTES)"
        )


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def find_surrogate(schema: Any) -> Path | None:
    """The path of the first key or string (document order) holding a lone surrogate, or None."""
    stack: list[tuple[Any, Path]] = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):  # a path holds keys that are text: a bad key is reported escaped
            if not _is_text(node):
                return path
        elif isinstance(node, dict):
            for key in node:
                if isinstance(key, str) and not _is_text(key):
                    return (*path, key.encode("utf-8", errors="backslashreplace").decode("ascii", "replace"))
            stack.extend(reversed([(child, (*path, key)) for key, child in node.items()]))
        elif isinstance(node, list):
            stack.extend(reversed([(child, (*path, i)) for i, child in enumerate(node)]))
    return None
