"""Chat parity with llama-server (AWS's llama.cpp container), with the openai SDK against the real
server on the bundled model: logprobs and top_logprobs (plain and streamed), response_format with a
JSON schema through llama.cpp's grammar, several stop strings; refusals are 4xx naming the field."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_helpers import DECISION, FORCED_CHAT, FORCED_TEXT

from decider_dev.local_server import LocalServer

pytestmark = [pytest.mark.server, pytest.mark.model]
MESSAGES = [{"role": "user", "content": "Name three colours."}]
COLOUR_SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
        "sure": {"type": "boolean"},
    },
    "required": ["colour", "sure"],
    "additionalProperties": False,
}


def _client(server: LocalServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _check_logprobs(entries: list, content: str | None, completion_tokens: int) -> None:
    """One answer's logprobs: a token each, bytes that spell the content, the top 3 sorted with the
    chosen (greedy) token first."""
    assert len(entries) == completion_tokens
    assert b"".join(bytes(entry.bytes) for entry in entries).decode() == content
    for entry in entries:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 3
        tops = [top.logprob for top in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def _streamed(client: openai.OpenAI, params: dict) -> tuple[list, str, int]:
    """A streamed answer's logprob entries, its text and its completion tokens (the usage chunk)."""
    entries, parts, usage = [], [], None
    for chunk in client.chat.completions.create(
        **params, stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            if chunk.choices[0].logprobs:
                entries.extend(chunk.choices[0].logprobs.content)
    assert usage is not None
    return entries, "".join(parts), usage.completion_tokens


GREEDY = {"model": "", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True}


def test_logprobs_and_top_logprobs(live_server: LocalServer) -> None:
    """Plain and streamed, each consistent in itself. Across requests they need not agree with the
    default kernels: a token's logits depend on where its cells sit, and kept chat turns and states
    move the next request's cells (bit for bit only with DECIDER_BATCH_INVARIANT, the next test)."""
    client = _client(live_server)
    completion = client.chat.completions.create(**GREEDY, top_logprobs=3)
    choice = completion.choices[0]
    assert completion.usage is not None
    _check_logprobs(choice.logprobs.content, choice.message.content, completion.usage.completion_tokens)
    _check_logprobs(*_streamed(client, {**GREEDY, "top_logprobs": 3}))
    bare = client.chat.completions.create(**GREEDY).choices[0].logprobs.content
    assert bare and all(entry.top_logprobs == [] for entry in bare)
    plain = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content


def test_logprobs_stop_with_the_text_a_stop_string_cut(live_server: LocalServer) -> None:
    """A stop string cuts the tokens that spell it: their logprobs go with their text (as
    llama-server drops them), plain and streamed, and usage still counts every generated token."""
    client = _client(live_server)
    params = {**GREEDY, "max_tokens": 12}
    free = client.chat.completions.create(**params).choices[0].logprobs.content
    spelled = [bytes(entry.bytes).decode(errors="replace") for entry in free]
    start = next(
        i
        for i in range(2, len(spelled) - 1)
        if spelled[i].strip() and (spelled[i] + spelled[i + 1]) not in "".join(spelled[:i])
    )
    stop = spelled[start] + spelled[start + 1]
    completion = client.chat.completions.create(**params, stop=[stop])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.message.content
    entries = choice.logprobs.content
    assert b"".join(bytes(entry.bytes) for entry in entries).decode() == choice.message.content
    assert completion.usage is not None and completion.usage.completion_tokens > len(entries)
    streamed, text, completion_tokens = _streamed(client, {**params, "stop": [stop]})
    assert b"".join(bytes(entry.bytes) for entry in streamed).decode() == text
    assert completion_tokens > len(streamed)


def test_greedy_chats_agree_bit_for_bit_with_batch_invariant_kernels(invariant_server: LocalServer) -> None:
    """With DECIDER_BATCH_INVARIANT=true the same greedy chat, plain, streamed and without logprobs,
    gives the same tokens and the same log-probabilities, however many requests came before."""
    client = _client(invariant_server)
    completion = client.chat.completions.create(**GREEDY, top_logprobs=3)
    entries = completion.choices[0].logprobs.content
    streamed, text, _ = _streamed(client, {**GREEDY, "top_logprobs": 3})
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    plain = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=6, temperature=0)
    assert plain.choices[0].message.content == text == completion.choices[0].message.content


