"""Chat completions: the one place a chat request becomes tokens, a plan and a work.

Handlers ask `ChatPlanner` (the engine's `chat`) for a plan (`plan`, on a worker thread: the
template, the tokens, the limits) and then for its work (`work`); nothing else builds a `ChatWork`.
The work runs on the scheduler's engine thread like any other (decider.engine.scheduling.work.Work): it
prefills its prompt in its own sequence, then decodes one token per step.

Turns kept across requests (decider.engine.memory.prefix_cache, kind `chat`). The next turn of a
conversation renders the earlier messages again, then the answer and a new question, so its
prompt starts with what the previous turn decoded:
- on attention-only models (partial hits allowed) a chat that ends by itself hands its sequence,
  prompt and generated tokens, to the cache; the next turn copies it and cuts it where the two
  token lists part (the template re-renders the answer from its text, which usually tokenizes as
  generated; where it does not, the turn decodes from there);
- on hybrid, recurrent and sliding-window models a copy cannot be cut back, so the entry must end
  exactly where the next prompt still agrees: at `ChatPlan.boundary`, the end of the messages
  before the generation prompt (the prompt rendered without it). Templates print the generation
  prompt differently from an earlier assistant turn (Qwen3's prints an empty think block only
  there), so the end of the whole prompt would often not be a prefix of the next one; the end of
  the messages is, for every template that renders earlier messages the same way whatever follows.
  The prefill stops there once and the cache keeps a copy. The previous answer is decoded again.
A kept turn serves only a prompt that continues it (one that covers its whole prompt): a first
turn, or the same request sent again, is prefilled whole as it was the first time, and gives the
same answer again. A conversation keeps one entry, its latest turn's: the turn a chat continued
gives way to the chat's own. The sampler (seed) and the response_format constraint are the
request's own: only the KV cells are reused.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from decider.engine.memory.prefix_cache import CHAT, MIN_PARTIAL_HIT, CachedState, Caches, StateCache
from decider.engine.memory.sequences import SeqPool
from decider.engine.model.native import OutputSpec, Row
from decider.engine.model.prompt import ChatTemplate, TemplateUnusableError
from decider.engine.scheduling.admission import ChatLengths
from decider.engine.scheduling.cost import Cost, span_attended
from decider.engine.scheduling.steps import Step, Unit
from decider.engine.scheduling.work import Footprint
from decider.engine.structured.constraints import Constraint, ConstraintFailedError
from decider.engine.works import chat_options, generation
from decider.engine.works.generation import (
    FinishReason,
    GenerationEvent,
    GenerationUsage,
    StopFilter,
    free_sampler,
    make_sampler,
)
from decider.errors import RequestError


@dataclass(frozen=True)
class ChatPlan:
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    # the response_format's constraint (decider.engine.structured.constraints), compiled while planning: the
    # request's own (one work per plan), it holds the parse state as tokens are generated
    constraint: Constraint | None = None
    top_logprobs: int | None = None  # None: no logprobs; else logprobs with this many alternatives
    # Where the messages end and the generation prompt begins (tokens): the turn kept on models that
    # take exact hits only. None: nothing is kept at a boundary (attention-only models keep the end).
    boundary: int | None = None
    space: str = ""  # the request's cache space: kept turns serve only their own (prefix_cache)

    @property
    def cost(self) -> Cost:
        return self.cost_given()

    @property
    def least_cost(self) -> Cost:
        return self.least_cost_given()

    def cost_given(self, cached: int = 0) -> Cost:
        """The prefill (less `cached` prompt tokens a kept turn holds), then one decode per generated
        token (each costs a whole step), up to max_tokens (what it may take; admission counts a
        running chat at the length chats have been generating)."""
        tokens = len(self.prompt) - cached + self.max_tokens
        return Cost(1 + self.max_tokens, tokens, span_attended(cached, tokens))

    def least_cost_given(self, cached: int = 0) -> Cost:
        """The prefill and the first token: a generation may end at any token."""
        rest = len(self.prompt) - cached
        return Cost(1, rest, span_attended(cached, rest))


class ChatPlanner:
    """Chat requests into plans and works, for one model (`DecisionEngine.chat`)."""

    def __init__(
        self,
        template: ChatTemplate,
        runtime: Any,
        caller_tokens: Callable[[str], list[int]],
        *,
        room: int,
        n_ctx_setting: str,
        max_token_bytes: int = 1,
    ) -> None:
        self._template = template
        self._runtime = runtime
        self._caller_tokens = caller_tokens
        self.room = room  # cells a chat may use: the context less the cached decision head and the pad
        self._n_ctx_setting = n_ctx_setting
        self._max_token_bytes = max(1, max_token_bytes)  # the vocabulary's longest piece
        self._exact_only = not bool(getattr(runtime, "partial_reuse", True))

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        generation_prompt: bool = True,
        max_prompt_tokens: int | None = None,
    ) -> list[int]:
        """Chat prompt tokens; a conversation the model's template refuses is a 422, not a 500.
        With `max_prompt_tokens`, a prompt whose message contents alone make more tokens than that
        by their bytes (no token is longer than the vocabulary's longest piece) is refused before
        anything is tokenized."""

        def check(text_bytes: int) -> None:
            floor = math.ceil(text_bytes / self._max_token_bytes)
            if max_prompt_tokens is not None and floor > max_prompt_tokens:
                raise RequestError(
                    f"The prompt is at least {floor} tokens ({text_bytes} bytes); the context holds "
                    f"{self.room} for chat ({self._n_ctx_setting}).",
                    code="context_length_exceeded",
                    param="messages",
                )

        try:
            return generation.chat_tokens(
                self._template,
                self._runtime,
                self._caller_tokens,
                messages,
                check if max_prompt_tokens is not None else None,
                add_generation_prompt=generation_prompt,
            )
        except TemplateUnusableError as exc:
            raise RequestError(
                f"The model's chat template rejects these messages: {exc}",
                code="invalid_messages",
                param="messages",
            ) from exc

    def plan(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int | None,
        max_tokens_cap: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int | None = None,
    ) -> ChatPlan:
        """Tokenize a chat; `max_tokens` None: up to what the context has left, at most `max_tokens_cap`."""
        prompt = self.render(messages, max_prompt_tokens=self.room - (max_tokens or 1))
        room = self.room - len(prompt)
        if max_tokens is None:
            max_tokens = max(1, min(max_tokens_cap, room))
        if max_tokens > room:
            raise RequestError(
                f"The prompt is {len(prompt)} tokens and max_tokens is {max_tokens}; the context holds "
                f"{self.room} for chat ({self._n_ctx_setting}).",
                code="context_length_exceeded",
                param="messages",
            )
        boundary = self._boundary(messages, prompt) if self._exact_only else None
        return ChatPlan(prompt, max_tokens, temperature, top_p, tuple(stop or ()), seed, boundary=boundary)

    def _boundary(self, messages: list[dict[str, Any]], prompt: list[int]) -> int | None:
        """Where the messages end in `prompt`: its common prefix with the rendering without the
        generation prompt (None when that is too short to be worth a kept copy)."""
        try:
            without = self.render(messages, generation_prompt=False)
        except RequestError:
            return None
        length = 0
        for ours, theirs in zip(prompt, without, strict=False):
            if ours != theirs:
                break
            length += 1
        return length if length >= MIN_PARTIAL_HIT else None

    @staticmethod
    def work(plan: ChatPlan, emit: Callable[[GenerationEvent], None] | None = None) -> ChatWork:
        """The work that generates `plan`'s answer (`emit`: each text delta and the end, streaming)."""
        return ChatWork(plan, emit)


class Sampling(Protocol):
    """What a chat reads after its row's decode (the step's runtime: LlamaRuntime, or a fake)."""

    def logits_at(self, batch_index: int) -> Any: ...

    def sample(self, sampler: Any, batch_index: int) -> int: ...

    def piece(self, token: int, *, special: bool = False) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...


class ChatWork:
    """One chat completion: prefill the prompt in its own sequence, then one token per step.

    It reserves its prompt's cells when it starts (less what a kept turn it copies holds) and takes
    one more for each token it decodes, when it decodes it: cells are never held for an answer not
    generated yet. A step with no free cell for its next token pauses it, or the scheduler stops it
    (`stop_for_cells`)."""

    kind = "chat"

    def __init__(self, plan: ChatPlan, emit: Callable[[GenerationEvent], None] | None = None) -> None:
        self.plan = plan
        self._emit = emit
        self.decodes = 0
        self.timing: dict[str, float] = {}
        self._seq: int | None = None
        self._decoded = 0
        self._dead = 0
        self._prefilled = 0
        self._position = 0
        self._last: int | None = None
        self._produced = 0
        self._parts: list[str] = []
        self._finish: FinishReason | None = None
        self._cut = False  # stopped for lack of memory cells, not by the model or max_tokens
        self._sampler: Any = None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopFilter(plan.stop)
        # With plan.top_logprobs: one per token whose text was emitted. A token's entry waits in
        # _held_logprobs (with the offset where its text starts) while a stop string may still cut
        # its text; one the cut removed entirely is dropped, as its text is.
        self.logprobs: list[chat_options.TokenLogprob] = []
        self._held_logprobs: list[tuple[int, chat_options.TokenLogprob]] = []
        self._decoded_chars = 0
        self._emitted_chars = 0
        # Kept across requests (decider.engine.memory.prefix_cache): the caches (seen at the first step),
        # the kept turn it copied (pinned while it runs), the prompt tokens that covered, the
        # generated tokens its sequence holds (decoded), whether it kept a turn of its own, and
        # what admission expected to find kept.
        self._caches: Caches | None = None
        self._entry: CachedState | None = None
        self.cached = 0
        self._fed: list[int] = []
        self._kept_boundary = False
        self._expected_cached = 0

    @property
    def cost(self) -> Cost:
        return self.plan.cost

    @property
    def least_cost(self) -> Cost:
        return self.plan.least_cost

    def costs_given(self, caches: Caches | None) -> tuple[Cost, Cost]:
        """Its costs less the prompt tokens a kept turn holds now (a peek: an estimate)."""
        states = caches.states if caches is not None else None
        cached = (
            states.peek(self.plan.prompt, self.plan.boundary, kind=CHAT, space=self.plan.space)
            if states is not None
            else 0
        )
        self._expected_cached = cached  # read by `cost_left` until it starts
        return self.plan.cost_given(cached), self.plan.least_cost_given(cached)

    @property
    def started(self) -> bool:
        return self._seq is not None or self._finish is not None

    @property
    def wants_start(self) -> bool:
        return not self.started

    @property
    def started_units(self) -> int:
        return 1 if self.started else 0

    @property
    def cells_wanted(self) -> int:
        """Cells its next step takes beyond its reservation: one while it generates."""
        return 1 if self._seq is not None and self._last is not None else 0

    @property
    def natural_end(self) -> tuple[int, bool] | None:
        """(tokens generated, whether the model stopped it) once it ended by itself (a stop, or its
        max_tokens); None when it was cancelled, failed or cut for lack of cells."""
        if self._finish in ("stop", "length") and not self._cut:
            return self._produced, self._finish == "stop"
        return None

    def cost_left(self, lengths: ChatLengths) -> list[Cost]:
        """What is left of it: the rest of its prompt (one step; before it starts, less what
        admission expected to find kept), and the tokens it is expected to generate still (a step
        each), at the length chats have been generating."""
        if self._finish is not None:
            return []
        prompt = len(self.plan.prompt)
        prefilled = self._prefilled if self.started else max(self._prefilled, self._expected_cached)
        pieces = []
        if prefilled < prompt:
            rest = prompt - prefilled
            pieces.append(Cost(1, rest, span_attended(prefilled, rest)))
        expected = lengths.expected_total(self.plan.max_tokens, self._produced)
        if (left := expected - self._produced) > 0:
            pieces.append(Cost(left, left, span_attended(prompt + self._produced, left)))
        return pieces

    def footprint(self) -> Footprint:
        """A generation never waits for another sequence, and its cells are its own: a memory epoch
        may end while it runs. Reserved (`future`): the prompt not decoded yet, no more. The cells
        of a kept turn it copied are the cache's (the entry is pinned)."""
        if self._seq is None:
            return Footprint(dead=self._dead)
        future = len(self.plan.prompt) - self._prefilled
        return Footprint(live=self._decoded, future=future, dead=self._dead, seqs=(self._seq,))

    @property
    def finished(self) -> bool:
        return self._finish is not None

    def outcome(self) -> tuple[str, FinishReason, GenerationUsage]:
        assert self._finish is not None
        return "".join(self._parts), self._finish, self._usage()

    def _usage(self) -> GenerationUsage:
        return GenerationUsage(
            prompt_tokens=len(self.plan.prompt), completion_tokens=self._produced, cached_tokens=self.cached
        )

    def _kept(self) -> StateCache | None:
        return self._caches.states if self._caches is not None else None

    def plan_step(self, step: Step) -> None:
        if self._finish is not None:
            return
        if self._seq is None and not self._start(step):
            return
        assert self._seq is not None
        prompt = self.plan.prompt
        if self._prefilled < len(prompt):
            end = len(prompt)
            kept, boundary = self._kept(), self.plan.boundary
            if kept is not None and not kept.partial and boundary is not None and self._prefilled < boundary:
                end = boundary  # a copy cannot be cut on this model: the prefill stops at the boundary once
            take = step.take(end - self._prefilled, alone=True)
            if take <= 0:
                return
            start = self._prefilled
            last = start + take == len(prompt)
            row = Row(self._seq, prompt[start : start + take], start, OutputSpec() if last else None)
            self._add(step, row, lambda done: self._after_prefill(step, take, done, last))
        elif self._last is not None and step.tokens_left and step.take_cells(1):
            token = self._last
            row = Row(self._seq, [token], self._position, OutputSpec())
            self._last = None
            self._position += 1
            self._add(step, row, lambda done: self._fed_and_sampled(step, token, done))

    def _start(self, step: Step) -> bool:
        """Reserve the prompt's cells (each generated token takes its own later) and take a sequence:
        a copy of the kept turn that begins the prompt (restored from host memory if need be), if
        there is one. The entry is pinned before the reservation, so making room cannot evict it, and
        its cells are left out of it."""
        self._caches = step.caches
        kept, prompt = self._kept(), self.plan.prompt
        hit = (
            kept.lookup(
                prompt, self.plan.boundary, kind=CHAT, space=self.plan.space, room=step, then=len(prompt)
            )
            if kept is not None
            else None
        )
        cached = hit.length if hit is not None else 0
        if hit is not None:
            hit.entry.pins += 1
        if not step.try_start(Unit.CHAT, len(prompt) - cached, sequences=1):
            if hit is not None:
                hit.entry.pins -= 1
            return False
        self._seq = step.seqs.acquire()
        assert self._seq is not None, "try_start checks that a sequence is available"
        if hit is not None and kept is not None:
            kept.take(hit, self._seq)  # copies (and pins once more): drop the reservation's pin
            hit.entry.pins -= 1
            self._entry = hit.entry
            self.cached = self._prefilled = self._position = cached
        elif kept is not None:
            kept.missed(CHAT)
        self._sampler = make_sampler(self.plan.temperature, self.plan.top_p, self.plan.seed)
        return True

    def _add(self, step: Step, row: Row, on_done: Callable[[Row], None]) -> None:
        def done(finished: Row) -> None:
            self._decoded += len(finished.tokens)
            on_done(finished)

        step.add(self, row, done)
        self.decodes += 1

    def _after_prefill(self, step: Step, take: int, done: Row, last: bool) -> None:
        self._prefilled += take
        self._position = self._prefilled
        kept, boundary = self._kept(), self.plan.boundary
        if kept is not None and not kept.partial and self._prefilled == boundary and self.cached < boundary:
            assert self._seq is not None
            self._kept_boundary = kept.store(
                self.plan.prompt[:boundary], self._seq, kind=CHAT, space=self.plan.space
            )
        if last:
            self._sampled(step, done)

    def _fed_and_sampled(self, step: Step, token: int, done: Row) -> None:
        self._fed.append(token)  # decoded: its sequence holds it now
        self._sampled(step, done)

    def _sampled(self, step: Step, done: Row) -> None:
        assert done.result is not None
        runtime: Sampling = step.runtime
        constraint, raw = self.plan.constraint, None
        if constraint is not None:  # only the allowed tokens keep their logits (in llama.cpp's buffer)
            logits = runtime.logits_at(done.result.batch_index)
            if self.plan.top_logprobs is not None:
                raw = logits.copy()  # logprobs are the model's own, before the mask
            try:
                constraint.mask(logits)
            except ConstraintFailedError as exc:
                raise _constraint_failed(exc) from None
        token = runtime.sample(self._sampler, done.result.batch_index)
        if runtime.is_eog(token):
            self._end(step.seqs, "stop")
            return
        if constraint is not None:
            try:
                constraint.accept(token)
            except ConstraintFailedError as exc:
                raise _constraint_failed(exc) from None
        if self.plan.top_logprobs is not None:  # released with the text event that carries this token
            logits = raw if raw is not None else runtime.logits_at(done.result.batch_index)
            entry = chat_options.token_logprobs(logits, token, self.plan.top_logprobs, runtime.piece)
            self._held_logprobs.append((self._decoded_chars, entry))
        self._produced += 1
        decoded = self._decoder.decode(runtime.piece(token))
        self._decoded_chars += len(decoded)
        text, stop_hit = self._stops.push(decoded)
        self._say(text)
        if stop_hit:
            self._held_logprobs.clear()  # their text was cut with the stop string
            self._end(step.seqs, "stop", flush=False)
        elif self._produced >= self.plan.max_tokens:
            self._end(step.seqs, "length")
        else:
            self._last = token

    def _say(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._emitted_chars += len(text)
            while self._held_logprobs and self._held_logprobs[0][0] < self._emitted_chars:
                self.logprobs.append(self._held_logprobs.pop(0)[1])
            if self._emit is not None:
                self._emit(GenerationEvent(text=text))

    def stop_for_cells(self, seqs: SeqPool) -> None:
        """End now with finish_reason "length": the context has no cell left for its next token."""
        if self._finish is None:
            self._cut = True
            self._end(seqs, "length")

    def _end(self, seqs: SeqPool, reason: FinishReason, *, flush: bool = True) -> None:
        if flush:
            # Whatever was held back as a possible stop prefix (or an unfinished character) is text.
            text, stop_hit = self._stops.push(self._decoder.decode(b"", final=True))
            self._say(text if stop_hit else text + self._stops.flush())
            if not stop_hit:  # every token's text is out now (tokens of no text of their own too)
                self.logprobs.extend(entry for _, entry in self._held_logprobs)
            self._held_logprobs.clear()
        self._finish = reason
        if not self._cut:
            self._keep_turn()
        self._release(seqs)
        if self._emit is not None:
            self._emit(GenerationEvent(finish_reason=reason, usage=self._usage()))

    def _keep_turn(self) -> None:
        """Ended by itself: keep this turn. On models that allow partial hits the cache takes this
        very sequence (prompt and generated tokens); on the others the boundary copy was kept during
        the prefill. The turn it continued (the entry it copied) gives way."""
        kept, continued = self._kept(), self._entry
        if kept is None:
            return
        self._unpin()
        if kept.partial and self._seq is not None:
            tokens = [*self.plan.prompt, *self._fed]
            if kept.adopt(
                tokens,
                self._seq,
                prompt_tokens=len(self.plan.prompt),
                replaces=continued,
                space=self.plan.space,
            ):
                self._seq = None  # the cache's now: not released
        elif self._kept_boundary and continued is not None:
            kept.drop(continued)

    def _unpin(self) -> None:
        kept = self._kept()
        if self._entry is not None and kept is not None:
            kept.unpin(self._entry)
        self._entry = None

    def _release(self, seqs: SeqPool) -> None:
        self._unpin()
        if self._seq is not None:
            seqs.release(self._seq)
            self._seq = None
            if seqs.epochs:
                self._dead += self._decoded
        if self._sampler is not None:
            free_sampler(self._sampler)
            self._sampler = None

    def abandon(self, seqs: SeqPool) -> None:
        """Cancelled or failed: its sequence goes and the turn it copied is unpinned (still kept)."""
        self._release(seqs)
        if self._finish is None:
            self._finish = "cancelled"


def _constraint_failed(exc: ConstraintFailedError) -> RequestError:
    """A chat whose response_format cannot take its next step ends with this (the loop fails that
    work alone): a 422 before the first token, an error event in a stream after it."""
    return RequestError(str(exc), code=exc.code, param="response_format")
