"""What the server keeps across requests, as clients and operators see it: `cached_tokens` on both
decision routes and on chat, and the cache counters in /metrics, against the real `serve` process. Token
counts and counters, never answers: it runs the tiny random model (`tiny_server`)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import DECISION

from decider_dev.local_server import LocalServer

pytestmark = [pytest.mark.server, pytest.mark.model]
OPENAI_QUESTIONS = [
    {"type": "predicate", "name": "refund", "instructions": "Does the customer ask for a refund?"},
    {
        "type": "score",
        "name": "anger",
        "instructions": "How upset is the customer?",
        "levels": [{"label": "calm"}, {"label": "annoyed"}, {"label": "furious"}],
    },
]


def cache_counters(server: LocalServer) -> dict[tuple[str, ...], float]:
    """Every decider_cache_* sample, keyed by its name and label values."""
    counters: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("decider_cache_"):
                counters[(sample.name, *sample.labels.values())] = sample.value
    return counters


def grew(before: dict[tuple[str, ...], float], after: dict[tuple[str, ...], float], *key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def state() -> str:
    # No other test asked about it, and it parts from every other prompt at its first words (a
    # common prefix of 16 tokens or more would be a partial hit on this attention-only model).
    return f"Ticket {uuid.uuid4().hex[:8]}. {DECISION['state']}"


def test_an_exact_repeat_reports_its_cached_tokens_and_counts_a_hit(tiny_server: LocalServer) -> None:
    body = {"model": "m", "input": state(), "questions": OPENAI_QUESTIONS}
    before = cache_counters(tiny_server)
    first = httpx.post(f"{tiny_server.base_url}/v1/decisions", json=body, timeout=60).json()["usage"]
    again = httpx.post(f"{tiny_server.base_url}/v1/decisions", json=body, timeout=60).json()["usage"]
    after = cache_counters(tiny_server)
    assert first["input_tokens_details"]["cached_tokens"] == 0
    cached = again["input_tokens_details"]["cached_tokens"]
    assert again["input_tokens"] == first["input_tokens"] and 0 < cached < again["input_tokens"]
    assert grew(before, after, "decider_cache_lookups_total", "repeat", "hit") == len(OPENAI_QUESTIONS)
    assert grew(before, after, "decider_cache_stores_total", "repeat") == len(OPENAI_QUESTIONS)


def test_new_questions_on_a_kept_state_decode_only_their_own_tokens(tiny_server: LocalServer) -> None:
    """Jev route: the count is in `extensions` (the default body stays what strict clients parse)."""
    shared = {"state": state(), "extensions": True}
    url = f"{tiny_server.base_url}/v1/systemone"
    before = cache_counters(tiny_server)
    first: dict[str, Any] = httpx.post(
        url, json={**shared, "questions": DECISION["questions"]}, timeout=60
    ).json()
    other = {"urgent": {"type": "noul", "instructions": "Is this urgent?"}}
    second: dict[str, Any] = httpx.post(url, json={**shared, "questions": other}, timeout=60).json()
    after = cache_counters(tiny_server)
    assert first["extensions"]["cached_tokens"] == 0 and "cached_tokens" not in first["usage"]
    assert second["extensions"]["cached_tokens"] > 10 and "cached_tokens" not in second["usage"]
    assert grew(before, after, "decider_cache_lookups_total", "state", "hit") == 1
    assert grew(before, after, "decider_cache_tokens_total", "state") == second["extensions"]["cached_tokens"]
    plain = httpx.post(url, json={"state": shared["state"], "questions": other}, timeout=60).json()
    assert "extensions" not in plain and set(plain["usage"]) == {"input_tokens", "output_tokens"}


def test_a_chat_turn_reports_what_it_copied_from_the_turn_before(tiny_server: LocalServer) -> None:
    """The real `openai` client reads `usage.prompt_tokens_details.cached_tokens`, in a completion
    and in a stream's final usage chunk; /metrics counts the chat turns kept, hit and replaced."""
    client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages: list[Any] = [{"role": "user", "content": f"Ticket {uuid.uuid4().hex[:8]}: it broke."}]
    before = cache_counters(tiny_server)
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "What should I do now?"},
    ]
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    messages += [
        {"role": "assistant", "content": second.choices[0].message.content},
        {"role": "user", "content": "And if it happens again?"},
    ]
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    streamed = usage.prompt_tokens_details.cached_tokens
    assert streamed is not None and second.usage.prompt_tokens <= streamed < usage.prompt_tokens
    after = cache_counters(tiny_server)
    lookups = [grew(before, after, "decider_cache_lookups_total", "chat", o) for o in ("hit", "miss")]
    assert lookups == [2, 1]  # a first turn continues nothing: it is prefilled whole
    assert grew(before, after, "decider_cache_stores_total", "chat") == 3
    assert grew(before, after, "decider_cache_evictions_total", "chat") >= 2  # each turn replaced
    assert grew(before, after, "decider_cache_tokens_total", "chat") >= cached + streamed


