"""Decision prompts: the model's own chat template around a frozen, versioned user message.

One system message and one user message whose text starts with the state (the evidence), so every
question about one state shares a true token prefix, then the question (criterion and labelled
options). Two versions exist, selected by `DECIDER_PROMPT_VERSION` and reported in every response:

- `decider-options-v1` (default): the user message is
  `json.dumps({"evidence": state, "criterion": instructions, "options": [{"letter", "description"}…]})`.
- `decider-options-v2` (opt-in): `Evidence: <json state>`, then `Criterion: …` and one
  `A. description` line per option, with one-word noul options: about 40 % fewer tokens per question.

The template is rendered once, with sentinel strings in place of the two message texts, and split
at the sentinels into fixed template pieces. Template pieces are tokenized with special-token
parsing on (they hold `<|im_start|>` and friends); the system text and the caller's text with
`CallerText.tokenize` (`engine/model/markers.py`: parsing off and no marker token), so a `<|im_end|>` or
a `</think>` inside a state stays plain text.

Per request the state segment is serialized and tokenized once, and each question's tail on its
own. The cut between them sits where tokenizers start a new pre-token (before a space or after a
newline); `PromptBuilder.for_state` checks one whole prompt against a full tokenization and falls
back to tokenizing whole prompts when the segments would tokenize differently.

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

# What `strftime_now` returns in decision prompts (part of every prompt version).
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

Tokenize = Callable[[str], list[int]]


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

    @classmethod
    def from_template(cls, template: ChatTemplate) -> PromptFrame:
        attempts = (
            [{"role": "system", "content": _SYSTEM_SENTINEL}, {"role": "user", "content": _USER_SENTINEL}],
            [{"role": "user", "content": f"{_SYSTEM_SENTINEL}\n\n{_USER_SENTINEL}"}],
        )
        last_error = "no attempt"
        for messages in attempts:
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
            return cls(pieces=(head, between, tail))
        raise TemplateUnusableError(f"the chat template cannot render a system + user prompt: {last_error}")


PROMPT_V1 = "decider-options-v1"
PROMPT_V2 = "decider-options-v2"


def _text(value: Any) -> str:
    """Caller text as shown to the model in v2: strings verbatim, structured values as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class PromptFormat:
    """One frozen prompt version: the user message's layout and its default noul option texts."""

    version: str
    noul_true: str
    noul_false: str

    def state_segment(self, state_json: str) -> str:
        """The user message up to the canonical cut: the same for every question on this state."""
        if self.version == PROMPT_V1:
            return '{"evidence": ' + state_json + ","
        return "Evidence: " + state_json + "\n"

    def tail_segment(self, instructions: Any, options: Sequence[tuple[str, Any]]) -> str:
        """The rest of the user message: the criterion and the labelled options."""
        if self.version == PROMPT_V1:
            rows = [{"letter": letter, "description": description} for letter, description in options]
            return (
                ' "criterion": '
                + json.dumps(instructions, ensure_ascii=False)
                + ', "options": '
                + json.dumps(rows, ensure_ascii=False)
                + "}"
            )
        lines = [f"{letter}. {_text(description)}" for letter, description in options]
        return "Criterion: " + _text(instructions) + "\nOptions:\n" + "\n".join(lines)

    def payload(self, state: Any, instructions: Any, options: Sequence[tuple[str, Any]]) -> str:
        """The whole user message."""
        return self.state_segment(json.dumps(state, ensure_ascii=False)) + self.tail_segment(
            instructions, options
        )


PROMPT_FORMATS: dict[str, PromptFormat] = {
    # Frozen texts: changing one changes every prompt hash, so it means a new version.
    PROMPT_V1: PromptFormat(
        PROMPT_V1, "The answer to the question is yes.", "The answer to the question is no."
    ),
    PROMPT_V2: PromptFormat(PROMPT_V2, "Yes", "No"),
}


def payload(state: Any, instructions: Any, options: Sequence[tuple[str, Any]]) -> str:
    """The v1 user message: evidence, then criterion, then the lettered options."""
    return PROMPT_FORMATS[PROMPT_V1].payload(state, instructions, options)


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    tokens: list[int]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class StatePrompt:
    """One request's state, serialized and tokenized once.

    `tokens` follow the builder's constant head. `canonical` is False when the segment-wise
    tokenization disagreed with a whole-prompt one (then whole prompts are tokenized per question).
    """

    state_json: str
    segment: str
    tokens: list[int]
    canonical: bool


