"""The container's settings: one typed object, read from the environment.

Every knob of the server and the engine is defined here, once. The CDK stacks build the
SageMaker model's `Environment` from this class (`Settings.to_environment`), the tools name
its keys in the deploy hints they print, and the server reads it at start-up. An invalid value
stops start-up with one clear message (see `decider.cli`).

Environment variables use the prefix `DECIDER_`, e.g. `DECIDER_N_CTX=8192`. The port is the
exception: SageMaker sets `SAGEMAKER_BIND_TO_PORT`, which wins over `DECIDER_PORT`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    Field,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from decider.invariance import MAX_INVARIANT_UBATCH, BatchPolicy

ENV_PREFIX = "DECIDER_"
SAGEMAKER_MODEL_DIR = Path("/opt/ml/model")
SAGEMAKER_MAX_BODY_BYTES = 6 * 1024 * 1024
MIN_API_KEY_LENGTH = 16
QuestionType = Literal["noul", "choice", "score"]


@dataclass(frozen=True)
class CacheBudget:
    """What the engine's caches may hold (decider.engine.memory.prefix_cache; `Settings.cache_budget`)."""

    state_cells: int = 0
    state_seqs: int = 0
    repeat_entries: int = 0
    # kept states saved to host memory when evicted (0: no host tier; None: sized at start from the memory
    # left, decider.memory_budget, by Engine.cache_budget)
    host_bytes: int | None = 0
    partial_hits: bool = True  # an entry may serve a prompt that shares only its beginning

    @property
    def states(self) -> bool:
        return self.state_cells > 0 and self.state_seqs > 0

    @property
    def host(self) -> bool:
        """A host tier behind the kept states (only where states are kept at all; an unsized one, None,
        is none until DecisionEngine.cache_budget sizes it)."""
        return self.states and bool(self.host_bytes)


@dataclass(frozen=True)
class GrammarLimits:
    """The response_format bounds (decider.engine.structured.schema_limits checks the size, llguidance's
    `LLParserLimits` the rest: decider.engine.structured.constraints); the defaults are the settings'."""

    schema_bytes: int = 65536
    compile_fuel: int = 200_000  # llguidance initial_lexer_fuel
    step_fuel: int = 100_000  # step_lexer_fuel
    step_items: int = 20_000  # step_max_items
    lexer_states: int = 50_000  # max_lexer_states
    grammar_size: int = 200_000  # max_grammar_size


