"""Chats beside long decodes: steps of their own, within a share of the engine's time.

Every step carries each generating chat's next token beside whatever else runs, so a chat gets one
token per decode. On CPU one decode of prefill takes seconds (up to `n_batch` 2,048 tokens: about
2.4 s for SmolLM2 on two cores, tens of seconds for a 4B model), and a chat streamed beside a batch
got a token every 2.4 s (`make bench-server ARGS="--levels batch_chat"`). So after a decode that
carried other work and took longer than `CHAT_INTERVAL_SECONDS` while chats were running or
waiting, the chats get decodes of their own until those have taken `share` of that decode's time;
then the next shared decode runs. A chats-only decode carries the started chats' rows (a prompt's
prefill, or one token each: about one pass over the weights, 10-30 ms for SmolLM2 here), and may
start the chat whose turn to start it is (first come, first served still holds). So a chat's first
token no longer waits for a second long decode, it streams dozens of tokens per shared decode, and
the other work takes at most `share` longer while chats run. Where decodes stay under the interval (a
GPU), nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass

CHAT_INTERVAL_SECONDS = 0.2  # a shared decode shorter than this paces chats well enough (5 tokens/s)


@dataclass
class ChatPace:
    """The time the generating chats may still take in decodes of their own (`credit`, seconds)."""

    share: float
    credit: float = 0.0

    def stretch(self, decode_seconds: float) -> float:
        """The most that chats running beside other work can stretch that work's time, if its
        decodes take `decode_seconds` (admission's estimate of a decision admitted while chats run):
        `share` more where decodes are long enough to earn chats decodes of their own, else none."""
        return 1.0 + self.share if decode_seconds > CHAT_INTERVAL_SECONDS else 1.0

    def chats_alone(self, chats: bool) -> bool:
        """Whether the next decode carries the chats alone (`chats`: some are running or waiting)."""
        if not chats:
            self.credit = 0.0
        return chats and self.credit > 0

    def decoded(self, seconds: float, *, chats_alone: bool, chats_waited: bool) -> None:
        """After a decode of `seconds`: a chats-only one spends the credit; a shared one that chats
        waited on (`chats_waited`: other work had rows, and chats are running or waiting) earns
        `share` of its time if it was long; any other ends the credit."""
        if chats_alone:
            self.credit -= seconds
        elif chats_waited and seconds > CHAT_INTERVAL_SECONDS:
            self.credit = self.share * seconds
        else:
            self.credit = 0.0
