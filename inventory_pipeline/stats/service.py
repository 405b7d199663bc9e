"""Every state transition of the stats worker (seed 001 D08 and #1590).

Three committed stages, each its own transaction and entry point: claim (attempt +
lease), compute (private typed output, in batches of at most 100 exercises for large
accounts), publish (atomic replacement of the public projections and applied_version
after checking generation and lease). Each stage arms its statement budget from the
settings row and declares its lease token for the fence trigger.
"""

from __future__ import annotations

import math
import time
from typing import Any
from uuid import UUID, uuid4

from inventory_pipeline.db import Connection, DatabaseError, jsonb, transaction
from inventory_pipeline.db.connection import is_error
from inventory_pipeline.stats import repository as repo
from inventory_pipeline.stats.models import (
    BATCH_SIZE,
    ComputeResult,
    PublishResult,
    StatsClaim,
    WorkerSettings,
)

STATEMENT_TIMEOUT = "57014"
LOCK_NOT_AVAILABLE = "55P03"
FOREIGN_KEY_VIOLATION = "23503"
TIMEOUT_MESSAGE = "canceling statement due to statement timeout"


def _interrupted(exc: DatabaseError) -> bool:
    return is_error(exc, STATEMENT_TIMEOUT) or is_error(exc, LOCK_NOT_AVAILABLE)


def _arm(conn: Connection, stage: str, claim: StatsClaim | None = None) -> WorkerSettings:
    return repo.arm_stage(conn, stage, "" if claim is None else str(claim.lease_token))


def _claim_from(row: dict[str, Any], token: UUID) -> StatsClaim:
    return StatsClaim(
        run_id=row["id"],
        job_id=row["job_id"],
        user_id=row["user_id"],
        lease_token=token,
        target_version=row["target_version"],
        base_applied_version=row["base_applied_version"],
        from_date=row["from_date"],
        exercise_ids=tuple(row["exercise_ids"]),
    )


# -- claim ---------------------------------------------------------------------------


def claim(conn: Connection, lock_owner: str, user_id: UUID | None = None) -> StatsClaim | None:
    """Claim work: resume a waiting batch run under its own token, revive a dead
    worker's job under a new lease at once, or start the oldest pending job. At most
    `active_lease_cap` live leases."""
    with transaction(conn):
        settings = _arm(conn, "claim")
        resumable = repo.one(conn, "resumable_run", {"user_id": user_id})
        if resumable is not None:
            return _claim_from(resumable, resumable["lease_token"])
        live = repo.one(conn, "live_leases")
        if live is not None and live["live"] >= settings.active_lease_cap:
            return None
        expired = repo.one(conn, "expired_run", {"user_id": user_id})
        if expired is not None:
            repo.run(
                conn,
                "retire_run",
                {"run_id": expired["id"], "phase": "failed", "error": "lease expired"},
            )
            job_id = expired["job_id"]
        else:
            pending = repo.one(conn, "pending_job", {"user_id": user_id})
            if pending is None:
                return None
            job_id = pending["id"]
        job = repo.one(conn, "start_job", {"job_id": job_id, "lock_owner": lock_owner})
        assert job is not None
        if job["attempts"] > settings.max_attempts:
            repo.run(conn, "fail_job", {"job_id": job_id, "error": "attempts exhausted"})
            return None
        token = uuid4()
        run = repo.one(
            conn,
            "create_run",
            {
                "job_id": job_id,
                "user_id": job["user_id"],
                "lease_token": token,
                "lease_seconds": settings.lease_seconds,
                "lock_owner": lock_owner,
                "target_version": job["requested_version"],
                "from_date": job["from_date"],
                "exercise_ids": job["exercise_ids"],
                "attempts": job["attempts"],
            },
        )
        assert run is not None
        return StatsClaim(
            run_id=run["id"],
            job_id=job_id,
            user_id=job["user_id"],
            lease_token=token,
            target_version=job["requested_version"],
            base_applied_version=run["base_applied_version"],
            from_date=job["from_date"],
            exercise_ids=tuple(job["exercise_ids"]),
        )


# -- compute -------------------------------------------------------------------------


def _save(
    conn: Connection,
    claim: StatsClaim,
    phase: str,
    payload: dict[str, Any],
    started: float,
    attempts: int,
    retry_seconds: int | None = None,
    error: str | None = None,
) -> Any:
    row = repo.one(
        conn,
        "save_run",
        {
            "run_id": claim.run_id,
            "phase": phase,
            "payload": jsonb(payload),
            "elapsed_ms": (time.perf_counter() - started) * 1000,
            "retry_seconds": retry_seconds,
            "attempts": attempts,
            "error": error,
        },
    )
    return None if row is None else row["retry_not_before"]