class Settings(BaseSettings):
    """Everything the container needs to load one model and serve it."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        frozen=True,
        validate_default=True,
        populate_by_name=True,
    )

    # --- model -------------------------------------------------------------------------
    model_path: Path = Field(
        SAGEMAKER_MODEL_DIR,
        description="A .gguf file, or a directory holding exactly one .gguf "
        "(or the one named by model_file). SageMaker mounts the model at /opt/ml/model.",
    )
    model_file: str | None = Field(
        None, description="File name of the GGUF inside model_path, when it holds several."
    )
    model_sha256: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="If set, the GGUF must hash to this value or start-up fails.",
    )
    model_alias: str | None = Field(
        None,
        description="Name in the served model id (<name>@<sha256[:12]>+<quant>); "
        "defaults to the GGUF file name without its quantization suffix.",
    )
    chat_template_fallback: Literal["chatml", "plain"] = Field(
        "chatml",
        description="Template used when the GGUF carries none (base models): ChatML text, "
        "or a plain 'System:/User:/Assistant:' layout.",
    )
    marker_tokens: tuple[str, ...] = Field(
        (),
        description="Token texts that caller text must never produce, on top of the vocabulary's control "
        "tokens and the user-defined tokens the chat template prints, as a JSON list, e.g. "
        '["<start_of_image>", "<end_of_image>"]. Each must be one token of the model; caller text '
        "holding one is tokenized as plain text.",
    )

    # --- llama.cpp context ---------------------------------------------------------------
    n_ctx: PositiveInt = Field(8192, description="Context size in tokens (KV cells, all sequences).")
    n_batch: PositiveInt = Field(
        2048,
        description="Logical batch: most tokens per llama_decode call (at most n_ctx, as llama.cpp has it).",
    )
    n_ubatch: PositiveInt | None = Field(
        None,
        description=f"Physical micro-batch size; default 512, or {MAX_INVARIANT_UBATCH} (its maximum) with "
        "batch_invariant.",
    )
    n_seq_max: int = Field(
        32,
        ge=2,
        le=256,
        description="Sequences in the context, shared by all running requests: the prompt head, one per "
        "state being prefilled, one per question branch, one per chat (and the invariance pad).",
    )
    n_threads: PositiveInt | None = Field(
        None, description="CPU threads; default: the physical cores this process may use (as llama.cpp)."
    )
    n_gpu_layers: int = Field(0, ge=-1, description="Layers offloaded to the GPU; -1 or 999 = all.")
    batch_invariant: bool = Field(
        False,
        description="Opt-in, CPU only: kernels whose results do not depend on what else shares a batch, so a "
        "question's answer is bitwise the same alone, among other questions or beside other requests, at "
        "any thread count. Micro-batches of 2-63 tokens, tiled K-quant matmul at every row count, no weight "
        "repacking, memory epochs (decider.invariance). Costs throughput (docs/engine.md); refused "
        "with GPU layers (CUDA picks kernels by batch size) and on recurrent/hybrid models such as Qwen3.5.",
    )
    epoch_cells: PositiveInt | None = Field(
        None,
        description="With batch_invariant: once decisions hold this many cells (in use, or released and "
        "not yet freed), nothing new starts until the running decisions end their memory epoch. CPU "
        "attention scans every cell up to the highest one in use, so a smaller span is faster under "
        "concurrency (8 clients: 0.93x the 1-client throughput at 4096 against 0.84x unbounded). "
        "Default: half of n_ctx.",
    )
    state_cache_cells: int | None = Field(
        None,
        ge=0,
        description="Cells that decision states and chat turns kept across requests may hold, together "
        "(decider.engine.memory.prefix_cache): a request whose prompt starts with a kept state, or a chat "
        "whose prompt starts with an earlier turn of its conversation, copies it and decodes only what "
        "follows. Kept entries are evicted, least recently used first, whenever running work needs their "
        "cells or sequences, so they never make a request wait. 0 turns it off; it is off with "
        "batch_invariant (memory epochs). Default: a quarter of n_ctx.",
    )
    state_cache_seqs: int = Field(
        8,
        ge=0,
        le=256,
        description="Sequences kept decision states and chat turns may hold (see state_cache_cells); 0: off.",
    )
    state_cache_host_mib: int | None = Field(
        None,
        ge=0,
        le=1_048_576,
        description="Host memory (MiB) for kept states and chat turns evicted from the context "
        "(llama-server's --cache-ram): an entry evicted for running work or the budget is first saved "
        "(llama_state_seq_get_data), and a later request it serves restores it (llama_state_seq_set_data, "
        "under a millisecond against seconds of prefill) instead of decoding it again. Least recently used "
        "entries go beyond the budget; an entry larger than it is not saved. 0 turns it off; it is off "
        "whenever state_cache_cells or state_cache_seqs is (and so with batch_invariant). Default (unset): "
        "half of the memory left once the model is loaded: the memory limit (the container's cgroup, else "
        "the machine's) less the engine's own memory (KV cache, recurrent states, buffers), the whole model "
        "file and a 1 GiB reserve, at most 8192 (llama-server's default); logged at start "
        "(decider.memory_budget). A ~300-token SmolLM2 state takes ~7 MB.",
    )
    cache_partial_hits: bool = Field(
        True,
        description="Whether a kept state or chat turn may serve a prompt that shares only its beginning "
        "(at least 16 tokens; attention-only models): a growing transcript decodes only what was added. "
        "false: exact hits only. A partial hit tells its caller, through cached_tokens and latency, how "
        "many leading tokens its prompt shares with a prompt another request of the same cache space "
        "sent: see docs/security.md, 'Callers and the caches'.",
    )
    repeat_cache_entries: int = Field(
        4096,
        ge=0,
        le=1_000_000,
        description="Prompts whose raw label readouts are kept: the same question on the same state (same "
        "model file, prompt version and tokens) is answered again without a decode, temperature and "
        "permutations applied afterwards. A few KiB each; 0 turns it off.",
    )
    flash_attn: bool = Field(
        True,
        description="Use flash attention where the backend supports it (llama.cpp 'auto'). On CPU it "
        "skips the masked cells of other branches in shared fan-out: ~25 % faster decisions measured.",
    )

    # --- decision readout ----------------------------------------------------------------
    temperature: PositiveFloat = Field(1.0, description="Softmax temperature over the option slots.")
    temperature_noul: PositiveFloat | None = Field(None, description="Overrides temperature for noul.")
    temperature_choice: PositiveFloat | None = Field(None, description="Overrides temperature for choice.")
    temperature_score: PositiveFloat | None = Field(None, description="Overrides temperature for score.")
    decision_mode: Literal["shared", "fresh"] = Field(
        "shared", description="shared: prefill the state once and fan out; fresh: one prefill per question."
    )
    prompt_version: Literal["decider-options-v1", "decider-options-v2"] = Field(
        "decider-options-v1",
        description="Decision prompt layout (reported in every response): v1 = SemIf-style JSON options; "
        "v2 = compact `A. description` lines, about 40 % fewer tokens per question.",
    )
    max_permutations: int = Field(8, ge=1, le=32, description="Largest `permutations` a request may ask for.")

    # --- request limits (each answers a clear 4xx) -----------------------------------------
    max_body_bytes: int = Field(
        SAGEMAKER_MAX_BODY_BYTES, ge=1024, le=SAGEMAKER_MAX_BODY_BYTES, description="413 above this."
    )
    max_questions: int = Field(64, ge=1, le=1024, description="Questions per decision request.")
    max_options: int = Field(
        255, ge=2, le=255, description="Options per choice, levels per score (Jev allows 2-255)."
    )
    max_batch_states: int = Field(64, ge=1, le=1024, description="States per /v1/systemone/batch request.")
    max_state_tokens: PositiveInt = Field(6144, description="Tokens of the state (evidence) alone.")
    max_request_tokens: PositiveInt | None = Field(
        None,
        description="Prompt tokens one decision request may have tokenized and held while it is planned "
        "(each state once, each question once per option order), checked on a byte bound before "
        "tokenizing and counted while tokenizing; 422 request_too_large beyond "
        "(decider.engine.works.request_size). Default: max_batch_states x n_ctx (524288 at the defaults: "
        "every state of the largest batch filling the context), about 19 MB of token ids.",
    )
    max_chat_tokens: PositiveInt = Field(1024, description="Largest chat max_tokens accepted.")
    max_stop_chars: int = Field(
        256,
        ge=1,
        le=4096,
        description="Characters per chat `stop` string (each is searched for after every token).",
    )

    # --- chat response_format bounds (decider.engine.structured.constraints;
    # 422 response_format_too_complex) ---
    max_schema_bytes: int = Field(
        GrammarLimits.schema_bytes,
        ge=256,
        le=SAGEMAKER_MAX_BODY_BYTES,
        description="Bytes of one JSON schema.",
    )
    max_constraint_compile_fuel: int = Field(
        GrammarLimits.compile_fuel,
        ge=1000,
        le=10_000_000,
        description="llguidance lexer fuel to build one schema's lexer (its initial_lexer_fuel): bounds the "
        "compile time; past it, 422 response_format_too_complex.",
    )
    max_constraint_step_fuel: int = Field(
        GrammarLimits.step_fuel,
        ge=1000,
        le=10_000_000,
        description="llguidance lexer fuel per generated token (step_lexer_fuel): bounds the mask work per "
        "token; past it the chat ends with response_format_too_complex.",
    )
    max_constraint_step_items: int = Field(
        GrammarLimits.step_items,
        ge=100,
        le=1_000_000,
        description="Earley items per generated token (llguidance step_max_items): bounds ambiguous schemas.",
    )
    max_constraint_lexer_states: int = Field(
        GrammarLimits.lexer_states,
        ge=100,
        le=1_000_000,
        description="Lexer states one chat's constraint may build (llguidance max_lexer_states; "
        "1-2 kB each).",
    )
    max_constraint_grammar_size: int = Field(
        GrammarLimits.grammar_size,
        ge=1000,
        le=2_000_000,
        description="Symbols in the grammar made from one schema (llguidance max_grammar_size).",
    )

    # --- admission control ---------------------------------------------------------------
    queue_size: int = Field(16, ge=0, le=10_000, description="Requests waiting for the model; 429 beyond.")
    parse_concurrency: int = Field(
        2,
        ge=1,
        le=64,
        description="Request bodies read, parsed and planned at once (on low-priority threads); queue_size "
        "more may wait before their body is read, 429 queue_full beyond (decider.server.intake).",
    )
    deadline_seconds: float = Field(
        55.0, gt=0, le=3600, description="Wait plus work budget per request (SageMaker allows 60 s)."
    )
    shutdown_grace_seconds: float = Field(
        25.0, ge=0, le=600, description="On SIGTERM, time given to in-flight requests."
    )
    chat_share: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Beside a decode of other work that took over 0.2 s (CPU prefill), the generating "
        "chats get decodes of their own for up to this share of its time, so they stream dozens of "
        "tokens per such decode instead of one; the other work takes at most this much longer while "
        "chats generate (decider.engine.scheduling.chat_pace). 0: a chat gets one token per decode.",
    )

    # --- HTTP ------------------------------------------------------------------------------
    # InvokeEndpoint "strips all POST headers except those supported by the API" and is authorized by
    # SigV4/IAM (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_runtime_InvokeEndpoint.html),
    # so an Authorization header never reaches the container there: the key is for other hosts.
    api_key: SecretStr | None = Field(
        None,
        description="When set, every route but /ping requires `Authorization: Bearer <key>` (401 otherwise). "
        "For use outside SageMaker only: SageMaker does not forward Authorization, and its IAM "
        "auth is the gate there, so to_environment() refuses to put a key into an endpoint.",
    )
    host: str = Field("0.0.0.0", description="Bind address.")  # noqa: S104 - container port
    port: int = Field(
        8080,
        ge=1,
        le=65535,
        validation_alias=AliasChoices("SAGEMAKER_BIND_TO_PORT", f"{ENV_PREFIX}PORT", "port"),
        description="Listen port; SageMaker's SAGEMAKER_BIND_TO_PORT wins.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    load_probe: bool = Field(
        True,
        description="Load the model once in a child process first (decider.engine.model.load_probe): a "
        "native crash at load becomes one log line with the signal and the settings, and exit status 3.",
    )
    supervise: bool = Field(
        True,
        description="Run the engine in a child process that the HTTP front restarts when it dies (a "
        "native crash answers the requests it was running 503 engine_restarted instead of ending the "
        "container; decider.server.supervisor). false: one process, as before.",
    )
    cpu_probe_cache: str = Field(
        "/tmp/decider/cpu-variant.json",  # noqa: S108 - the container's own scratch space
        description="Where the CPU-variant probe's verdict is cached (keyed by the CPU's flags, the "
        "llama.cpp libraries and the model), so a restart on the same host skips the probe; empty: no cache.",
    )

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        key = value.get_secret_value()
        if len(key) < MIN_API_KEY_LENGTH:
            raise ValueError(f"the API key must be at least {MIN_API_KEY_LENGTH} characters")
        if not all("!" <= char <= "~" for char in key):
            raise ValueError("the API key must be printable ASCII without spaces (a bearer token)")
        return value

    @field_validator("marker_tokens")
    @classmethod
    def _check_markers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not text for text in value):
            raise ValueError("marker token texts must not be empty")
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> Settings:
        if self.batch_invariant and self.n_gpu_layers != 0:
            raise ValueError("batch_invariant holds for CPU kernels only; with n_gpu_layers leave it off")
        problems = self.batch_policy.problems()
        if problems:
            raise ValueError("; ".join(problems))
        if self.max_state_tokens >= self.n_ctx:
            raise ValueError(
                f"max_state_tokens ({self.max_state_tokens}) must be below n_ctx ({self.n_ctx}), "
                "so that questions still fit after the state"
            )
        return self

    @property
    def request_token_limit(self) -> int:
        """max_request_tokens, resolved."""
        if self.max_request_tokens is not None:
            return self.max_request_tokens
        return self.max_batch_states * self.n_ctx

    @property
    def epoch_limit(self) -> int:
        """epoch_cells, resolved."""
        return self.epoch_cells if self.epoch_cells is not None else self.n_ctx // 2

    @property
    def cache_budget(self) -> CacheBudget:
        """What the engine keeps across requests (state_cache_cells resolved)."""
        cells = self.state_cache_cells if self.state_cache_cells is not None else self.n_ctx // 4
        return CacheBudget(
            cells,
            self.state_cache_seqs,
            self.repeat_cache_entries,
            None if self.state_cache_host_mib is None else self.state_cache_host_mib * 1024 * 1024,
            partial_hits=self.cache_partial_hits,
        )

    @property
    def logical_batch(self) -> int:
        """n_batch, resolved: at most n_ctx, as llama.cpp takes it."""
        return min(self.n_batch, self.n_ctx)

    @property
    def micro_batch(self) -> int:
        """n_ubatch, resolved: the default is at most the logical batch."""
        if self.n_ubatch is not None:
            return self.n_ubatch
        return min(BatchPolicy.default_ubatch(self.batch_invariant), self.logical_batch)

    @property
    def batch_policy(self) -> BatchPolicy:
        """How decodes are cut and what the context reserves for it (the one owner of those rules)."""
        return BatchPolicy(self.batch_invariant, self.logical_batch, self.micro_batch, self.n_seq_max)

    @property
    def grammar_limits(self) -> GrammarLimits:
        """The response_format bounds, as decider.engine.structured.constraints takes them."""
        return GrammarLimits(
            schema_bytes=self.max_schema_bytes,
            compile_fuel=self.max_constraint_compile_fuel,
            step_fuel=self.max_constraint_step_fuel,
            step_items=self.max_constraint_step_items,
            lexer_states=self.max_constraint_lexer_states,
            grammar_size=self.max_constraint_grammar_size,
        )

    def temperature_for(self, question_type: QuestionType) -> float:
        """The readout temperature for one question type (its override, else the global one)."""
        override = getattr(self, f"temperature_{question_type}")
        return float(override if override is not None else self.temperature)

    def threads(self) -> int:
        return self.n_threads or physical_cores() or max(1, os.cpu_count() or 1)

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> Settings:
        """These values over the defaults, validated, with no variable of this process's environment.

        `Settings(...)` and `Settings.model_validate(...)` both read DECIDER_*; the stacks must not, or
        a synth machine's exported DECIDER_N_THREADS would land in the deployed model's environment.
        """
        return _ValuesOnly(**values)

    @classmethod
    def env_name(cls, field: str) -> str:
        """The environment variable that sets `field`, e.g. `DECIDER_N_CTX` for `n_ctx`."""
        if field not in cls.model_fields:
            raise KeyError(f"unknown container setting {field!r}")
        if field == "port":
            return "SAGEMAKER_BIND_TO_PORT"
        return f"{ENV_PREFIX}{field.upper()}"

    def to_environment(self, *, only_set: bool = False) -> dict[str, str]:
        """The environment that reproduces these settings, as SageMaker's `Environment` map.

        Host and port are left out: SageMaker owns them. Unset optional values (None, an empty
        list) are left out too. An API key is refused: it would be stored in clear in the
        endpoint's model definition, and it would lock SageMaker out (InvokeEndpoint forwards
        only `X-Amzn-SageMaker-Custom-Attributes`, never `Authorization`).
        """
        if self.api_key is not None:
            raise ValueError(
                f"{self.env_name('api_key')} is for servers outside SageMaker: SageMaker does not forward "
                "the Authorization header (IAM authorizes InvokeEndpoint), and the key would be stored in "
                "clear in the model's environment"
            )
        fields = self.model_fields_set if only_set else type(self).model_fields.keys()
        env: dict[str, str] = {}
        for name in sorted(fields):
            if name in {"host", "port"}:
                continue
            value = getattr(self, name)
            if value is None or value == ():
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, tuple):
                text = json.dumps(list(value), ensure_ascii=False)
            else:
                text = str(value)
            env[self.env_name(name)] = text
        return env


class _ValuesOnly(Settings):
    """Settings from init values and defaults only (`Settings.from_values`)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


CPU_SYSFS = Path("/sys/devices/system/cpu")


def physical_cores(sysfs: Path = CPU_SYSFS, allowed: set[int] | None = None) -> int | None:
    """Cores this process may run on, each counted once however many hardware threads it has: the
    distinct thread-sibling sets of the allowed CPUs, as llama.cpp counts them for llama-server's
    default ("hyperthreading isn't useful for linear algebra"). None when sysfs does not say."""
    if allowed is None:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    siblings = set()
    for cpu in allowed:
        try:
            siblings.add((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip())
        except OSError:
            return None
    return len(siblings) or None
