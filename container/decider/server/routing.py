"""Dispatch of SageMaker's `POST /invocations` to the decision or chat handlers.

SageMaker forwards `CustomAttributes` verbatim as the `X-Amzn-SageMaker-Custom-Attributes`
header. A `route=` entry there picks the handler from an allow-list (the convention of the AWS
llama.cpp container; `route=/v1/models` answers as `GET /v1/models` does, for `decider-proxy`);
without one, the body's shape decides: `input` with a list of `questions`
means OpenAI's Decisions API, other `questions` a Jev decision (with `states` instead of `state`:
the batch route), `messages` chat.
"""

from __future__ import annotations

from typing import Any, Literal

from decider.errors import NotFoundError, RequestError

CUSTOM_ATTRIBUTES_HEADER = "X-Amzn-SageMaker-Custom-Attributes"
Target = Literal["decision", "batch", "openai_decision", "chat", "models"]
ROUTES: dict[str, Target] = {
    "/v1/systemone": "decision",
    "/v1/systemone/batch": "batch",
    "/v1/decisions": "openai_decision",
    "/v1/chat/completions": "chat",
    "/v1/models": "models",  # by `route=` only (decider-proxy's GET /v1/models); the body is ignored
}
TARGET_PATHS: dict[Target, str] = {target: path for path, target in ROUTES.items()}


def parse_custom_attributes(value: str | None) -> dict[str, str]:
    """`k=v` pairs separated by commas or semicolons; keys are case-insensitive, bare words ignored."""
    pairs: dict[str, str] = {}
    if not value:
        return pairs
    for item in value.replace(";", ",").split(","):
        key, sep, val = item.partition("=")
        if sep and key.strip():
            pairs[key.strip().lower()] = val.strip()
    return pairs


def target_from_attributes(attributes: dict[str, str]) -> Target | None:
    """The allow-listed target named by `route=`, None when there is no `route=`."""
    if "route" not in attributes:
        return None
    route = attributes["route"]
    normalized = route.rstrip("/") if route != "/" else route
    if normalized in ROUTES:
        return ROUTES[normalized]
    raise NotFoundError(
        f"route {route!r} in {CUSTOM_ATTRIBUTES_HEADER} is not served; "
        f"use one of: {', '.join(sorted(ROUTES))}",
        code="unknown_route",
        param=CUSTOM_ATTRIBUTES_HEADER,
    )


def target_from_body(body: Any) -> Target:
    """Route by shape: `input` + a list of `questions` → OpenAI decision, `questions` → Jev
    decision (`states` instead of `state`: the batch route), `messages` → chat."""
    if not isinstance(body, dict):
        raise RequestError(
            "the request body must be a JSON object with `questions` (decision) or `messages` (chat)",
            code="invalid_body",
        )
    has_questions, has_messages = "questions" in body, "messages" in body
    if has_questions and has_messages:
        raise RequestError(
            "the body has both `questions` and `messages`; name the route with "
            f"{CUSTOM_ATTRIBUTES_HEADER}: route=/v1/systemone, route=/v1/decisions or "
            "route=/v1/chat/completions",
            code="ambiguous_body",
        )
    if has_questions:
        if "input" in body and isinstance(body["questions"], list):
            return "openai_decision"
        return "batch" if "states" in body and "state" not in body else "decision"
    if has_messages:
        return "chat"
    raise RequestError(
        "cannot route the request: the body has neither `questions` (decision) nor `messages` (chat), "
        f"and {CUSTOM_ATTRIBUTES_HEADER} names no route",
        code="unroutable_body",
    )
