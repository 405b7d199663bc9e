"""Publish: the third committed stage. Atomically replaces the public projections and
advances applied_version with the generation's PR overview window, after checking the
lease, that the target is newer than the applied generation, and that the published
base has not moved."""

from __future__ import annotations

import time

from inventory_pipeline.db import Connection, DatabaseError, transaction
from inventory_pipeline.stats import repository as repo
from inventory_pipeline.stats.models import (
    FOREIGN_KEY_VIOLATION,
    INTERRUPTIONS,
    PublishResult,
    StatsClaim,
)


def publish(
    conn: Connection, claim: StatsClaim, record_interruptions: bool = True
) -> PublishResult:
    """Publish the computed run in one server-side call. A generation not newer than
    the applied one is refused and its range absorbed by a successor with a newer
    generation; a moved base or a deleted referenced row (23503) rejects into the
    successor too. An interruption (57014/55P03) is a failed attempt with backoff: the
    output stays for the retry (unless the caller handles it itself: the scoped
    processor)."""
    started = time.perf_counter()
    try:
        try:
            return repo.publish_stage(conn, claim)
        except DatabaseError as exc:
            if exc.sqlstate != FOREIGN_KEY_VIOLATION:
                raise
        # A referenced row went away: the statement-by-statement path rejects it.
        with transaction(conn):
            return _publish(conn, claim, started)
    except DatabaseError as exc:
        if not (record_interruptions and exc.sqlstate in INTERRUPTIONS):
            raise
        return _defer(conn, claim, f"publish interrupted ({exc.sqlstate})")


def _publish(conn: Connection, claim: StatsClaim, started: float) -> PublishResult:
    repo.arm_stage(conn, "publish", claim.lease_token)
    publication = repo.lock_publish(conn, claim)
    if publication is None:
        return PublishResult("lease_lost", claim.user_id, claim.target_version)
    _, applied = repo.lock_user_state(conn, claim.user_id)
    if claim.target_version <= applied:
        return _reject(
            conn, claim, f"generation {claim.target_version} is not newer than applied {applied}"
        )
    if applied != publication.base_applied_version:
        return _reject(conn, claim, "the published base moved")
    try:
        with transaction(conn):
            repo.replace_projections(conn, claim, publication)
    except DatabaseError as exc:
        if exc.sqlstate != FOREIGN_KEY_VIOLATION:
            raise
        return _reject(conn, claim, "a referenced canonical row was deleted (23503)")
    applied = repo.advance_applied(conn, claim.user_id, claim.target_version)
    # applied_version itself is the publication fence of the PR window (no flag).
    repo.publish_pr_window(conn, claim.user_id, claim.target_version)
    repo.finish_published(conn, claim, (time.perf_counter() - started) * 1000)
    return PublishResult("published", claim.user_id, claim.target_version, applied)


def _reject(conn: Connection, claim: StatsClaim, reason: str) -> PublishResult:
    """The payload is not published; the successor absorbs its range."""
    repo.retire_run(conn, claim.run_id, "rejected", reason)
    repo.supersede_job(conn, claim.job_id, f"superseded: {reason}")
    return PublishResult("rejected", claim.user_id, claim.target_version, reason=reason)


def _defer(conn: Connection, claim: StatsClaim, error: str) -> PublishResult:
    """A failed publication attempt: wait attempts x backoff with the output kept, or
    fail the run and job past the attempt cap (the range stays owed)."""
    with transaction(conn):
        settings = repo.arm_stage(conn, "claim", claim.lease_token)
        run = repo.lock_run(conn, claim)
        if run is None or run.phase != "computed":
            return PublishResult("lease_lost", claim.user_id, claim.target_version)
        if run.attempts >= settings.max_attempts:
            repo.retire_run(conn, claim.run_id, "failed", error)
            repo.fail_job(conn, claim.job_id, error)
            return PublishResult("failed", claim.user_id, claim.target_version, reason=error)
        retry_at = repo.defer_run(
            conn,
            claim.run_id,
            run.attempts + 1,
            run.attempts * settings.retry_backoff_seconds,
            error,
        )
    return PublishResult(
        "retry_pending",
        claim.user_id,
        claim.target_version,
        reason=error,
        retry_not_before=retry_at,
    )
