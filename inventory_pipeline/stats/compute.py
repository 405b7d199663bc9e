"""Compute: the second committed stage. Builds the run's private output in one
server-side call; an account with more than BATCH_SIZE candidate exercises is prepared
there (the exercise list frozen), then computed here in batches of at most BATCH_SIZE
and finalized, each step its own transaction with the cursor in the run's payload.

Responses: `computed` (publish may follow), `batch_pending` (commit and call again; with
reason transaction_boundary_required when called twice in one transaction),
`retry_pending` (wait for retry_not_before), `failed` (no partial publication)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from inventory_pipeline.db import ArmedCall, Connection, transaction
from inventory_pipeline.stats import repository as repo
from inventory_pipeline.stats.models import (
    BATCH_SIZE,
    INTERRUPTIONS,
    LAPSED_WITHOUT_SLOT,
    TRANSACTION_BOUNDARY,
    BatchCursor,
    ComputeResult,
    RunState,
    StatsClaim,
    WorkerSettings,
)


class _NoFreeSlot(Exception):
    """A batch's lease lapsed while it ran and no slot of the cap is free: its
    transaction is rolled back."""


@dataclass(frozen=True)
class _Attempt:
    """One compute call: its claim, settings, start time and the run's attempt count."""

    conn: Connection
    claim: StatsClaim
    settings: WorkerSettings
    started: float
    attempts: int

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000

    def save(self, phase: str, payload: dict[str, Any]) -> None:
        repo.save_run(
            self.conn, self.claim.run_id, phase, payload, self.elapsed_ms(), self.attempts
        )


def stage_call(claim: StatsClaim) -> ArmedCall:
    """The compute stage's server-side call, for a caller that sends it in a round trip
    with other calls (its answer then goes to `compute` as `answered`)."""
    return repo.compute_call(claim, BATCH_SIZE)


def compute(
    conn: Connection,
    claim: StatsClaim,
    record_interruptions: bool = True,
    answered: Callable[[], ComputeResult | None] | None = None,
) -> ComputeResult:
    """One compute call in its own transaction: one server-side call, or for a run in
    batches the steps below. An interruption (57014/55P03) is a failed attempt with
    backoff, unless the caller handles it (the scoped processor). `answered` gives the
    server-side call's answer when the caller made that call in a round trip of its
    own."""
    started = time.perf_counter()

    def call() -> ComputeResult | None:
        return repo.compute_stage(conn, claim, BATCH_SIZE)

    ask = answered or call
    try:
        while True:
            stage_answer, ask = ask(), call
            if stage_answer is not None:
                return stage_answer
            with transaction(conn):
                stepped = _compute(conn, claim, started)
            if stepped is not None:
                return stepped
            # The run left its batches meanwhile (another worker restarted it under the
            # same token): the stage call prepares or computes it again.
    except _NoFreeSlot:
        return ComputeResult("failed", reason=LAPSED_WITHOUT_SLOT)
    except INTERRUPTIONS as exc:
        if not record_interruptions:
            raise
        return _record_failed_attempt(conn, claim, f"interrupted ({exc.sqlstate})")


def _compute(conn: Connection, claim: StatsClaim, started: float) -> ComputeResult | None:
    """The next step of a run in batches; None when the run is not in batches (any
    more), which only the stage call computes."""
    settings = repo.arm_stage(conn, "compute", claim.lease_token)
    run = repo.lock_run(conn, claim)
    if run is None:
        return ComputeResult("failed", reason="lease lost or run busy")
    raw = run.payload.get("_batch")
    if raw is None:
        return None
    answer = _answer_without_work(run)
    if answer is not None:
        return answer
    # Renew the lease at the stage boundary; an expired lease resumed under the same
    # token consumes a retry. A lease that holds no slot (lapsed, or past its retry
    # time) is renewed only into a free slot of the cap, locked to the commit.
    slotted = run.expired or run.retry_not_before is not None
    if slotted and not repo.renew_lapsed_lease(conn, claim.run_id):
        return ComputeResult("failed", reason=LAPSED_WITHOUT_SLOT)
    attempts = repo.renew_lease(conn, claim.run_id, settings.lease_seconds, run.expired)
    attempt = _Attempt(conn, claim, settings, started, attempts)
    if attempts > settings.max_attempts:
        return _fail_attempt(attempt, run.payload, "attempts exhausted")
    cursor = BatchCursor.from_payload(raw)
    if repo.user_versions(conn, claim.user_id) != (cursor.source_revision, cursor.base):
        # Changed inputs invalidate the attempt: drop the partial output, start over.
        repo.clear_outputs(conn, claim.run_id)
        restart = {"_restarts": int(run.payload.get("_restarts", 0)) + 1}
        return _fail_attempt(attempt, restart, "inputs changed")
    step = (
        _run_batch(attempt, cursor, run.xid)
        if cursor.stage == "batches"
        else _finalize(attempt, cursor)
    )
    # The step is several statements sent from here, so nothing bounds how long it ran
    # or how long its commit waits (a caller's own transaction): a lease that lapses
    # before the commit holds no slot as others see it, and a claim may fill it. A step
    # that leaves the lease active keeps the lease's slot locked to the commit while the
    # lease is still active; else (a slot above a lowered cap, or being filled) it
    # relies on the lease outlasting the commit by a second; else it renews into a free
    # slot of the cap. With none free the step is undone and the run stays as it was.
    if (
        not slotted
        and step.status in ("batch_pending", "computed")
        and not repo.hold_lease_slot(conn, claim.run_id, run.lease_until)
        and not repo.lease_outlasts_commit(conn, run.lease_until)
        and not repo.renew_lapsed_lease(conn, claim.run_id)
    ):
        raise _NoFreeSlot
    return step


