"""`promote`: plan, apply, smoke-test, roll back and prune SageMaker endpoint configs with boto3."""
