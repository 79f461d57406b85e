"""Builds the CDK app: config → ImageStack, CpuStack, GpuStack, with cdk-nag validation.

`app.py` (the `cdk` CLI entry point) and `decider_stacks.synth.synthesize` (tools and tests) both call
`build_app`, so the CLI and in-process synths produce the same templates.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from aws_cdk import App, Environment, Validations
from cdk_nag import AwsSolutionsChecks

from decider_stacks.config import AppConfig, load_config
from decider_stacks.endpoint_stack import EndpointStack
from decider_stacks.image_stack import ImageStack
from decider_stacks.nag import unvalidated


@dataclass
class DeciderApp:
    app: App
    config: AppConfig
    image: ImageStack
    cpu: EndpointStack
    gpu: EndpointStack


def build_app(app: App | None = None, *, nag: bool = True) -> DeciderApp:
    """Create the three stacks in `app` (default: a fresh App reading the CLI's context).

    The config is validated first; a bad value raises `decider_stacks.config.ConfigError` before any
    construct exists. Stacks are environment-agnostic unless `account`/`region` are configured,
    so synth never needs credentials and never looks anything up.
    """
    app = app or App()
    context: Mapping[str, Any] = app.node.get_all_context()
    config = load_config(context)
    env = (
        Environment(account=config.account, region=config.region) if config.account or config.region else None
    )
    description = "decider: typed decisions and chat from one GGUF on SageMaker"
    with nullcontext() if nag else unvalidated():
        image = ImageStack(
            app,
            "ImageStack",
            config=config,
            endpoint_stacks={"CpuStack": config.cpu, "GpuStack": config.gpu},
            env=env,
            description=f"{description} (shared build)",
        )
        cpu = EndpointStack(
            app,
            "CpuStack",
            config=config,
            variant=config.cpu,
            image_stack=image,
            env=env,
            description=f"{description} (CPU endpoint)",
        )
        gpu = EndpointStack(
            app,
            "GpuStack",
            config=config,
            variant=config.gpu,
            image_stack=image,
            env=env,
            description=f"{description} (GPU endpoint)",
        )
    if nag:  # off only where templates are compared, never validated (the update walk test)
        Validations.of(app).add_plugins(AwsSolutionsChecks(app, verbose=True))
    return DeciderApp(app=app, config=config, image=image, cpu=cpu, gpu=gpu)
