"""A request's cache space: which kept states, chat turns and exact repeats may serve it.

By default every request of an endpoint shares one space: an endpoint usually serves one
application, and sharing is what makes a re-asked state cheap. Callers that are not one trust
domain keep apart by naming a salt (vLLM's `cache_salt`): in the body (every route takes it) or,
for callers that cannot change the body, in SageMaker's `X-Amzn-SageMaker-Custom-Attributes`
header (`cache_salt=<value>` among other `;`-separated attributes). The two nest: a gateway that
sets the header per tenant keeps tenants apart whatever salt their bodies name. Requests with the
same salts share a space; a request with none is in the default space. Why it matters:
docs/security.md, "Callers and the caches".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from decider.errors import RequestError

SALT_FIELD = "cache_salt"
CUSTOM_ATTRIBUTES = "x-amzn-sagemaker-custom-attributes"
MAX_SALT_CHARS = 256
DEFAULT_SPACE = ""
# How the OpenAPI document shows the field; its checks are `_checked`'s (one error code on every route).
SALT_FIELD_SCHEMA = {
    "anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_SALT_CHARS}, {"type": "null"}],
    "description": "Keeps this request's cached states apart from other salts' (docs/security.md); "
    "null or absent: the default space. Also `cache_salt=<value>` in X-Amzn-SageMaker-Custom-Attributes.",
}


def cache_space(body: Any, headers: Mapping[str, str] | None = None) -> str:
    """The space of a request: `""` when it names no salt, else a digest of its header's and its
    body's salts (a 422 `invalid_cache_salt` when one is not a non-empty string of at most 256
    characters)."""
    from_header = _header_salt(headers.get(CUSTOM_ATTRIBUTES) if headers is not None else None)
    from_body = _body_salt(body)
    if from_header is None and from_body is None:
        return DEFAULT_SPACE
    named = json.dumps([from_header, from_body], ensure_ascii=False).encode("utf-8", "surrogatepass")
    return hashlib.sha256(named).hexdigest()[:32]


def _body_salt(body: Any) -> str | None:
    if not isinstance(body, dict) or body.get(SALT_FIELD) is None:
        return None
    return _checked(body[SALT_FIELD], f"`{SALT_FIELD}`", SALT_FIELD)


def _header_salt(attributes: str | None) -> str | None:
    """`cache_salt=<value>` among the header's `;`-separated attributes; the others are not ours."""
    if not attributes:
        return None
    found = None
    for part in attributes.split(";"):
        name, sep, value = part.partition("=")
        if sep and name.strip() == SALT_FIELD:
            if found is not None:
                raise RequestError(
                    f"X-Amzn-SageMaker-Custom-Attributes names {SALT_FIELD} more than once.",
                    code="invalid_cache_salt",
                    param=SALT_FIELD,
                )
            found = _checked(value.strip(), f"X-Amzn-SageMaker-Custom-Attributes' {SALT_FIELD}", SALT_FIELD)
    return found


def _checked(value: Any, where: str, param: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_SALT_CHARS:
        raise RequestError(
            f"{where} must be a non-empty string of at most {MAX_SALT_CHARS} characters.",
            code="invalid_cache_salt",
            param=param,
        )
    return value
