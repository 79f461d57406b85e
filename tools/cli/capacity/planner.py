"""Latency and capacity estimates per instance type: time = overhead + tokens / throughput.

Every figure has a named source:

- Measured latency: the AWS guide this project answers (`aws-samples/sagemaker-genai-hosting-examples`,
  `03-features/semif-decision-model/README.md`, its measurement table): Qwen3.5-4B Q4_K_M through
  llama.cpp on the 231 public JevBench tasks, one request at a time, network included. CPU
  `ml.c6i.8xlarge` with 32 threads: p50 1.715 s, p95 19.291 s.
  GPU `ml.g6e.xlarge` (L40S), all layers on the GPU: p50 0.352 s, p95 0.599 s.
- Tokens per request. p50: "about 426 input tokens per decision" (the SemIf run on the v1.2.1 board,
  `fstandhartinger/jevbench` `RESULTS-v1.2.md`). p95: 3,999 tokens, the longest public hard item
  (`hard-opus-a-long_policy-01`, `shisa-ai/jevbench-results` `reports/JEVBENCH.md`), an upper bound
  for the p95 request. Mean: 819 tokens, inferred
  from 120 non-hard items at 426 and 111 hard items at "about 1,244 per hard decision".
- vCPUs, GPU compute (dense FP16 Tensor Core TFLOPS) and prices: `stacks/instances.py` (sources there).

The two measured points and their token counts give a throughput and a fixed overhead per platform.
On CPU the fit gives a negative overhead (long prompts cost more per token: attention), so the
overhead is taken as 0 and the throughput from the p95 point alone: the slower, conservative
choice, 6.48 tokens/s per vCPU. Scaling assumptions, stated: CPU time scales with 1/vCPUs at the same
per-vCPU speed (c7i counted as fast as the measured c6i); GPU time scales with 1/TFLOPS.

Requests are modelled as served back to back. The engine batches concurrent requests into shared
decodes, but a compute-bound CPU gains ~1x from that (make bench-server), and the GPU gain is not
measured yet, so an instance is counted at about 60 / mean service time requests a minute;
autoscaling should target a fraction of that.
"""

from __future__ import annotations

from dataclasses import dataclass

from decider_stacks.config import DEFAULT_CONCURRENCY_TARGET, TARGET_UTILISATION
from decider_stacks.instances import GPU_FAMILIES, INSTANCE_TYPES, InstanceSpec, family_of, gpu_model


@dataclass(frozen=True)
class Measurement:
    instance_type: str
    p50_s: float
    p95_s: float
    source: str


@dataclass(frozen=True)
class Workload:
    """Input tokens per request at p50 and p95, and on average."""

    p50_tokens: int = 426
    p95_tokens: int = 3_999
    mean_tokens: int = 819
    source: str = (
        "fstandhartinger/jevbench RESULTS-v1.2.md: ~426 tokens per decision (p50); shisa-ai/jevbench-results "
        "reports/JEVBENCH.md: 3,999 on the longest public hard item (p95, an upper bound); mean 819 "
        "inferred from 120 × 426 and 111 hard × 1,244"
    )


GUIDE = (
    "AWS guide, aws-samples/sagemaker-genai-hosting-examples 03-features/semif-decision-model/README.md "
    "(231 public JevBench tasks, sequential, network included)"
)
CPU_MEASUREMENT = Measurement("ml.c6i.8xlarge", 1.715, 19.291, GUIDE)
GPU_MEASUREMENT = Measurement("ml.g6e.xlarge", 0.352, 0.599, GUIDE)
REFERENCE_WORKLOAD = Workload()
# TARGET_UTILISATION: the autoscaling target as a share of what one instance can serve, and
# DEFAULT_CONCURRENCY_TARGET: the concurrency it means (stacks/config.py: one source of truth).


@dataclass(frozen=True)
class Model:
    """time(tokens) = overhead_s + tokens / (rate × units); units are vCPUs (CPU) or TFLOPS (GPU)."""

    platform: str  # "cpu" | "gpu"
    overhead_s: float
    rate: float  # tokens/s per vCPU, or per dense FP16 TFLOPS
    unit: str
    note: str

    def seconds(self, tokens: float, units: float) -> float:
        return self.overhead_s + tokens / (self.rate * units)


