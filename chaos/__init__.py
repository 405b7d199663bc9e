"""The convergence harness: seeded workloads against SIGKILLed and paused
worker processes, then quiescence and a check that the database holds the right answer.

`python -m chaos --seed N --seconds S` runs it; `tests/chaos` runs a bounded one in CI.
"""