def test_response_format_json_schema_constrains_the_output(live_server: LocalServer) -> None:
    client = _client(live_server)
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "colour", "schema": COLOUR_SCHEMA, "strict": True},
    }
    for seed in (1, 2):
        completion = client.chat.completions.create(
            model="", messages=MESSAGES, max_tokens=40, seed=seed, response_format=response_format
        )
        assert completion.choices[0].finish_reason == "stop", completion
        answer = json.loads(completion.choices[0].message.content)
        assert set(answer) == {"colour", "sure"} and answer["colour"] in {"red", "green", "blue"}
        assert isinstance(answer["sure"], bool)
    streamed = client.chat.completions.create(
        model="", messages=MESSAGES, max_tokens=40, seed=1, response_format=response_format, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert json.loads(text)["colour"] in {"red", "green", "blue"}
    as_object = client.chat.completions.create(
        model="", messages=MESSAGES, max_tokens=8, seed=1, response_format={"type": "json_object"}
    )
    assert as_object.choices[0].message.content.lstrip().startswith(("{", "["))


def test_several_stop_strings(live_server: LocalServer) -> None:
    """The answer is cut before the first of several stop strings, however the tokens split the
    text (a forced answer: the same text whatever the logits, server_helpers.FORCED_CHAT)."""
    client = _client(live_server)
    for stream in (False, True):
        cut = client.chat.completions.create(
            model="", stop=[".", "!", ",", "\n"], stream=stream, **FORCED_CHAT
        )
        if stream:
            chunks = list(cut)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            content, finish = cut.choices[0].message.content, [cut.choices[0].finish_reason]
        assert (content, finish) == (FORCED_TEXT[: FORCED_TEXT.index(",")], ["stop"])


def test_seeded_chats_repeat_bit_for_bit_with_batch_invariant_kernels(invariant_server: LocalServer) -> None:
    """With DECIDER_BATCH_INVARIANT=true a seeded chat at temperature 1 gives the same tokens again,
    plain and streamed, after other chats and decisions have come and gone and beside one that runs.
    (The default kernels do not promise it: server_helpers.FORCED_CHAT.)"""
    client = _client(invariant_server)
    seeded = {"model": "", "messages": MESSAGES, "max_tokens": 8, "seed": 11, "logprobs": True}
    first = client.chat.completions.create(**seeded).choices[0].logprobs.content
    for i in range(2):  # cells taken and freed before the next ask
        client.chat.completions.create(
            model="", messages=[{"role": "user", "content": f"Count to {i + 3}."}], max_tokens=8
        )
        httpx.post(
            f"{invariant_server.base_url}/v1/systemone", json={**DECISION, "state": f"case {i}"}, timeout=120
        )
    with ThreadPoolExecutor(max_workers=1) as pool:
        beside = pool.submit(
            client.chat.completions.create,
            model="",
            messages=[{"role": "user", "content": "Tell a story."}],
            max_tokens=24,
        )
        streamed, _, _ = _streamed(client, seeded)
        assert beside.result().choices[0].message.content is not None
    again = client.chat.completions.create(**seeded).choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in first]
    assert [(e.token, e.logprob) for e in again] == [(e.token, e.logprob) for e in first]


@pytest.mark.parametrize(
    ("params", "param", "code"),
    [
        ({"top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_parameter"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_parameter"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "unsupported_parameter"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "unsupported_parameter",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}, "strict": True},
                }
            },
            "response_format.json_schema.schema.$ref",
            "invalid_response_format",
        ),
    ],
)
def test_refusals_are_4xx_naming_the_field(
    live_server: LocalServer, params: dict, param: str, code: str
) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        _client(live_server).chat.completions.create(model="", messages=MESSAGES, max_tokens=4, **params)
    assert (refused.value.param, refused.value.code) == (param, code)
