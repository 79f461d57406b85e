"""The decision engine: typed option probabilities from one GGUF model, with shared-state fan-out.

For every question the prompt ends right where the model would write an option's letter. The
engine reads the logits at that last position, keeps only the option slots, divides by the
temperature and normalizes: nothing is generated.

Shared mode (the default) prefills the tokens that every question's prompt starts with once,
in sequence 0, then copies that sequence into branch sequences and decodes all branch suffixes
in one batch per chunk, reading logits only at each suffix's last token, and removes the
branches. Fresh mode prefills each question's prompt on its own: the reference path.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from decider.engine import generation
from decider.engine.markers import CallerText, MarkerError
from decider.engine.modelfile import display_name, quantization_from_name, resolve_model_file, verify_sha256
from decider.engine.native import ContextConfig, LlamaRuntime, NativeError, Row
from decider.engine.prompt import (
    FALLBACK_TEMPLATES,
    PROMPT_VERSION,
    ChatTemplate,
    PromptBuilder,
    PromptFrame,
    TemplateUnusableError,
    payload,
)
from decider.engine.readout import (
    CONFIDENCE_FORMULA,
    align_to_options,
    allowed_token_mass,
    argmax,
    average_logits,
    logsumexp,
    normalized_peak,
    option_orders,
    score_expectation,
    softmax,
)
from decider.engine.slots import SlotError, SlotTable, build_slot_table
from decider.errors import DeadlineExceededError, DeciderError, RequestError, StartupError
from decider.schemas.decision import (
    Answer,
    ChoiceAnswer,
    DecisionRequest,
    DecisionResponse,
    NoulAnswer,
    Question,
    ScoreAnswer,
    Usage,
)
from decider.settings import Settings

PERMUTATION_SEED = 20240601  # frozen: the same request always sees the same option orders


class ModelInfo(BaseModel):
    """What is being served, as reported by /ping, /v1/models and every response's `model`."""

    model_config = ConfigDict(frozen=True)

    id: str
    name: str
    file: str
    sha256: str
    size_bytes: int
    quantization: str
    architecture: str
    n_ctx: int
    n_seq_max: int
    chat_template_source: str
    prompt_version: str
    max_options: int
    slot_labels: tuple[str, ...]
    markers: dict[str, list[str]]  # token texts caller text never becomes, by source (engine/markers.py)


@dataclass
class _Item:
    """One prompt to read: a question shown in one option order."""

    question: Question
    order: tuple[int, ...]
    tokens: list[int]
    sha256: str
    logits: np.ndarray | None = field(default=None, repr=False)


@dataclass
class _RunStats:
    prefix_tokens: int = 0
    suffix_tokens: int = 0
    decodes: int = 0
    branches: int = 0
    prefill_seconds: float = 0.0
    fanout_seconds: float = 0.0


