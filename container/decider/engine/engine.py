"""The decision engine: one GGUF model, its verified labels and prompt, decisions and chat as work.

For every question the prompt ends right where the model would write an option's label. The
engine reads the logits there (and, for labels of several tokens, at one more position per label
prefix), keeps only the labels' scores, divides by the temperature and normalizes: nothing is
generated. Planning (`plan_decision`, `plan_batch`, `chat_plan`) tokenizes and checks every
limit; the resulting work (`decision_work`, `chat_work`) runs on the scheduler's engine thread,
batched with everything else that is running (see `decider.engine.scheduling.scheduler`). Chats are planned
and built by one module, `decider.engine.works.chat` (`engine.chat`).

`decide(request)` runs one request in-process on a private scheduler (tests, benchmarks) and returns
its `DecisionOutcome`: the engine never builds wire responses (decider.server.answers does).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from decider.engine.model.labels import LabelError, LabelTable, build_label_table
from decider.engine.model.markers import CallerText, MarkerError
from decider.engine.model.modelfile import (
    display_name,
    quantization_from_name,
    resolve_model_file,
    verify_sha256,
)
from decider.engine.model.native import ContextConfig, InvarianceUnsupportedError, LlamaRuntime, NativeError
from decider.engine.model.prompt import (
    FALLBACK_TEMPLATES,
    PROMPT_FORMATS,
    ChatTemplate,
    PromptBuilder,
    PromptFrame,
    TemplateUnusableError,
)
from decider.engine.scheduling.jobs import Job
from decider.engine.scheduling.scheduler import Scheduler
from decider.engine.works import generation
from decider.engine.works.chat import ChatPlan, ChatPlanner, ChatWork
from decider.engine.works.decision_work import DecisionWork
from decider.engine.works.decisions import (
    BatchDecisionRequest,
    DecisionOutcome,
    DecisionPlan,
    DecisionPlanner,
    DecisionRequest,
)
from decider.engine.works.generation import GenerationEvent
from decider.errors import StartupError
from decider.memory_budget import size_host_tier
from decider.settings import CacheBudget, Settings


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
    n_batch: int
    n_ubatch: int
    batch_invariant: bool
    chat_template_source: str
    prompt_version: str
    max_options: int
    slot_labels: tuple[str, ...]  # the single-token labels (questions with up to this many options)
    markers: dict[
        str, list[str]
    ]  # token texts caller text never becomes, by source (engine/model/markers.py)


class DecisionEngine:
    """One model, one llama context, decisions and chat."""

    def __init__(
        self,
        settings: Settings,
        runtime: LlamaRuntime,
        template: ChatTemplate,
        planner: DecisionPlanner,
        info: ModelInfo,
        caller: CallerText,
    ) -> None:
        self.settings = settings
        self._rt = runtime
        self._template = template
        self._caller = caller
        self.planner = planner
        self.model_info = info
        self.max_options = info.max_options
        self.chat = ChatPlanner(
            template,
            runtime,
            caller.tokenize,
            room=planner.room,  # the cached decision head and the pad stay
            n_ctx_setting=settings.env_name("n_ctx"),
            max_token_bytes=planner.max_token_bytes,
        )
        self._local: Any = None  # a private scheduler for `decide`, created on first use

    @functools.cached_property
    def cache_budget(self) -> CacheBudget:
        """The settings' cache budget, with the host tier sized now when it is left to its default:
        from the memory left once the model and its context are loaded (decider.memory_budget)."""
        budget = self.settings.cache_budget
        if budget.host_bytes is not None:
            return budget
        if not budget.states or self._rt.policy.epochs:  # no state is kept (memory epochs: none ever)
            return dataclasses.replace(budget, host_bytes=0)
        size = size_host_tier(self.model_info.size_bytes)
        logging.getLogger(__name__).info("%s", size.describe())
        return dataclasses.replace(budget, host_bytes=size.bytes)

    # --- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, settings: Settings, *, count_passes: bool = False) -> DecisionEngine:
        """Load the model named by the settings; any problem is a one-line `StartupError`.
        `count_passes`: the runtime counts forward passes (`runtime.passes`; benchmarks, tests)."""
        path = resolve_model_file(settings)
        digest = verify_sha256(path, settings)
        config = ContextConfig.from_settings(settings, count_passes=count_passes)
        try:
            runtime = LlamaRuntime(path, config)
        except InvarianceUnsupportedError as exc:  # asked for on a model where it cannot hold
            raise StartupError(f"{settings.env_name('batch_invariant')}=true: {exc}") from exc
        except NativeError as exc:
            raise StartupError(str(exc)) from exc
        try:
            template = _chat_template(runtime, settings)
            frame = PromptFrame.from_template(template)
            caller = CallerText.for_model(runtime, template, settings.marker_tokens)
            builder = PromptBuilder(
                frame,
                PROMPT_FORMATS[settings.prompt_version],
                lambda text: runtime.tokenize(text, special=True),
                caller.tokenize,
                runtime.bos,
                runtime.add_bos,
            )
            labels = build_label_table(
                builder,
                lambda text: runtime.tokenize(text, special=False),
                runtime.piece,
                settings.max_options,
            )
        except (TemplateUnusableError, LabelError, MarkerError) as exc:
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
            n_batch=config.policy.n_batch,
            n_ubatch=config.policy.n_ubatch,
            batch_invariant=config.policy.invariant,
            chat_template_source=template.source,
            prompt_version=builder.version,
            max_options=len(labels),
            slot_labels=tuple(label.text for label in labels.single),
            markers=caller.report(),
        )
        planner = DecisionPlanner(
            settings,
            builder,
            labels,
            n_ctx=runtime.n_ctx,
            max_token_bytes=runtime.max_token_bytes(),
            piece=runtime.piece,
            model_id=info.id,
        )
        return cls(settings, runtime, template, planner, info, caller)

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
            self._local = None
        self._rt.close()

    # --- small helpers -----------------------------------------------------------------------------
    @property
    def runtime(self) -> LlamaRuntime:
        return self._rt

    @property
    def label_table(self) -> LabelTable:
        return self.planner.labels

    @property
    def head_tokens(self) -> list[int]:
        return self.planner.builder.head_tokens

    @property
    def cache_namespace(self) -> str:
        """What exact repeats are keyed under: the model file's digest and the prompt version."""
        return f"{self.model_info.sha256}|{self.model_info.prompt_version}"

    def count_tokens(self, text: str) -> int:
        """Tokens of caller text, as the prompt holds them."""
        return len(self._caller.tokenize(text))

    @property
    def caller_text(self) -> CallerText:
        """The one tokenizer of caller text (markers neutralized), for tests and audits."""
        return self._caller

    def render_prompt(
        self, state: Any, instructions: Any, options: list[tuple[str, Any]]
    ) -> tuple[str, list[int]]:
        """The exact prompt text and tokens for one question (for tests and audits)."""
        prompt = self.planner.builder.build(state, instructions, options)
        return prompt.text, prompt.tokens

    # --- decisions ----------------------------------------------------------------------------------
    def plan_decision(self, request: DecisionRequest) -> DecisionPlan:
        """Tokenize and check a request (RequestError on any limit); no model call."""
        return self.planner.plan(request)

    def plan_batch(self, request: BatchDecisionRequest) -> DecisionPlan:
        return self.planner.plan_batch(request)

    def decision_work(self, plan: DecisionPlan) -> DecisionWork:
        return DecisionWork(plan, self.planner)

    def decide(self, request: DecisionRequest | BatchDecisionRequest) -> DecisionOutcome:
        """Run one request in-process, synchronously (a private scheduler; not for the server). Its
        response: `decider.server.answers.decision_response`, or `decide` there in one call."""
        batch = hasattr(request, "states")
        plan = self.plan_batch(request) if batch else self.plan_decision(request)  # type: ignore[arg-type]
        return self._run_local(self.decision_work(plan), "decision")

    def _run_local(self, work: Any, kind: str) -> Any:
        if self._local is None:
            self._local = Scheduler(
                queue_size=1024,
                deadline_seconds=3600,
                epoch_cells=self.settings.epoch_limit,
                cache_budget=self.cache_budget,
                chat_share=self.settings.chat_share,
            )
            # On the engine thread, as the server does: with OpenMP every thread that computes a
            # graph keeps its own team of compute threads, and two teams on the same cores made
            # every later small decode several times slower (3 ms -> 21 ms for one token here).
            self._local.submit_unscheduled(
                lambda: self._local.attach(self._rt, self.head_tokens, namespace=self.cache_namespace)
            ).result()
        now = time.monotonic()
        job = Job(kind, uuid.uuid4().hex, now + 3600, now, work.cost)
        return self._local.submit(job, work).result()

    # --- chat ----------------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Chat prompt tokens; a conversation the model's template refuses is a 422, not a 500."""
        return self.chat.render(messages)

    def chat_plan(self, messages: list[dict[str, Any]], **params: Any) -> ChatPlan:
        """Tokenize a chat and check its limits (`ChatPlanner.plan`)."""
        return self.chat.plan(messages, **params)

    def chat_work(self, plan: ChatPlan, emit: Callable[[GenerationEvent], None] | None = None) -> ChatWork:
        """The work that answers a planned chat (`emit`: each text delta and the end, when streaming)."""
        return self.chat.work(plan, emit)

    def generate(
        self, messages: list[dict[str, Any]], **params: Any
    ) -> tuple[str, str, generation.GenerationUsage]:
        """One chat completion in-process, synchronously: (text, finish reason, usage)."""
        plan = self.chat_plan(
            messages,
            max_tokens=params.pop("max_tokens", None),
            max_tokens_cap=self.settings.max_chat_tokens,
            **params,
        )
        return self._run_local(self.chat_work(plan), "chat")


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
