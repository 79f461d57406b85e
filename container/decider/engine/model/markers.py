"""Markers: the tokens caller text must never become, and THE function that tokenizes caller text.

llama.cpp's `parse_special=false` skips only CONTROL and UNKNOWN tokens while tokenizing:
USER_DEFINED added tokens are still matched. Qwen's `<think>`, `</think>` and `<tool_call>` are such
tokens, and so are Gemma 3's `<start_of_image>` and `[multimodal]`; a `</think>` in a state would
reach the model as the real token. The same attribute also holds ordinary text (Gemma's runs of
newlines and spaces, HTML tags such as `<table>`), which must stay as it is.

At load, three kinds of token are classified as markers:

- `control`: every CONTROL token of the vocabulary (`<|im_end|>`, `<start_of_turn>`, …);
- `template`: every USER_DEFINED token the chat template prints, found by rendering it over probe
  conversations (system, multi-turn, thinking on and off, tools and tool calls, image parts) and
  tokenizing what the template itself wrote, plus those whose text the template source spells out
  (branches no probe reaches); whitespace-only tokens are never markers;
- `setting`: the token texts listed in `DECIDER_MARKER_TOKENS` (each must be one token).

`CallerText.tokenize` is the one way caller text (states, instructions, options, chat message
contents) becomes tokens: special parsing off, then, if a marker still appears, every literal
occurrence of a marker's text is split after its first character and each piece tokenized on its own,
so the marker is read as plain text (`<` + `think>`). That is deterministic, keeps the text
byte-for-byte, and is verified for every marker at load. The caller is never refused for it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import llama_cpp

from decider.engine.model.prompt import ChatTemplate, TemplateUnusableError

MarkerSource = Literal["control", "template", "setting"]
MARKER_SOURCES: tuple[MarkerSource, ...] = ("control", "template", "setting")
_PROBE = "\x00DECIDER-PROBE-{}-7f3a\x00"
_PROBE_PATTERN = re.compile("\x00DECIDER-PROBE-\\d+-7f3a\x00")


class Vocabulary(Protocol):
    """What marker classification needs of `decider.engine.model.native.LlamaRuntime`."""

    n_vocab: int

    def tokenize(self, text: str, *, special: bool) -> list[int]: ...

    def token_attr(self, token: int) -> int: ...

    def piece(self, token: int, *, special: bool = False) -> bytes: ...


class MarkerError(ValueError):
    """A configured marker is not one token, or a marker cannot be neutralized (fails the load)."""


@dataclass(frozen=True)
class Marker:
    token: int
    text: str
    source: MarkerSource


class CallerText:
    """Tokenizes caller text with special parsing off and no marker token in the result."""

    def __init__(self, markers: Sequence[Marker], tokenize: Callable[[str], list[int]]) -> None:
        """`tokenize` must be the vocabulary's tokenizer with special-token parsing OFF."""
        self.markers = tuple(markers)
        self._tokenize = tokenize
        self._ids = frozenset(marker.token for marker in self.markers)
        # CONTROL tokens are never matched with parsing off; only the others can appear as text.
        texts = sorted({m.text for m in self.markers if m.source != "control"}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        for marker in self.markers:
            if marker.source != "control":
                self._verify(marker)

    def tokenize(self, text: str) -> list[int]:
        """THE way to tokenize caller text: never a marker token, text kept byte-for-byte."""
        tokens = self._tokenize(text)
        if self._ids.isdisjoint(tokens):
            return tokens  # the common case: one tokenization and one set check
        return self._neutralized(text)

    def _neutralized(self, text: str) -> list[int]:
        """`text`, which tokenizes to a marker, cut into pieces that do not (each tokenized once)."""
        pieces = list(self._pieces(text))
        if len(pieces) == 1:  # no literal occurrence (a marker made by merging): halve the text
            if len(text) < 2:
                raise MarkerError(f"{text!r} is itself a marker token and cannot be written as plain text")
            middle = len(text) // 2
            pieces = [text[:middle], text[middle:]]
        return [token for piece in pieces for token in self.tokenize(piece)]

    def _pieces(self, text: str) -> Iterator[str]:
        """The text cut at every marker occurrence, each occurrence cut after its first character."""
        last = 0
        for match in self._pattern.finditer(text) if self._pattern else ():
            found = match.group()
            yield from (part for part in (text[last : match.start()], found[:1], found[1:]) if part)
            last = match.end()
        if text[last:]:
            yield text[last:]

    def _verify(self, marker: Marker) -> None:
        """The marker, alone and between words, must come out as plain-text tokens."""
        try:
            tokens = [*self.tokenize(marker.text), *self.tokenize(f"a {marker.text} b")]
        except MarkerError as exc:
            raise MarkerError(
                f"marker {marker.text!r} ({marker.source}) cannot be neutralized: {exc}"
            ) from None
        if not self._ids.isdisjoint(tokens):  # unreachable unless the tokenizer is inconsistent
            raise MarkerError(f"marker {marker.text!r} ({marker.source}) cannot be neutralized")

    def report(self) -> dict[str, list[str]]:
        """Marker texts by source, for `/v1/models`."""
        return {source: [m.text for m in self.markers if m.source == source] for source in MARKER_SOURCES}

    @classmethod
    def for_model(
        cls, vocab: Vocabulary, template: ChatTemplate, configured: Sequence[str] = ()
    ) -> CallerText:
        """Classify the markers of `vocab` (see the module docstring) and build the tokenizer."""
        control: list[int] = []
        user_defined: set[int] = set()
        for token in range(vocab.n_vocab):
            attr = vocab.token_attr(token)
            if attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL:
                control.append(token)
            elif attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED:
                user_defined.add(token)
        markers = [Marker(token, _text(vocab, token), "control") for token in control]
        texts = {token: _text(vocab, token) for token in user_defined}
        printed = template_printed_tokens(template, vocab) & user_defined
        printed |= {token for token, text in texts.items() if text.strip() and text in template.text}
        markers += [
            Marker(token, texts[token], "template")
            for token in sorted(printed)
            if texts[token].strip()  # whitespace runs are ordinary text
        ]
        known = {marker.token for marker in markers}
        for text in configured:
            tokens = vocab.tokenize(text, special=True)
            if len(tokens) != 1:
                raise MarkerError(
                    f"DECIDER_MARKER_TOKENS: {text!r} is not one token of this model ({len(tokens)} tokens)"
                )
            if tokens[0] not in known:
                markers.append(Marker(tokens[0], text, "setting"))
                known.add(tokens[0])
        return cls(markers, lambda text: vocab.tokenize(text, special=False))


def _text(vocab: Vocabulary, token: int) -> str:
    return vocab.piece(token, special=True).decode("utf-8", errors="replace")


def _probe_conversations() -> Iterator[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Conversations that reach the branches of common templates, with probe strings as contents."""
    n = iter(range(1_000))

    def s() -> str:
        return _PROBE.format(next(n))

    tool = {
        "type": "function",
        "function": {
            "name": "probe",
            "description": "A probe.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
    call = {"id": "call_0", "type": "function", "function": {"name": "probe", "arguments": {"q": "x"}}}
    system, user = {"role": "system", "content": s()}, {"role": "user", "content": s()}
    assistant = {"role": "assistant", "content": s()}
    for thinking in (False, True):
        flags = {"enable_thinking": thinking}
        yield [system, user], flags
        yield [user], flags
        yield [system, user, assistant, {"role": "user", "content": s()}], flags
        yield [user, {"role": "assistant", "content": s(), "reasoning_content": s()}], flags
        yield [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s()}]}], flags
        yield (
            [
                system,
                user,
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": s(), "tool_call_id": "call_0", "name": "probe"},
            ],
            {**flags, "tools": [tool]},
        )


def template_printed_tokens(template: ChatTemplate, vocab: Vocabulary) -> set[int]:
    """Every token the template itself writes (contents cut out), over the probe conversations."""
    tokens: set[int] = set()
    for messages, context in _probe_conversations():
        for generation_prompt in (True, False):
            try:
                text = template.render(messages, add_generation_prompt=generation_prompt, **context)
            except TemplateUnusableError:
                continue  # the template refuses this shape (e.g. no system role): other probes remain
            for piece in _PROBE_PATTERN.split(text):
                tokens.update(vocab.tokenize(piece, special=True))
    return tokens
