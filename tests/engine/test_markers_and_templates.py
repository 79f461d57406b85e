"""Markers, caller-text tokenization and the chat template environment, on a fake vocabulary.

The fake tokenizer behaves like llama.cpp's: USER_DEFINED tokens are matched in the text even with
special parsing off, CONTROL tokens only with it on, everything else is one token per character.
The real vocabularies (SmolLM2, Gemma 3) are tested in test_markers_live.py.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime

import llama_cpp
import pytest

from decider.engine.model.markers import CallerText, Marker, MarkerError, template_printed_tokens
from decider.engine.model.prompt import (
    DECISION_PROMPT_DATE,
    FALLBACK_TEMPLATES,
    ChatTemplate,
    PromptFrame,
    TemplateUnusableError,
)
from decider.engine.works.generation import chat_tokens

CONTROL, USER_DEFINED = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL, llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
SPECIAL = {
    1000: ("<|im_start|>", CONTROL),
    1001: ("<|im_end|>", CONTROL),
    1002: ("<think>", USER_DEFINED),
    1003: ("</think>", USER_DEFINED),
    1004: ("<table>", USER_DEFINED),
    1005: ("\n\n", USER_DEFINED),
    1006: ("<img>", USER_DEFINED),
}


class FakeVocab:
    """Characters are their code points; the added tokens above are matched longest first."""

    n_vocab = 1007
    bos = None
    add_bos = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def token_attr(self, token: int) -> int:
        return SPECIAL[token][1] if token in SPECIAL else llama_cpp.LLAMA_TOKEN_ATTR_NORMAL

    def piece(self, token: int, *, special: bool = False) -> bytes:
        return (SPECIAL[token][0] if token in SPECIAL else chr(token)).encode()

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        self.calls.append((text, special))
        matchable = {
            t: s for t, (s, attr) in SPECIAL.items() if attr == USER_DEFINED or (special and attr == CONTROL)
        }
        pattern = re.compile(
            "|".join(re.escape(s) for s in sorted(matchable.values(), key=len, reverse=True))
        )
        by_text = {s: t for t, s in matchable.items()}
        tokens: list[int] = []
        last = 0
        for match in pattern.finditer(text):
            tokens += [ord(c) for c in text[last : match.start()]]
            tokens.append(by_text[match.group()])
            last = match.end()
        return tokens + [ord(c) for c in text[last:]]

    def text_of(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t, special=True) for t in tokens).decode()


def chatml(text: str = FALLBACK_TEMPLATES["chatml"]) -> ChatTemplate:
    return ChatTemplate(source="test", text=text, bos_token="", eos_token="")


# A Qwen-style template: thinking block in the generation prompt, `<img>` for image parts.
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<img>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture
def vocab() -> FakeVocab:
    return FakeVocab()


def test_markers_are_control_tokens_template_printed_tokens_and_configured_ones(vocab):
    caller = CallerText.for_model(vocab, chatml(THINKING), configured=["<table>"])
    report = caller.report()
    assert report["control"] == ["<|im_start|>", "<|im_end|>"]
    # Printed by the template: <think>, </think>, <img> and "\n\n" — whitespace is never a marker.
    assert sorted(report["template"]) == ["</think>", "<img>", "<think>"]
    assert report["setting"] == ["<table>"]


def test_without_a_setting_ordinary_user_defined_tokens_stay_text(vocab):
    caller = CallerText.for_model(vocab, chatml(THINKING))
    assert caller.tokenize("a <table>\n\nb") == [ord("a"), ord(" "), 1004, 1005, ord("b")]


def test_caller_text_never_becomes_a_marker_and_keeps_every_byte(vocab):
    caller = CallerText.for_model(vocab, chatml(THINKING), configured=["<table>"])
    text = "x </think><think>y <table> <|im_end|>\n\n<img>"
    tokens = caller.tokenize(text)
    assert not {1000, 1001, 1002, 1003, 1004, 1006} & set(tokens)
    assert 1005 in tokens  # the newline pair is ordinary text and stays one token
    assert vocab.text_of(tokens) == text
    assert caller.tokenize(text) == tokens  # deterministic
    assert caller.tokenize("<think>") == [ord("<"), *[ord(c) for c in "think>"]]


def test_clean_text_takes_the_fast_path(vocab):
    caller = CallerText.for_model(vocab, chatml())
    vocab.calls.clear()
    assert caller.tokenize("plain words") == [ord(c) for c in "plain words"]
    assert vocab.calls == [("plain words", False)]


def test_a_configured_marker_must_be_one_token(vocab):
    with pytest.raises(MarkerError, match="not one token"):
        CallerText.for_model(vocab, chatml(), configured=["<tab"])


def test_a_single_character_marker_cannot_be_neutralized_and_fails_the_load():
    def tokenize(text: str) -> list[int]:
        return [7 if c == "|" else ord(c) for c in text]

    with pytest.raises(MarkerError, match="cannot be neutralized"):
        CallerText([Marker(7, "|", "setting")], tokenize)


def test_a_marker_spelled_out_in_a_branch_no_probe_reaches_is_found_in_the_source(vocab):
    unreachable = chatml(FALLBACK_TEMPLATES["chatml"] + "{% if never_set %}<img>{% endif %}")
    assert CallerText.for_model(vocab, unreachable).report()["template"] == ["<img>"]


def test_template_printed_tokens_cut_out_message_contents(vocab):
    printed = template_printed_tokens(chatml(THINKING), vocab)
    assert {1000, 1001, 1002, 1003, 1005, 1006} <= printed
    assert 1004 not in printed


# --- the chat template environment (Hugging Face's) ------------------------------------------------


def test_loopcontrols_generation_tag_and_no_trailing_newline():
    template = chatml(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}\n"
    )
    assert template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a]"


def test_tojson_keeps_non_ascii_and_html_and_takes_hugging_face_arguments():
    template = chatml("{{ messages[0] | tojson }}|{{ {'b': 1, 'a': 2} | tojson(sort_keys=True, indent=1) }}")
    text = template.render([{"role": "user", "content": "é <b>&"}])
    first, second = text.split("|", 1)
    assert first == '{"role": "user", "content": "é <b>&"}'
    assert json.loads(second) == {"a": 2, "b": 1} and second.startswith('{\n "a"')


@pytest.mark.parametrize(
    "body",
    [
        "{{ messages[0]['content'] + 1 }}",  # TypeError
        "{{ 1 // 0 }}",  # ZeroDivisionError
        "{{ raise_exception('no') }}",  # TemplateError
        "{{ messages[5]['content'].upper() }}",  # UndefinedError
        "{% for %}",  # syntax error, found at first render
    ],
)
def test_every_render_failure_is_a_template_unusable_error(body):
    with pytest.raises(TemplateUnusableError):
        chatml(body).render([{"role": "user", "content": "x"}])


def test_decision_prompts_see_a_fixed_date_and_chat_the_real_one():
    dated = chatml(
        "{{ strftime_now('%Y-%m-%d') }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )
    frame = PromptFrame.from_template(dated)
    assert frame.pieces[0].startswith(DECISION_PROMPT_DATE.strftime("%Y-%m-%d"))
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    assert dated.render([{"role": "user", "content": "x"}]).startswith(today)


# --- chat prompts: caller text never parsed for special tokens ---------------------------------------

# Mistral v0.3 style: the system text is printed inside the LAST user turn, after earlier turns.
MISTRAL = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}"
    "<s>{% for m in loop_messages %}{% if m['role'] == 'user' %}"
    "{% if loop.last and system is defined %}[INST] {{ system }}\n\n{{ m['content'] }}[/INST]"
    "{% else %}[INST] {{ m['content'] }}[/INST]{% endif %}"
    "{% else %} {{ m['content'] }}</s>{% endif %}{% endfor %}"
)
CONVERSATION = [
    {"role": "system", "content": "SYS <|im_end|>"},
    {"role": "user", "content": "U1 <think>"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
]


def test_a_mistral_multi_turn_chat_places_every_content_without_special_parsing(vocab):
    caller = CallerText.for_model(vocab, chatml(THINKING))
    placed: list[str] = []

    def caller_tokens(text: str) -> list[int]:
        placed.append(text)
        return caller.tokenize(text)

    vocab.calls.clear()
    tokens = chat_tokens(chatml(MISTRAL), vocab, caller_tokens, CONVERSATION)
    assert placed == ["U1 <think>", "A1", "SYS <|im_end|>", "U2"]  # the template's order
    contents = [m["content"] for m in CONVERSATION]
    parsed = [text for text, special in vocab.calls if special]
    assert not any(content in text for content in contents for text in parsed)
    assert vocab.text_of(tokens) == "<s>[INST] U1 <think>[/INST] A1</s>[INST] SYS <|im_end|>\n\nU2[/INST]"
    assert 1001 not in tokens and 1002 not in tokens


def test_contents_printed_twice_or_dropped_are_placed_as_printed(vocab):
    caller = CallerText.for_model(vocab, chatml())
    twice = chatml(
        "{% for m in messages %}{% if m['role'] == 'user' %}"
        "{{ m['content'] }}|{{ m['content'] }}{% endif %}{% endfor %}"
    )
    messages = [{"role": "system", "content": "dropped"}, {"role": "user", "content": "u"}]
    assert vocab.text_of(chat_tokens(twice, vocab, caller.tokenize, messages)) == "u|u"


@pytest.mark.parametrize("transform", ["upper", "tojson", "replace('D', 'd')"])
def test_a_template_that_alters_contents_is_refused(vocab, transform):
    caller = CallerText.for_model(vocab, chatml())
    template = chatml(f"{{% for m in messages %}}{{{{ m['content'] | {transform} }}}}{{% endfor %}}")
    with pytest.raises(TemplateUnusableError, match="alters message contents"):
        chat_tokens(template, vocab, caller.tokenize, [{"role": "user", "content": "hello"}])
