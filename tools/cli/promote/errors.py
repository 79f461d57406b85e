"""Failures `promote` reports; each carries a machine-readable code and the exit status to use."""

from __future__ import annotations

# Exit statuses (documented in the README part).
EXIT_OK = 0
EXIT_REFUSED = 1  # a guardrail refused, bad input, or an AWS error
EXIT_USAGE = 2  # argparse uses 2 for bad command lines
EXIT_ROLLED_BACK = 3  # the update was rolled back (alarm, smoke test) or failed on the service side


class PromoteError(Exception):
    """A failure with a one-line message a CI log reader can act on."""

    exit_code = EXIT_REFUSED

    def __init__(self, code: str, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint


class GuardrailError(PromoteError):
    """A guardrail refused the operation before anything changed."""


class DeploymentFailedError(PromoteError):
    """The update failed or was rolled back; the endpoint is back on (or stuck near) the old config."""

    exit_code = EXIT_ROLLED_BACK
