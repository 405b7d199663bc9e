"""The operator's runbook for the stats worker: show and change the budgets, pause and
resume claiming, retry an exhausted job, and the status figures. The CLI and the
Dagster control job both call these."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from inventory_pipeline.db import (
    CheckViolation,
    Connection,
    NumericValueOutOfRange,
    transaction,
)
from inventory_pipeline.stats import repository as repo
from inventory_pipeline.stats.models import RetryOutcome, WorkerSettings

# What an operator may change: every setting but the pause (pause and resume do that).
SETTING_NAMES = tuple(f.name for f in fields(WorkerSettings) if f.name != "paused")


# The rule each settings CHECK keeps, as an operator reads it (stats/schema.sql).
SETTING_RULES = {
    "stats_projection_worker_settings_claim_budget_ms_check": (
        "the claim budget must be at least 0.1 s (100 ms): below that a claim can fail every time"
    ),
    "stats_projection_worker_settings_compute_budget_ms_check": (
        "the compute budget must be at least 0.1 s (100 ms): below that a compute step can"
        " fail every time"
    ),
    "stats_projection_worker_settings_publish_budget_ms_check": (
        "the publish budget must be at least 0.1 s (100 ms) and under 8 s, the save's deadline"
    ),
    "stats_projection_worker_settings_lease_seconds_check": "the lease must be above 0",
    "stats_projection_worker_settings_active_lease_cap_check": (
        "the active lease cap must be at least 1"
    ),
    "stats_projection_worker_settings_max_attempts_check": "attempts must be at least 1",
    "stats_projection_worker_settings_retry_backoff_seconds_check": (
        "the backoff must not be negative"
    ),
    "stats_settings_lease_covers_work": (
        "the lease must cover the compute and publish budgets together"
    ),
}


class RunbookError(ValueError):
    """The operator's request cannot be carried out (one line says why)."""


def settings(conn: Connection) -> WorkerSettings:
    return repo.read_settings(conn)


def change_settings(conn: Connection, changes: dict[str, int | None]) -> WorkerSettings:
    """Change budgets, lease, cap, attempts or backoff; the settings table's CHECKs
    decide what is allowed (publish below 8 s, the lease covering compute + publish),
    and a refusal states the rule, not the constraint's name."""
    unknown = set(changes) - set(SETTING_NAMES)
    if unknown:
        raise RunbookError(f"unknown setting {sorted(unknown)[0]}")
    try:
        with transaction(conn):
            return repo.update_settings(conn, dict(changes))
    except CheckViolation as exc:
        rule = SETTING_RULES.get(exc.constraint or "", "a setting breaks the table's rules")
        raise RunbookError(f"settings refused: {rule}") from None
    except NumericValueOutOfRange:
        raise RunbookError("settings refused: a value is too large") from None


def pause(conn: Connection) -> WorkerSettings:
    """No claim starts while paused: work in flight finishes its stage calls, pending
    jobs and resumable runs wait; nothing is dropped."""
    with transaction(conn):
        return repo.update_settings(conn, {"paused": True})


def resume(conn: Connection) -> WorkerSettings:
    with transaction(conn):
        return repo.update_settings(conn, {"paused": False})


def retry(conn: Connection, job_id: int) -> RetryOutcome:
    """Retry an exhausted (failed) job: its range goes through the queue again as a new
    generation. Refused for an unknown job, a job that did not fail, one already
    retried, and one whose range is no longer owed: a later job of its user took it in
    (published, in progress, or failed in turn: then that job is the one to retry), and
    a retry would only make the user stale again."""
    with transaction(conn):
        job = repo.lock_job(conn, job_id)
        if job is None:
            raise RunbookError(f"no stats job {job_id}")
        if job.status != "failed":
            raise RunbookError(f"job {job_id} is {job.status}, not an exhausted failure")
        if job.retried_by is not None:
            raise RunbookError(f"job {job_id} was already retried as job {job.retried_by}")
        if not job.owed:
            taker = (
                f"job {job.taken_in_by} took it in and is {job.taker_status}"
                if job.taken_in_by is not None
                else "a later job of its user took it in"
            )
            raise RunbookError(f"job {job_id}'s range is no longer owed: {taker}")
        return RetryOutcome(job_id, repo.retry_job(conn, job_id))


def status(conn: Connection) -> dict[str, Any]:
    """The status function: queue, active/expired/backing-off leases, exhausted
    failures, owed ranges, stale users, timings and the settings row."""
    return repo.worker_status(conn)
