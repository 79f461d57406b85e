"""Prompt version `decider-options-v1`: the model's own chat template around a JSON payload.

One system message and one user message. The user message is
`json.dumps({"evidence": state, "criterion": instructions, "options": [{"letter", "description"}…]})`,
evidence first, so every question about one state starts with the same tokens.

The template is rendered once, with sentinel strings in place of the two message texts, and
split at the sentinels into fixed template pieces. Template pieces are tokenized with
special-token parsing on (they hold `<|im_start|>` and friends); the system text with parsing off,
and the caller's payload with `CallerText.tokenize` (`engine/markers.py`: parsing off and no marker
token), so a `<|im_end|>` or a `</think>` inside a state stays plain text.

Templates run in the environment Hugging Face's `apply_chat_template` gives them (`trim_blocks`,
`lstrip_blocks`, no kept trailing newline, the `loopcontrols` extension and the `{% generation %}`
tag, `tojson` without ASCII escaping, `raise_exception`, `strftime_now`). The decision prompt sees
a fixed date, `DECISION_PROMPT_DATE`, part of the prompt version: it never changes with the day the
server runs. Chat sees the real date (UTC).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

from jinja2 import Template, TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

PROMPT_VERSION = "decider-options-v1"
# What `strftime_now` returns in decision prompts (part of decider-options-v1).
DECISION_PROMPT_DATE = datetime(2026, 1, 1, tzinfo=UTC)
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
CallerTokenize = Callable[[str], list[int]]


class TemplateUnusableError(ValueError):
    """The chat template cannot compile, or cannot render these messages."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Hugging Face's `tojson`: plain `json.dumps`, non-ASCII kept (Jinja's own escapes HTML)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _clock(now: datetime | None) -> Callable[[str], str]:
    return lambda fmt: (now or datetime.now(UTC)).strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}…{% endgeneration %}` (Hugging Face's assistant-mask tag): renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


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
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _clock(None)
        return env.from_string(self.text)

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        now: datetime | None = None,
        **context: Any,
    ) -> str:
        """Render; `now` fixes what `strftime_now` returns, `context` overrides the variables
        (`enable_thinking=False`, `tools=None`). Any failure is a `TemplateUnusableError`."""
        variables = {"enable_thinking": False, "tools": None, **context}
        try:
            return self._compiled.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                strftime_now=_clock(now),
                **variables,
            )
        except Exception as exc:  # templates fail in many ways (TypeError, KeyError, …), all the caller's
            raise TemplateUnusableError(f"{type(exc).__name__}: {exc}") from exc


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
                text = template.render(messages, now=DECISION_PROMPT_DATE)
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
    """Turns (system text, payload) into tokens; the caller's payload goes through `caller_tokens`
    (`CallerText.tokenize`: special parsing off, markers neutralized)."""

    def __init__(
        self,
        frame: PromptFrame,
        tokenize: Tokenize,
        bos: int | None,
        add_bos: bool,
        *,
        caller_tokens: CallerTokenize,
    ) -> None:
        self.frame = frame
        self._tokenize = tokenize
        self._caller_tokens = caller_tokens
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
            *self._caller_tokens(user_payload),
            *self._tail,
        ]
        return RenderedPrompt(text=text, tokens=tokens)

    def full_text_tokens(self, text: str) -> list[int]:
        """Tokens of a whole prompt text with special parsing on (used only for load-time probes)."""
        return [*self._bos, *self._tokenize(text, True)]
