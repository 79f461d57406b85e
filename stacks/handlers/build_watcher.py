"""Fails the image build's wait condition as soon as its CodeBuild build fails.

An EventBridge rule sends "CodeBuild Build State Change" events of the image project here (CodeBuild
User Guide, "Build notifications input format reference": the event carries the build's status,
phases, logs link and environment variables). A build that failed, stopped, faulted or timed out
gets a FAILURE signal on the wait condition named by its WAIT_HANDLE_URL variable, so the stack
rolls back at once with the reason instead of waiting for the wait condition's timeout.
"""

from __future__ import annotations

import logging
from typing import Any

try:  # package import (tools, tests)
    from . import wait_signal
    from .build_states import FAILED_STATES
except ImportError:  # the Lambda asset's root
    import wait_signal  # type: ignore[no-redef]
    from build_states import FAILED_STATES  # type: ignore[no-redef]

LOG = logging.getLogger()
LOG.setLevel(logging.INFO)


def failure_reason(detail: dict[str, Any]) -> str:
    info = detail.get("additional-information", {})
    text = f"CodeBuild build {detail.get('build-id', '?')} ended {detail.get('build-status')}"
    for phase in info.get("phases", []):
        if phase.get("phase-status") not in (None, "SUCCEEDED"):
            messages = "; ".join(m for m in phase.get("phase-context", []) if m and m != ": ")
            text += f" in phase {phase.get('phase-type')}" + (f": {messages}" if messages else "")
            break
    link = info.get("logs", {}).get("deep-link")
    return f"{text}. Logs: {link}" if link else text


def on_build_state_change(event: dict[str, Any], _context: Any = None, send: Any = None) -> dict[str, Any]:
    """EventBridge target. Returns what it did (for the logs and the tests)."""
    detail = event.get("detail", {})
    status = detail.get("build-status")
    if status not in FAILED_STATES:
        return {"signalled": False, "why": f"status {status}"}
    variables = (
        detail.get("additional-information", {}).get("environment", {}).get("environment-variables", [])
    )
    url = next((v.get("value") for v in variables if v.get("name") == "WAIT_HANDLE_URL"), None)
    if not url:
        LOG.info("build %s has no WAIT_HANDLE_URL (not a deploy-time build)", detail.get("build-id"))
        return {"signalled": False, "why": "no wait handle"}
    reason = failure_reason(detail)
    (send or wait_signal.send_signal)(url, "FAILURE", reason)
    return {"signalled": True, "why": reason}
