"""Which property changes force a replacement: createOnlyProperties from the schemas bundled in cfn-lint.

cfn-lint ships the CloudFormation resource provider schemas per region, so this works offline.
"""

from __future__ import annotations

from functools import cache

from cfnlint.schema import PROVIDER_SCHEMA_MANAGER, ResourceNotFoundError

SCHEMA_REGION = "us-east-1"
Pointer = tuple[str, ...]  # "/properties/A/*/B" -> ("A", "*", "B")


@cache
def create_only_properties(resource_type: str) -> tuple[Pointer, ...] | None:
    """Property paths whose change replaces the resource; None when the type has no schema (Custom::…)."""
    try:
        schema = PROVIDER_SCHEMA_MANAGER.get_resource_schema(SCHEMA_REGION, resource_type)
    except ResourceNotFoundError:
        return None
    pointers = schema.schema.get("createOnlyProperties", [])
    return tuple(tuple(p.split("/")[2:]) for p in pointers if p.startswith("/properties/"))


def matches(pointer: Pointer, path: tuple[str | int, ...]) -> bool:
    """True when a change at `path` touches `pointer` (either is a prefix of the other; * = any index)."""
    for want, have in zip(pointer, path, strict=False):
        if want == "*":
            continue
        if want != str(have):
            return False
    return True
