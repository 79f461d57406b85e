"""The HTTP layer: SageMaker's hosting contract plus the decision and OpenAI chat routes
(decider.server.app), and the front process that keeps the engine in a child
(decider.server.supervisor). Nothing is imported here: the front must not load the engine."""
