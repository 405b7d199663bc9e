"""Runs the named statements of `queries.sql` and turns rows into typed values."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any
from uuid import UUID

from inventory_pipeline.db import (
    ArmedCall,
    Connection,
    DatabaseError,
    Row,
    call_armed,
    execute,
    fetch_all,
    fetch_one,
    jsonb,
)
from inventory_pipeline.db.queries import load_queries
from inventory_pipeline.stats.models import (
    ComputeResult,
    ExhaustedJob,
    PublishResult,
    RunState,
    StatsClaim,
    WorkerSettings,
    WorkWaiting,
)

QUERIES = load_queries("inventory_pipeline.stats")

# The settings row's columns, named as the settings type names them.
_SETTINGS = tuple(f.name for f in fields(WorkerSettings))


def _one(conn: Connection, name: str, params: dict[str, Any] | None = None) -> Row:
    row = fetch_one(conn, QUERIES[name], params)
    if row is None:
        raise LookupError(f"stats query {name} returned no row")
    return row


def _ids(value: list[str] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


def _id_list(value: tuple[str, ...] | None) -> list[str] | None:
    return None if value is None else list(value)


def _settings(row: Row) -> WorkerSettings:
    return WorkerSettings(**{k: row[k] for k in _SETTINGS})


# -- settings and stage arming -------------------------------------------------------


def arm_stage(conn: Connection, stage: str, lease_token: UUID | None) -> WorkerSettings:
    """Arm the stage's statement budget, declare the lease token (None: none), and read
    the settings, in one round trip."""
    token = "" if lease_token is None else str(lease_token)
    return _settings(_one(conn, "arm_stage", {"stage": stage, "lease_token": token}))


def read_settings(conn: Connection) -> WorkerSettings:
    return _settings(_one(conn, "read_settings"))


def update_settings(conn: Connection, changes: dict[str, int | bool | None]) -> WorkerSettings:
    """Change the given settings (None keeps a value); the table's CHECKs judge it."""
    params: dict[str, Any] = dict.fromkeys(_SETTINGS)
    params.update(changes)
    return _settings(_one(conn, "update_settings", params))


# -- the stages as one server-side call each ------------------------------------------


def _stage_call(
    stage: str, lease_token: UUID | None, name: str, params: dict[str, Any]
) -> ArmedCall:
    """The stage's function under its statement budget and lease token, as a
    transaction of its own. Claim and compute, in a transaction of their own, commit
    without waiting for the WAL flush: a crash can lose only whole stages (a claim or a
    private output, never a publication), which the queue then does again, as after a
    lost lease. Publication always waits for its flush."""
    token = "" if lease_token is None else str(lease_token)
    return ArmedCall(
        QUERIES["arm_stage_call"],
        {"stage": stage, "lease_token": token},
        QUERIES[name],
        params,
        async_commit=stage != "publish",
    )


def claim_call(
    lock_owner: str, user_id: UUID | None, wait: bool, after_run: int | None = None
) -> ArmedCall:
    """The claim stage; with `after_run`, nothing is claimed while that run is open."""
    params = {"lock_owner": lock_owner, "user_id": user_id, "wait": wait, "after_run": after_run}
    return _stage_call("claim", None, "claim_stage", params)


def compute_call(claim: StatsClaim, batch_size: int) -> ArmedCall:
    params = {"run_id": claim.run_id, "lease_token": claim.lease_token, "batch_size": batch_size}
    return _stage_call("compute", claim.lease_token, "compute_stage", params)


def publish_call(claim: StatsClaim) -> ArmedCall:
    params = {"run_id": claim.run_id, "lease_token": claim.lease_token}
    return _stage_call("publish", claim.lease_token, "publish_stage", params)


Answer = Row | None | DatabaseError


def stage_round(conn: Connection, calls: list[ArmedCall]) -> list[Answer]:
    """Several stage calls in one round trip, each its own transaction (see
    `db.call_armed`): each one's row, or the error that rolled that call back."""
    return call_armed(conn, calls)


def _row(answer: Answer) -> Row | None:
    if isinstance(answer, DatabaseError):
        raise answer
    return answer


def claimed(answer: Answer) -> StatsClaim | ExhaustedJob | None:
    """The claim stage's answer (None: nothing claimed; a job without a run: it was
    failed past the attempt cap); raises the call's error."""
    row = _row(answer)
    if row is None:
        return None
    if row["claim_run_id"] is None:
        return ExhaustedJob(job_id=row["claim_job_id"], user_id=row["claim_user_id"])
    return StatsClaim(
        run_id=row["claim_run_id"],
        job_id=row["claim_job_id"],
        user_id=row["claim_user_id"],
        lease_token=row["claim_lease_token"],
        target_version=row["claim_target_version"],
        base_applied_version=row["claim_base_applied_version"],
        from_date=row["claim_from_date"],
        exercise_ids=_ids(row["claim_exercise_ids"]),
    )


