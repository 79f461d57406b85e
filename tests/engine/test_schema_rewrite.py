"""A caller's schema as llguidance is handed it (decider.engine.structured.schema_rewrite): `$ref`s checked
against the schema itself, the dialect spelled as llguidance knows it, and, without `strict`, what
llguidance refuses left out instead of the whole schema refused (issue 31 §1: coverage of
real-world schemas). Compiled on the tiny vocabulary of test_constraints."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from test_constraints import FAKE

from decider.engine.structured import schema_rewrite
from decider.engine.structured.constraints import INVALID, ConstraintError, compile_constraint


def compiles(schema: dict[str, Any], *, strict: bool = False) -> bool:
    try:
        compile_constraint(FAKE, schema, strict=strict)
    except ConstraintError:
        return False
    return True


def test_a_ref_to_another_document_is_left_out_without_strict() -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "http://json-schema.org/draft-07/schema#"}}}
    assert compiles(schema) and not compiles(schema, strict=True)
    kept = schema_rewrite.prepare(schema, strict=False)
    assert kept["properties"]["a"] == {}  # any value: the server fetches nothing


def test_a_ref_inside_the_schema_is_kept_whatever_its_spelling() -> None:
    """By pointer, by the schema's own `$id`, and by a key JSON Pointer allows and a URI does not."""
    schema = {
        "$id": "https://example.com/config.json",
        "$defs": {"x": {"type": "string"}, "{alias?:str}": {"type": "boolean"}},
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/x"},
            "b": {"$ref": "https://example.com/config.json#/$defs/x"},
            "c": {"$ref": "#/$defs/{alias?:str}"},
        },
    }
    kept = schema_rewrite.prepare(schema, strict=True)
    assert kept["properties"]["a"] == {"$ref": "#/$defs/x"}
    assert kept["properties"]["b"] == {"$ref": "https://example.com/config.json#/$defs/x"}
    assert kept["properties"]["c"] == {"$ref": "#/$defs/%7Balias?:str%7D"}
    assert compiles(schema, strict=True)


def test_a_ref_pointing_to_nothing_is_named_with_strict() -> None:
    schema = {"properties": {"a": {"$ref": "#/definitions/missing"}}}
    with pytest.raises(ConstraintError) as refused:
        compile_constraint(FAKE, schema, strict=True)
    assert refused.value.code == INVALID and refused.value.path == ("properties", "a", "$ref")
    assert "points to nothing" in str(refused.value)
    assert compiles(schema)


@pytest.mark.parametrize(
    ("dialect", "spelled"),
    [
        ("https://json-schema.org/draft-07/schema", "http://json-schema.org/draft-07/schema#"),
        ("http://json-schema.org/draft-04/schema", "http://json-schema.org/draft-04/schema#"),
        ("http://json-schema.org/draft/2019-09/schema#", "https://json-schema.org/draft/2019-09/schema"),
        ("http://json-schema.org/schema", None),  # "the latest": no draft named
    ],
)
def test_the_dialect_is_spelled_as_llguidance_knows_it(dialect: str, spelled: str | None) -> None:
    schema = {"$schema": dialect, "type": "string"}
    assert schema_rewrite.known_dialect(schema).get("$schema") == spelled
    assert compiles(schema, strict=True)  # llguidance would try to fetch any other spelling


def test_a_pattern_llguidance_cannot_parse_is_left_out_without_strict() -> None:
    look_around = "^(?!x)[a-z]+$"
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": look_around}, "b": {"pattern": "^b+$"}},
        "definitions": {"elsewhere": {"threshold": {"pattern": look_around}}},  # reachable by a $ref
    }
    assert schema_rewrite.bad_patterns(schema) == {look_around: ("properties", "a", "pattern")}
    repaired = schema_rewrite.repair(schema, "regex parse error: look-around is not supported")
    assert repaired is not None and "pattern" not in repaired["properties"]["a"]
    assert repaired["properties"]["b"] == {"pattern": "^b+$"}  # what parses stays enforced
    assert "pattern" not in repaired["definitions"]["elsewhere"]["threshold"]
    assert compiles(schema) and not compiles(schema, strict=True)


def test_overlapping_pattern_properties_are_narrowed_without_strict() -> None:
    schema = {"type": "object", "properties": {"a": {}}, "patternProperties": {"^.*$": {"type": "string"}}}
    message = "patternProperty regexes /^.*$/ and /a/ are not disjoint"
    assert schema_rewrite.repair(schema, message) == {
        "type": "object",
        "properties": {"a": {}},
        "patternProperties": {},
    }


def test_a_recursive_ref_combined_with_other_keywords_is_unrolled_without_strict() -> None:
    node = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/definitions/n"}}}}
    schema = {
        "definitions": {"n": node, "m": {"allOf": [{"$ref": "#/definitions/n"}, {"required": ["kids"]}]}},
        "properties": {"root": {"$ref": "#/definitions/n", "minProperties": 1}},
    }
    message = "circular references with sibling keys are not supported: json-schema:///#/definitions/n"
    repaired = schema_rewrite.repair(schema, message)
    assert repaired is not None
    assert repaired["properties"]["root"] == {"$ref": "#/definitions/n"}
    assert repaired["definitions"]["m"]["allOf"][0] == {}
    assert repaired["definitions"]["n"] == node  # the recursion itself stays


def test_closing_objects_never_refuses_what_a_combined_anyof_member_lists() -> None:
    """A Unity .asmdef: `required: [name]` beside `anyOf` members listing other properties. Closing
    the members would make `name` unsatisfiable (llguidance: 'required property is unsatisfiable')."""
    schema = {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string"}, "include": {"type": "array"}},
        "anyOf": [{"properties": {"include": {"minItems": 1}}}, {"properties": {"include": {"maxItems": 0}}}],
    }
    kept = schema_rewrite.closed_objects(schema)
    assert "additionalProperties" not in kept and all("additionalProperties" not in m for m in kept["anyOf"])
    assert compiles(schema, strict=True)


def test_what_the_rewrite_leaves_still_validates_an_instance_the_schema_accepts() -> None:
    """Best effort only ever leaves a keyword out: an instance of the original schema is one of the
    rewritten schema too."""
    schema = {
        "$schema": "https://json-schema.org/draft-07/schema",
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^(?!_)[a-z_]+$"},
            "meta": {"$ref": "http://json-schema.org/draft-07/schema#"},
        },
    }
    instance = {"name": "ok_name", "meta": {"type": "string"}}
    jsonschema.Draft7Validator(schema).validate(instance)
    rewritten = schema_rewrite.prepare(schema, strict=False)
    rewritten = schema_rewrite.repair(rewritten, "regex parse error") or rewritten
    jsonschema.Draft7Validator(rewritten).validate(instance)
