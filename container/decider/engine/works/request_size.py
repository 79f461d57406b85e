"""The prompt tokens one decision request has the server tokenize and hold while it is planned.

Planning tokenizes each state once and each question's tail once per option order, before the
scheduler can admit or refuse the request by its cost. A body within `DECIDER_MAX_BODY_BYTES` can
therefore ask for far more text than it holds: 64 questions of 80 KB at 8 permutations is 40 MB of
text to tokenize from a 5 MB body (about 8 million tokens, ~300 MB of token lists). The tokens
planned for a request are bounded by `DECIDER_MAX_REQUEST_TOKENS` (422 `request_too_large`), one rule
checked in two places:

- **Before anything is tokenized, from the bytes** (`TextBytes.least_tokens`). No token is longer
  than the vocabulary's longest piece (`max_token_bytes`), so a text of B bytes is at least
  ceil(B / max_token_bytes) tokens, and a request whose floor passes the limit is refused without
  a tokenizer call. This is the only byte bound that may refuse: the other one, at most one token
  per byte (`TextBytes.most_tokens`), tells when a request can never be refused, not that it must
  be (English is about 4 bytes a token; refusing on it would refuse requests at a quarter of the
  limit).
- **While tokenizing, where the floor was not decisive** (`TokenBudget`): the tokens are counted as
  each text is tokenized, and the request is refused as soon as the count passes the limit. At most
  one text more than the limit is held, and one text is itself bounded before it is tokenized: its
  prompt must fit the context (`DecisionPlanner`'s byte check of each question).

`DecisionPlanner` (decider.engine.works.decisions) owns the request limits and applies these; every
route that plans decisions goes through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from decider.errors import RequestError

REQUEST_TOO_LARGE = "request_too_large"
ADVICE = "Send fewer questions or permutations, shorter texts, or fewer states per request."


@dataclass(frozen=True)
class QuestionText:
    """One question's tail as planning tokenizes it: once per option order, each the same length
    (an order moves the same descriptions between the same labels)."""

    key: str
    orders: int
    tail_bytes: int


@dataclass(frozen=True)
class TextBytes:
    """The bytes of every text planning will tokenize for one request, measured without a tokenizer.

    `states[i]` is state i's segment (tokenized once per state); each question's tail is tokenized
    once per option order on every state. Where the segments tokenize differently together (a
    non-canonical cut), a question's tokens hold its state's segment as well."""

    states: tuple[int, ...]
    questions: tuple[QuestionText, ...]

    def least_tokens(self, max_token_bytes: int) -> tuple[int, int]:
        """(the states' tokens, the questions' tokens) at the least: no token spans more bytes."""
        per = max(1, max_token_bytes)
        states = sum(math.ceil(size / per) for size in self.states)
        tails = sum(q.orders * math.ceil(q.tail_bytes / per) for q in self.questions)
        return states, len(self.states) * tails

    def most_tokens(self, tokens_per_text: int = 1) -> int:
        """Tokens at the most: one per byte (llama.cpp's BPE and SPM tokenizers never emit a token
        for less than a byte of text), plus `tokens_per_text` for each text tokenized (SPM's space
        prefix, the template's own tokens after a tail), a question's text holding its state."""
        total = 0
        for state in self.states:
            total += state + tokens_per_text
            for question in self.questions:
                total += question.orders * (state + question.tail_bytes + tokens_per_text)
        return total

    def largest_tail(self) -> QuestionText | None:
        return max(self.questions, key=lambda q: q.tail_bytes, default=None)


def too_large(tokens: int, limit: int, setting: str, param: str, *, least: bool) -> RequestError:
    """The one refusal: `tokens` (a floor from bytes when `least`) past `limit`."""
    amount = f"at least {tokens}" if least else f"more than {limit}"
    return RequestError(
        f"Planning this request tokenizes {amount} prompt tokens (each state once, each question once "
        f"per option order); at most {limit} are allowed ({setting}). {ADVICE}",
        code=REQUEST_TOO_LARGE,
        param=param,
    )


class TokenBudget:
    """The tokens planned for one request so far, refused as soon as they pass the limit."""

    def __init__(self, limit: int, setting: str) -> None:
        self.limit = limit
        self.setting = setting
        self.used = 0

    def take(self, tokens: int, param: str) -> None:
        """Count `tokens` just tokenized for the field `param`; past the limit: 422 request_too_large."""
        self.used += tokens
        if self.used > self.limit:
            raise too_large(self.used, self.limit, self.setting, param, least=False)
