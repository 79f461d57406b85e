"""Request bodies shared by the engine tests."""

from __future__ import annotations

from typing import Any

# The README's example decision request.
EXAMPLE: dict[str, Any] = {
    "model": "jev-latest",
    "state": "Payouts failing for 3 days, losing sales!",
    "questions": {
        "team": {
            "type": "choice",
            "instructions": "Which team owns this?",
            "criteria": {"billing": "Payments, refunds", "technical": "Bugs, outages", "sales": None},
        },
        "anger": {
            "type": "score",
            "instructions": "How frustrated?",
            "criteria": ["Calm", "Civil", "Very angry"],
        },
        "refund": {"type": "noul", "instructions": "Is money back requested?"},
    },
}