def _answer_without_work(run: RunState) -> ComputeResult | None:
    """The responses that need no computation: already computed, finished, a second
    call in one transaction, a run still backing off."""
    if run.phase == "computed":
        return ComputeResult("computed")
    if run.phase != "claimed":
        return ComputeResult("failed", reason=f"run is {run.phase}")
    raw = run.payload.get("_batch")
    if raw is not None and int(raw["xid"]) == run.xid:
        cursor = BatchCursor.from_payload(raw)
        return ComputeResult(
            "batch_pending", cursor.stage, cursor.next_offset, cursor.total, TRANSACTION_BOUNDARY
        )
    if run.backing_off:
        return ComputeResult("retry_pending", retry_not_before=run.retry_not_before)
    return None


def _run_batch(attempt: _Attempt, cursor: BatchCursor, xid: int) -> ComputeResult:
    """The next batch under a savepoint: an interruption rolls back this batch only,
    keeps the committed predecessors and counts a failed attempt."""
    chunk = cursor.next_chunk()
    try:
        with transaction(attempt.conn):
            repo.compute_exercises(attempt.conn, attempt.claim, chunk)
    except INTERRUPTIONS as exc:
        kept = replace(cursor, retry_count=cursor.retry_count + 1)
        return _fail_attempt(
            attempt, {"_batch": kept.to_payload()}, f"batch interrupted ({exc.sqlstate})"
        )
    cursor = cursor.advanced(len(chunk), xid)
    attempt.save("claimed", {"_batch": cursor.to_payload()})
    return ComputeResult("batch_pending", cursor.stage, cursor.next_offset, cursor.total)


def _finalize(attempt: _Attempt, cursor: BatchCursor) -> ComputeResult:
    """Final aggregation: the user's periods, then the complete manifest."""
    repo.compute_periods(attempt.conn, attempt.claim)
    manifest = {
        "exercises": list(cursor.exercises),
        "mode": "batched",
        "batches": math.ceil(cursor.total / BATCH_SIZE),
    }
    attempt.save("computed", {"manifest": manifest})
    return ComputeResult("computed", total_exercises=cursor.total)


def _fail_attempt(attempt: _Attempt, payload: dict[str, Any], error: str) -> ComputeResult:
    """A failed attempt keeps its token and cursor and waits attempts x backoff (the
    first retry one backoff); past the attempt cap the run and its job fail, and the
    job's range stays owed."""
    conn, claim, settings = attempt.conn, attempt.claim, attempt.settings
    if attempt.attempts >= settings.max_attempts:
        # The failed run's private output is never read again; it goes with the run.
        repo.save_run(
            conn,
            claim.run_id,
            "failed",
            payload,
            attempt.elapsed_ms(),
            attempt.attempts,
            error=error,
        )
        repo.fail_job(conn, claim.job_id, error)
        return ComputeResult("failed", reason=error)
    retry_at = repo.save_run(
        conn,
        claim.run_id,
        "claimed",
        payload,
        attempt.elapsed_ms(),
        attempt.attempts + 1,
        retry_seconds=attempt.attempts * settings.retry_backoff_seconds,
        error=error,
    )
    return ComputeResult("retry_pending", reason=error, retry_not_before=retry_at)


def _record_failed_attempt(conn: Connection, claim: StatsClaim, error: str) -> ComputeResult:
    """An interruption outside a batch savepoint: the attempt failed as a whole."""
    started = time.perf_counter()
    with transaction(conn):
        settings = repo.arm_stage(conn, "claim", claim.lease_token)
        run = repo.lock_run(conn, claim)
        if run is None or run.phase != "claimed":
            return ComputeResult("failed", reason="lease lost or run busy")
        attempt = _Attempt(conn, claim, settings, started, run.attempts)
        return _fail_attempt(attempt, run.payload, error)
