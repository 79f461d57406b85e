"""Option slots: single-token labels (A–Z, then two-letter pairs) verified against the tokenizer.

A label is usable only if it is one token that decodes back to itself and survives the
boundary check on a probe prompt: tokenizing `prompt + label` must give the prompt's tokens
followed by exactly that token. Otherwise the model's first answer token would not be the label.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from decider.engine.prompt import PromptBuilder, payload

PROBE_OPTIONS = (("A", "The statement is true."), ("B", "The statement is false."))


def candidate_labels() -> Iterator[str]:
    """A…Z, then AA, AB, …, ZZ."""
    yield from string.ascii_uppercase
    for first in string.ascii_uppercase:
        for second in string.ascii_uppercase:
            yield first + second


@dataclass(frozen=True)
class SlotTable:
    labels: tuple[str, ...]
    token_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.labels)


class SlotError(ValueError):
    """The tokenizer cannot provide the option slots."""


def build_slot_table(
    builder: PromptBuilder,
    tokenize: Callable[[str, bool], list[int]],
    piece: Callable[[int], bytes],
    wanted: int,
) -> SlotTable:
    """The first `wanted` verified labels (fewer if the vocabulary has fewer; at least A and B)."""
    probe = builder.build(payload("Probe evidence.", "Is the statement true?", PROBE_OPTIONS))
    base = builder.full_text_tokens(probe.text)
    labels: list[str] = []
    ids: list[int] = []
    rejected: list[str] = []
    for label in candidate_labels():
        if len(labels) >= wanted:
            break
        tokens = tokenize(label, False)
        ok = (
            len(tokens) == 1
            and tokens[0] not in ids
            and piece(tokens[0]) == label.encode()
            and builder.full_text_tokens(probe.text + label) == [*base, tokens[0]]
        )
        if ok:
            labels.append(label)
            ids.append(tokens[0])
        elif len(label) == 1:
            rejected.append(label)
    if labels[:2] != ["A", "B"]:
        raise SlotError(
            "the tokenizer cannot provide single-token option labels after the prompt "
            f"(labels failing the boundary check: {', '.join(rejected) or 'none'})"
        )
    return SlotTable(labels=tuple(labels), token_ids=tuple(ids))
