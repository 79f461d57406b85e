"""decide-eval: quality, calibration and latency of a decision endpoint (see cli.py)."""
