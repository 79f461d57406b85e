"""A SageMaker API call whose JSON body is sent as given: signed with SigV4, without botocore's model.

The Lambda runtime's bundled botocore validates parameters against its own (older) service model and
refuses fields it does not know (ProductionVariant PrefixAwareRoutingConfig, MetricsConfig, …). The
post-deploy check copies the previous endpoint config exactly as CloudFormation created it, so it
sends that body as SageMaker's JSON 1.1 protocol expects (`X-Amz-Target: SageMaker.<Operation>`),
whatever the runtime's botocore knows.
"""

from __future__ import annotations

import json
from typing import Any

import boto3
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.exceptions import ClientError
from botocore.httpsession import URLLib3Session


class SageMakerJson:
    """`call(operation, body)`: one request to the regional SageMaker API; ClientError on an error."""

    def __init__(self, session: Any | None = None) -> None:
        self.session = session or boto3.session.Session()
        # The regional endpoint as botocore resolves it (partition and FIPS settings included).
        self.url = self.session.client("sagemaker").meta.endpoint_url
        self.http = URLLib3Session()

    def call(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
        region = self.session.region_name
        request = AWSRequest(
            method="POST",
            url=self.url.rstrip("/") + "/",
            data=json.dumps(body).encode(),
            headers={
                "Content-Type": "application/x-amz-json-1.1",
                "X-Amz-Target": f"SageMaker.{operation}",
            },
        )
        credentials = self.session.get_credentials().get_frozen_credentials()
        SigV4Auth(credentials, "sagemaker", region).add_auth(request)
        response = self.http.send(request.prepare())
        payload = json.loads(response.content or b"{}")
        if response.status_code >= 300:
            code = str(payload.get("__type", "UnknownError")).rsplit("#", 1)[-1]
            message = payload.get("message") or payload.get("Message") or ""
            raise ClientError({"Error": {"Code": code, "Message": message}}, operation)
        return payload
