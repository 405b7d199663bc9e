"""Lapsed leases: which leases ran out before their holder finished, and who took the
work back (docs/deployment.md#failure-guarantees)."""
