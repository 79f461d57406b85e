"""The game day: scenarios the AWS documentation leaves open, run in a scratch account (never in tests)."""