def test_a_cache_salt_keeps_callers_apart(tiny_server: LocalServer) -> None:
    """docs/security.md, "Callers and the caches": a state kept under one salt (in the body, or in
    SageMaker's custom-attributes header) serves that salt only; no salt is the shared space."""
    url = f"{tiny_server.base_url}/v1/decisions"
    text = state()

    def cached(question: int, salt: str | None = None, header: str | None = None) -> int:
        body: dict[str, Any] = {"model": "m", "input": text, "questions": [OPENAI_QUESTIONS[question]]}
        if salt is not None:
            body["cache_salt"] = salt
        headers = {"X-Amzn-SageMaker-Custom-Attributes": header} if header else {}
        reply = httpx.post(url, json=body, headers=headers, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["input_tokens_details"]["cached_tokens"]

    assert cached(0, salt="tenant-a") == 0
    assert cached(1) == 0  # the shared space never saw it
    assert cached(1, salt="tenant-b") == 0
    assert cached(1, header="trace=1; cache_salt=tenant-a") == 0  # a header salt is not a body salt
    assert cached(1, salt="tenant-a") > 10  # its own space: the kept state serves it
    assert cached(0, header="cache_salt=tenant-a") > 10  # kept by the header-only request above
    for bad in ({"cache_salt": ""}, {"cache_salt": 7}, {"cache_salt": "x" * 257}):
        refused = httpx.post(url, json={"model": "m", "input": text, "questions": OPENAI_QUESTIONS, **bad})
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_cache_salt"
    twice = {"X-Amzn-SageMaker-Custom-Attributes": "cache_salt=a;cache_salt=b"}
    body = {"model": "m", "input": text, "questions": OPENAI_QUESTIONS}
    refused = httpx.post(url, json=body, headers=twice)
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_cache_salt"


def test_every_route_takes_a_cache_salt(tiny_server: LocalServer) -> None:
    """The Jev route and chat take the field too (strict request schemas would refuse it)."""
    jev = httpx.post(
        f"{tiny_server.base_url}/v1/systemone",
        json={"state": state(), "questions": DECISION["questions"], "cache_salt": "t", "extensions": True},
        timeout=60,
    )
    assert jev.status_code == 200 and jev.json()["extensions"]["cached_tokens"] == 0, jev.text
    chat = httpx.post(
        f"{tiny_server.base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": state()}], "max_tokens": 2, "cache_salt": "t"},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    refused = httpx.post(
        f"{tiny_server.base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "cache_salt": ["t"]},
        timeout=60,
    )
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_cache_salt"


def test_the_host_tier_is_sized_from_the_memory_left_and_reported(tiny_server: LocalServer) -> None:
    """DECIDER_STATE_CACHE_HOST_MIB unset: the engine child sizes the tier once the model is loaded
    (decider.memory_budget: half of what the limit leaves after the engine, the model file and 1 GiB),
    and /metrics says how much it got. This machine leaves gigabytes beside the model."""
    budget = cache_counters(tiny_server)[("decider_cache_host_budget_bytes",)]
    assert 1024**3 <= budget <= 8 * 1024**3
