"""What each SageMaker hosting instance type offers: vCPUs, memory, GPUs and their CUDA architecture.

One table, read by the config validation (which GPU types the CUDA image can run), the capacity
planner, and the local image test (which runs the container with the instance's memory limit).
Figures are the instance families' published specifications (the `ml.` types are the EC2 types of
the same name). This module must not import aws_cdk.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceSpec:
    vcpus: int
    memory_gib: float
    gpus: int = 0
    gpu_memory_gib: float = 0.0  # per GPU
    cuda_arch: str | None = None  # e.g. "86" for sm_86

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 1024**3)


def _cpu_family(family: str, gib_per_vcpu: int, sizes: dict[str, int]) -> dict[str, InstanceSpec]:
    return {f"ml.{family}.{size}": InstanceSpec(vcpus, vcpus * gib_per_vcpu) for size, vcpus in sizes.items()}


_INTEL_SIZES = {
    "large": 2,
    "xlarge": 4,
    "2xlarge": 8,
    "4xlarge": 16,
    "8xlarge": 32,
    "12xlarge": 48,
    "16xlarge": 64,
    "24xlarge": 96,
}
# (vCPUs, memory GiB, GPUs) per size; the GPU model is the family's.
_GPU_SIZES: dict[str, dict[str, tuple[int, int, int]]] = {
    "g5": {
        "xlarge": (4, 16, 1),
        "2xlarge": (8, 32, 1),
        "4xlarge": (16, 64, 1),
        "8xlarge": (32, 128, 1),
        "12xlarge": (48, 192, 4),
        "16xlarge": (64, 256, 1),
        "24xlarge": (96, 384, 4),
        "48xlarge": (192, 768, 8),
    },
    "g6": {
        "xlarge": (4, 16, 1),
        "2xlarge": (8, 32, 1),
        "4xlarge": (16, 64, 1),
        "8xlarge": (32, 128, 1),
        "12xlarge": (48, 192, 4),
        "16xlarge": (64, 256, 1),
        "24xlarge": (96, 384, 4),
        "48xlarge": (192, 768, 8),
    },
    "g6e": {
        "xlarge": (4, 32, 1),
        "2xlarge": (8, 64, 1),
        "4xlarge": (16, 128, 1),
        "8xlarge": (32, 256, 1),
        "12xlarge": (48, 384, 4),
        "16xlarge": (64, 512, 1),
        "24xlarge": (96, 768, 4),
        "48xlarge": (192, 1536, 8),
    },
    "p5": {"48xlarge": (192, 2048, 8)},
}
# GPU model per family: (memory GiB per GPU, CUDA compute capability without the dot).
_GPU_MODELS = {"g5": (24, "86"), "g6": (24, "89"), "g6e": (48, "89"), "p5": (80, "90")}

INSTANCE_TYPES: dict[str, InstanceSpec] = {
    **_cpu_family("c6i", 2, {**_INTEL_SIZES, "32xlarge": 128}),
    **_cpu_family("c7i", 2, {**_INTEL_SIZES, "48xlarge": 192}),
    **_cpu_family("m6i", 4, {**_INTEL_SIZES, "32xlarge": 128}),
    **_cpu_family("m7i", 4, {**_INTEL_SIZES, "48xlarge": 192}),
    **_cpu_family("r6i", 8, {**_INTEL_SIZES, "32xlarge": 128}),
    **_cpu_family("r7i", 8, {**_INTEL_SIZES, "48xlarge": 192}),
    **{
        f"ml.{family}.{size}": InstanceSpec(
            vcpus, memory, gpus, _GPU_MODELS[family][0], _GPU_MODELS[family][1]
        )
        for family, sizes in _GPU_SIZES.items()
        for size, (vcpus, memory, gpus) in sizes.items()
    },
}


def instance_spec(instance_type: str) -> InstanceSpec:
    """The spec of a known instance type; a clear KeyError names the known ones otherwise."""
    try:
        return INSTANCE_TYPES[instance_type]
    except KeyError:
        families = sorted({name.split(".")[1] for name in INSTANCE_TYPES})
        raise KeyError(
            f"{instance_type} is not in stacks/instances.py (known families: {', '.join(families)})"
        ) from None
