"""`infra-diff`: synthesize the CDK app offline for two revisions and diff the templates by resource."""
