"""Option labels verified against the tokenizer: single tokens first, two-letter codes beyond them.

The model answers by writing an option's label right after the prompt. A label is usable only if
its tokenization after the prompt is its own standalone tokenization (the boundary check:
tokenizing `prompt + label` gives the prompt's tokens followed by exactly the label's tokens) and
its tokens decode back to it.

- `single`: A–Z, then the two-letter pairs that are ONE token (AA, AB, …), in that order. A
  question with at most `len(single)` options uses them: its probabilities are a softmax over one
  logit per option, read at the prompt's last position. Large vocabularies hold all 255 (SmolLM2
  and Gemma 3 do).
- `double`: every two-letter code AA, AB, …, ZZ, whatever its token count. A question with more
  options than `single` holds uses these. Codes of equal length are textually prefix-free, so no
  label's tokens are a prefix of another's, and each label's probability is well defined: the
  product of its tokens' full-vocabulary probabilities (the chain rule), read at the prompt's last
  position and at one more position per distinct label prefix.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from decider.engine.model.prompt import PromptBuilder

MAX_OPTIONS = 255  # Jev's documented ceiling for choice options
PROBE_STATE = "Probe evidence."
PROBE_QUESTION = "Is the statement true?"
PROBE_OPTIONS = (("A", "The statement is true."), ("B", "The statement is false."))
READOUT_SINGLE = "single-token-logits-v1"
READOUT_CHAIN = "chain-rule-logprobs-v1"


@dataclass(frozen=True)
class Label:
    text: str
    tokens: tuple[int, ...]


def letter_pairs() -> Iterator[str]:
    for first in string.ascii_uppercase:
        for second in string.ascii_uppercase:
            yield first + second


class LabelError(ValueError):
    """The tokenizer cannot provide option labels."""


@dataclass(frozen=True)
class LabelTable:
    single: tuple[Label, ...]
    double: tuple[Label, ...]
    limit: int  # most options a question may have (settings and table combined)

    def __len__(self) -> int:
        return self.limit

    def for_count(self, n: int) -> tuple[Label, ...]:
        """The labels shown to a question with `n` options."""
        if n > self.limit:
            raise ValueError(f"{n} options exceed the {self.limit} supported")
        return self.single[:n] if n <= len(self.single) else self.double[:n]

    @staticmethod
    def readout_for(labels: Sequence[Label]) -> str:
        return READOUT_SINGLE if all(len(label.tokens) == 1 for label in labels) else READOUT_CHAIN


def build_label_table(
    builder: PromptBuilder,
    tokenize: Callable[[str], list[int]],
    piece: Callable[[int], bytes],
    wanted: int,
    *,
    single_limit: int = MAX_OPTIONS,
) -> LabelTable:
    """Verify the candidate labels on a probe prompt; `wanted` caps how many options a question may
    have, `single_limit` how many single-token labels are used before two-letter codes take over."""
    probe_text, probe_tokens = builder.probe(PROBE_STATE, PROBE_QUESTION, PROBE_OPTIONS)

    def verified(label: str) -> Label | None:
        tokens = tokenize(label)
        if not tokens or b"".join(piece(t) for t in tokens) != label.encode():
            return None
        if builder.full_text_tokens(probe_text + label) != [*probe_tokens, *tokens]:
            return None
        return Label(label, tuple(tokens))

    single: list[Label] = []
    rejected: list[str] = []
    for text in [*string.ascii_uppercase, *letter_pairs()]:
        if len(single) >= min(wanted, single_limit, MAX_OPTIONS):
            break
        label = verified(text)
        if label is not None and len(label.tokens) == 1 and label.tokens not in {s.tokens for s in single}:
            single.append(label)
        elif len(text) == 1:
            rejected.append(text)
    if [label.text for label in single[:2]] != ["A", "B"]:
        raise LabelError(
            "the tokenizer cannot provide single-token option labels after the prompt "
            f"(labels failing the boundary check: {', '.join(rejected) or 'none'})"
        )
    double: list[Label] = []
    if wanted > len(single):
        for text in letter_pairs():
            if len(double) >= min(wanted, MAX_OPTIONS):
                break
            label = verified(text)
            if label is not None:
                double.append(label)
        check_prefix_free(double)
    limit = min(wanted, max(len(single), len(double)))
    return LabelTable(single=tuple(single), double=tuple(double), limit=limit)


def check_prefix_free(labels: Sequence[Label]) -> None:
    """No label's tokens may be a prefix of another's (else their probabilities overlap)."""
    seen = {label.tokens for label in labels}
    for label in labels:
        for cut in range(1, len(label.tokens)):
            if label.tokens[:cut] in seen:
                raise LabelError(f"label {label.text!r} extends another label's tokens")


@dataclass(frozen=True)
class LabelTrie:
    """The positions a question's readout needs: one per distinct proper prefix of its labels.

    `nodes[prefix]` = the tokens whose logits are read after the prompt plus `prefix` (the root is
    the empty prefix, at the prompt's last position). Single-token label sets have only the root.
    """

    nodes: dict[tuple[int, ...], tuple[int, ...]]

    @classmethod
    def of(cls, labels: Sequence[Label]) -> LabelTrie:
        wanted: dict[tuple[int, ...], list[int]] = {}
        for label in labels:
            for cut in range(len(label.tokens)):
                ids = wanted.setdefault(label.tokens[:cut], [])
                if label.tokens[cut] not in ids:
                    ids.append(label.tokens[cut])
        return cls({prefix: tuple(ids) for prefix, ids in wanted.items()})

    def children(self, prefix: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Prefixes one token longer than `prefix` that need their own readout position."""
        return [(*prefix, t) for t in self.nodes[prefix] if (*prefix, t) in self.nodes]
