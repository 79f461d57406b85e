"""The HTTP layer: SageMaker's hosting contract plus the decision and OpenAI chat routes."""

from decider.server.app import create_app

__all__ = ["create_app"]
