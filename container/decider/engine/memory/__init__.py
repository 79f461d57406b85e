"""The engine's memory across steps: the context's sequences (sequences), kept states and chat turns
(prefix_cache) and their host-memory tier (host_cache). When memory is freed in batch-invariant
mode is the scheduler's call (decider.engine.scheduling.epochs)."""
