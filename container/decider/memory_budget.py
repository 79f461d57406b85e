"""Host memory: what the host tier may take by default, and whether a configuration fits an instance.

Two users, one set of numbers:

* the engine, once the model is loaded, sizes the host tier (`DECIDER_STATE_CACHE_HOST_MIB` unset) from
  what is *measured*: the memory limit (the container's cgroup, else the machine's), less the engine's own
  anonymous memory (KV cache, recurrent states, compute and output buffers: all allocated and cleared at
  load), the whole model file (mapped: counted in full, as a CPU decode touches every page), and RESERVE
  (the front process, request bodies, allocator slack). The tier gets HOST_TIER_SHARE of what is left, at
  most HOST_TIER_CAP (llama-server's `--cache-ram` default);
* the CDK stacks, at synth, check that the same parts fit the instance type's memory, from the model's
  declared shape (`Footprint`), and refuse with the numbers when they do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024
GIB = 1024 * MIB
HOST_TIER_SHARE = 0.5
HOST_TIER_CAP = 8 * GIB
RESERVE = 1 * GIB
LOGIT_BYTES = 4  # llama.cpp's output buffer holds f32 logits


@dataclass(frozen=True)
class HostTierSize:
    """The host tier's default and how it was reached (logged at start)."""

    bytes: int
    limit: int
    engine: int
    model: int

    def describe(self) -> str:
        def gib(n: int) -> str:
            return f"{n / GIB:.2f} GiB"

        return (
            f"host tier {gib(self.bytes)} = {HOST_TIER_SHARE:g} x (limit {gib(self.limit)} - engine "
            f"{gib(self.engine)} - model file {gib(self.model)} - reserve {gib(RESERVE)}), at most "
            f"{gib(HOST_TIER_CAP)}"
        )


def host_tier_bytes(limit: int, engine: int, model: int) -> int:
    """HOST_TIER_SHARE of what the limit leaves after the engine, the model file and RESERVE (≥ 0)."""
    left = limit - engine - model - RESERVE
    return max(0, min(HOST_TIER_CAP, int(HOST_TIER_SHARE * left)))


def memory_limit(root: Path = Path("/")) -> int:
    """The memory this process may use: its cgroup's limit (v2, then v1), else the machine's memory."""
    total = _meminfo_kib(root / "proc/meminfo", "MemTotal") * 1024
    for candidate in (root / "sys/fs/cgroup/memory.max", root / "sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = candidate.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:  # "max", or v1's huge "no limit", mean none
            return int(text)
    return total


def engine_anonymous(root: Path = Path("/")) -> int:
    """This process's resident anonymous memory (RssAnon): what it allocated, not the mapped model."""
    return _meminfo_kib(root / "proc/self/status", "RssAnon") * 1024


def size_host_tier(model_bytes: int, root: Path = Path("/")) -> HostTierSize:
    """The host tier's default, measured now (call once the model and its context are loaded)."""
    limit, engine = memory_limit(root), engine_anonymous(root)
    return HostTierSize(host_tier_bytes(limit, engine, model_bytes), limit, engine, model_bytes)


def _meminfo_kib(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0])
    raise ValueError(f"{key} not in {path}")


@dataclass(frozen=True)
class Footprint:
    """A model's memory by its shape, for the synth-time check (Qwen3.5-4B: 8 attention layers x 4 KV heads
    x 256 x K and V in f16 = 32 KiB per token; 24 delta-net layers of 2 MiB state + 96 KiB convolution
    = ~50 MiB per sequence; 248,320 tokens in the vocabulary)."""

    file_bytes: int
    kv_bytes_per_token: int
    recurrent_bytes_per_sequence: int
    n_vocab: int


@dataclass(frozen=True)
class MemoryNeed:
    """What one configuration needs (bytes), and where: `device` is the GPU's when layers are offloaded."""

    model: int
    kv: int
    recurrent: int
    outputs: int  # the logits buffer at its largest: a full batch of outputs (host memory)
    host_tier: int  # explicit, or 0 when sized at start from what is left
    on_gpu: bool

    @property
    def device(self) -> int:
        return self.model + self.kv + self.recurrent

    @property
    def host(self) -> int:
        return (0 if self.on_gpu else self.device) + self.outputs + self.host_tier + RESERVE


def memory_need(
    footprint: Footprint, *, n_ctx: int, n_seq_max: int, n_batch: int, host_tier: int, on_gpu: bool
) -> MemoryNeed:
    return MemoryNeed(
        model=footprint.file_bytes,
        kv=n_ctx * footprint.kv_bytes_per_token,
        recurrent=n_seq_max * footprint.recurrent_bytes_per_sequence,
        outputs=min(n_batch, n_ctx) * footprint.n_vocab * LOGIT_BYTES,
        host_tier=host_tier,
        on_gpu=on_gpu,
    )


def fit_problems(need: MemoryNeed, *, host_memory: int, gpu_memory: int = 0) -> list[str]:
    """Why `need` does not fit the instance (empty when it does), with the numbers."""

    def gib(n: int) -> str:
        return f"{n / GIB:.1f} GiB"

    problems = []
    parts = f"model {gib(need.model)} + KV cache {gib(need.kv)} + recurrent states {gib(need.recurrent)}"
    if need.on_gpu and need.device > gpu_memory:
        problems.append(f"GPU memory: {parts} = {gib(need.device)} > the GPU's {gib(gpu_memory)}")
    if need.host > host_memory:
        host_parts = "" if need.on_gpu else f"{parts} + "
        problems.append(
            f"host memory: {host_parts}logits {gib(need.outputs)} + host tier {gib(need.host_tier)} + "
            f"reserve {gib(RESERVE)} = {gib(need.host)} > the instance's {gib(host_memory)}"
        )
    return problems
