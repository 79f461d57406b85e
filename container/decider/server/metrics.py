"""Prometheus metrics of one server instance (own registry, so several apps can coexist in tests)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# Paths that get their own label value; anything else is "other" so that scanners and fuzzers
# cannot blow up the label cardinality.
KNOWN_ROUTES = frozenset(
    {
        "/ping",
        "/invocations",
        "/v1/systemone",
        "/v1/systemone/batch",
        "/v1/decisions",
        "/v1/chat/completions",
        "/v1/models",
        "/metrics",
    }
)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 45, 60, 120)


def route_label(path: str) -> str:
    return path if path in KNOWN_ROUTES else "other"


class ServerMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # the *_created series only add noise to scrapes
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "decider_http_requests", "HTTP requests by route and status.", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "decider_http_request_duration_seconds",
            "Time from request start to the end of the response body.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.invocation_targets = Counter(
            "decider_invocations",
            "/invocations requests by the route they were dispatched to.",
            ["target"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "decider_queue_depth", "Admitted requests waiting for the model.", registry=r
        )
        self.engine_busy = Gauge(
            "decider_engine_busy", "Requests the model has started and not finished.", registry=r
        )
        self.queue_wait = Histogram(
            "decider_queue_wait_seconds",
            "Time admitted requests waited for the model.",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_seconds = Histogram(
            "decider_engine_duration_seconds",
            "Time the model spent on one request.",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rejections = Counter(
            "decider_admission_rejections",
            "Requests refused by admission control, by code.",
            ["code"],
            registry=r,
        )
        self.tokens = Counter(
            "decider_tokens",
            "Tokens processed, by kind (decision_input, prompt, completion).",
            ["kind"],
            registry=r,
        )
        self.decodes = Counter(
            "decider_engine_decodes", "llama_decode calls (each may carry rows of many requests).", registry=r
        )
        self.decode_rows = Histogram(
            "decider_engine_decode_rows",
            "Rows (sequences appended to) per llama_decode.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.decode_tokens = Histogram(
            "decider_engine_decode_tokens",
            "Tokens per llama_decode.",
            buckets=(1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096),
            registry=r,
        )
        # What the engine keeps across requests (decider.engine.memory.prefix_cache): cache = state | chat
        # (kept sequences: decision states, chat turns) | repeat.
        self.cache_lookups = Counter(
            "decider_cache_lookups",
            "Look-ups of kept states (per decision state started), kept chat turns (per chat started) "
            "and exact repeats (per prompt), by outcome (hit, miss).",
            ["cache", "outcome"],
            registry=r,
        )
        self.cache_stores = Counter(
            "decider_cache_stores", "Entries put into a cache.", ["cache"], registry=r
        )
        self.cache_evictions = Counter(
            "decider_cache_evictions",
            "Entries dropped: least recently used, for running work or the budget (state, chat), replaced "
            "by a conversation's next turn (chat), or over the bound (repeat).",
            ["cache"],
            registry=r,
        )
        self.cache_tokens = Counter(
            "decider_cache_tokens",
            "Prompt tokens read from kept states and chat turns instead of decoded.",
            ["cache"],
            registry=r,
        )
        # The host-memory tier behind the kept sequences (decider.engine.memory.host_cache):
        # cache = state | chat.
        self.cache_host_saves = Counter(
            "decider_cache_host_saves",
            "Kept states and chat turns saved to host memory as they were evicted from the context.",
            ["cache"],
            registry=r,
        )
        self.cache_host_restores = Counter(
            "decider_cache_host_restores",
            "Entries put back from host memory into the context for a request they serve, by outcome "
            "(hit; failed: llama.cpp could not place it, the request decoded the prefix instead).",
            ["cache", "outcome"],
            registry=r,
        )
        self.cache_host_evictions = Counter(
            "decider_cache_host_evictions",
            "Entries dropped from host memory: least recently used beyond its budget, or a chat turn "
            "replaced by its conversation's next turn.",
            ["cache"],
            registry=r,
        )
        self.cache_host_bytes = Gauge(
            "decider_cache_host_bytes",
            "Bytes of host memory the saved entries hold (DECIDER_STATE_CACHE_HOST_MIB bounds it).",
            registry=r,
        )
        self.cache_host_budget_bytes = Gauge(
            "decider_cache_host_budget_bytes",
            "The host tier's budget: DECIDER_STATE_CACHE_HOST_MIB, or sized at start from the memory left "
            "once the model was loaded (decider.memory_budget); 0 when there is no host tier.",
            registry=r,
        )
        self.model_ready = Gauge(
            "decider_model_ready", "1 once the model is loaded and verified.", registry=r
        )

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