def computed(answer: Answer) -> ComputeResult | None:
    """The compute stage's answer; None for a run in batches (computed step by step by
    the caller); raises the call's error."""
    row = _row(answer)
    if row is None:
        raise LookupError("stats query compute_stage returned no row")
    if row["compute_status"] == "client":
        return None
    return ComputeResult(
        status=row["compute_status"],
        stage=row["compute_stage"],
        next_offset=row["compute_next_offset"],
        total_exercises=row["compute_total"],
        reason=row["compute_reason"],
        retry_not_before=row["compute_retry_not_before"],
    )


def published(claim: StatsClaim, answer: Answer) -> PublishResult:
    """The publish stage's answer; raises the call's error."""
    row = _row(answer)
    if row is None:
        raise LookupError("stats query publish_stage returned no row")
    status = row["publish_status"]
    return PublishResult(
        # The stage function's word for a lost lease predates the one word "lost".
        status="lost" if status == "lease_lost" else status,
        user_id=claim.user_id,
        generation=claim.target_version,
        applied_version=row["publish_applied_version"],
        reason=row["publish_reason"],
    )


def claim_stage(
    conn: Connection,
    lock_owner: str,
    user_id: UUID | None,
    wait: bool,
    after_run: int | None = None,
) -> StatsClaim | ExhaustedJob | None:
    """The claim stage in one call (see `claimed`)."""
    [answer] = stage_round(conn, [claim_call(lock_owner, user_id, wait, after_run)])
    return claimed(answer)


def compute_stage(conn: Connection, claim: StatsClaim, batch_size: int) -> ComputeResult | None:
    """The compute stage in one call; None for a run in batches."""
    [answer] = stage_round(conn, [compute_call(claim, batch_size)])
    return computed(answer)


def publish_stage(conn: Connection, claim: StatsClaim) -> PublishResult:
    """The publish stage in one call."""
    [answer] = stage_round(conn, [publish_call(claim)])
    return published(claim, answer)


# -- runs and jobs ---------------------------------------------------------------------


def retire_run(conn: Connection, run_id: int, phase: str, error: str) -> None:
    execute(conn, QUERIES["retire_run"], {"run_id": run_id, "phase": phase, "error": error})


def fail_job(conn: Connection, job_id: int, error: str) -> None:
    """The job failed for good; the database owes its range (trigger)."""
    execute(conn, QUERIES["fail_job"], {"job_id": job_id, "error": error})


# -- compute -------------------------------------------------------------------------


def lock_run(conn: Connection, claim: StatsClaim) -> RunState | None:
    """The run under this lease token, locked for the stage (None: lost or busy)."""
    row = fetch_one(
        conn, QUERIES["lock_run"], {"run_id": claim.run_id, "lease_token": claim.lease_token}
    )
    if row is None:
        return None
    return RunState(
        phase=row["phase"],
        lease_until=row["lease_until"],
        expired=bool(row["expired"]),
        backing_off=bool(row["backing_off"]),
        retry_not_before=row["retry_not_before"],
        attempts=int(row["attempts"]),
        payload=dict(row["payload"]),
        xid=int(row["xid"]),
    )


def hold_lease_slot(conn: Connection, run_id: int, lease_until: datetime) -> bool:
    """Whether the lease's slot is locked to the commit, the lease (ending at
    `lease_until` as others see it) still active after the lock."""
    row = _one(conn, "hold_lease_slot", {"run_id": run_id, "lease_until": lease_until})
    return bool(row["held"])


def lease_outlasts_commit(conn: Connection, lease_until: datetime) -> bool:
    """Whether a lease ending at `lease_until` is still active a second from now, time
    enough for the commit that follows."""
    return bool(_one(conn, "lease_outlasts_commit", {"lease_until": lease_until})["outlasts"])


def renew_lapsed_lease(conn: Connection, run_id: int) -> bool:
    """Whether a lease that holds no slot (or may not by the commit) took a free slot of
    the cap (its own first, locked to the commit), so that it may be renewed without
    passing the cap."""
    return bool(_one(conn, "renew_lapsed_lease", {"run_id": run_id})["renewed"])


def renew_lease(conn: Connection, run_id: int, lease_seconds: int, consume_attempt: bool) -> int:
    """A fresh lease at a stage boundary; returns the run's attempts."""
    row = _one(
        conn,
        "renew_lease",
        {
            "run_id": run_id,
            "lease_seconds": lease_seconds,
            "consume_attempt": 1 if consume_attempt else 0,
        },
    )
    return int(row["attempts"])


def user_versions(conn: Connection, user_id: UUID) -> tuple[int, int]:
    """(requested_version, applied_version) of a user (0, 0 when it has none)."""
    row = _one(conn, "user_versions", {"user_id": user_id})
    return int(row["requested_version"]), int(row["applied_version"])


def compute_exercises(conn: Connection, claim: StatsClaim, exercises: tuple[str, ...]) -> None:
    execute(
        conn,
        QUERIES["compute_exercises"],
        {"user_id": claim.user_id, "run_id": claim.run_id, "exercise_ids": list(exercises)},
    )