def _fail_attempt(
    conn: Connection,
    claim: StatsClaim,
    settings: WorkerSettings,
    payload: dict[str, Any],
    started: float,
    attempts: int,
    error: str,
) -> ComputeResult:
    """A failed batch attempt keeps its token and cursor and waits attempts x backoff;
    past the attempt cap the run and its job fail (no partial publication)."""
    if attempts >= settings.max_attempts:
        # The failed run's private output is never read again; it goes with the run.
        _save(conn, claim, "failed", payload, started, attempts, error=error)
        repo.run(conn, "fail_job", {"job_id": claim.job_id, "error": error})
        return ComputeResult("failed", reason=error)
    retry_at = _save(
        conn,
        claim,
        "claimed",
        payload,
        started,
        attempts + 1,
        retry_seconds=(attempts + 1) * settings.retry_backoff_seconds,
        error=error,
    )
    return ComputeResult("retry_pending", reason=error, retry_not_before=retry_at)


def compute(
    conn: Connection, claim: StatsClaim, record_interruptions: bool = True
) -> ComputeResult:
    """One compute call in its own transaction (seed 001 #1590 responses). An
    interruption (57014/55P03) becomes a failed attempt with backoff, unless the caller
    handles it itself (the scoped processor)."""
    started = time.perf_counter()
    try:
        with transaction(conn):
            return _compute(conn, claim, started)
    except DatabaseError as exc:
        if not (record_interruptions and _interrupted(exc)):
            raise
        return _record_failed_attempt(conn, claim, f"interrupted ({exc.__cause__.sqlstate})")  # type: ignore[union-attr]


def _compute(conn: Connection, claim: StatsClaim, started: float) -> ComputeResult:
    settings = _arm(conn, "compute", claim)
    row = repo.one(conn, "lock_run", {"run_id": claim.run_id, "lease_token": claim.lease_token})
    if row is None:
        return ComputeResult("failed", reason="lease lost or run busy")
    if row["phase"] == "computed":
        return ComputeResult("computed")
    if row["phase"] != "claimed":
        return ComputeResult("failed", reason=f"run is {row['phase']}")
    payload: dict[str, Any] = dict(row["payload"])
    batch: dict[str, Any] | None = payload.get("_batch")
    if batch is not None and batch.get("xid") == row["xid"]:
        return ComputeResult(
            "batch_pending",
            stage=batch["stage"],
            next_offset=batch["next_offset"],
            total_exercises=batch["total"],
            reason="transaction_boundary_required",
        )
    if row["backing_off"]:
        return ComputeResult("retry_pending", retry_not_before=row["retry_not_before"])
    # Renew the lease at the stage boundary; an expired lease resumed under the same
    # token consumes a retry.
    renewed = repo.one(
        conn,
        "renew_lease",
        {
            "run_id": claim.run_id,
            "lease_seconds": settings.lease_seconds,
            "consume_attempt": 1 if row["expired"] else 0,
        },
    )
    attempts = int(renewed["attempts"]) if renewed else int(row["attempts"])
    if attempts > settings.max_attempts:
        return _fail_attempt(
            conn, claim, settings, payload, started, attempts, "attempts exhausted"
        )
    scope = {"user_id": claim.user_id, "run_id": claim.run_id}
    if batch is None:
        candidates = [
            r["exercise_id"]
            for r in repo.many(
                conn,
                "candidate_exercises",
                {"user_id": claim.user_id, "exercise_ids": list(claim.exercise_ids)},
            )
        ]
        if len(candidates) <= BATCH_SIZE:
            repo.run(conn, "compute_exercises", {**scope, "exercise_ids": candidates})
            repo.run(conn, "compute_periods", {**scope, "from_date": claim.from_date})
            manifest = {"exercises": candidates, "mode": "single", "batches": 1}
            _save(conn, claim, "computed", {"manifest": manifest}, started, attempts)
            return ComputeResult("computed", total_exercises=len(candidates))
        # Preparation freezes the exact exercise list and the inputs it depends on.
        versions = repo.one(conn, "user_versions", {"user_id": claim.user_id})
        assert versions is not None
        batch = {
            "stage": "batches",
            "next_offset": 0,
            "exercises": candidates,
            "total": len(candidates),
            "source_revision": versions["requested_version"],
            "base": versions["applied_version"],
            "output_revision": 1,
            "retry_count": 0,
            "xid": row["xid"],
        }
        _save(conn, claim, "claimed", {"_batch": batch}, started, attempts)
        return ComputeResult("batch_pending", "batches", 0, len(candidates))
    versions = repo.one(conn, "user_versions", {"user_id": claim.user_id})
    assert versions is not None
    if (versions["requested_version"], versions["applied_version"]) != (
        batch["source_revision"],
        batch["base"],
    ):
        # Changed inputs invalidate the attempt: drop the partial output, start over.
        repo.run(conn, "clear_outputs", {"run_id": claim.run_id})
        restart = {"_restarts": int(payload.get("_restarts", 0)) + 1}
        return _fail_attempt(conn, claim, settings, restart, started, attempts, "inputs changed")
    if batch["stage"] == "batches":
        offset = int(batch["next_offset"])
        chunk = batch["exercises"][offset : offset + BATCH_SIZE]
        try:
            with transaction(conn):  # the batch's savepoint
                repo.run(conn, "compute_exercises", {**scope, "exercise_ids": chunk})
        except DatabaseError as exc:
            if not _interrupted(exc):
                raise
            batch["retry_count"] = int(batch["retry_count"]) + 1
            return _fail_attempt(
                conn,
                claim,
                settings,
                {"_batch": batch},
                started,
                attempts,
                f"batch interrupted ({exc.__cause__.sqlstate})",  # type: ignore[union-attr]
            )
        batch["next_offset"] = offset + len(chunk)
        batch["xid"] = row["xid"]
        if batch["next_offset"] >= batch["total"]:
            batch["stage"] = "finalize"
        _save(conn, claim, "claimed", {"_batch": batch}, started, attempts)
        return ComputeResult("batch_pending", batch["stage"], batch["next_offset"], batch["total"])
    # Final aggregation: user-level periods, then the complete manifest.
    repo.run(conn, "compute_periods", {**scope, "from_date": claim.from_date})
    manifest = {
        "exercises": batch["exercises"],
        "mode": "batched",
        "batches": math.ceil(batch["total"] / BATCH_SIZE),
    }
    _save(conn, claim, "computed", {"manifest": manifest}, started, attempts)
    return ComputeResult("computed", total_exercises=batch["total"])


