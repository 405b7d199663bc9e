"""Runs the named statements of `queries.sql` and turns rows into typed values."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any
from uuid import UUID

from inventory_pipeline.db import (
    Connection,
    QueryCanceled,
    Row,
    execute,
    fetch_all,
    fetch_one,
    fetch_one_armed,
    in_transaction,
    listen,
    wait_for_notify,
)
from inventory_pipeline.db.queries import load_queries
from inventory_pipeline.stats.models import (
    ComputeResult,
    ExhaustedJob,
    GivenBack,
    PrExercise,
    PrOverview,
    PublishResult,
    StatsClaim,
    WorkerSettings,
    WorkWaiting,
)

QUERIES = load_queries("inventory_pipeline.stats")

# The settings row's columns, named as the settings type names them; likewise a PR
# overview row's.
_SETTINGS = tuple(f.name for f in fields(WorkerSettings))
_PR_EXERCISE = tuple(f.name for f in fields(PrExercise))


def _one(conn: Connection, name: str, params: dict[str, Any] | None = None) -> Row:
    row = fetch_one(conn, QUERIES[name], params)
    if row is None:
        raise LookupError(f"stats query {name} returned no row")
    return row


def _settings(row: Row) -> WorkerSettings:
    return WorkerSettings(**{k: row[k] for k in _SETTINGS})


# -- settings -------------------------------------------------------------------------


def read_settings(conn: Connection) -> WorkerSettings:
    return _settings(_one(conn, "read_settings"))


def update_settings(conn: Connection, changes: dict[str, int | bool | None]) -> WorkerSettings:
    """Change the given settings (None keeps a value); the table's CHECKs judge it."""
    params: dict[str, Any] = dict.fromkeys(_SETTINGS)
    params.update(changes)
    return _settings(_one(conn, "update_settings", params))


# -- the stages, one server-side call each ----------------------------------------------


def arm_params(conn: Connection, stage: str, lease_token: UUID | None) -> dict[str, Any]:
    """The parameters of `arm_stage` for a stage call made now on `conn`.

    A claim or compute in its own transaction commits without waiting for its WAL
    flush: a crash can lose it only with every later transaction, and the run's next
    stage then finds its lease gone or its work undone. A publication waits (it is
    what readers are told), and so does any stage inside a caller's transaction, whose
    commit is the caller's."""
    return {
        "arm_stage": stage,
        "arm_lease_token": "" if lease_token is None else str(lease_token),
        "arm_async_commit": stage != "publish" and not in_transaction(conn),
    }


def _stage(
    conn: Connection, stage: str, lease_token: UUID | None, name: str, params: dict[str, Any]
) -> Row | None:
    """The stage's function as one transaction under its statement budget and lease
    token (see `db.fetch_one_armed`)."""
    arm = arm_params(conn, stage, lease_token)
    return fetch_one_armed(conn, QUERIES["arm_stage"], arm, QUERIES[name], params)


def _answer(row: Row | None, name: str) -> Row:
    if row is None:
        raise LookupError(f"stats query {name} returned no row")
    return row


def budget_spent(conn: Connection, stage: str, canceled: QueryCanceled) -> bool:
    """Did a canceled stage call run for its whole statement budget (its timeout, not a
    client's or operator's cancel)? The call's time is measured by the client, from
    before it was sent to its error."""
    row = fetch_one(conn, QUERIES["stage_budget"], {"stage": stage})
    budget = None if row is None else row["budget_ms"]
    return (
        canceled.elapsed_ms is not None
        and budget is not None
        and (canceled.elapsed_ms >= float(budget))
    )


def claim_stage(
    conn: Connection, lock_owner: str, user_id: UUID | None
) -> StatsClaim | ExhaustedJob | None:
    """The claim stage (None: nothing claimed; a job without a run: the claim failed it
    past the attempt cap)."""
    params = {"lock_owner": lock_owner, "user_id": user_id}
    row = _stage(conn, "claim", None, "claim_stage", params)
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
        exercise_ids=None
        if row["claim_exercise_ids"] is None
        else tuple(row["claim_exercise_ids"]),
        lock_owner=lock_owner,
    )


def compute_stage(conn: Connection, claim: StatsClaim, batch_size: int) -> ComputeResult:
    params = {"run_id": claim.run_id, "lease_token": claim.lease_token, "batch_size": batch_size}
    row = _answer(_stage(conn, "compute", claim.lease_token, "compute_stage", params), "compute")
    return ComputeResult(
        status=row["compute_status"],
        stage=row["compute_stage"],
        next_offset=row["compute_next_offset"],
        total_exercises=row["compute_total"],
        reason=row["compute_reason"],
        retry_not_before=row["compute_retry_not_before"],
    )


def publish_stage(conn: Connection, claim: StatsClaim) -> PublishResult:
    params = {"run_id": claim.run_id, "lease_token": claim.lease_token}
    row = _answer(_stage(conn, "publish", claim.lease_token, "publish_stage", params), "publish")
    return PublishResult(
        status=row["publish_status"],
        user_id=claim.user_id,
        generation=claim.target_version,
        applied_version=row["publish_applied_version"],
        reason=row["publish_reason"],
        retry_not_before=row["publish_retry_not_before"],
    )


