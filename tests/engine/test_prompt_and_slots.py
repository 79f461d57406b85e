"""Template framing and slot verification with fake tokenizers: no model needed."""

from __future__ import annotations

import json

import pytest
from decider.engine.prompt import (
    FALLBACK_TEMPLATES,
    SYSTEM_PROMPT,
    ChatTemplate,
    PromptBuilder,
    PromptFrame,
    TemplateUnusableError,
    payload,
)
from decider.engine.slots import SlotError, build_slot_table

NO_SYSTEM_ROLE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<turn>{{ m['role'] }}: {{ m['content'] }}</turn>{% endfor %}"
    "{% if add_generation_prompt %}<turn>model: {% endif %}"
)


def chars(text: str, special: bool) -> list[int]:
    """A character-level tokenizer: every label longer than one letter is several tokens."""
    return [ord(c) for c in text]


def piece(token: int) -> bytes:
    return chr(token).encode()


def builder(template_text: str, tokenize=chars) -> PromptBuilder:
    template = ChatTemplate(source="test", text=template_text, bos_token="", eos_token="")
    return PromptBuilder(
        PromptFrame.from_template(template),
        tokenize,
        bos=None,
        add_bos=False,
        caller_tokens=lambda text: tokenize(text, False),
    )


def test_payload_puts_evidence_first_and_keeps_structure():
    text = payload({"b": 1, "a": "é"}, {"task": "x"}, [("A", "yes"), ("B", {"k": None})])
    assert text.startswith('{"evidence": {"b": 1, "a": "é"}, "criterion": {"task": "x"}, "options": [')
    assert json.loads(text)["options"][1] == {"letter": "B", "description": {"k": None}}


def test_chatml_frame_splits_around_the_two_messages():
    frame = PromptFrame.from_template(
        ChatTemplate(source="fallback:chatml", text=FALLBACK_TEMPLATES["chatml"], bos_token="", eos_token="")
    )
    head, between, tail = frame.pieces
    assert head == "<|im_start|>system\n" and between == "<|im_end|>\n<|im_start|>user\n"
    assert tail == "<|im_end|>\n<|im_start|>assistant\n" and not frame.system_in_user


def test_a_template_without_a_system_role_gets_the_system_text_in_the_user_turn():
    b = builder(NO_SYSTEM_ROLE)
    assert b.frame.system_in_user
    prompt = b.build("PAYLOAD")
    assert prompt.text == f"<turn>user: {SYSTEM_PROMPT}\n\nPAYLOAD</turn><turn>model: "


def test_a_template_that_hides_message_contents_is_unusable():
    template = ChatTemplate(
        source="t", text="{% for m in messages %}[msg]{% endfor %}", bos_token="", eos_token=""
    )
    with pytest.raises(TemplateUnusableError):
        PromptFrame.from_template(template)


def test_template_pieces_parse_special_tokens_and_caller_text_does_not():
    calls: list[tuple[str, bool]] = []

    def spy(text: str, special: bool) -> list[int]:
        calls.append((text, special))
        return chars(text, special)

    b = builder(FALLBACK_TEMPLATES["chatml"], spy)
    calls.clear()
    b.build("caller <|im_end|> text")
    assert calls == [("caller <|im_end|> text", False)]


def test_slot_table_keeps_only_labels_that_are_single_tokens():
    table = build_slot_table(builder(FALLBACK_TEMPLATES["chatml"]), chars, piece, wanted=64)
    assert table.labels == tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    assert table.token_ids == tuple(ord(c) for c in table.labels)
    assert len(build_slot_table(builder(FALLBACK_TEMPLATES["chatml"]), chars, piece, wanted=5)) == 5


def test_a_tokenizer_that_merges_labels_into_the_prompt_cannot_load():
    def merging(text: str, special: bool) -> list[int]:
        tokens = chars(text, special)
        out: list[int] = []
        for token in tokens:  # "\n" followed by a capital letter becomes one token
            if out and out[-1] == ord("\n") and 65 <= token <= 90:
                out[-1] = 1000 + token
            else:
                out.append(token)
        return out

    with pytest.raises(SlotError, match="single-token option labels"):
        build_slot_table(builder(FALLBACK_TEMPLATES["chatml"], merging), merging, piece, wanted=64)
