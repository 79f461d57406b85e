"""The engine's memory across steps: kept states and chat turns (prefix_cache), their host-memory
tier (host_cache), and the memory epochs of batch-invariant mode (epochs)."""
