"""Request bodies and assertions shared by the server tests."""

from __future__ import annotations

from typing import Any

DECISION: dict[str, Any] = {
    "state": "Subject: charged twice\n\nI was charged twice for order 1182 and I want my money back today.",
    "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "team": {
            "type": "choice",
            "instructions": "Which team should handle this?",
            "criteria": {"billing": "Payments and refunds", "technical": "Bugs and outages", "sales": None},
        },
        "anger": {
            "type": "score",
            "instructions": "How upset is the customer?",
            "criteria": ["calm", "annoyed", "furious"],
        },
    },
}
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "seed": 7}


def assert_error_body(body: Any, code: str | None = None) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == {"type", "code", "message", "param"}, body
    assert isinstance(body["error"]["code"], str) and body["error"]["message"], body
    if code is not None:
        assert body["error"]["code"] == code, body
