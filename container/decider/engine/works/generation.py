"""Chat generation pieces: prompt tokens from the template, the sampler chain, stop strings.

The generation loop itself is `decider.engine.works.chat.ChatWork`, one token per scheduler step. Text
deltas are produced with an incremental UTF-8 decoder (a character may be split over tokens) and
held back while they could still be the start of a stop string, so a stop string that spans
tokens is found and never emitted.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llama_cpp

from decider.engine.model.native import LlamaRuntime
from decider.engine.model.prompt import ChatTemplate, TemplateUnusableError

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class GenerationUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens copied from a kept turn instead of decoded

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class GenerationEvent:
    """A text delta (`finish_reason` None), or the final event with `finish_reason` and `usage`."""

    text: str = ""
    finish_reason: FinishReason | None = None
    usage: GenerationUsage | None = None


def _content_text(content: Any) -> str:
    """OpenAI message content: a string, or a list of `{"type": "text", "text": …}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


_MESSAGE_SENTINEL = "\x00DECIDER-MSG-{}-7f3a\x00"
_MESSAGE_SENTINELS = re.compile("\x00DECIDER-MSG-(\\d+)-7f3a\x00")
_SENTINEL_TRACE = re.compile("DECIDER-MSG-\\d+-7f3a", re.IGNORECASE)


def chat_tokens(
    template: ChatTemplate,
    runtime: LlamaRuntime,
    caller_tokens: Callable[[str], list[int]],
    messages: Sequence[dict[str, Any]],
    before_tokenizing: Callable[[int], None] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Prompt tokens for a chat: the template's own text parses special tokens, message contents never.

    The template is rendered with a sentinel in place of each content and split at the sentinels;
    each content is tokenized by `caller_tokens` (`CallerText.tokenize`) wherever the template
    printed it, in the template's order: once, more than once, or not at all (templates drop
    messages, and Mistral-style ones move the system text into the last user turn). A template that
    alters a content (so that its sentinel no longer appears intact) cannot place it safely:
    `TemplateUnusableError`, which the engine answers with 422 `invalid_messages`.
    `before_tokenizing`, if given, gets the bytes of the contents as printed (plain text, each token
    at most the vocabulary's longest piece) before anything is tokenized.
    """
    contents = [_content_text(message.get("content")) for message in messages]
    rendered_messages = [
        {"role": str(message.get("role", "user")), "content": _MESSAGE_SENTINEL.format(i)}
        for i, message in enumerate(messages)
    ]
    text = template.render(rendered_messages, add_generation_prompt=add_generation_prompt)
    if before_tokenizing is not None:  # the caller text about to be tokenized, for a bound that can tell
        printed = [contents[int(match.group(1))] for match in _MESSAGE_SENTINELS.finditer(text)]
        before_tokenizing(sum(len(content.encode("utf-8", errors="replace")) for content in printed))
    tokens: list[int] = []
    last = 0
    for match in _MESSAGE_SENTINELS.finditer(text):
        tokens += _template_tokens(runtime, text[last : match.start()])
        tokens += caller_tokens(contents[int(match.group(1))])
        last = match.end()
    tokens += _template_tokens(runtime, text[last:])
    bos = runtime.bos
    if runtime.add_bos and bos is not None and tokens[:1] != [bos]:
        tokens.insert(0, bos)
    return tokens


def _template_tokens(runtime: LlamaRuntime, piece: str) -> list[int]:
    if _SENTINEL_TRACE.search(piece):
        raise TemplateUnusableError(
            "the chat template alters message contents, so they cannot be placed as plain text"
        )
    return runtime.tokenize(piece, special=True)


class StopFilter:
    """Streams text while withholding any tail that could still become a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        buffer = self._pending + text
        hits = [buffer.find(stop) for stop in self._stops]
        hits = [i for i in hits if i >= 0]
        if hits:
            self._pending = ""
            return buffer[: min(hits)], True
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buffer)), 0, -1):
                if buffer.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        self._pending = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text


def make_sampler(temperature: float, top_p: float, seed: int | None) -> Any:
    """A llama.cpp sampler chain: greedy at temperature 0, else top-p, temperature, seeded draw.
    A response_format's mask (decider.engine.structured.constraints) is applied to the logits before
    it runs."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if temperature <= 0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    else:
        if top_p < 1.0:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(top_p, 1))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(temperature))
        dist_seed = seed if seed is not None else random.getrandbits(32)
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(dist_seed & 0xFFFFFFFF))
    return chain


def free_sampler(sampler: Any) -> None:
    llama_cpp.llama_sampler_free(sampler)
