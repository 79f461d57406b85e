"""`preflight`: read-only checks of a new account before the first `cdk deploy`."""
