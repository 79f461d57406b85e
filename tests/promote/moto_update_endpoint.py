"""What moto 5.2.5 lacks for `promote`, patched in: UpdateEndpoint and its deployment semantics.

moto has no UpdateEndpoint action at all (so no DeploymentConfig, no Updating state, no
PendingDeploymentSummary, no auto-rollback). This module adds a small simulator to moto's
SageMaker backend, in-process, so it also serves `ThreadedMotoServer` (same process):

- UpdateEndpoint validates the endpoint (must be InService, else the ValidationException SageMaker
  gives for an in-progress endpoint) and the config, then marks the endpoint Updating with a
  PendingDeploymentSummary.
- Each DescribeEndpoint while Updating advances the simulation. After `polls_until_done` polls the
  update ends: if any alarm of AutoRollbackConfiguration is in ALARM (read from moto's CloudWatch
  backend), the endpoint stays on the old config with a FailureReason (rolled back); otherwise it
  switches to the new config. `during_update` hooks run on the first Updating poll, so a test can flip
  an alarm to ALARM while the canary bakes.

Everything else (models, configs, tags, alarms, InvokeEndpoint results) is plain moto.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moto.cloudwatch.models import cloudwatch_backends
from moto.core.responses import ActionResult
from moto.sagemaker.exceptions import ValidationError
from moto.sagemaker.models import SageMakerModelBackend
from moto.sagemaker.responses import SageMakerResponse


@dataclass
class _Pending:
    old_config: str
    new_config: str
    deployment_config: dict[str, Any] | None
    polls_left: int
    retain: bool = False
    excluded: frozenset[str] = frozenset()
    hooks_ran: bool = False


@dataclass
class UpdateSimulator:
    polls_until_done: int = 2
    # SageMaker refuses an update to the config the endpoint already runs ("To update an endpoint,
    # you must create a new EndpointConfig"); on for the stacks' rollback scenarios.
    refuse_same_config: bool = False
    during_update: list[Callable[[SageMakerModelBackend, str], None]] = field(default_factory=list)
    update_calls: list[dict[str, Any]] = field(default_factory=list)
    _pending: dict[str, _Pending] = field(default_factory=dict)

    def reset(self) -> None:
        self.polls_until_done = 2
        self.refuse_same_config = False
        self.during_update.clear()
        self.update_calls.clear()
        self._pending.clear()

    def start(
        self,
        backend: SageMakerModelBackend,
        name: str,
        config: str,
        deployment: dict | None,
        retain: bool | None = None,
        exclude: list[dict[str, str]] | None = None,
    ) -> str:
        endpoint = backend.endpoints.get(name)
        if endpoint is None:
            raise ValidationError(message=f"Could not find endpoint '{name}'.")
        if endpoint.endpoint_status != "InService":
            raise ValidationError(message=f'Cannot update in-progress endpoint "{endpoint.arn}".')
        backend.describe_endpoint_config(config)  # ValidationError when missing
        if self.refuse_same_config and endpoint.endpoint_config_name == config:
            raise ValidationError(
                message=f'Endpoint "{endpoint.arn}" already runs endpoint config "{config}".'
            )
        self.update_calls.append(
            {
                "EndpointName": name,
                "EndpointConfigName": config,
                "DeploymentConfig": deployment,
                "RetainAllVariantProperties": retain,
                "ExcludeRetainedVariantProperties": exclude,
            }
        )
        endpoint.endpoint_status = "Updating"
        endpoint.failure_reason = None
        endpoint.pending_deployment_summary = {"EndpointConfigName": config}
        self._pending[name] = _Pending(
            endpoint.endpoint_config_name,
            config,
            deployment,
            self.polls_until_done,
            retain=bool(retain),
            excluded=frozenset(p["VariantPropertyType"] for p in exclude or []),
        )
        return endpoint.arn

    def advance(self, backend: SageMakerModelBackend, name: str) -> None:
        pending = self._pending.get(name)
        endpoint = backend.endpoints.get(name)
        if pending is None or endpoint is None:
            return
        if not pending.hooks_ran:
            pending.hooks_ran = True
            for hook in self.during_update:
                hook(backend, name)
        pending.polls_left -= 1
        if pending.polls_left > 0:
            return
        del self._pending[name]
        endpoint.pending_deployment_summary = None
        endpoint.endpoint_status = "InService"
        firing = self._firing_alarms(backend, pending.deployment_config)
        if firing:
            endpoint.failure_reason = (
                f"Deployment rolled back: CloudWatch alarm(s) {', '.join(firing)} in ALARM during the canary."
            )
            return
        endpoint.endpoint_config_name = pending.new_config
        config = backend.endpoint_configs[pending.new_config]
        old = {v["VariantName"]: v for v in endpoint.production_variants}
        endpoint.production_variants = endpoint._process_production_variants(config.production_variants)
        if pending.retain:  # as UpdateEndpoint's RetainAllVariantProperties: the live values stay
            for variant in endpoint.production_variants:
                before = old.get(variant["VariantName"], {})
                kept = {"DesiredInstanceCount": ("CurrentInstanceCount", "DesiredInstanceCount")}
                kept["DesiredWeight"] = ("CurrentWeight", "DesiredWeight")
                for prop, keys in kept.items():
                    if prop not in pending.excluded:
                        variant.update({k: before[k] for k in keys if k in before})
        if pending.deployment_config:
            endpoint.last_deployment_config = pending.deployment_config

    @staticmethod
    def _firing_alarms(backend: SageMakerModelBackend, deployment: dict | None) -> list[str]:
        names = [
            a["AlarmName"]
            for a in ((deployment or {}).get("AutoRollbackConfiguration") or {}).get("Alarms", [])
        ]
        alarms = cloudwatch_backends[backend.account_id][backend.region_name].alarms
        return [n for n in names if n in alarms and alarms[n].state_value == "ALARM"]


SIMULATOR = UpdateSimulator()


def install() -> None:
    """Add UpdateEndpoint to moto's SageMaker responses and hook DescribeEndpoint (idempotent)."""
    if getattr(SageMakerResponse, "_promote_patched", False):
        return

    def update_endpoint(self: SageMakerResponse) -> ActionResult:
        arn = SIMULATOR.start(
            self.sagemaker_backend,
            self._get_param("EndpointName"),
            self._get_param("EndpointConfigName"),
            self._get_param("DeploymentConfig"),
            self._get_param("RetainAllVariantProperties"),
            self._get_param("ExcludeRetainedVariantProperties"),
        )
        return ActionResult({"EndpointArn": arn})

    original_describe = SageMakerModelBackend.describe_endpoint

    def describe_endpoint(self: SageMakerModelBackend, endpoint_name: str) -> dict[str, Any]:
        SIMULATOR.advance(self, endpoint_name)
        described = original_describe(self, endpoint_name)
        pending = getattr(self.endpoints.get(endpoint_name), "pending_deployment_summary", None)
        if pending and isinstance(described, dict):  # as SageMaker reports an update in progress
            described = {**described, "PendingDeploymentSummary": pending}
        return described

    SageMakerResponse.update_endpoint = update_endpoint  # type: ignore[attr-defined]
    SageMakerModelBackend.describe_endpoint = describe_endpoint  # type: ignore[method-assign]
    SageMakerResponse._promote_patched = True  # type: ignore[attr-defined]
