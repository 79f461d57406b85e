"""CodeBuild build statuses, shared by the handlers and the stack that matches them in an event rule."""

# Every final status but SUCCEEDED (CodeBuild API Reference, Build.buildStatus).
FAILED_STATES = ("FAILED", "FAULT", "STOPPED", "TIMED_OUT")
