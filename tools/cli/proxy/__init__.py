"""`decider-proxy`: the container's HTTP API on localhost, forwarded to a SageMaker endpoint as
SigV4-signed InvokeEndpoint calls; and the same as httpx transports for in-process use."""

from decider_cli.proxy.invoker import SageMakerInvoker
from decider_cli.proxy.transport import (
    AsyncSageMakerTransport,
    SageMakerTransport,
    async_sagemaker_http_client,
    sagemaker_http_client,
)

__all__ = [
    "AsyncSageMakerTransport",
    "SageMakerInvoker",
    "SageMakerTransport",
    "async_sagemaker_http_client",
    "sagemaker_http_client",
]
