"""A request's cache space (decider.schemas.cache_salt): from the body's `cache_salt`, SageMaker's
custom-attributes header, or both; every malformed salt is a 422 `invalid_cache_salt`."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from decider.errors import RequestError
from decider.schemas.cache_salt import MAX_SALT_CHARS, cache_space

HEADER = "X-Amzn-SageMaker-Custom-Attributes"


def headers(value: str) -> dict[str, str]:
    return {HEADER.lower(): value}


def test_no_salt_is_the_shared_space() -> None:
    assert cache_space({"state": "s"}) == cache_space({"cache_salt": None}) == ""
    assert cache_space(["not", "an", "object"]) == ""
    assert cache_space({}, headers("trace=abc; other=1")) == ""  # attributes that are not ours


def test_a_salt_names_a_space_of_its_own_wherever_it_is_sent() -> None:
    a, b = cache_space({"cache_salt": "a"}), cache_space({"cache_salt": "b"})
    assert a and b and a != b and a == cache_space({"cache_salt": "a", "other": 1})
    from_header = cache_space({}, headers("x=1; cache_salt = a ;y=2"))
    assert from_header == cache_space({}, headers("cache_salt=a")) and from_header not in (a, "")
    both = cache_space({"cache_salt": "a"}, headers("cache_salt=a"))
    assert both not in (a, from_header)  # a gateway's header salt nests the caller's body salt


TOKEN = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=MAX_SALT_CHARS)


@given(st.text(min_size=1, max_size=MAX_SALT_CHARS), TOKEN)
def test_different_salts_never_share_a_space(first: str, second: str) -> None:
    if first != second:
        assert cache_space({"cache_salt": first}) != cache_space({"cache_salt": second})
    assert cache_space({"cache_salt": first}) != cache_space(
        {"cache_salt": first}, headers(f"cache_salt={second}")
    )


@pytest.mark.parametrize("salt", ["", 7, True, ["a"], {"a": 1}, "x" * (MAX_SALT_CHARS + 1)])
def test_a_malformed_body_salt_is_refused(salt: Any) -> None:
    with pytest.raises(RequestError) as refused:
        cache_space({"cache_salt": salt})
    assert (refused.value.status, refused.value.code, refused.value.param) == (
        422,
        "invalid_cache_salt",
        "cache_salt",
    )
    assert not refused.value.retryable


@pytest.mark.parametrize("value", ["cache_salt=", "cache_salt=a;cache_salt=a", "cache_salt=" + "x" * 257])
def test_a_malformed_header_salt_is_refused(value: str) -> None:
    with pytest.raises(RequestError) as refused:
        cache_space({}, headers(value))
    assert refused.value.code == "invalid_cache_salt"
