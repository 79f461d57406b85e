"""A chat's `response_format`: the schema checked (schema_limits), rewritten for llguidance
(schema_rewrite), and compiled into a token mask per step (constraints)."""
