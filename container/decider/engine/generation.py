"""Chat generation pieces: prompt tokens from the template, the sampler chain, stop strings.

The generation loop itself is `decider.engine.work.ChatWork`, one token per scheduler step. Text
deltas are produced with an incremental UTF-8 decoder (a character may be split over tokens) and
held back while they could still be the start of a stop string, so a stop string that spans
tokens is found and never emitted.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llama_cpp

from decider.engine.native import LlamaRuntime
from decider.engine.prompt import ChatTemplate

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class GenerationUsage:
    prompt_tokens: int
    completion_tokens: int

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


def chat_tokens(
    template: ChatTemplate, runtime: LlamaRuntime, messages: Sequence[dict[str, Any]]
) -> list[int]:
    """Prompt tokens for a chat: template pieces parse special tokens, message contents do not."""
    sentinels = [f"\x00DECIDER-MSG-{i}-7f3a\x00" for i in range(len(messages))]
    rendered_messages = [
        {"role": str(message.get("role", "user")), "content": sentinel}
        for message, sentinel in zip(messages, sentinels, strict=True)
    ]
    text = template.render(rendered_messages, add_generation_prompt=True)
    tokens: list[int] = []
    rest = text
    for message, sentinel in zip(messages, sentinels, strict=True):
        if rest.count(sentinel) != 1:
            # The template rewrites contents (rare): fall back to rendering the real text.
            real = [
                {"role": str(m.get("role", "user")), "content": _content_text(m.get("content"))}
                for m in messages
            ]
            tokens = runtime.tokenize(template.render(real, add_generation_prompt=True), special=True)
            rest = ""
            break
        before, rest = rest.split(sentinel)
        tokens += runtime.tokenize(before, special=True)
        tokens += runtime.tokenize(_content_text(message.get("content")), special=False)
    tokens += runtime.tokenize(rest, special=True)
    bos = runtime.bos
    if runtime.add_bos and bos is not None and tokens[:1] != [bos]:
        tokens.insert(0, bos)
    return tokens


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
    """A llama.cpp sampler chain: greedy at temperature 0, else top-p, temperature, seeded draw."""
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