class PromptBuilder:
    """Turns states and questions into prompt tokens, tokenizing caller text with special parsing off.

    `tokenize_template(text)` parses special tokens (template pieces only); `tokenize_text(text)`
    never does, nor lets a marker token through (`CallerText.tokenize`: system text, caller text).
    """

    def __init__(
        self,
        frame: PromptFrame,
        fmt: PromptFormat,
        tokenize_template: Tokenize,
        tokenize_text: Tokenize,
        bos: int | None,
        add_bos: bool,
    ) -> None:
        self.frame = frame
        self.format = fmt
        self._tokenize_template = tokenize_template
        self._tokenize_text = tokenize_text
        head, between, tail = frame.pieces
        head_ids = tokenize_template(head)
        # Models that want BOS get it once, unless the template already printed it.
        bos_ids = [bos] if add_bos and bos is not None and head_ids[:1] != [bos] else []
        self._bos = bos_ids
        self._tail = tokenize_template(tail)
        self.head_text = head + SYSTEM_PROMPT + between
        # BOS, template head, system prompt and the text up to the user message: the same tokens
        # at the start of every decision prompt of this version (its KV is computed once and shared).
        self.head_tokens = [*bos_ids, *head_ids, *tokenize_text(SYSTEM_PROMPT), *tokenize_template(between)]

    @property
    def version(self) -> str:
        return self.format.version

    @property
    def tail_template_tokens(self) -> list[int]:
        """The template's own tokens after the user message, at the end of every question's tail."""
        return self._tail

    def for_state(self, state_json: str, probe_tail: str) -> StatePrompt:
        """Tokenize the serialized state once; check the cut against `probe_tail` (one question)."""
        segment = self.format.state_segment(state_json)
        tokens = self._tokenize_text(segment)
        whole = self._tokenize_text(segment + probe_tail)
        canonical = whole == [*tokens, *self._tokenize_text(probe_tail)]
        return StatePrompt(state_json=state_json, segment=segment, tokens=tokens, canonical=canonical)

    def tail(self, state: StatePrompt, instructions: Any, options: Sequence[tuple[str, Any]]) -> list[int]:
        """Tokens after the head for one question: its own tail, or the whole payload when the
        state's cut is not canonical."""
        tail_text = self.format.tail_segment(instructions, options)
        if state.canonical:
            return [*self._tokenize_text(tail_text), *self._tail]
        return [*self._tokenize_text(state.segment + tail_text), *self._tail]

    def text(self, state: StatePrompt, instructions: Any, options: Sequence[tuple[str, Any]]) -> str:
        """The exact prompt text of one question (what `prompt_sha256` hashes)."""
        return (
            self.head_text
            + state.segment
            + self.format.tail_segment(instructions, options)
            + self.frame.pieces[2]
        )

    def build(self, state: Any, instructions: Any, options: Sequence[tuple[str, Any]]) -> RenderedPrompt:
        """One whole prompt, tokenized segment-wise as `for_state` + `tail` would (tests, audits)."""
        tail_text = self.format.tail_segment(instructions, options)
        prompt = self.for_state(json.dumps(state, ensure_ascii=False), tail_text)
        tokens = [
            *self.head_tokens,
            *(prompt.tokens if prompt.canonical else []),
            *self.tail(prompt, instructions, options),
        ]
        return RenderedPrompt(text=self.text(prompt, instructions, options), tokens=tokens)

    def probe(
        self, state: Any, instructions: Any, options: Sequence[tuple[str, Any]]
    ) -> tuple[str, list[int]]:
        """A prompt's text and its full-text tokenization (load-time label verification)."""
        text = self.build(state, instructions, options).text
        return text, self.full_text_tokens(text)

    def full_text_tokens(self, text: str) -> list[int]:
        """Tokens of a whole prompt text with special parsing on (used only for load-time probes)."""
        return [*self._bos, *self._tokenize_template(text)]
