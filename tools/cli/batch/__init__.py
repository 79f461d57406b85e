"""`decide-batch`: decisions in bulk with SageMaker Batch Transform over JSON Lines."""
