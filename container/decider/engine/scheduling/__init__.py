"""Who runs when: admission by estimated cost (admission, cost), the one engine thread (scheduler,
loop), each decode step being assembled with its start rules (steps), and a request's job."""
