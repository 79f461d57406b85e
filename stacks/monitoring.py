"""Alarms, their SNS topic, and the CloudWatch dashboard of one endpoint variant.

Three alarms roll a deployment back: the 5xx *rate* (metric math over Invocations, so a background
error rate on a busy endpoint does not roll back every deploy, and a single error in a quiet minute
does not either), the model latency p90, and the model-failure rate (InvocationModelErrors that are
not 4xx answers: the container's 5xx, socket errors, timeouts). The others notify only: the 4xx
rate, the model error rate (InvocationModelErrors: any non-2xx answer, socket error or timeout),
ModelSetupTime, memory and disk. SageMaker documents ModelSetupTime for serverless endpoints; on
these instance-backed ones it may never be reported, and that alarm then stays OK (missing data is
not breaching).
Every alarm sends ALARM and OK to the stack's SNS topic.

The alarms' dimensions use the (stable, configured) endpoint name rather than a reference to the
endpoint resource: the endpoint's DeploymentConfig references the alarms, so a reference back
would be a cycle.
"""

from __future__ import annotations

from aws_cdk import Annotations, Aws, Duration, RemovalPolicy
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from constructs import Construct

from decider_stacks.config import VariantConfig

VARIANT_NAME = "AllTraffic"
ONE_MINUTE = Duration.minutes(1)
ERROR_KINDS = {
    "Invocation5XXErrors": "server",
    "Invocation4XXErrors": "client",
    "InvocationModelErrors": "model",
}


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


def error_rate(errors_metric: str, variant: VariantConfig, label: str) -> cw.MathExpression:
    """100 × errors / invocations per minute; 0 in minutes with fewer than `error_rate_min_invocations`
    requests (a quiet minute's single error is not a rate)."""
    floor = variant.alarms.error_rate_min_invocations
    # Metric ids must be unique within one graph, which shows several rates.
    kind = ERROR_KINDS[errors_metric]
    errors, invocations = f"{kind}_errors", f"{kind}_invocations"
    return cw.MathExpression(
        expression=f"IF({invocations} >= {floor}, 100 * {errors} / {invocations}, 0)",
        using_metrics={
            errors: invocation_metric(errors_metric, variant),
            invocations: invocation_metric("Invocations", variant),
        },
        period=ONE_MINUTE,
        label=label,
    )


