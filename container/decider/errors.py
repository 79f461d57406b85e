"""Typed errors with machine-readable codes, shared by the engine and the HTTP layer.

Every error a client can cause or see is a `DeciderError`. The HTTP layer turns it into
`{"error": {"type", "code", "message", "param"}}` with its status, so no layer below the
server needs to know about HTTP beyond the status number.
"""

from __future__ import annotations

from typing import Any


class DeciderError(Exception):
    """An error with an HTTP status, an error type, a stable code and the offending parameter."""

    status: int = 500
    type: str = "api_error"
    code: str = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.param = param
        self.headers = dict(headers or {})

    def to_wire(self) -> dict[str, Any]:
        return {"error": {"type": self.type, "code": self.code, "message": self.message, "param": self.param}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status}, code={self.code!r}, param={self.param!r})"


class RequestError(DeciderError):
    """The request is invalid (422 unless a more precise 4xx applies, e.g. 413)."""

    status = 422
    type = "invalid_request_error"
    code = "invalid_body"


class PayloadTooLargeError(RequestError):
    status = 413
    code = "body_too_large"


class NotFoundError(DeciderError):
    status = 404
    type = "not_found_error"
    code = "unknown_endpoint"


class OverloadedError(DeciderError):
    """The bounded queue is full: retry later (429 + Retry-After)."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class DeadlineExceededError(DeciderError):
    """Waiting plus working would pass the request deadline."""

    status = 504
    type = "api_error"
    code = "deadline_exceeded"


class UnavailableError(DeciderError):
    """The model is not loaded (yet), or the server is shutting down (503 + Retry-After)."""

    status = 503
    type = "api_error"
    code = "model_unavailable"


class StartupError(Exception):
    """The server cannot start: missing/invalid model file, unusable tokenizer, bad setting.

    Its message is printed as one log line before a non-zero exit.
    """
