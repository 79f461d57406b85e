"""Alarms and the CloudWatch dashboard of one endpoint variant.

The alarms' dimensions use the (stable, configured) endpoint name rather than a reference to the
endpoint resource: the endpoint's DeploymentConfig references the alarms, so a reference back
would be a cycle.
"""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cw
from constructs import Construct

from stacks.config import VariantConfig

VARIANT_NAME = "AllTraffic"
ONE_MINUTE = Duration.minutes(1)


def _metric(
    namespace: str, name: str, variant: VariantConfig, statistic: str, label: str | None
) -> cw.Metric:
    # No label on alarm metrics: a labelled metric turns the alarm into a metric-math alarm.
    return cw.Metric(
        namespace=namespace,
        metric_name=name,
        dimensions_map={"EndpointName": variant.endpoint_name, "VariantName": VARIANT_NAME},
        statistic=statistic,
        period=ONE_MINUTE,
        label=label,
    )


def invocation_metric(
    name: str, variant: VariantConfig, statistic: str = "Sum", label: str | None = None
) -> cw.Metric:
    """A per-variant metric of the AWS/SageMaker namespace (invocations, errors, latency)."""
    return _metric("AWS/SageMaker", name, variant, statistic, label)


def instance_metric(name: str, variant: VariantConfig, statistic: str = "Average") -> cw.Metric:
    """A per-variant instance metric (CPU, memory, disk, GPU utilisation)."""
    return _metric("/aws/sagemaker/Endpoints", name, variant, statistic, None)


class EndpointAlarms(Construct):
    """5xx errors and model latency roll a deployment back; memory pressure is reported only."""

    def __init__(self, scope: Construct, construct_id: str, *, variant: VariantConfig) -> None:
        super().__init__(scope, construct_id)
        thresholds = variant.alarms
        self.errors_5xx = cw.Alarm(
            self,
            "Errors5xx",
            alarm_description=f"{variant.endpoint_name}: {thresholds.error_5xx_count}+ 5xx responses "
            "a minute "
            "in 2 of 3 minutes. Rolls back a deployment in progress.",
            metric=invocation_metric("Invocation5XXErrors", variant),
            threshold=thresholds.error_5xx_count,
            comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            evaluation_periods=3,
            datapoints_to_alarm=2,
            treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
        )
        self.latency = cw.Alarm(
            self,
            "ModelLatencyP90",
            alarm_description=f"{variant.endpoint_name}: model latency p90 above "
            f"{thresholds.latency_p90_ms} ms "
            "in 2 of 3 minutes. Rolls back a deployment in progress.",
            # ModelLatency is reported in microseconds.
            metric=invocation_metric("ModelLatency", variant, "p90"),
            threshold=thresholds.latency_p90_ms * 1000,
            comparison_operator=cw.ComparisonOperator.GREATER_THAN_THRESHOLD,
            evaluation_periods=3,
            datapoints_to_alarm=2,
            treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
        )
        self.memory = cw.Alarm(
            self,
            "MemoryHigh",
            alarm_description=f"{variant.endpoint_name}: instance memory above 90 % for 5 minutes.",
            metric=instance_metric("MemoryUtilization", variant, "Maximum"),
            threshold=90,
            comparison_operator=cw.ComparisonOperator.GREATER_THAN_THRESHOLD,
            evaluation_periods=5,
            treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
        )

    @property
    def rollback_alarms(self) -> list[cw.Alarm]:
        return [self.errors_5xx, self.latency]


class EndpointDashboard(Construct):
    """Traffic, errors, latency and instance utilisation of one endpoint on one page."""

    def __init__(
        self, scope: Construct, construct_id: str, *, variant: VariantConfig, alarms: EndpointAlarms
    ) -> None:
        super().__init__(scope, construct_id)
        utilisation = [
            instance_metric(m, variant) for m in ("CPUUtilization", "MemoryUtilization", "DiskUtilization")
        ]
        if variant.is_gpu:
            utilisation += [instance_metric(m, variant) for m in ("GPUUtilization", "GPUMemoryUtilization")]
        self.dashboard = cw.Dashboard(self, "Dashboard", default_interval=Duration.hours(3))
        self.dashboard.add_widgets(
            cw.GraphWidget(
                title="Invocations per minute",
                left=[invocation_metric("Invocations", variant)],
                right=[invocation_metric("InvocationsPerInstance", variant)],
                width=12,
            ),
            cw.GraphWidget(
                title="Errors per minute",
                left=[
                    invocation_metric("Invocation4XXErrors", variant),
                    invocation_metric("Invocation5XXErrors", variant),
                    invocation_metric("InvocationModelErrors", variant),
                ],
                width=12,
            ),
        )
        self.dashboard.add_widgets(
            cw.GraphWidget(
                title="Model latency (microseconds)",
                left=[
                    invocation_metric("ModelLatency", variant, stat, f"ModelLatency {stat}")
                    for stat in ("p50", "p90", "p99")
                ],
                right=[invocation_metric("OverheadLatency", variant, "p90", "OverheadLatency p90")],
                width=12,
            ),
            cw.GraphWidget(title="Instance utilisation (%)", left=utilisation, width=12),
        )
        self.dashboard.add_widgets(
            cw.AlarmStatusWidget(
                title="Alarms",
                alarms=[alarms.errors_5xx, alarms.latency, alarms.memory],
                width=24,
            )
        )