def _record_failed_attempt(conn: Connection, claim: StatsClaim, error: str) -> ComputeResult:
    """An interruption outside a batch savepoint: the attempt failed as a whole."""
    started = time.perf_counter()
    with transaction(conn):
        settings = _arm(conn, "claim", claim)
        row = repo.one(conn, "lock_run", {"run_id": claim.run_id, "lease_token": claim.lease_token})
        if row is None or row["phase"] != "claimed":
            return ComputeResult("failed", reason="lease lost or run busy")
        return _fail_attempt(
            conn, claim, settings, dict(row["payload"]), started, int(row["attempts"]), error
        )


# -- publish -------------------------------------------------------------------------


def publish(conn: Connection, claim: StatsClaim) -> PublishResult:
    """Atomically replace the public projections and advance applied_version, after
    checking the lease and that the published base has not moved (seed 001 D08)."""
    started = time.perf_counter()
    with transaction(conn):
        _arm(conn, "publish", claim)
        row = repo.one(
            conn, "lock_publish", {"run_id": claim.run_id, "lease_token": claim.lease_token}
        )
        if row is None:
            return PublishResult("lease_lost", claim.user_id, claim.target_version)
        repo.one(conn, "lock_user_publish", {"user_id": claim.user_id})
        state = repo.one(conn, "lock_state", {"user_id": claim.user_id})
        assert state is not None
        if state["applied_version"] != row["base_applied_version"]:
            return _reject(conn, claim, "the published base moved")
        manifest = row["payload"]["manifest"]
        params = {
            "user_id": claim.user_id,
            "run_id": claim.run_id,
            "generation": claim.target_version,
        }
        try:
            with transaction(conn):
                repo.run(conn, "force_constraints")
                repo.run(
                    conn,
                    "replace_exercise_stats",
                    {**params, "exercise_ids": manifest["exercises"]},
                )
                repo.run(conn, "replace_period_stats", {**params, "from_date": row["from_date"]})
        except DatabaseError as exc:
            if not is_error(exc, FOREIGN_KEY_VIOLATION):
                raise
            return _reject(conn, claim, "a referenced canonical row was deleted (23503)")
        advanced = repo.one(
            conn, "advance_applied", {"user_id": claim.user_id, "generation": claim.target_version}
        )
        assert advanced is not None
        # The PR overview window of this generation, published with it: applied_version
        # itself is the publication fence (no separate published flag).
        window = {"user_id": claim.user_id, "generation": claim.target_version}
        repo.run(conn, "drop_older_snapshots", window)
        repo.run(conn, "build_pr_snapshot", window)
        repo.run(conn, "schedule_rollover", window)
        repo.run(
            conn,
            "finish_published",
            {
                "run_id": claim.run_id,
                "job_id": claim.job_id,
                "publish_ms": (time.perf_counter() - started) * 1000,
            },
        )
        return PublishResult(
            "published", claim.user_id, claim.target_version, advanced["applied_version"]
        )


def _reject(conn: Connection, claim: StatsClaim, reason: str) -> PublishResult:
    """The payload is not published; the successor claim absorbs its scope."""
    repo.run(conn, "retire_run", {"run_id": claim.run_id, "phase": "rejected", "error": reason})
    repo.one(conn, "supersede_job", {"job_id": claim.job_id, "error": f"superseded: {reason}"})
    return PublishResult("rejected", claim.user_id, claim.target_version, reason=reason)