class DecisionEngine:
    """One model, one llama context, decisions and chat. Not thread-safe: one caller at a time."""

    def __init__(
        self,
        settings: Settings,
        runtime: LlamaRuntime,
        template: ChatTemplate,
        builder: PromptBuilder,
        slots: SlotTable,
        info: ModelInfo,
        caller: CallerText,
    ) -> None:
        self.settings = settings
        self._rt = runtime
        self._template = template
        self._caller = caller
        self._builder = builder
        self._slots = slots
        self.model_info = info
        self.max_options = info.max_options

    # --- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, settings: Settings) -> DecisionEngine:
        """Load the model named by the settings; any problem is a one-line `StartupError`."""
        path = resolve_model_file(settings)
        digest = verify_sha256(path, settings)
        config = ContextConfig(
            n_ctx=settings.n_ctx,
            n_batch=settings.n_batch,
            n_ubatch=settings.n_ubatch,
            n_seq_max=settings.n_seq_max,
            n_threads=settings.threads(),
            n_gpu_layers=settings.n_gpu_layers,
            flash_attn=settings.flash_attn,
        )
        try:
            runtime = LlamaRuntime(path, config)
        except NativeError as exc:
            raise StartupError(str(exc)) from exc
        try:
            template = _chat_template(runtime, settings)
            frame = PromptFrame.from_template(template)
            caller = CallerText.for_model(runtime, template, settings.marker_tokens)
            builder = PromptBuilder(
                frame,
                lambda text, special: runtime.tokenize(text, special=special),
                runtime.bos,
                runtime.add_bos,
                caller_tokens=caller.tokenize,
            )
            slots = build_slot_table(
                builder,
                lambda text, special: runtime.tokenize(text, special=special),
                runtime.piece,
                settings.max_options,
            )
        except (TemplateUnusableError, SlotError, MarkerError) as exc:
            runtime.close()
            raise StartupError(f"{path.name}: {exc}") from exc
        quantization = runtime.quantization or quantization_from_name(path) or "unknown"
        name = settings.model_alias or display_name(path)
        info = ModelInfo(
            id=f"{name}@{digest[:12]}+{quantization}",
            name=name,
            file=str(path),
            sha256=digest,
            size_bytes=path.stat().st_size,
            quantization=quantization,
            architecture=runtime.architecture,
            n_ctx=runtime.n_ctx,
            n_seq_max=runtime.n_seq_max,
            chat_template_source=template.source,
            prompt_version=PROMPT_VERSION,
            max_options=len(slots),
            slot_labels=slots.labels,
            markers=caller.report(),
        )
        return cls(settings, runtime, template, builder, slots, info, caller)

    def close(self) -> None:
        self._rt.close()

    # --- small helpers -----------------------------------------------------------------------------
    def count_tokens(self, text: str) -> int:
        """Tokens of caller text, as the prompt holds them."""
        return len(self._caller.tokenize(text))

    def render_prompt(
        self, state: Any, instructions: Any, options: list[tuple[str, Any]]
    ) -> tuple[str, list[int]]:
        """The exact prompt text and tokens for one question (for tests and audits)."""
        prompt = self._builder.build(payload(state, instructions, options))
        return prompt.text, prompt.tokens

    @property
    def runtime(self) -> LlamaRuntime:
        return self._rt

    @property
    def slot_table(self) -> SlotTable:
        return self._slots

    @property
    def caller_text(self) -> CallerText:
        """The one tokenizer of caller text (markers neutralized), for tests and audits."""
        return self._caller

    # --- decisions ----------------------------------------------------------------------------------
    def decide(
        self, request: DecisionRequest, *, should_stop: Callable[[], bool] | None = None
    ) -> DecisionResponse:
        """Answer every question. `should_stop` is polled between decodes (deadline / disconnect)."""
        started = time.perf_counter()
        stop = should_stop or _never
        self._check_limits(request)
        items = self._build_items(request)
        tokenize_seconds = time.perf_counter() - started
        mode = request.mode or self.settings.decision_mode
        if mode == "shared" and self._rt.n_seq_max < 2:
            mode = "fresh"  # no room for branches: the reference path is the only one
        try:
            stats = self._run_shared(items, stop) if mode == "shared" else self._run_fresh(items, stop)
        except NativeError as exc:
            self._rt.clear()
            raise DeciderError(
                f"the model failed to evaluate the prompt: {exc}", code="backend_failed"
            ) from exc
        answers: dict[str, Answer] = {}
        by_question: dict[str, list[_Item]] = {}
        for item in items:
            by_question.setdefault(item.question.key, []).append(item)
        for question in request.questions:
            answers[question.key] = self._answer(question, by_question[question.key], request.extensions)
        input_tokens = stats.prefix_tokens + stats.suffix_tokens  # fresh: no prefix, whole prompts
        extensions = None
        if request.extensions:
            extensions = {
                "mode": mode,
                "model": self.model_info.id,
                "prompt_version": PROMPT_VERSION,
                "permutations": request.permutations,
                "timing": {
                    "total_seconds": time.perf_counter() - started,
                    "tokenize_seconds": tokenize_seconds,
                    "prefill_seconds": stats.prefill_seconds,
                    "fanout_seconds": stats.fanout_seconds,
                },
                "prefix_tokens": stats.prefix_tokens,
                "suffix_tokens": stats.suffix_tokens,
                "decodes": stats.decodes,
                "branches": stats.branches,
            }
        return DecisionResponse(
            model=self.model_info.id,
            answers=answers,
            usage=Usage(input_tokens=input_tokens, output_tokens=0),
            extensions=extensions,
        )

    def _check_limits(self, request: DecisionRequest) -> None:
        if len(request.questions) > self.settings.max_questions:
            raise RequestError(
                f"The request has {len(request.questions)} questions; "
                f"at most {self.settings.max_questions} are allowed.",
                code="too_many_questions",
                param="questions",
            )
        if request.permutations > self.settings.max_permutations:
            raise RequestError(
                f"`permutations` must be at most {self.settings.max_permutations}.",
                code="invalid_permutations",
                param="permutations",
            )
        for question in request.questions:
            if len(question.options) > self.max_options:
                raise RequestError(
                    f"The question has {len(question.options)} options; this model supports at most "
                    f"{self.max_options} (labels {self._slots.labels[0]}…{self._slots.labels[-1]}).",
                    code="option_count_unsupported",
                    param=f"questions.{question.key}.criteria",
                )

    def _build_items(self, request: DecisionRequest) -> list[_Item]:
        state_tokens = self.count_tokens(json.dumps(request.state, ensure_ascii=False))
        if state_tokens > self.settings.max_state_tokens:
            raise RequestError(
                f"The state is {state_tokens} tokens; at most {self.settings.max_state_tokens} are allowed "
                f"({self.settings.env_name('max_state_tokens')}). It is never truncated.",
                code="context_length_exceeded",
                param="state",
            )
        labels = self._slots.labels
        items: list[_Item] = []
        for question in request.questions:
            for order in option_orders(len(question.options), request.permutations, PERMUTATION_SEED):
                shown = [
                    (labels[slot], question.options[index].description) for slot, index in enumerate(order)
                ]
                prompt = self._builder.build(payload(request.state, question.instructions, shown))
                if len(prompt.tokens) > self._rt.n_ctx:
                    raise RequestError(
                        f"The prompt for question {question.key!r} is {len(prompt.tokens)} tokens; "
                        "the context holds "
                        f"{self._rt.n_ctx} ({self.settings.env_name('n_ctx')}). It is never truncated.",
                        code="context_length_exceeded",
                        param=f"questions.{question.key}",
                    )
                items.append(
                    _Item(question=question, order=order, tokens=prompt.tokens, sha256=prompt.sha256)
                )
        return items

    def _run_fresh(self, items: list[_Item], stop: Callable[[], bool]) -> _RunStats:
        stats = _RunStats()
        t0 = time.perf_counter()
        try:
            for item in items:
                _check_stop(stop)
                self._rt.clear()
                row = Row(seq_id=0, tokens=item.tokens, start_pos=0)
                stats.decodes += self._rt.decode_rows([row])
                item.logits = row.logits
        finally:
            self._rt.clear()
        stats.prefill_seconds = time.perf_counter() - t0
        stats.suffix_tokens = sum(len(item.tokens) for item in items)
        return stats

    def _run_shared(self, items: list[_Item], stop: Callable[[], bool]) -> _RunStats:
        prefix_len = common_prefix_length([item.tokens for item in items])
        stats = _RunStats(prefix_tokens=prefix_len)
        self._rt.clear()
        t0 = time.perf_counter()
        _check_stop(stop)
        if prefix_len:
            stats.decodes += self._rt.decode_rows(
                [Row(seq_id=0, tokens=items[0].tokens[:prefix_len], start_pos=0, want_logits=False)]
            )
        t1 = time.perf_counter()
        stats.prefill_seconds = t1 - t0
        max_branches = self._rt.n_seq_max - 1
        budget = self._rt.n_ctx - prefix_len
        try:
            for chunk in _chunks(items, prefix_len, max_branches, budget):
                _check_stop(stop)
                rows = []
                for branch, item in enumerate(chunk, start=1):
                    self._rt.seq_copy(0, branch)
                    rows.append(Row(seq_id=branch, tokens=item.tokens[prefix_len:], start_pos=prefix_len))
                stats.decodes += self._rt.decode_rows(rows)
                for branch, (item, row) in enumerate(zip(chunk, rows, strict=True), start=1):
                    item.logits = row.logits
                    self._rt.seq_remove(branch)
                stats.branches += len(chunk)
                stats.suffix_tokens += sum(len(row.tokens) for row in rows)
        finally:
            self._rt.clear()
        stats.fanout_seconds = time.perf_counter() - t1
        return stats

    def _answer(self, question: Question, items: list[_Item], with_extensions: bool) -> Answer:
        n = len(question.options)
        slot_ids = self._slots.token_ids[:n]
        per_order: list[list[float]] = []
        masses: list[float] = []
        for item in items:
            assert item.logits is not None
            slot_logits = item.logits[list(slot_ids)]
            per_order.append(align_to_options(item.order, slot_logits))
            if with_extensions:  # a pass over the whole vocabulary: only when it is reported
                masses.append(allowed_token_mass(slot_logits, logsumexp(item.logits)))
        logits = average_logits(per_order)
        temperature = self.settings.temperature_for(question.type)
        probs = softmax(logits, temperature)
        keys = [option.key for option in question.options]
        extensions = None
        if with_extensions:
            first = items[0]
            full_argmax = int(np.argmax(first.logits))
            extensions = {
                "option_ids": list(slot_ids),
                "option_labels": list(self._slots.labels[:n]),
                "option_logits": dict(zip(keys, logits, strict=True)),
                "allowed_token_mass": float(np.mean(masses)),
                "prompt_sha256": first.sha256,
                "prompt_version": PROMPT_VERSION,
                "input_tokens": len(first.tokens),
                "temperature": temperature,
                "full_vocab_argmax_id": full_argmax,
                "full_vocab_argmax_text": self._rt.piece(full_argmax).decode("utf-8", errors="replace"),
                "permutations": [list(item.order) for item in items],
            }
            if question.type != "noul":
                extensions["confidence_formula"] = CONFIDENCE_FORMULA
        if question.type == "noul":
            return NoulAnswer(noul=probs[0], extensions=extensions)
        probabilities = dict(zip(keys, probs, strict=True))
        if question.type == "choice":
            return ChoiceAnswer(
                choice=keys[argmax(probs)],
                probabilities=probabilities,
                confidence=normalized_peak(probs),
                extensions=extensions,
            )
        return ScoreAnswer(
            score=score_expectation(probs),
            legend={o.key: o.description for o in question.options},
            probabilities=probabilities,
            confidence=normalized_peak(probs),
            extensions=extensions,
        )

    # --- chat ----------------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Chat prompt tokens; a conversation the model's template refuses is a 422, not a 500."""
        try:
            return generation.chat_tokens(self._template, self._rt, self._caller.tokenize, messages)
        except TemplateUnusableError as exc:
            raise RequestError(
                f"The model's chat template rejects these messages: {exc}",
                code="invalid_messages",
                param="messages",
            ) from exc

    def generate(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[generation.GenerationEvent]:
        """Stream a chat completion on the shared context (its memory is cleared first)."""
        prompt = self.render_chat(messages)
        if len(prompt) + max_tokens > self._rt.n_ctx:
            raise RequestError(
                f"The prompt is {len(prompt)} tokens and max_tokens is {max_tokens}; the context holds "
                f"{self._rt.n_ctx} ({self.settings.env_name('n_ctx')}).",
                code="context_length_exceeded",
                param="messages",
            )
        return generation.generate(
            self._rt,
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop or [],
            seed=seed,
            should_stop=should_stop,
        )


def _never() -> bool:
    return False


def _check_stop(stop: Callable[[], bool]) -> None:
    if stop():
        raise DeadlineExceededError(
            "The decision was stopped before it finished (deadline passed or client gone)."
        )


def common_prefix_length(sequences: list[list[int]]) -> int:
    """Longest common token prefix, capped so every sequence keeps at least one token to decode."""
    if not sequences:
        return 0
    limit = min(len(seq) for seq in sequences) - 1
    # Every sequence lies between the lexicographic min and max, so it shares their common prefix:
    # one walk over two sequences instead of one over all of them per position.
    low, high = min(sequences), max(sequences)
    length = 0
    while length < limit and low[length] == high[length]:
        length += 1
    return length


def _chunks(
    items: list[_Item], prefix_len: int, max_branches: int, cell_budget: int
) -> Iterator[list[_Item]]:
    """Greedy chunks with at most `max_branches` branches and Σ suffix tokens ≤ `cell_budget`."""
    chunk: list[_Item] = []
    used = 0
    for item in items:
        size = len(item.tokens) - prefix_len
        if chunk and (len(chunk) >= max_branches or used + size > cell_budget):
            yield chunk
            chunk, used = [], 0
        chunk.append(item)
        used += size
    if chunk:
        yield chunk


def _chat_template(runtime: LlamaRuntime, settings: Settings) -> ChatTemplate:
    bos = runtime.bos
    bos_text = runtime.token_text(bos, "") if bos is not None else ""
    eos_text = runtime.token_text(runtime.eos, "")
    text = runtime.chat_template()
    if text:
        return ChatTemplate(source="gguf", text=text, bos_token=bos_text, eos_token=eos_text)
    fallback = settings.chat_template_fallback
    return ChatTemplate(
        source=f"fallback:{fallback}",
        text=FALLBACK_TEMPLATES[fallback],
        bos_token=bos_text,
        eos_token=eos_text,
    )
