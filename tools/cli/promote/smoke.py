"""Smoke tests through `sagemaker-runtime` (one decision, one chat call).

The requests and their checks live with the post-deploy check of the stacks
(`stacks/handlers/smoke.py`), so `promote smoke` and a `cdk deploy` test an endpoint the same way.
"""

from decider_stacks.handlers.smoke import CHAT_REQUEST, DECISION_REQUEST, SmokeResult, run_smoke

__all__ = ["CHAT_REQUEST", "DECISION_REQUEST", "SmokeResult", "run_smoke"]
