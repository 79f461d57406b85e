"""Who runs when: admission by estimated cost (admission, cost), the one engine thread (scheduler,
loop), each decode step being assembled with its start rules (steps), a request's job, the memory
epochs of batch-invariant mode (epochs), and the `Work` protocol the loop drives (work)."""
