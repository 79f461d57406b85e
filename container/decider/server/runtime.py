"""The server's model state: loading in the background, ready, failed or stopping.

The HTTP server listens at once (SageMaker expects connections within 250 ms) while the model
loads on the engine thread. `/ping` turns 200 only after the load (including the label checks
and the decode of the cached prompt head) has succeeded. A load failure is fatal: it is logged
as one line and the process exits non-zero (see `decider.cli`), so a broken model never reports
healthy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

from decider.engine.scheduling.loop import Backend
from decider.engine.scheduling.scheduler import Scheduler
from decider.errors import EXIT_STARTUP_FAILED, StartupError, UnavailableError, model_loading, shutting_down
from decider.server.intake import Intake
from decider.server.metrics import ServerMetrics
from decider.settings import Settings

log = logging.getLogger("decider.server")

State = Literal["loading", "ready", "failed", "stopping"]


class Engine(Protocol):
    """What the server uses of `decider.engine.DecisionEngine`: planning (any thread) and the
    backend the scheduler decodes on (the engine thread only)."""

    model_info: Any

    @property
    def runtime(self) -> Backend: ...

    @property
    def head_tokens(self) -> list[int]: ...

    def plan_decision(self, request: Any) -> Any: ...

    def plan_batch(self, request: Any) -> Any: ...

    def decision_work(self, plan: Any) -> Any: ...

    def chat_plan(self, messages: list[dict[str, str]], **params: Any) -> Any: ...

    def chat_work(self, plan: Any, emit: Any = None) -> Any: ...


EngineLoader = Callable[[Settings], Engine]


def load_engine(settings: Settings) -> Engine:
    """The production loader: register llama.cpp backends (a GPU one when GPU layers are
    requested), then load and verify the GGUF."""
    from decider.engine import DecisionEngine
    from decider.engine.model.ggml_backends import ensure_backends, loaded_backend_paths, require_gpu
    from decider.engine.model.load_probe import check_load
    from decider.engine.model.modelfile import resolve_model_file, verify_sha256

    model = resolve_model_file(settings)
    verify_sha256(model, settings)  # before a CPU probe parses it (the digest is cached for the load)
    cache = Path(settings.cpu_probe_cache) if settings.cpu_probe_cache else None
    backends = ensure_backends(model, cache=cache)
    log.info("llama.cpp backends: %s", backends.describe())
    require_gpu(backends, settings.n_gpu_layers, setting=settings.env_name("n_gpu_layers"))
    if settings.load_probe:
        check_load(model, settings, loaded_backend_paths(), backends_described=backends.describe())
    return DecisionEngine.load(settings)


def read_vocabulary(engine: Engine) -> None:
    """Read structured output's vocabulary (every token's bytes: decider.engine.structured.constraints)
    while the model loads, before `/ping` turns 200. It is read once per loaded model: about 0.2 s
    of a core for SmolLM2's 49,152 tokens, over a second for Qwen3.5's 248,320. Read on the first
    chat with a `response_format` instead, it ran on an intake thread, at intake's low priority,
    inside that chat's deadline and not bounded by it: beside two busy loops a 2 s deadline was
    answered after 6.5 s (docs/structured-output.md)."""
    from decider.engine.model.native import LlamaRuntime
    from decider.engine.structured import constraints

    runtime = engine.runtime
    if not isinstance(runtime, LlamaRuntime):  # test doubles have no vocabulary
        return
    started = time.monotonic()
    constraints.vocabulary(runtime)
    seconds = time.monotonic() - started
    log.info("structured output's vocabulary read: %d tokens in %.2f s", runtime.n_vocab, seconds)


def _cache_namespace(engine: Engine) -> str:
    """What repeats are keyed under: the model file's digest and the prompt version."""
    engine_namespace = getattr(engine, "cache_namespace", None)  # DecisionEngine's; test fakes have none
    return engine_namespace if isinstance(engine_namespace, str) else ""


