"""Command-line tools that work on the decider stack from outside the container."""
