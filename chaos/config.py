"""Shortened clocks for the harness: leases of seconds, retries of seconds, so lost
claims, expiries and retries all happen inside a short run. Everything else is the
product's own code and SQL."""

from __future__ import annotations

from inventory_pipeline.profiles.models import RefreshPolicy
from inventory_pipeline.recovery.policy import RetryPolicy

LEASE_SECONDS = 3

PROFILE_POLICY = RefreshPolicy(
    lease_seconds=LEASE_SECONDS,
    retry_seconds=1,
    circuit_probe_seconds=2,
    native_max_age_seconds=10**7,  # native refreshes would only add noise
    run_claims=10,
)

RETRY_POLICY = RetryPolicy(
    transient_base_seconds=1,
    slow_base_seconds=2,
    cap_seconds=6,
    floor_seconds=1,
    refresh_seconds=30 * 86400,  # a success is not re-observed during the run
)

# seed 001 D08's one budget source, shortened; the lease still covers both budgets and
# attempts are plentiful so that kills alone never exhaust a job.
STATS_SETTINGS = {
    "claim_budget_ms": 2000,
    "compute_budget_ms": 1500,
    "publish_budget_ms": 1500,
    "lease_seconds": LEASE_SECONDS,
    "active_lease_cap": 3,
    "max_attempts": 1000,
    "retry_backoff_seconds": 1,
}

API_KEY = "chaos-key-0b1d2c3e4f"
WRONG_KEY = "chaos-wrong-key-9a8b7c"
