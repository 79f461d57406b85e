"""Template framing, prompt versions and label verification with fake tokenizers: no model needed."""

from __future__ import annotations

import json

import pytest

from decider.engine.model.labels import LabelError, build_label_table
from decider.engine.model.prompt import (
    FALLBACK_TEMPLATES,
    PROMPT_FORMATS,
    PROMPT_V1,
    PROMPT_V2,
    SYSTEM_PROMPT,
    ChatTemplate,
    PromptBuilder,
    PromptFrame,
    TemplateUnusableError,
    payload,
)

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


def builder(template_text: str, tokenize=chars, version: str = PROMPT_V1) -> PromptBuilder:
    template = ChatTemplate(source="test", text=template_text, bos_token="", eos_token="")
    return PromptBuilder(
        PromptFrame.from_template(template),
        PROMPT_FORMATS[version],
        lambda text: tokenize(text, True),
        lambda text: tokenize(text, False),
        None,
        False,
    )


OPTIONS = [("A", "yes"), ("B", {"k": None})]


def test_payload_puts_evidence_first_and_keeps_structure():
    text = payload({"b": 1, "a": "é"}, {"task": "x"}, OPTIONS)
    assert text.startswith('{"evidence": {"b": 1, "a": "é"}, "criterion": {"task": "x"}, "options": [')
    assert json.loads(text)["options"][1] == {"letter": "B", "description": {"k": None}}


def test_v1_state_and_tail_segments_are_exactly_the_json_payload():
    fmt = PROMPT_FORMATS[PROMPT_V1]
    state, criterion = {"b": 1, "a": "é"}, {"task": "x"}
    segments = fmt.state_segment(json.dumps(state, ensure_ascii=False)) + fmt.tail_segment(criterion, OPTIONS)
    whole = json.dumps(
        {
            "evidence": state,
            "criterion": criterion,
            "options": [{"letter": "A", "description": "yes"}, {"letter": "B", "description": {"k": None}}],
        },
        ensure_ascii=False,
    )
    assert segments == whole


def test_v2_lists_options_one_per_line_after_the_evidence():
    fmt = PROMPT_FORMATS[PROMPT_V2]
    text = fmt.payload("Payouts fail.", "Who owns it?", [("A", "Billing"), ("B", {"team": "tech"})])
    assert (
        text
        == 'Evidence: "Payouts fail."\nCriterion: Who owns it?\nOptions:\nA. Billing\nB. {"team": "tech"}'
    )
    assert (fmt.noul_true, fmt.noul_false) == ("Yes", "No")


def test_the_state_is_tokenized_once_and_cut_where_tokenizers_split():
    b = builder(FALLBACK_TEMPLATES["chatml"])
    prompt = b.build("Evidence.", "Pick.", OPTIONS)
    full = b.full_text_tokens(prompt.text)
    assert prompt.tokens == full  # segment-wise tokens equal a whole-text tokenization
    state = b.for_state(json.dumps("Evidence."), b.format.tail_segment("Pick.", OPTIONS))
    assert state.canonical and prompt.tokens[: len(b.head_tokens) + len(state.tokens)] == [
        *b.head_tokens,
        *state.tokens,
    ]


def test_a_tokenizer_that_merges_across_the_cut_falls_back_to_whole_payloads():
    def merging(text: str, special: bool) -> list[int]:  # ", " is one token
        out: list[int] = []
        for token in chars(text, special):
            if out and out[-1] == ord(",") and token == ord(" "):
                out[-1] = 5000
            else:
                out.append(token)
        return out

    b = builder(FALLBACK_TEMPLATES["chatml"], merging)
    prompt = b.build("Evidence.", "Pick.", OPTIONS)
    state = b.for_state(json.dumps("Evidence."), b.format.tail_segment("Pick.", OPTIONS))
    assert not state.canonical
    assert prompt.tokens == b.full_text_tokens(prompt.text)


def test_chatml_frame_splits_around_the_two_messages():
    frame = PromptFrame.from_template(
        ChatTemplate(source="fallback:chatml", text=FALLBACK_TEMPLATES["chatml"], bos_token="", eos_token="")
    )
    head, between, tail = frame.pieces
    assert head == "<|im_start|>system\n" and between == "<|im_end|>\n<|im_start|>user\n"
    assert tail == "<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_without_a_system_role_gets_the_system_text_in_the_user_turn():
    b = builder(NO_SYSTEM_ROLE)
    prompt = b.build("STATE", "Q", OPTIONS)
    assert (
        prompt.text == f"<turn>user: {SYSTEM_PROMPT}\n\n{payload('STATE', 'Q', OPTIONS)}</turn><turn>model: "
    )


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
    b.build("caller <|im_end|> text", "Q", OPTIONS)
    assert calls and all(not special for _, special in calls)
    assert any("caller <|im_end|> text" in text for text, _ in calls)


def caller_chars(text: str) -> list[int]:
    return chars(text, False)


def test_single_token_labels_first_then_two_letter_codes_of_any_token_count():
    table = build_label_table(builder(FALLBACK_TEMPLATES["chatml"]), caller_chars, piece, wanted=64)
    assert [label.text for label in table.single] == list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    assert [label.tokens for label in table.single[:2]] == [(65,), (66,)]
    assert [(label.text, label.tokens) for label in table.double[:2]] == [("AA", (65, 65)), ("AB", (65, 66))]
    assert len(table) == 64 and len(table.for_count(27)) == 27 and table.for_count(27)[0].text == "AA"
    assert len(build_label_table(builder(FALLBACK_TEMPLATES["chatml"]), caller_chars, piece, wanted=5)) == 5
    assert (
        len(build_label_table(builder(FALLBACK_TEMPLATES["chatml"]), caller_chars, piece, wanted=300)) == 255
    )


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

    with pytest.raises(LabelError, match="single-token option labels"):
        build_label_table(
            builder(FALLBACK_TEMPLATES["chatml"], merging), lambda t: merging(t, False), piece, wanted=64
        )
