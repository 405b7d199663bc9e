"""The stats worker: three committed stages, each one server-side call in a transaction
of its own (claim: an attempt and a lease; compute: private output, one step per call;
publish: the public projections and applied_version, atomically), and the drivers that
run them: the drain (what the Dagster drain and `stats drain` run), the one-owner
synchronous door and the scoped single-user processor. The stages decide every outcome
in the database (docs/training-stats.md); this module only sequences them.

A database error a stage call raises changed nothing. A transient one (a deadlock, a
serialization failure, a cancel, a lock timeout) leaves the run to its lease, and the
claim's recovery takes it back when the lease lapses; any other one is raised.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, Literal
from uuid import UUID

from inventory_pipeline.db import TRANSIENT, Connection, QueryCanceled, savepoint
from inventory_pipeline.stats import rebuild
from inventory_pipeline.stats import repository as repo
from inventory_pipeline.stats.models import (
    BATCH_SIZE,
    BUDGET_SPENT,
    TRANSACTION_BOUNDARY,
    AccountResult,
    ComputeResult,
    DrainSummary,
    ExhaustedJob,
    ProcessResult,
    PublishResult,
    StatsClaim,
    WorkWaiting,
)
from inventory_pipeline.stats.rebuild import RebuildProgress
from inventory_pipeline.stats.runbook import status as worker_status

__all__ = [
    "claim",
    "compute",
    "drain",
    "keep_draining",
    "process",
    "process_one_account",
    "process_user",
    "publish",
    "read_pr_overview",
    "request_rebuild",
    "work_waiting",
    "worker_status",
]

# Claims one `claim` call makes at most: a claim that failed a job past the attempt cap
# ends there (one owner a transaction), and one hit by a transient error is made again.
CLAIM_TRIES = 5
# Claims one drain makes at most (a run of the Dagster drain job, or `stats drain`).
MAX_ROUNDS = 2_000


def claim(conn: Connection, lock_owner: str, user_id: UUID | None = None) -> StatsClaim | None:
    """Claim the next work, oldest first, or the given user's (None: nothing claimable
    now, paused, or no lease slot free). The claim never waits for a lock: it passes by
    a user another claim or a scoped processor holds."""
    for _ in range(CLAIM_TRIES):
        try:
            answer = repo.claim_stage(conn, lock_owner, user_id)
        except TRANSIENT:
            continue
        if not isinstance(answer, ExhaustedJob):
            return answer
    return None


def compute(conn: Connection, claimed: StatsClaim) -> ComputeResult:
    """One compute step: the whole computation, or a batch run's next step (commit, then
    call again while it answers batch_pending)."""
    return repo.compute_stage(conn, claimed, BATCH_SIZE)


def publish(conn: Connection, claimed: StatsClaim) -> PublishResult:
    return repo.publish_stage(conn, claimed)


def process(conn: Connection, claimed: StatsClaim) -> ProcessResult:
    """Compute step by step until the run is computed, then publish. Inside a caller's
    transaction the cursor cannot advance: the first transaction_boundary_required ends
    the call with batch_pending."""
    batches = 0
    while True:
        result = compute(conn, claimed)
        if result.status != "batch_pending":
            break
        if result.reason == TRANSACTION_BOUNDARY:
            return ProcessResult("batch_pending", batches)
        batches += 1
    if result.status != "computed":
        return ProcessResult(result.status, batches, reason=result.reason)
    return ProcessResult("computed", max(batches, 1), publish(conn, claimed))


def drain(
    conn: Connection, lock_owner: str, max_rounds: int = MAX_ROUNDS, until: float | None = None
) -> DrainSummary:
    """Claim and process until a claim finds nothing, `max_rounds` claims were made, or
    the monotonic clock passed `until`. Nothing is claimed while paused."""
    published: list[tuple[UUID, int, int]] = []
    failures: list[tuple[UUID, str, str]] = []
    counts = {"deferred": 0, "rejected": 0, "failed": 0, "lost": 0, "interrupted": 0}
    for _ in range(max_rounds):
        if until is not None and time.monotonic() >= until:
            break
        claimed = claim(conn, lock_owner)
        if claimed is None:
            break
        try:
            result = process(conn, claimed)
        except TRANSIENT:
            counts["interrupted"] += 1
            continue
        if result.outcome == "published":
            published.append((claimed.user_id, claimed.target_version, result.batches))
        else:
            counts[result.outcome] += 1
            publication = result.publication
            reason = result.reason or (publication.reason if publication else None)
            if reason and result.outcome != "lost":
                failures.append((claimed.user_id, result.outcome, reason))
    return DrainSummary(tuple(published), **counts, failures=tuple(failures))


# A drain kept alive looks for work at least this often while it waits: work that
# becomes claimable with time alone (a retry's backoff ending, a dead worker's lease
# lapsing) sends no notification. One claim every few seconds keeps an idle drain well
# under one query a second.
RECHECK_SECONDS = 5.0
# A drain kept alive hands what it did to its reporter at most this often (and at its end).
REPORT_SECONDS = 30.0

DrainEnd = Literal["idle", "lifetime", "paused"]


def keep_draining(
    conn: Connection,
    lock_owner: str,
    *,
    idle_seconds: float,
    lifetime_seconds: float,
    report: Callable[[DrainSummary], None],
    max_rounds: int = MAX_ROUNDS,
    report_seconds: float = REPORT_SECONDS,
    recheck_seconds: float = RECHECK_SECONDS,
) -> DrainEnd:
    """Drain, then sleep until the database notifies that work may have become claimable
    (or `recheck_seconds` pass) and drain again; end when `lifetime_seconds` have passed,
    when a pass that claimed nothing finds the worker paused, or when nothing was claimed
    for `idle_seconds` after a pass that found nothing claimable (with 0, the first such
    pass ends it). A pass claims at most `max_rounds` and stops at the next report or the
    lifetime's end; the next pass follows at once. What the drain did reaches `report` at most every
    `report_seconds`, at the end, and on the way out of an error (the database keeps the
    work either way; the report is what an operator sees). A notification only wakes the
    drain: the claim decides what it may take, so a missed or extra notification changes
    when a claim is tried, nothing else. Listening comes first, so work saved before it
    is claimed by the first pass."""
    repo.listen_for_work(conn)
    started = last_claim = last_report = time.monotonic()
    unreported = DrainSummary(())
    try:
        while True:
            until = min(started + lifetime_seconds, last_report + report_seconds)
            passed = drain(conn, lock_owner, max_rounds, until)
            unreported += passed
            now = time.monotonic()
            if passed.rounds:
                last_claim = now
            # A pass cut short by its claims or its clock may have left work claimable.
            cut = passed.rounds >= max_rounds or now >= until
            end: DrainEnd | None = None
            if now - started >= lifetime_seconds:
                end = "lifetime"
            elif not passed.rounds and work_waiting(conn).paused:
                end = "paused"
            elif not cut and now - last_claim >= idle_seconds:
                end = "idle"
            if end or now >= last_report + report_seconds:
                if unreported.rounds:
                    report(unreported)
                    unreported = DrainSummary(())
                last_report = now
            if end:
                return end
            if not cut:
                left = min(started + lifetime_seconds, last_claim + idle_seconds) - now
                repo.wait_for_work(conn, min(recheck_seconds, left))
    except BaseException:
        if unreported.rounds:
            with contextlib.suppress(Exception):
                report(unreported)
        raise


def work_waiting(conn: Connection) -> WorkWaiting:
    """The one definition of work waiting, for the sensor and the drain alike."""
    return repo.waiting_work(conn)


def process_one_account(conn: Connection, lock_owner: str) -> AccountResult:
    """The one-owner synchronous door: exactly one account per call; a caller drains by
    looping while has_more. A pending batch is deferred, not counted as completed."""
    claimed = claim(conn, lock_owner)
    if claimed is None:
        remaining = repo.remaining_users(conn)
        return AccountResult(None, "idle", None, remaining > 0, remaining)
    result = process(conn, claimed)
    remaining = repo.remaining_users(conn)
    outcome = "deferred" if result.outcome == "lost" else result.outcome
    return AccountResult(
        claimed.user_id,
        outcome,
        claimed.target_version,
        remaining > 0,
        remaining,
        result.batches,
    )


def process_user(conn: Connection, user_id: UUID, lock_owner: str) -> AccountResult:
    """The scoped single-user processor: claim, compute and publish one user's job in
    one subtransaction. When a stage runs out of its statement budget, the
    subtransaction rolls back, the job stays pending and the answer is
    worker_timed_out; a client's or operator's cancel is raised. An account that needs
    batches is deferred to the worker (batches need their own transactions). The
    uncommitted claim holds the user and its lease slot: other claims pass them by."""
    outcome: Literal["published", "rejected", "deferred", "worker_timed_out"]
    generation: int | None = None
    with savepoint(conn) as subtransaction:
        claimed = claim(conn, lock_owner, user_id)
        if claimed is None:
            remaining = repo.remaining_users(conn, user_id)
            return AccountResult(user_id, "idle", None, remaining > 0, remaining)
        stage = "compute"
        try:
            computed = compute(conn, claimed)
            stage = "publish"
            publication = publish(conn, claimed) if computed.status == "computed" else None
        except QueryCanceled as canceled:
            # The budget can run out before the stage's own handler is entered (while
            # the call is planned or starts): the same answer as when it is caught there.
            if not repo.budget_spent(conn, stage, canceled):
                raise
            outcome = "worker_timed_out"
            subtransaction.rollback()
        if publication is not None and publication.status in ("published", "rejected"):
            outcome = "published" if publication.status == "published" else "rejected"
            generation = claimed.target_version
        else:
            reason = computed.reason if publication is None else publication.reason
            outcome = "worker_timed_out" if reason == BUDGET_SPENT else "deferred"
            subtransaction.rollback()
    remaining = repo.remaining_users(conn, user_id)
    return AccountResult(
        user_id, outcome, generation, remaining > 0, remaining, 1 if generation else 0
    )


def request_rebuild(conn: Connection, user_ids: list[UUID] | None) -> RebuildProgress:
    """Enqueue full-history ranges through the queue (never around it), one user per
    transaction (see `rebuild.py`)."""
    return rebuild.request_rebuild(conn, user_ids)


def read_pr_overview(conn: Connection, user_id: UUID, as_of: Any) -> list[dict[str, Any]]:
    """The fail-closed reader: raises ObjectNotInPrerequisiteState (SQLSTATE 55000)
    unless the applied generation has a snapshot for exactly this date; each row says
    whether the generation is stale."""
    return repo.read_pr_overview(conn, user_id, as_of)