def compute_periods(conn: Connection, claim: StatsClaim) -> None:
    execute(
        conn,
        QUERIES["compute_periods"],
        {"user_id": claim.user_id, "run_id": claim.run_id, "from_date": claim.from_date},
    )


def clear_outputs(conn: Connection, run_id: int) -> None:
    execute(conn, QUERIES["clear_outputs"], {"run_id": run_id})


def save_run(
    conn: Connection,
    run_id: int,
    phase: str,
    payload: dict[str, Any],
    elapsed_ms: float,
    attempts: int,
    retry_seconds: int | None = None,
    error: str | None = None,
) -> datetime | None:
    """Record a compute step; returns the retry time it set (None: none)."""
    row = _one(
        conn,
        "save_run",
        {
            "run_id": run_id,
            "phase": phase,
            "payload": jsonb(payload),
            "elapsed_ms": elapsed_ms,
            "retry_seconds": retry_seconds,
            "attempts": attempts,
            "error": error,
        },
    )
    retry_at: datetime | None = row["retry_not_before"]
    return retry_at


def defer_run(
    conn: Connection, run_id: int, attempts: int, retry_seconds: int, error: str
) -> datetime:
    row = _one(
        conn,
        "defer_run",
        {"run_id": run_id, "attempts": attempts, "retry_seconds": retry_seconds, "error": error},
    )
    retry_at: datetime = row["retry_not_before"]
    return retry_at


# -- publish -------------------------------------------------------------------------


def lock_publish(conn: Connection, claim: StatsClaim) -> bool:
    """Lock the computed run under its live lease (False: the lease is lost)."""
    params = {"run_id": claim.run_id, "lease_token": claim.lease_token}
    return fetch_one(conn, QUERIES["lock_publish"], params) is not None


def lock_user_state(conn: Connection, user_id: UUID) -> tuple[int, int]:
    """Serialize publications of one user, then lock its state row: (requested,
    applied)."""
    fetch_one(conn, QUERIES["lock_user_publish"], {"user_id": user_id})
    row = _one(conn, "lock_state", {"user_id": user_id})
    return int(row["requested_version"]), int(row["applied_version"])


def publish_pr_window(conn: Connection, user_id: UUID, generation: int) -> None:
    """The PR overview window of this generation, and the rollover it is due for, as
    the publish stage builds them (for a caller that loads generations without
    publishing them, such as a benchmark's setup; a test keeps the two identical)."""
    window = {"user_id": user_id, "generation": generation}
    execute(conn, QUERIES["drop_older_snapshots"], window)
    execute(conn, QUERIES["build_pr_snapshot"], window)
    execute(conn, QUERIES["schedule_rollover"], window)


def supersede_job(conn: Connection, job_id: int, error: str) -> int:
    """End the job; its range moves into the user's successor job (returned)."""
    row = _one(conn, "supersede_job", {"job_id": job_id, "error": error})
    return int(row["successor_id"])


# -- drain policy, status and runbook -----------------------------------------------


def remaining_users(conn: Connection, user_id: UUID | None = None) -> int:
    return int(_one(conn, "remaining_users", {"user_id": user_id})["users"])


def waiting_work(conn: Connection) -> WorkWaiting:
    row = _one(conn, "waiting_work")
    return WorkWaiting(
        waiting=int(row["waiting"]), free_slots=int(row["free_slots"]), paused=bool(row["paused"])
    )


def worker_status(conn: Connection) -> dict[str, Any]:
    return dict(_one(conn, "worker_status")["status"])


@dataclass(frozen=True)
class JobState:
    job_id: int
    user_id: UUID
    status: str
    retried_by: int | None


def lock_job(conn: Connection, job_id: int) -> JobState | None:
    row = fetch_one(conn, QUERIES["lock_job"], {"job_id": job_id})
    if row is None:
        return None
    retried = row["retried_by"]
    return JobState(
        row["id"], row["user_id"], row["status"], None if retried is None else int(retried)
    )


def retry_job(conn: Connection, job_id: int) -> int:
    """Enqueue the failed job's range as a new generation; returns the successor."""
    return int(_one(conn, "retry_job", {"job_id": job_id})["successor_id"])


def read_pr_overview(conn: Connection, user_id: UUID, as_of: Any) -> list[dict[str, Any]]:
    return fetch_all(conn, QUERIES["read_pr_overview"], {"user_id": user_id, "as_of": as_of})


# -- maintenance: untyped runners still used by maintenance.py -----------------------


def one(conn: Connection, name: str, params: dict[str, Any] | None = None) -> Row | None:
    return fetch_one(conn, QUERIES[name], params)


def many(conn: Connection, name: str, params: dict[str, Any] | None = None) -> list[Row]:
    return fetch_all(conn, QUERIES[name], params)


def run(conn: Connection, name: str, params: dict[str, Any] | None = None) -> int:
    return execute(conn, QUERIES[name], params)
