"""What each SageMaker hosting instance type offers: vCPUs, memory, GPUs, CUDA architecture, storage, price.

One table, read by the config validation (which GPU types the CUDA image can run, where KmsKeyId and
VolumeSizeInGB are allowed), the capacity planner (`capacity-plan`), the preflight (quota names), and
the local image test (which runs the container with the instance's memory limit). This module must
not import aws_cdk.

Sources:
- vCPUs, memory, GPUs and local NVMe storage: the EC2 instance-type specifications of the same name
  (the `ml.` types are those EC2 types). SageMaker does not provision EBS on NVMe types: "When using
  an ML instance with NVMe SSD volumes, SageMaker doesn't provision Amazon EBS ... storage. Available
  storage is fixed to the NVMe-type instance's storage capacity" (SageMaker API reference, ResourceConfig
  VolumeSizeInGB); CreateEndpointConfig rejects VolumeSizeInGB and KmsKeyId there.
- CUDA compute capability per GPU model: NVIDIA's CUDA GPU list (T4 7.5, A100 8.0, A10G 8.6, L4/L40S
  8.9, H100/H200 9.0, B200 10.0, RTX PRO 6000 Blackwell 12.0). Blackwell needs CUDA 12.8 or newer.
- Dense FP16 Tensor Core TFLOPS (no sparsity) per GPU model: NVIDIA's datasheets (T4 65, A100 312,
  A10 125 - AWS publishes no separate figure for its A10G -, L4 121, L40S 362, H100 SXM 989); the
  capacity planner scales prefill time by it.
- Prices: SageMaker real-time inference on-demand USD per hour in us-east-1, from the AWS Price List
  API offer file for AmazonSageMaker as quoted on 2026-09-27 (a public listing of that offer file,
  not re-read here: no AWS access). Other regions cost more or less; check
  `aws pricing get-products --service-code AmazonSageMaker` before you budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PRICE_REGION = "us-east-1"
PRICE_SOURCE = "AWS Price List API, AmazonSageMaker offer, us-east-1, as quoted on 2026-09-27"


@dataclass(frozen=True)
class GpuModel:
    name: str
    memory_gib: float
    cuda_arch: str  # compute capability without the dot: "89" = sm_89
    tensor_tflops: float | None = None  # dense FP16 Tensor Core TFLOPS


@dataclass(frozen=True)
class InstanceSpec:
    vcpus: int
    memory_gib: float
    gpus: int = 0
    gpu_memory_gib: float = 0.0  # per GPU
    cuda_arch: str | None = None  # e.g. "86" for sm_86
    storage: Literal["ebs", "nvme"] = "ebs"
    nvme_gb: int = 0  # local NVMe storage (GB) on NVMe types
    price_per_hour: float | None = None  # USD, SageMaker real-time inference, PRICE_REGION

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 1024**3)


# GPU model per instance family. Families listed here without sizes below (p5e, p5en, g7e, p6-b200)
# are known so that the config can name their GPU when it refuses them.
GPU_FAMILIES: dict[str, GpuModel] = {
    "g4dn": GpuModel("NVIDIA T4", 16, "75", 65),
    "p4d": GpuModel("NVIDIA A100 40GB", 40, "80", 312),
    "p4de": GpuModel("NVIDIA A100 80GB", 80, "80", 312),
    "g5": GpuModel("NVIDIA A10G", 24, "86", 125),
    "g6": GpuModel("NVIDIA L4", 24, "89", 121),
    "g6e": GpuModel("NVIDIA L40S", 48, "89", 362),
    "p5": GpuModel("NVIDIA H100", 80, "90", 989),
    "p5e": GpuModel("NVIDIA H200", 141, "90", 989),
    "p5en": GpuModel("NVIDIA H200", 141, "90", 989),
    "p6-b200": GpuModel("NVIDIA B200", 179, "100"),
    "g7e": GpuModel("NVIDIA RTX PRO 6000 Blackwell", 96, "120"),
}
# Accelerators that are not NVIDIA GPUs: the CUDA image cannot use them, the CPU image should not.
NON_GPU_ACCELERATOR_FAMILIES = frozenset({"inf1", "inf2", "trn1", "trn1n", "trn2"})


def _cpu_family(
    family: str, gib_per_vcpu: int, sizes: dict[str, int], prices: dict[str, float]
) -> dict[str, InstanceSpec]:
    return {
        f"ml.{family}.{size}": InstanceSpec(vcpus, vcpus * gib_per_vcpu, price_per_hour=prices.get(size))
        for size, vcpus in sizes.items()
    }


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
# USD per hour by size, PRICE_SOURCE.
_CPU_PRICES = {
    "c6i": {
        "large": 0.102,
        "xlarge": 0.204,
        "2xlarge": 0.408,
        "4xlarge": 0.816,
        "8xlarge": 1.632,
        "12xlarge": 2.448,
        "16xlarge": 3.264,
        "24xlarge": 4.896,
        "32xlarge": 6.528,
    },
    "c7i": {
        "large": 0.107,
        "xlarge": 0.214,
        "2xlarge": 0.428,
        "4xlarge": 0.857,
        "8xlarge": 1.714,
        "12xlarge": 2.57,
        "16xlarge": 3.427,
        "24xlarge": 5.141,
        "48xlarge": 10.282,
    },
    "m6i": {
        "large": 0.115,
        "xlarge": 0.23,
        "2xlarge": 0.461,
        "4xlarge": 0.922,
        "8xlarge": 1.843,
        "12xlarge": 2.765,
        "16xlarge": 3.686,
        "24xlarge": 5.53,
        "32xlarge": 7.373,
    },
    "m7i": {
        "large": 0.121,
        "xlarge": 0.242,
        "2xlarge": 0.484,
        "4xlarge": 0.968,
        "8xlarge": 1.935,
        "12xlarge": 2.903,
        "16xlarge": 3.871,
        "24xlarge": 5.806,
        "48xlarge": 11.612,
    },
    "r6i": {
        "large": 0.151,
        "xlarge": 0.302,
        "2xlarge": 0.605,
        "4xlarge": 1.21,
        "8xlarge": 2.419,
        "12xlarge": 3.629,
        "16xlarge": 4.838,
        "24xlarge": 7.258,
        "32xlarge": 9.677,
    },
    "r7i": {
        "large": 0.159,
        "xlarge": 0.318,
        "2xlarge": 0.635,
        "4xlarge": 1.27,
        "8xlarge": 2.54,
        "12xlarge": 3.81,
        "16xlarge": 5.08,
        "24xlarge": 7.62,
        "48xlarge": 15.241,
    },
}
# (vCPUs, memory GiB, GPUs, local NVMe GB, USD per hour) per size; the GPU model is the family's.
_GPU_SIZES: dict[str, dict[str, tuple[int, int, int, int, float]]] = {
    "g4dn": {
        "xlarge": (4, 16, 1, 125, 0.7364),
        "2xlarge": (8, 32, 1, 225, 0.94),
        "4xlarge": (16, 64, 1, 225, 1.505),
        "8xlarge": (32, 128, 1, 900, 2.72),
        "12xlarge": (48, 192, 4, 900, 4.89),
        "16xlarge": (64, 256, 1, 900, 5.44),
    },
    "g5": {
        "xlarge": (4, 16, 1, 250, 1.41),
        "2xlarge": (8, 32, 1, 450, 1.52),
        "4xlarge": (16, 64, 1, 600, 2.03),
        "8xlarge": (32, 128, 1, 900, 3.06),
        "12xlarge": (48, 192, 4, 3800, 7.09),
        "16xlarge": (64, 256, 1, 1900, 5.12),
        "24xlarge": (96, 384, 4, 3800, 10.18),
        "48xlarge": (192, 768, 8, 7600, 20.36),
    },
    "g6": {
        "xlarge": (4, 16, 1, 250, 1.127),
        "2xlarge": (8, 32, 1, 450, 1.222),
        "4xlarge": (16, 64, 1, 600, 1.654),
        "8xlarge": (32, 128, 1, 900, 2.518),
        "12xlarge": (48, 192, 4, 3760, 5.752),
        "16xlarge": (64, 256, 1, 1880, 4.246),
        "24xlarge": (96, 384, 4, 3760, 8.344),
        "48xlarge": (192, 768, 8, 7520, 16.688),
    },
    "g6e": {
        "xlarge": (4, 32, 1, 250, 2.61),
        "2xlarge": (8, 64, 1, 450, 2.8),
        "4xlarge": (16, 128, 1, 600, 3.76),
        "8xlarge": (32, 256, 1, 900, 5.66),
        "12xlarge": (48, 384, 4, 3800, 13.12),
        "16xlarge": (64, 512, 1, 1900, 9.47),
        "24xlarge": (96, 768, 4, 3800, 18.83),
        "48xlarge": (192, 1536, 8, 7600, 37.66),
    },
    "p4d": {"24xlarge": (96, 1152, 8, 8000, 25.2513)},
    "p4de": {"24xlarge": (96, 1152, 8, 8000, 31.5641)},
    "p5": {"48xlarge": (192, 2048, 8, 30720, 63.296)},
}

INSTANCE_TYPES: dict[str, InstanceSpec] = {
    **_cpu_family("c6i", 2, {**_INTEL_SIZES, "32xlarge": 128}, _CPU_PRICES["c6i"]),
    **_cpu_family("c7i", 2, {**_INTEL_SIZES, "48xlarge": 192}, _CPU_PRICES["c7i"]),
    **_cpu_family("m6i", 4, {**_INTEL_SIZES, "32xlarge": 128}, _CPU_PRICES["m6i"]),
    **_cpu_family("m7i", 4, {**_INTEL_SIZES, "48xlarge": 192}, _CPU_PRICES["m7i"]),
    **_cpu_family("r6i", 8, {**_INTEL_SIZES, "32xlarge": 128}, _CPU_PRICES["r6i"]),
    **_cpu_family("r7i", 8, {**_INTEL_SIZES, "48xlarge": 192}, _CPU_PRICES["r7i"]),
    **{
        f"ml.{family}.{size}": InstanceSpec(
            vcpus,
            memory,
            gpus,
            GPU_FAMILIES[family].memory_gib,
            GPU_FAMILIES[family].cuda_arch,
            storage="nvme",
            nvme_gb=nvme,
            price_per_hour=price,
        )
        for family, sizes in _GPU_SIZES.items()
        for size, (vcpus, memory, gpus, nvme, price) in sizes.items()
    },
}


def family_of(instance_type: str) -> str:
    """`ml.g6e.xlarge` → `g6e` (no validation; see decider_stacks.config.instance_family)."""
    parts = instance_type.split(".")
    return parts[1] if len(parts) == 3 else instance_type


def instance_spec(instance_type: str) -> InstanceSpec:
    """The spec of a known instance type; a clear KeyError names the known ones otherwise."""
    try:
        return INSTANCE_TYPES[instance_type]
    except KeyError:
        families = sorted({name.split(".")[1] for name in INSTANCE_TYPES})
        raise KeyError(
            f"{instance_type} is not in stacks/instances.py (known families: {', '.join(families)})"
        ) from None


def gpu_model(instance_type: str) -> GpuModel | None:
    """The NVIDIA GPU of a GPU instance type's family, or None (CPU type or unknown family)."""
    return GPU_FAMILIES.get(family_of(instance_type))
