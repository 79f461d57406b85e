"""Typed errors with machine-readable codes, shared by the engine and the HTTP layer.

Every error a client can cause or see is a `DeciderError`. The HTTP layer turns it into one body
that both kinds of client read:

    {"error": {"type", "code", "message", "param", "retryable"},   # OpenAI / SemIf style
     "detail": …}                                                  # FastAPI / TypeSafe style

`detail` is `[{"loc": ["body", …], "msg", "type"}]` for validation errors (422) and
`{"error_type", "message"}` for every other status. `retryable` says whether the same request can
succeed later (overload, deadline after waiting, loading); the HTTP layer also sends it as
`x-should-retry`, which the openai SDK obeys. No layer below the server needs to know about HTTP
beyond the status number.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Loc = tuple[str | int, ...]


class DeciderError(Exception):
    """An error with an HTTP status, an error type, a stable code and the offending parameter.

    `param` is a dotted path (`questions.team.criteria`) or a sequence of path parts
    (`("questions", 3, "choices")`); a sequence keeps list indices as integers and keys that hold
    dots intact in the FastAPI-style `loc`.
    """

    status: int = 500
    type: str = "api_error"
    code: str = "internal_error"
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | Sequence[str | int] | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if retryable is not None:
            self.retryable = retryable
        self.param: str | None = None
        self.loc: Loc = ()
        self.relocated(param)
        self.headers = dict(headers or {})

    def relocated(self, param: str | Sequence[str | int] | None) -> DeciderError:
        """Point the error at another parameter (e.g. a route's own field names); returns self."""
        if param is None or isinstance(param, str):
            self.param = param or None
            self.loc = tuple(param.split(".")) if param else ()
        else:
            self.loc = tuple(param)
            self.param = ".".join(str(part) for part in self.loc) or None
        return self

    def detail(self) -> list[dict[str, Any]] | dict[str, str]:
        """FastAPI's shape: a list of validation errors for 422, else `{error_type, message}`."""
        if self.status != 422:
            return {"error_type": self.code, "message": self.message}
        return [{"loc": ["body", *self.loc], "msg": self.message, "type": self.code}]

    def to_wire(self) -> dict[str, Any]:
        return {
            "error": {
                "type": self.type,
                "code": self.code,
                "message": self.message,
                "param": self.param,
                "retryable": self.retryable,
            },
            "detail": self.detail(),
        }

    def response_headers(self) -> dict[str, str]:
        """The error's own headers plus `x-should-retry` (the openai SDK retries or not on it)."""
        return {**self.headers, "x-should-retry": "true" if self.retryable else "false"}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status}, code={self.code!r}, param={self.param!r})"


class RequestError(DeciderError):
    """The request is invalid (422 unless a more precise 4xx applies, e.g. 413). Never retryable."""

    status = 422
    type = "invalid_request_error"
    code = "invalid_body"


class PayloadTooLargeError(RequestError):
    status = 413
    code = "body_too_large"


class RequestExceedsDeadlineError(RequestError):
    """The request is too large to finish within the deadline even on an idle server.

    Raised before any work starts, from a token-based estimate of its cost (the scheduler owns
    the estimate). A 4xx, never a 503/504: typesafe-sdk and the openai SDK retry 5xx, and a retry
    can only fail again. The caller must send less work per request (fewer questions, a shorter
    state) or raise `DECIDER_DEADLINE_SECONDS` where the platform allows it.
    """

    code = "request_exceeds_deadline"


class AuthenticationError(DeciderError):
    """A configured API key is missing from the request or does not match (401)."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFoundError(DeciderError):
    status = 404
    type = "not_found_error"
    code = "unknown_endpoint"


class OverloadedError(DeciderError):
    """The bounded queue is full: retry later (429 + Retry-After)."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"
    retryable = True


class DeadlineExceededError(DeciderError):
    """Waiting plus working passed the request deadline (retryable when waiting cost the time)."""

    status = 504
    type = "api_error"
    code = "deadline_exceeded"
    retryable = True


class UnavailableError(DeciderError):
    """The model is not loaded (yet), or the server is shutting down (503 + Retry-After)."""

    status = 503
    type = "api_error"
    code = "model_unavailable"
    retryable = True


def shutting_down() -> UnavailableError:
    """SIGTERM arrived: what cannot finish within the drain is refused, to be retried elsewhere."""
    return UnavailableError("the server is shutting down", code="shutting_down", headers={"Retry-After": "1"})


def model_loading() -> UnavailableError:
    return UnavailableError(
        "the model is still loading", code="model_unavailable", headers={"Retry-After": "2"}
    )


# `serve`'s exit statuses: each cause of a failed start has its own, so an orchestrator (or a person
# reading CloudWatch) can tell them apart without parsing the log.
EXIT_STARTUP_FAILED = 1  # the model or a setting the engine checks cannot be used
EXIT_INVALID_SETTINGS = 2  # a DECIDER_* variable does not validate
EXIT_LOAD_CRASHED = 3  # loading the model killed the probe process (a native crash in llama.cpp)
EXIT_ENGINE_CRASHING = 4  # the engine process kept dying: the front gave up (decider.server.supervisor)


class StartupError(Exception):
    """The server cannot start: missing/invalid model file, unusable tokenizer, bad setting.

    Its message is printed as one log line before a non-zero exit (`exit_code`).
    """

    exit_code = EXIT_STARTUP_FAILED


class LoadCrashedError(StartupError):
    """The model's load killed the probe process (decider.engine.model.load_probe): the server does not
    try it in its own process, where the same crash would end it without a word."""

    exit_code = EXIT_LOAD_CRASHED


def internal_error(exc: BaseException) -> DeciderError:
    """What a client sees of a bug: the usual error body, no traceback (that goes to the log)."""
    return DeciderError(f"internal error ({type(exc).__name__}); see the server log", code="internal_error")
