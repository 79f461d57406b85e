"""Prompt version `decider-options-v1`: the model's own chat template around a JSON payload.

One system message and one user message. The user message is
`json.dumps({"evidence": state, "criterion": instructions, "options": [{"letter", "description"}…]})`,
evidence first, so every question about one state starts with the same tokens.

The template is rendered once, with sentinel strings in place of the two message texts, and
split at the sentinels into fixed template pieces. Template pieces are tokenized with
special-token parsing on (they hold `<|im_start|>` and friends); the system text and the caller's
payload with parsing off, so a `<|im_end|>` inside a state stays plain text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

PROMPT_VERSION = "decider-options-v1"
SYSTEM_PROMPT = (
    "Apply the supplied criterion to the supplied evidence. Choose exactly one listed option. "
    "Respond with only its letter, with no explanation or reasoning."
)

# Templates for GGUFs without one (base models), selected by Settings.chat_template_fallback.
FALLBACK_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "plain": (
        "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
        "{% endfor %}{% if add_generation_prompt %}Assistant:\n{% endif %}"
    ),
}

_SYSTEM_SENTINEL = "\x00DECIDER-SYSTEM-7f3a\x00"
_USER_SENTINEL = "\x00DECIDER-USER-7f3a\x00"

Tokenize = Callable[[str, bool], list[int]]


class TemplateUnusableError(ValueError):
    """The chat template cannot render the two-message prompt."""


def _raise(message: str) -> None:
    raise TemplateError(message)


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled Jinja chat template plus the special-token texts it may print."""

    source: str  # "gguf", "fallback:chatml" or "fallback:plain"
    text: str
    bos_token: str
    eos_token: str

    @cached_property
    def _compiled(self) -> Template:
        """The template compiled once (on first render), not on every chat request."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now(UTC).strftime(fmt)
        return env.from_string(self.text)

    def render(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        try:
            return self._compiled.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                enable_thinking=False,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=None,
            )
        except TemplateError as exc:
            raise TemplateUnusableError(str(exc)) from exc


@dataclass(frozen=True)
class PromptFrame:
    """The rendered template split around the system text and the user payload.

    `pieces` = (head, between, tail); the prompt is head + system + between + payload + tail.
    When the template has no system role, the system text is folded into the user message.
    """

    pieces: tuple[str, str, str]
    system_in_user: bool

    @classmethod
    def from_template(cls, template: ChatTemplate) -> PromptFrame:
        attempts = (
            (
                [
                    {"role": "system", "content": _SYSTEM_SENTINEL},
                    {"role": "user", "content": _USER_SENTINEL},
                ],
                False,
            ),
            ([{"role": "user", "content": f"{_SYSTEM_SENTINEL}\n\n{_USER_SENTINEL}"}], True),
        )
        last_error = "no attempt"
        for messages, folded in attempts:
            try:
                text = template.render(messages)
            except TemplateUnusableError as exc:
                last_error = str(exc)
                continue
            if text.count(_SYSTEM_SENTINEL) != 1 or text.count(_USER_SENTINEL) != 1:
                last_error = "the template does not print message contents verbatim"
                continue
            head, rest = text.split(_SYSTEM_SENTINEL)
            between, tail = rest.split(_USER_SENTINEL)
            return cls(pieces=(head, between, tail), system_in_user=folded)
        raise TemplateUnusableError(f"the chat template cannot render a system + user prompt: {last_error}")


def payload(state: Any, instructions: Any, options: Sequence[tuple[str, Any]]) -> str:
    """The user message: evidence, then criterion, then the lettered options."""
    return json.dumps(
        {
            "evidence": state,
            "criterion": instructions,
            "options": [{"letter": letter, "description": description} for letter, description in options],
        },
        ensure_ascii=False,
    )


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    tokens: list[int]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


class PromptBuilder:
    """Turns (system text, payload) into tokens, tokenizing caller text with special parsing off."""

    def __init__(self, frame: PromptFrame, tokenize: Tokenize, bos: int | None, add_bos: bool) -> None:
        self.frame = frame
        self._tokenize = tokenize
        head, between, tail = frame.pieces
        self._head = tokenize(head, True)
        self._between = tokenize(between, True)
        self._tail = tokenize(tail, True)
        self._system = tokenize(SYSTEM_PROMPT, False)
        # Models that want BOS get it once, unless the template already printed it.
        self._bos = [bos] if add_bos and bos is not None and self._head[:1] != [bos] else []

    def build(self, user_payload: str) -> RenderedPrompt:
        head, between, tail = self.frame.pieces
        text = head + SYSTEM_PROMPT + between + user_payload + tail
        tokens = [
            *self._bos,
            *self._head,
            *self._system,
            *self._between,
            *self._tokenize(user_payload, False),
            *self._tail,
        ]
        return RenderedPrompt(text=text, tokens=tokens)

    def full_text_tokens(self, text: str) -> list[int]:
        """Tokens of a whole prompt text with special parsing on (used only for load-time probes)."""
        return [*self._bos, *self._tokenize(text, True)]