def describe_failure(exc: BaseException) -> str:
    """One line for the start-up failure log."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, StartupError | FileNotFoundError | PermissionError | ValueError):
        return text
    return f"{type(exc).__name__}: {text}"


class ServerRuntime:
    def __init__(self, settings: Settings, *, loader: EngineLoader = load_engine) -> None:
        self.settings = settings
        self.metrics = ServerMetrics()
        self.scheduler = Scheduler(
            queue_size=settings.queue_size,
            deadline_seconds=settings.deadline_seconds,
            metrics=self.metrics,
            epoch_cells=settings.epoch_limit,
            cache_budget=settings.cache_budget,
            chat_share=settings.chat_share,
        )
        self.intake = Intake(settings.parse_concurrency, max_waiting=settings.queue_size)
        self._loader = loader
        self.state: State = "loading"
        self.engine: Engine | None = None
        self.failure: str | None = None
        self.exit_code = EXIT_STARTUP_FAILED  # serve's status when the start fails (StartupError.exit_code)
        self.loaded_at: float | None = None

    def start_loading(self, on_fatal: Callable[[str], None]) -> asyncio.Future[None]:
        """Load the model on the engine thread; on failure call `on_fatal(one_line)` on the loop."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()

        def load() -> None:
            try:
                engine = self._loader(self.settings)
                if self.state != "stopping":
                    read_vocabulary(engine)
                    self.scheduler.attach(
                        engine.runtime,
                        engine.head_tokens,
                        namespace=_cache_namespace(engine),
                        budget=getattr(engine, "cache_budget", None),  # the host tier sized now
                    )  # decodes the prompt head
            except BaseException as exc:  # everything here is fatal: report it as one line
                self.state = "failed"
                self.failure = describe_failure(exc)
                self.exit_code = getattr(exc, "exit_code", EXIT_STARTUP_FAILED)
                log.debug("model load failed", exc_info=True)
                loop.call_soon_threadsafe(on_fatal, self.failure)
                return
            if self.state == "stopping":
                return
            self.engine = engine
            self.loaded_at = time.time()
            self.state = "ready"
            self.metrics.model_ready.set(1)
            log.info("model ready: %s (loaded in %.1f s)", engine.model_info.id, time.monotonic() - started)

        return asyncio.wrap_future(self.scheduler.submit_unscheduled(load))

    async def watch_engine(self, on_fatal: Callable[[str], None], interval: float = 0.2) -> None:
        """Until the server stops: if the engine thread dies, turn unhealthy (`/ping` 503: it
        already is, from `ready`) and call `on_fatal(one_line)` once, so the process exits non-zero
        and SageMaker replaces the instance instead of sending it traffic that can only time out."""
        while self.state != "stopping":
            failure = self.scheduler.failure
            if failure is not None and self.state != "failed":
                self.state = "failed"
                self.failure = f"the engine thread died: {failure}"
                self.metrics.model_ready.set(0)
                on_fatal(self.failure)
                return
            await asyncio.sleep(interval)

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.engine is not None and self.scheduler.engine_alive

    def require_engine(self) -> Engine:
        if self.ready:
            assert self.engine is not None
            return self.engine
        if self.state == "stopping":
            raise shutting_down()
        if self.state == "failed" and self.engine is None:
            raise UnavailableError(
                f"the model failed to load: {self.failure}", code="model_unavailable", retryable=False
            )
        if self.engine is not None:  # ready, but the engine thread is gone: this instance is exiting
            raise UnavailableError(
                f"the engine thread died ({self.scheduler.failure}); the server is exiting, retry",
                code="engine_failed",
                headers={"Retry-After": "1"},
            )
        raise model_loading()

    def served_model_id(self) -> str:
        return self.require_engine().model_info.id

    def stop(self) -> None:
        self.state = "stopping"
        self.metrics.model_ready.set(0)
        self.scheduler.close()
        self.intake.close()
