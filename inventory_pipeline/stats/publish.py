"""Publish: the third committed stage. Atomically replaces the public projections and
advances applied_version with the generation's PR overview window, after checking the
lease, that the target is newer than the applied generation, and that the published
base has not moved."""

from __future__ import annotations

from collections.abc import Callable

from inventory_pipeline.db import Connection, ForeignKeyViolation, transaction
from inventory_pipeline.stats import repository as repo
from inventory_pipeline.stats.models import INTERRUPTIONS, PublishResult, StatsClaim

# Why a publication whose stage call hit a deleted referenced row is rejected.
DELETED_REFERENCE = "a referenced canonical row was deleted (23503)"


def publish(
    conn: Connection,
    claim: StatsClaim,
    record_interruptions: bool = True,
    answered: Callable[[], PublishResult] | None = None,
) -> PublishResult:
    """Publish the computed run in one server-side call. A generation not newer than
    the applied one is refused and its range absorbed by a successor with a newer
    generation; a moved base or a deleted referenced row (23503) rejects into the
    successor too. An interruption (57014/55P03) is a failed attempt with backoff: the
    output stays for the retry (unless the caller handles it itself: the scoped
    processor). `answered` gives the server-side call's answer when the caller made
    that call in a round trip of its own."""
    try:
        try:
            return answered() if answered is not None else repo.publish_stage(conn, claim)
        except ForeignKeyViolation:
            # The stage call rolled back whole, after its generation and base checks
            # passed: only the rejection is left to do.
            return _reject_deleted_reference(conn, claim)
    except INTERRUPTIONS as exc:
        if not record_interruptions:
            raise
        return _defer(conn, claim, f"publish interrupted ({exc.sqlstate})")


def _reject_deleted_reference(conn: Connection, claim: StatsClaim) -> PublishResult:
    """Reject into the successor under the run's live lease and the user's publication
    lock, as the stage call rejects a moved base."""
    with transaction(conn):
        repo.arm_stage(conn, "publish", claim.lease_token)
        if not repo.lock_publish(conn, claim):
            return PublishResult("lost", claim.user_id, claim.target_version)
        repo.lock_user_state(conn, claim.user_id)
        return _reject(conn, claim, DELETED_REFERENCE)


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
            return PublishResult("lost", claim.user_id, claim.target_version)
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
