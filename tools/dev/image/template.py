"""What the image test takes from the synthesized CpuStack template: the container environment
and the instance type, so that stacks → settings → container run as one path.

Only the model identity is replaced (the production GGUF is not on this machine): the file name and
its sha256 then name the bundled SmolLM2 model. Everything else is exactly what SageMaker would set.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decider_stacks.instances import instance_spec

MODEL_TYPE = "AWS::SageMaker::Model"
ENDPOINT_CONFIG_TYPE = "AWS::SageMaker::EndpointConfig"
MODEL_FILE_ENV = "DECIDER_MODEL_FILE"
MODEL_SHA256_ENV = "DECIDER_MODEL_SHA256"


class TemplateError(ValueError):
    """The template does not have the shape the image test relies on."""


@dataclass(frozen=True)
class ContainerSpec:
    stack: str
    environment: dict[str, str]  # the template's, model identity replaced
    instance_type: str
    memory_bytes: int
    replaced: dict[str, tuple[str | None, str]]  # name -> (template value, value used)


def _only(template: dict[str, Any], cfn_type: str) -> dict[str, Any]:
    found = [r for r in template.get("Resources", {}).values() if r.get("Type") == cfn_type]
    if len(found) != 1:
        raise TemplateError(f"expected one {cfn_type} in the template, found {len(found)}")
    return found[0].get("Properties", {})


def model_environment(template: dict[str, Any]) -> dict[str, str]:
    """The `Environment` of the one SageMaker model's primary container; every value a string."""
    container = _only(template, MODEL_TYPE).get("PrimaryContainer") or {}
    environment = container.get("Environment")
    if not isinstance(environment, dict) or not environment:
        raise TemplateError(f"the {MODEL_TYPE} has no PrimaryContainer.Environment")
    unresolved = sorted(name for name, value in environment.items() if not isinstance(value, str))
    if unresolved:
        raise TemplateError(f"environment values that are not plain strings (intrinsics?): {unresolved}")
    return dict(environment)


def instance_type(template: dict[str, Any]) -> str:
    """The instance type of the endpoint config's one production variant."""
    variants = _only(template, ENDPOINT_CONFIG_TYPE).get("ProductionVariants") or []
    if len(variants) != 1 or not isinstance(variants[0].get("InstanceType"), str):
        raise TemplateError(f"expected one production variant with an InstanceType, found {variants!r}")
    return variants[0]["InstanceType"]


def container_spec(
    template: dict[str, Any], *, model_file: str, model_sha256: str, stack: str
) -> ContainerSpec:
    """The container's environment and memory limit, with the model identity replaced."""
    environment = model_environment(template)
    replaced = {}
    for name, value in ((MODEL_FILE_ENV, model_file), (MODEL_SHA256_ENV, model_sha256)):
        replaced[name] = (environment.get(name), value)
        environment[name] = value
    kind = instance_type(template)
    return ContainerSpec(
        stack=stack,
        environment=environment,
        instance_type=kind,
        memory_bytes=instance_spec(kind).memory_bytes,
        replaced=replaced,
    )


def synthesize_stack(stack: str = "CpuStack") -> dict[str, Any]:
    """Synthesize the app offline (cdk.json's context, as `npx cdk synth`) and return one template."""
    from decider_stacks.synth import synthesize

    os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")  # jsii's Node banner
    with tempfile.TemporaryDirectory(prefix="decider-image-synth-") as outdir:
        templates = synthesize(Path(outdir))
    if stack not in templates:
        raise TemplateError(f"the app has no stack {stack!r} (stacks: {sorted(templates)})")
    return templates[stack]