class AlarmTopic(Construct):
    """The SNS topic every alarm of the endpoint notifies: encrypted, TLS only, CloudWatch may publish."""

    def __init__(self, scope: Construct, construct_id: str, *, variant: VariantConfig) -> None:
        super().__init__(scope, construct_id)
        # CloudWatch cannot publish to a topic encrypted with the AWS-managed SNS key: a customer key
        # whose policy lets CloudWatch use it (Amazon SNS Developer Guide, encryption at rest with
        # CloudWatch alarms as the event source).
        self.key = kms.Key(
            self,
            "Key",
            description=f"Encrypts the alarm notifications of the {variant.endpoint_name} endpoint",
            enable_key_rotation=True,
            removal_policy=RemovalPolicy.DESTROY,
            pending_window=Duration.days(7),
        )
        self.key.add_to_resource_policy(
            iam.PolicyStatement(
                sid="CloudWatchAlarmsPublish",
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["kms:Decrypt", "kms:GenerateDataKey*"],
                resources=["*"],  # in a key policy, "*" is this key
                conditions={"StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID}},
            )
        )
        self.topic = sns.Topic(
            self,
            "Topic",
            display_name=f"{variant.endpoint_name} alarms",
            master_key=self.key,
            enforce_ssl=True,
        )
        self.topic.add_to_resource_policy(
            iam.PolicyStatement(
                sid="CloudWatchAlarmsPublish",
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["sns:Publish"],
                resources=[self.topic.topic_arn],
                conditions={"StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID}},
            )
        )
        if variant.alarms.email:
            sns.Subscription(
                self,
                "Email",
                topic=self.topic,
                protocol=sns.SubscriptionProtocol.EMAIL,
                endpoint=variant.alarms.email,
            )
        else:  # printed by `cdk synth` and `cdk deploy` (and kept in the assembly's metadata)
            Annotations.of(self).add_warning_v2(
                "decider:alarm-topic-without-subscriber", unsubscribed(variant)
            )


def unsubscribed(variant: VariantConfig) -> str:
    """The warning for an alarm topic nobody reads."""
    return (
        f"the alarms of {variant.endpoint_name} notify an SNS topic without a subscriber: nobody hears of "
        f"an ALARM. Set -c {variant.name}.alarms.email=ops@example.com (and confirm the e-mail), or "
        "subscribe your own endpoint to the stack output AlarmTopicArn"
    )


class EndpointAlarms(Construct):
    """Rate and latency alarms roll a deployment back; the others notify. All notify the topic."""

    def __init__(self, scope: Construct, construct_id: str, *, variant: VariantConfig) -> None:
        super().__init__(scope, construct_id)
        thresholds = variant.alarms
        name = variant.endpoint_name
        self.topic = AlarmTopic(self, "Notify", variant=variant).topic
        self.all_alarms: list[cw.Alarm] = []
        self.error_rate = self._above(
            "ErrorRate5xx",
            f"{name}: more than {thresholds.error_rate_percent:g} % of invocations "
            f"answered 5xx in 2 of 3 minutes (minutes with fewer than "
            f"{thresholds.error_rate_min_invocations} invocations count as 0). Rolls back a deployment "
            "in progress.",
            error_rate("Invocation5XXErrors", variant, "5xx error rate (%)"),
            thresholds.error_rate_percent,
            periods=3,
            datapoints=2,
        )
        self.latency = self._above(
            "ModelLatencyP90",
            f"{name}: model latency p90 above {thresholds.latency_p90_ms} ms "
            "in 2 of 3 minutes. Rolls back a deployment in progress.",
            invocation_metric("ModelLatency", variant, "p90"),
            thresholds.latency_p90_ms * 1000,  # ModelLatency is reported in microseconds
            periods=3,
            datapoints=2,
        )
        self._above(
            "ErrorRate4xx",
            f"{name}: more than {thresholds.client_error_rate_percent:g} % of invocations "
            "answered 4xx in 2 of 3 minutes: callers send requests the endpoint refuses (see the error "
            "codes in the endpoint's logs).",
            error_rate("Invocation4XXErrors", variant, "4xx error rate (%)"),
            thresholds.client_error_rate_percent,
            periods=3,
            datapoints=2,
        )
        self._above(
            "ModelErrorRate",
            f"{name}: more than {thresholds.model_error_rate_percent:g} % of invocations "
            "got no 2xx from the container (any error status, socket error or timeout) in 2 of 3 minutes.",
            error_rate("InvocationModelErrors", variant, "model error rate (%)"),
            thresholds.model_error_rate_percent,
            periods=3,
            datapoints=2,
        )
        # InvocationModelErrors counts every non-2xx answer, 4xx included, and the container answers 4xx
        # to invalid requests: a caller's bad input must not roll a deploy back. The rollback alarm
        # counts the rest (the container's 5xx, socket errors, malformed answers, timeouts).
        floor = thresholds.error_rate_min_invocations
        self.model_failures = self._above(
            "ModelFailureRate",
            f"{name}: more than {thresholds.error_rate_percent:g} % of invocations failed in the model "
            "container other than with a 4xx answer (5xx, socket errors, timeouts) in 2 of 3 minutes. Rolls "
            "back a deployment in progress.",
            cw.MathExpression(
                expression=(
                    f"IF(failure_invocations >= {floor} AND failure_errors > failure_client, "
                    "100 * (failure_errors - failure_client) / failure_invocations, 0)"
                ),
                using_metrics={
                    "failure_errors": invocation_metric("InvocationModelErrors", variant),
                    "failure_client": invocation_metric("Invocation4XXErrors", variant),
                    "failure_invocations": invocation_metric("Invocations", variant),
                },
                period=ONE_MINUTE,
                label="model failure rate (%)",
            ),
            thresholds.error_rate_percent,
            periods=3,
            datapoints=2,
        )
        self._above(
            "ModelSetupTime",
            f"{name}: launching compute and loading the model took longer than "
            f"{thresholds.model_setup_time_s} s.",
            invocation_metric("ModelSetupTime", variant, "Maximum"),
            thresholds.model_setup_time_s * 1_000_000,  # in microseconds
            periods=1,
        )
        self._above(
            "MemoryHigh",
            f"{name}: instance memory above 90 % for 5 minutes.",
            instance_metric("MemoryUtilization", variant, "Maximum"),
            90,
            periods=5,
        )
        self._above(
            "DiskHigh",
            f"{name}: instance disk above {thresholds.disk_percent:g} % for 5 minutes "
            "(the space the container uses on the instance, the model included).",
            instance_metric("DiskUtilization", variant, "Maximum"),
            thresholds.disk_percent,
            periods=5,
        )

    def _above(
        self,
        construct_id: str,
        description: str,
        metric: cw.IMetric,
        threshold: float,
        *,
        periods: int,
        datapoints: int | None = None,
    ) -> cw.Alarm:
        """An alarm on `metric` above `threshold` (missing data is not breaching), sending ALARM and
        OK to the topic."""
        alarm = cw.Alarm(
            self,
            construct_id,
            alarm_description=description,
            metric=metric,
            threshold=threshold,
            comparison_operator=cw.ComparisonOperator.GREATER_THAN_THRESHOLD,
            evaluation_periods=periods,
            datapoints_to_alarm=datapoints,
            treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
        )
        action = cw_actions.SnsAction(self.topic)
        alarm.add_alarm_action(action)
        alarm.add_ok_action(action)
        self.all_alarms.append(alarm)
        return alarm

    @property
    def rollback_alarms(self) -> list[cw.Alarm]:
        """The alarms that roll a deployment back (SageMaker allows up to 10): the 5xx rate, the p90
        latency, and the model-failure rate (model errors that are not 4xx answers)."""
        return [self.error_rate, self.latency, self.model_failures]


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
                right=[
                    error_rate("Invocation5XXErrors", variant, "5xx rate (%)"),
                    error_rate("Invocation4XXErrors", variant, "4xx rate (%)"),
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
        self.dashboard.add_widgets(cw.AlarmStatusWidget(title="Alarms", alarms=alarms.all_alarms, width=24))
