"""`capacity-plan`: p50/p95 latency, capacity and cost per instance type for the default model."""