def give_back_run(
    conn: Connection, claim: StatsClaim, stage: str, sqlstate: str, budget_spent: bool
) -> GivenBack:
    params = {
        "run_id": claim.run_id,
        "lease_token": claim.lease_token,
        "lock_owner": claim.lock_owner,
        "stage": stage,
        "sqlstate": sqlstate,
        "budget_spent": budget_spent,
    }
    # Armed as a claim: its budget bounds the give-back's own waits.
    row = _answer(_stage(conn, "claim", claim.lease_token, "give_back_run", params), "give back")
    return GivenBack(
        row["give_back_status"], row["give_back_reason"], row["give_back_retry_not_before"]
    )


def publish_pr_window(conn: Connection, user_id: UUID, generation: int) -> None:
    """The PR overview window of this generation, and the rollover it is due for, as
    the publish stage builds them (for a caller that loads generations without
    publishing them, such as a benchmark's setup; a test keeps the two identical)."""
    window = {"user_id": user_id, "generation": generation}
    execute(conn, QUERIES["drop_older_snapshots"], window)
    execute(conn, QUERIES["build_pr_snapshot"], window)
    execute(conn, QUERIES["schedule_rollover"], window)


# -- drain policy, status and runbook -----------------------------------------------


def remaining_users(conn: Connection, user_id: UUID | None = None) -> int:
    return int(_one(conn, "remaining_users", {"user_id": user_id})["users"])


def waits_for_retry(conn: Connection, user_id: UUID) -> bool:
    return bool(_one(conn, "waits_for_retry", {"user_id": user_id})["waits"])


# The channel the database notifies when stats work may have become claimable (the
# triggers calling stats_notify_work).
WORK_CHANNEL = "stats_work"


def listen_for_work(conn: Connection) -> None:
    listen(conn, WORK_CHANNEL)


def wait_for_work(conn: Connection, timeout: float) -> bool:
    """Wait up to `timeout` seconds for a statement that may have made work claimable;
    True when one committed (or did since the last wait)."""
    return wait_for_notify(conn, timeout)


def hold_drain_lock(conn: Connection, owner: str) -> None:
    _one(conn, "hold_drain_lock", {"owner": owner})


def live_drains(conn: Connection, owners: list[str]) -> frozenset[str]:
    rows = fetch_all(conn, QUERIES["live_drains"], {"owners": owners})
    return frozenset(row["owner"] for row in rows)


def waiting_work(conn: Connection) -> WorkWaiting:
    row = _one(conn, "waiting_work")
    return WorkWaiting(
        waiting=int(row["waiting"]),
        free_slots=int(row["free_slots"]),
        paused=bool(row["paused"]),
        oldest_wait_seconds=float(row["oldest_wait_seconds"]),
    )


def worker_status(conn: Connection) -> dict[str, Any]:
    return dict(_one(conn, "worker_status")["status"])


@dataclass(frozen=True)
class JobState:
    job_id: int
    user_id: UUID
    status: str
    retried_by: int | None
    owed: bool  # its range is still owed (a failed job no later job took in)
    taken_in_by: int | None  # the latest job of its user that took its range in
    taker_status: str | None


def lock_job(conn: Connection, job_id: int) -> JobState | None:
    row = fetch_one(conn, QUERIES["lock_job"], {"job_id": job_id})
    if row is None:
        return None
    retried = row["retried_by"]
    return JobState(
        row["id"],
        row["user_id"],
        row["status"],
        None if retried is None else int(retried),
        bool(row["owed"]),
        row["taken_in_by"],
        row["taker_status"],
    )


def retry_job(conn: Connection, job_id: int) -> int:
    """Enqueue the failed job's range as a new generation; returns the successor."""
    return int(_one(conn, "retry_job", {"job_id": job_id})["successor_id"])


def read_pr_overview(conn: Connection, user_id: UUID, as_of: Any) -> PrOverview:
    rows = fetch_all(conn, QUERIES["read_pr_overview"], {"user_id": user_id, "as_of": as_of})
    header = rows[0]  # the status function fails closed rather than return no row
    exercises = tuple(
        PrExercise(**{name: row[name] for name in _PR_EXERCISE})
        for row in rows
        if row["exercise_id"] is not None
    )
    return PrOverview(header["as_of_date"], header["generation"], header["stale"], exercises)


# -- maintenance: untyped runners still used by maintenance.py -----------------------


def one(conn: Connection, name: str, params: dict[str, Any] | None = None) -> Row | None:
    return fetch_one(conn, QUERIES[name], params)


def many(conn: Connection, name: str, params: dict[str, Any] | None = None) -> list[Row]:
    return fetch_all(conn, QUERIES[name], params)


def run(conn: Connection, name: str, params: dict[str, Any] | None = None) -> int:
    return execute(conn, QUERIES[name], params)
