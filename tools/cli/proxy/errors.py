"""The container's error body, built on the proxy's side of the wire.

The same shape as `decider.errors.DeciderError.to_wire()` (this package does not import the
container's): `{"error": {"type", "code", "message", "param", "retryable"}, "detail": …}`, with
`detail` a FastAPI validation list for 422 and `{"error_type", "message"}` otherwise. Every error
response also carries `x-should-retry` (the openai SDK obeys it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ProxyError(Exception):
    """An error the proxy answers itself (SageMaker refused or failed, or the request cannot be sent)."""

    status: int
    code: str
    message: str
    type: str = "api_error"
    param: str | None = None
    retryable: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def to_wire(self) -> dict[str, Any]:
        detail: Any
        if self.status == 422:
            loc = ["body", *self.param.split(".")] if self.param else ["body"]
            detail = [{"loc": loc, "msg": self.message, "type": self.code}]
        else:
            detail = {"error_type": self.code, "message": self.message}
        return {
            "error": {
                "type": self.type,
                "code": self.code,
                "message": self.message,
                "param": self.param,
                "retryable": self.retryable,
            },
            "detail": detail,
        }

    def body(self) -> bytes:
        return json.dumps(self.to_wire(), ensure_ascii=False).encode()

    def response_headers(self) -> dict[str, str]:
        return {
            **self.headers,
            "content-type": "application/json",
            "x-should-retry": "true" if self.retryable else "false",
        }


def request_error(message: str, code: str, *, status: int = 422, param: str | None = None) -> ProxyError:
    return ProxyError(status, code, message, type="invalid_request_error", param=param)


def not_found(message: str, code: str = "unknown_endpoint") -> ProxyError:
    return ProxyError(404, code, message, type="not_found_error")


def retryable_of(body: bytes) -> bool | None:
    """`error.retryable` of a container error body, None when the body is not one."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict) and isinstance(error.get("retryable"), bool):
        return bool(error["retryable"])
    return None
