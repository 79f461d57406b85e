"""Signalling an AWS::CloudFormation::WaitCondition through its handle's presigned URL.

The body is the documented signal JSON, `{"Status", "Reason", "UniqueId", "Data"}`, sent with an
HTTP PUT and an empty Content-Type (CloudFormation User Guide, "Create wait conditions in a
CloudFormation template": wait condition signal syntax). A FAILURE signal fails the wait condition at
once, so the stack rolls back without waiting for the timeout.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable

LOG = logging.getLogger(__name__)

SIGNAL_ID = "image"  # one signal per wait condition (Count 1)
MAX_REASON = 1000


class SignalError(RuntimeError):
    """The presigned URL did not accept the signal."""


def signal_body(status: str, reason: str, data: str) -> bytes:
    if status not in {"SUCCESS", "FAILURE"}:
        raise ValueError(f"status must be SUCCESS or FAILURE, got {status!r}")
    return json.dumps(
        {"Status": status, "Reason": reason[:MAX_REASON], "UniqueId": SIGNAL_ID, "Data": data}
    ).encode()


def _put(url: str, body: bytes, timeout: float) -> int:
    # Presigned handles are https://; plain http only to 127.0.0.1 (the tests' local receiver).
    if not url.startswith(("https://", "http://127.0.0.1:")):
        raise SignalError("a wait condition handle is an https:// presigned URL")
    request = urllib.request.Request(url, data=body, method="PUT", headers={"Content-Type": ""})  # noqa: S310
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - scheme checked above
        return response.status


def send_signal(
    url: str,
    status: str,
    reason: str,
    data: str = "",
    *,
    put: Callable[[str, bytes, float], int] = _put,
    timeout: float = 20.0,
) -> None:
    """PUT one signal; raise SignalError when the URL refuses it."""
    body = signal_body(status, reason, data)
    try:
        code = put(url, body, timeout)
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:300]
        raise SignalError(f"wait condition handle answered HTTP {error.code}: {detail}") from error
    except (urllib.error.URLError, OSError) as error:
        raise SignalError(f"could not reach the wait condition handle: {error}") from error
    if not 200 <= code < 300:
        raise SignalError(f"wait condition handle answered HTTP {code}")
    LOG.info("signalled %s to the wait condition: %s", status, reason)
