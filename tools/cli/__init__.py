"""`decider_cli`: the command-line tools users run against the stacks and endpoints from outside the
container (promote, infra-diff, decide-eval, decide-batch, decider-proxy, preflight, capacity-plan)."""