def fit(measurement: Measurement, units: float, workload: Workload, platform: str, unit: str) -> Model:
    """Overhead and throughput through the p50 and p95 points; overhead < 0 → 0 and the p95 rate."""
    dt = measurement.p95_s - measurement.p50_s
    dn = workload.p95_tokens - workload.p50_tokens
    rate = dn / (dt * units)
    overhead = measurement.p50_s - workload.p50_tokens / (rate * units)
    if overhead >= 0:
        note = (
            f"two-point fit on {measurement.instance_type}: {overhead:.3f} s fixed + {rate:.2f} tokens/s "
            f"per {unit}"
        )
        return Model(platform, overhead, rate, unit, note)
    rate = workload.p95_tokens / (measurement.p95_s * units)
    note = (
        f"p95 point of {measurement.instance_type}: {rate:.2f} tokens/s per {unit}, no fixed overhead "
        "(the two-point fit's overhead is negative; this is the slower, conservative rate)"
    )
    return Model(platform, 0.0, rate, unit, note)


def cpu_model() -> Model:
    """Fitted on the measured tasks' token counts (REFERENCE_WORKLOAD), whatever the workload asked."""
    spec = INSTANCE_TYPES[CPU_MEASUREMENT.instance_type]
    return fit(CPU_MEASUREMENT, spec.vcpus, REFERENCE_WORKLOAD, "cpu", "vCPU")


def gpu_model_fit() -> Model:
    tflops = GPU_FAMILIES[family_of(GPU_MEASUREMENT.instance_type)].tensor_tflops
    assert tflops is not None
    return fit(GPU_MEASUREMENT, tflops, REFERENCE_WORKLOAD, "gpu", "TFLOPS")


@dataclass(frozen=True)
class Estimate:
    instance_type: str
    spec: InstanceSpec
    units: float
    p50_s: float
    p95_s: float
    mean_s: float
    deadline_s: float
    headroom: float  # p95 must stay under headroom × deadline

    @property
    def fits(self) -> bool:
        return self.p95_s <= self.headroom * self.deadline_s

    @property
    def requests_per_minute(self) -> float:
        """What one instance completes a minute, one request at a time."""
        return 60.0 / self.mean_s

    @property
    def suggested_target(self) -> int:
        """target_invocations_per_instance: TARGET_UTILISATION of an instance's capacity."""
        return max(1, int(self.requests_per_minute * TARGET_UTILISATION))

    @property
    def suggested_concurrency_target(self) -> float:
        """target_concurrency_per_instance: the requests a back-to-back server holds on average at
        TARGET_UTILISATION with random arrivals, rho / (1 - rho) (M/M/1), whatever its speed. The
        engine's batching (unmeasured on GPU, ~1x on CPU) is not counted."""
        return DEFAULT_CONCURRENCY_TARGET


class UnknownInstanceError(KeyError):
    pass


def estimate(
    instance_type: str,
    *,
    deadline_s: float,
    headroom: float = 0.5,
    workload: Workload = REFERENCE_WORKLOAD,
) -> Estimate:
    """The estimate for one instance type from stacks/instances.py."""
    if instance_type not in INSTANCE_TYPES:
        raise UnknownInstanceError(f"{instance_type} is not in stacks/instances.py")
    spec = INSTANCE_TYPES[instance_type]
    if spec.gpus:
        gpu = gpu_model(instance_type)
        if gpu is None or gpu.tensor_tflops is None:
            raise UnknownInstanceError(f"no GPU compute figure for {instance_type}")
        model, units = gpu_model_fit(), float(gpu.tensor_tflops)  # one GPU serves the model
    else:
        model, units = cpu_model(), float(spec.vcpus)
    return Estimate(
        instance_type,
        spec,
        units,
        model.seconds(workload.p50_tokens, units),
        model.seconds(workload.p95_tokens, units),
        model.seconds(workload.mean_tokens, units),
        deadline_s,
        headroom,
    )


def candidates(platform: str) -> list[str]:
    """Instance types to compare: the xlarge of each single-GPU family, or the c7i sizes up to 16xlarge
    and the measured c6i.8xlarge."""
    if platform == "gpu":
        return [f"ml.{family}.xlarge" for family in ("g4dn", "g5", "g6", "g6e")]
    sizes = ("xlarge", "2xlarge", "4xlarge", "8xlarge", "12xlarge", "16xlarge")
    return [f"ml.c7i.{size}" for size in sizes] + [CPU_MEASUREMENT.instance_type]
