"""Every config key, a valid changed value for it, and the update rules a pair of synths must keep.

Used by test_update_rules.py: the app is synthesized once per changed key (CPU and GPU keys share a
synth: their stacks are independent) and each endpoint stack is compared with the baseline the way
CloudFormation will update it (decider_cli.infra_diff: replacements from the resource schemas, propagated
through references).
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from decider_cli.infra_diff.diff import diff_templates, update_refusals
from decider_stacks.config import AppConfig, ConfigError, VariantConfig, load_config
from decider_stacks.synth import cdk_json_context

ECR_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/decider@sha256:" + "b" * 64
# Values for keys whose type alone does not suggest a valid other value (variant-specific where needed).
EXAMPLES: dict[str, list[Any]] = {
    "endpoint_name": ["{name}-b"],
    "replace_endpoint": ["decider-old"],
    "instance_type": ["ml.c7i.12xlarge", "ml.g6.2xlarge"],
    "instance_pools": [["ml.c7i.12xlarge"], ["ml.g6e.xlarge"]],
    "inference_ami_version": ["al2-ami-sagemaker-inference-gpu-3-1"],
    "image_uri": [ECR_IMAGE],
    "model_s3_uri": ["s3://other-models/qwen/"],
    "email": ["ops@example.com"],
    "build_args": [{"PYTHON_IMAGE": "public.ecr.aws/docker/library/python:3.11.14-slim-bookworm"}],
    "container": [{"temperature": 1.25}],
    "repository": ["bartowski/Qwen_Qwen3-4B-GGUF"],
    "revision": ["0" * 40],
    "file": ["Qwen_Qwen3.5-4B-Q5_K_M.gguf"],
    "sha256": ["0" * 64],
    "project": ["decider2"],
    "min_capacity": [3],
    "step_instance_count": [2],
    "account": ["123456789012"],
    "region": ["eu-west-1"],
}
# Keys that only validate together with another (`instance_pools` needs `provision_timeout_s`).
COMPANIONS: dict[str, dict[str, Any]] = {
    "instance_pools": {"provision_timeout_s": 1200},
    "min_capacity": {"initial_instance_count": 3},  # 3: within both variants' max_capacity
    # a step of 2 needs a fleet of at least 4
    "step_instance_count": {"min_capacity": 4, "initial_instance_count": 4, "max_capacity": 4},
}
ROOT_SCALARS = ("project", "account", "region")
ENVIRONMENT_KEYS = frozenset({"account", "region"})


def _leaves(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, FieldInfo]]:
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _leaves(annotation, f"{prefix}{name}.")
        elif name != "name":  # the variant's own name is not a setting
            yield f"{prefix}{name}", info


def config_keys() -> dict[str, list[str]]:
    """`cpu`/`gpu`/`app` → every dotted key (nested objects walked down to their leaves)."""
    variant = [key for key, _ in _leaves(VariantConfig, "")]
    model = [f"model.{key}" for key, _ in _leaves(AppConfig.model_fields["model"].annotation, "")]
    return {
        "cpu": [f"cpu.{key}" for key in variant],
        "gpu": [f"gpu.{key}" for key in variant],
        "app": model + list(ROOT_SCALARS),
    }


def _field(key: str) -> FieldInfo:
    parts = key.split(".")
    model: type[BaseModel] = AppConfig
    if parts[0] in ("cpu", "gpu"):
        model, parts = VariantConfig, parts[1:]
    for part in parts[:-1]:
        model = model.model_fields[part].annotation  # type: ignore[assignment]
    return model.model_fields[parts[-1]]


def _current(config: AppConfig, key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _bounds(info: FieldInfo) -> tuple[float | None, float | None]:
    low = high = None
    for item in info.metadata:
        low = getattr(item, "ge", None) if getattr(item, "ge", None) is not None else low
        low = getattr(item, "gt", None) if low is None and getattr(item, "gt", None) is not None else low
        high = getattr(item, "le", None) if getattr(item, "le", None) is not None else high
    return low, high


def _candidates(key: str, info: FieldInfo, current: Any, variant: str) -> list[Any]:
    leaf = key.rsplit(".", 1)[-1]
    if leaf in EXAMPLES:
        values = [v.format(name=current) if isinstance(v, str) else v for v in EXAMPLES[leaf]]
        return [v for v in values if v != current]
    annotation = info.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is Literal:
        return [v for v in typing.get_args(annotation) if v != current]
    if annotation is bool or isinstance(current, bool):
        return [not current] if current is not None else [True, False]
    low, high = _bounds(info)
    if annotation is int or isinstance(current, int):
        base = current if current is not None else int(low or 1)
        values = [base + 1, base - 1, base * 2, base + 60, base - 60, low, high]
        values += [300, 600, 1200]
        return [
            int(v)
            for v in values
            if v is not None and v != current and (low is None or v >= low) and (high is None or v <= high)
        ]
    if annotation is float or isinstance(current, float):
        base = current if current is not None else 1.0
        values = [base * 1.1, base / 2, low, high]
        return [
            float(v) for v in values if v is not None and v != current and v and (high is None or v <= high)
        ]
    raise AssertionError(f"no change known for {key} ({annotation}); add one to EXAMPLES")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def changed_context(key: str, baseline: AppConfig) -> dict[str, str] | None:
    """`-c` pairs that change `key` (plus what it needs to validate) to a valid other value; None when
    no other value validates on its own (e.g. a GPU-only key on the CPU variant)."""
    variant = key.split(".", 1)[0] if key.split(".", 1)[0] in ("cpu", "gpu") else ""
    for value in _candidates(key, _field(key), _current(baseline, key), variant):
        pairs = {key: _text(value)}
        for companion, companion_value in COMPANIONS.get(key.rsplit(".", 1)[-1], {}).items():
            pairs[f"{variant}.{companion}"] = _text(companion_value)  # the leaf's own variant
        try:
            load_config({**cdk_json_context(), **pairs})
        except ConfigError:
            continue
        return pairs
    return None


def update_violations(
    stack: str, before: dict[str, Any], after: dict[str, Any], *, same_environment: bool = True
) -> list[str]:
    """What CloudFormation would do wrong updating `stack` from `before` to `after` (infra-diff's
    update refusals: an Endpoint changed under the same config, a resource changed beside the same
    wait handle, a changed ServiceToken)."""
    report = diff_templates({stack: before}, {stack: after})
    replaced = {r.logical_id for r in report.resources if r.action == "replace"}
    refusals = update_refusals(stack, before, after, replaced, same_environment=same_environment)
    return [f"{r.code}: {r.message}" for r in refusals]
