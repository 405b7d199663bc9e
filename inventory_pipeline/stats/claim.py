"""Claim: the first committed stage of the worker. One transaction records an attempt
and a lease (a fresh token), or resumes a run whose retry time has come under its own
token, within the cap of active leases."""

from __future__ import annotations

from uuid import UUID, uuid4

from inventory_pipeline.db import Connection, DatabaseError, transaction
from inventory_pipeline.stats import repository as repo
from inventory_pipeline.stats.models import (
    STATEMENT_TIMEOUT,
    UNIQUE_VIOLATION,
    StatsClaim,
    WorkerSettings,
)

# Jobs a claim tries before giving up this round: a candidate can turn out to belong to
# a user whose live job committed meanwhile, or to have exhausted its attempts.
CLAIM_TRIES = 5


def claim(
    conn: Connection, lock_owner: str, user_id: UUID | None = None, wait: bool = True
) -> StatsClaim | None:
    """Claim work, oldest first: resume a run due to resume (same token and cursor),
    revive a dead worker's job under a new lease at once, or start the oldest pending
    job of a user with no live job. None while paused, at the cap of active leases (a
    run waiting out a retry does not hold a slot), when nothing is claimable, or when
    the turn to count leases did not come within the claim budget (or at once, without
    `wait`). One server-side call; a start the one-live-job index refused (another
    claim won the user) is retried statement by statement."""
    try:
        return repo.claim_stage(conn, lock_owner, user_id, wait)
    except DatabaseError as exc:
        if exc.sqlstate != UNIQUE_VIOLATION:
            raise
    return _claim_stepwise(conn, lock_owner, user_id, wait)


def _claim_stepwise(
    conn: Connection, lock_owner: str, user_id: UUID | None, wait: bool
) -> StatsClaim | None:
    """The claim statement by statement, trying up to CLAIM_TRIES candidates."""
    with transaction(conn):
        settings = repo.arm_stage(conn, "claim", None)
        if settings.paused:
            return None
        active = _active_leases(conn, wait)
        if active is None or active >= settings.active_lease_cap:
            return None
        resumable = repo.resumable_run(conn, user_id)
        if resumable is not None:
            run_id, token = resumable
            repo.declare_lease(conn, token)
            return repo.resume_run(conn, run_id, settings.lease_seconds, lock_owner)
        for _ in range(CLAIM_TRIES):
            job = _next_job(conn, user_id)
            if job is None:
                return None
            claimed = _start(conn, settings, job, lock_owner)
            if claimed is not None:
                return claimed
        return None


def _active_leases(conn: Connection, wait: bool) -> int | None:
    """Active leases once this claim has the turn; None if it did not get it (a
    statement timeout while waiting rolls back only this step)."""
    try:
        with transaction(conn):
            return repo.active_leases_after_lock(conn, wait)
    except DatabaseError as exc:
        if exc.sqlstate != STATEMENT_TIMEOUT:
            raise
        return None


def _next_job(conn: Connection, user_id: UUID | None) -> int | None:
    """A dead worker's job (its run retired: a new lease never adopts another lease's
    output), else the oldest pending job."""
    expired = repo.expired_run(conn, user_id)
    if expired is not None:
        run_id, job_id = expired
        repo.retire_run(conn, run_id, "failed", "lease expired")
        return job_id
    return repo.pending_job(conn, user_id)


def _start(
    conn: Connection, settings: WorkerSettings, job_id: int, lock_owner: str
) -> StatsClaim | None:
    """Start the job under a new lease, taking in the user's owed range. None when the
    user's other job went live first (the one-live-job index refused this one) or the
    job has exhausted its attempts (it fails and its range stays owed)."""
    try:
        with transaction(conn):
            job = repo.start_job(conn, job_id, lock_owner)
    except DatabaseError as exc:
        if exc.sqlstate != UNIQUE_VIOLATION:
            raise
        return None
    if job.attempts > settings.max_attempts:
        repo.fail_job(conn, job_id, "attempts exhausted")
        return None
    job = repo.absorb_owed_range(conn, job)
    return repo.create_run(conn, job, uuid4(), settings.lease_seconds, lock_owner)
