"""The stats worker: three committed stages, each one server-side call in a transaction
of its own (claim: an attempt and a lease; compute: private output, one step per call;
publish: the public projections and applied_version, atomically), and the drivers that
run them: the drain (what the Dagster drain and `stats drain` run), the one-owner
synchronous door and the scoped single-user processor. The stages decide every outcome
in the database (docs/training-stats.md); this module only sequences them.

A database error a stage call raises changed nothing. After a transient one (a
statement timeout, a cancel, a lock timeout, a deadlock, a serialization failure) a
claim is made again, and a compute or publication gives its run back at once (a failed
attempt, or due again at once), so no lease slot is held while nobody works on it; any
other error is raised.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, Literal
from uuid import UUID

from inventory_pipeline.db import (
    TRANSIENT,
    Connection,
    DatabaseError,
    QueryCanceled,
    in_transaction,
    savepoint,
)
from inventory_pipeline.stats import rebuild
from inventory_pipeline.stats import repository as repo
from inventory_pipeline.stats.models import (
    BATCH_SIZE,
    TRANSACTION_BOUNDARY,
    AccountResult,
    ComputeResult,
    DrainSummary,
    ExhaustedJob,
    GivenBack,
    ProcessResult,
    PrOverview,
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
    "live_drains",
    "process",
    "process_one_account",
    "process_user",
    "publish",
    "read_pr_overview",
    "request_rebuild",
    "work_waiting",
    "worker_status",
]

# Claims one `claim` call makes at most in a row that a transient error (a deadlock, a
# serialization failure, a timeout) rolled back whole; the last error is then raised. A
# claim that failed a job past the attempt cap ends there (one owner a transaction) and
# is made again too: it consumed that job.
CLAIM_TRIES = 5
# Claims one drain makes at most (a run of the Dagster drain job, or `stats drain`).
MAX_ROUNDS = 2_000


def claim(conn: Connection, lock_owner: str, user_id: UUID | None = None) -> StatsClaim | None:
    """Claim the next work, oldest first, or the given user's (None: nothing claimable
    now, paused, or no lease slot free). The claim never waits for a lock: it passes by
    a user another claim or a scoped processor holds. Raises the last transient error
    when CLAIM_TRIES claims in a row failed: that is not "nothing to claim"."""
    failures = 0
    while True:
        try:
            answer = repo.claim_stage(conn, lock_owner, user_id)
        except TRANSIENT:
            failures += 1
            if failures >= CLAIM_TRIES:
                raise
            continue
        if not isinstance(answer, ExhaustedJob):
            return answer


def compute(conn: Connection, claimed: StatsClaim) -> ComputeResult:
    """One compute step: the whole computation, or a batch run's next step (commit, then
    call again while it answers batch_pending). A step a transient error ended is given
    back (see `give_back`), and answered as the run then stands."""
    try:
        return repo.compute_stage(conn, claimed, BATCH_SIZE)
    except TRANSIENT as error:
        given = give_back(conn, claimed, "compute", error)
    return ComputeResult(
        status=given.status,
        reason=given.reason,
        retry_not_before=given.retry_not_before,
        interrupted=True,
    )


def publish(conn: Connection, claimed: StatsClaim) -> PublishResult:
    """The publication; one a transient error ended is given back as `compute`'s."""
    try:
        return repo.publish_stage(conn, claimed)
    except TRANSIENT as error:
        given = give_back(conn, claimed, "publish", error)
    return PublishResult(
        status=given.status,
        user_id=claimed.user_id,
        generation=claimed.target_version,
        reason=given.reason,
        retry_not_before=given.retry_not_before,
        interrupted=True,
    )


def give_back(conn: Connection, claimed: StatsClaim, stage: str, error: DatabaseError) -> GivenBack:
    """A stage call that a transient error rolled back whole left its run claimed under
    a live lease and holding its slot: give it back now, in a transaction of its own
    (`stats_give_back_run`: a failed attempt for a timeout, a cancel or a lock timeout, due
    again at once after a deadlock, the SQLSTATE recorded). Inside a caller's transaction
    the error is the caller's (its rollback undoes the claim too) and is raised. When the
    give-back itself meets a transient error, the run is left to its lease."""
    if in_transaction(conn):
        raise error
    sqlstate = error.sqlstate or ""
    try:
        spent = isinstance(error, QueryCanceled) and repo.budget_spent(conn, stage, error)
        return repo.give_back_run(conn, claimed, stage, sqlstate, spent)
    except TRANSIENT as again:
        return GivenBack(
            "lost",
            f"{stage}: interrupted ({sqlstate}); not given back ({again.sqlstate}):"
            " left to its lease",
            None,
        )


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
        return ProcessResult(
            result.status, batches, reason=result.reason, interrupted=result.interrupted
        )
    return ProcessResult("computed", max(batches, 1), publish(conn, claimed))


def drain(
    conn: Connection, lock_owner: str, max_rounds: int = MAX_ROUNDS, until: float | None = None
) -> DrainSummary:
    """Claim and process until a claim finds nothing, `max_rounds` claims were made, or
    the monotonic clock passed `until`. Nothing is claimed while paused."""
    published: list[tuple[UUID, int, int]] = []
    failures: list[tuple[UUID, str, str]] = []
    counts = {"deferred": 0, "rejected": 0, "failed": 0, "lost": 0, "interrupted": 0}
    claim_error: str | None = None
    for _ in range(max_rounds):
        if until is not None and time.monotonic() >= until:
            break
        try:
            claimed = claim(conn, lock_owner)
        except TRANSIENT as error:
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            claim_error = f"{CLAIM_TRIES} claims in a row failed ({error.sqlstate}): {first_line}"
            break
        if claimed is None:
            break
        result = process(conn, claimed)
        if result.outcome == "published":
            published.append((claimed.user_id, claimed.target_version, result.batches))
        else:
            counts[result.outcome] += 1
            publication = result.publication
            reason = result.reason or (publication.reason if publication else None)
            if reason and result.outcome != "lost":
                failures.append((claimed.user_id, result.outcome, reason))
    return DrainSummary(
        tuple(published), **counts, failures=tuple(failures), claim_error=claim_error
    )


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
    is claimed by the first pass. The drain holds its session lock while it lives
    (`live_drains` tells it from a drain whose worker died unseen)."""
    repo.hold_drain_lock(conn, lock_owner)
    repo.listen_for_work(conn)
    started = last_claim = last_report = time.monotonic()
    unreported = DrainSummary(())
    try:
        while True:
            until = min(started + lifetime_seconds, last_report + report_seconds)
            passed = drain(conn, lock_owner, max_rounds, until)
            unreported += passed
            now = time.monotonic()
            # A pass whose claims kept failing is not idle: work may be waiting.
            if passed.rounds or passed.claim_error:
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
                if not unreported.empty:
                    report(unreported)
                    unreported = DrainSummary(())
                last_report = now
            if end:
                return end
            if not cut:
                left = min(started + lifetime_seconds, last_claim + idle_seconds) - now
                repo.wait_for_work(conn, min(recheck_seconds, left))
    except BaseException:
        if not unreported.empty:
            with contextlib.suppress(Exception):
                report(unreported)
        raise


def live_drains(conn: Connection, owners: list[str]) -> frozenset[str]:
    """Which of these kept-alive drains (by lock owner) still have a database session:
    a drain whose worker died has none once the server ended its session."""
    return repo.live_drains(conn, owners)


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
    outcome = result.outcome
    if outcome == "interrupted":  # given back: backing off, or failed for good
        stands = result.publication.status if result.publication else result.status
        outcome = "failed" if stands == "failed" else "deferred"
    elif outcome == "lost":
        outcome = "deferred"
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
    worker_timed_out; a client's or operator's cancel, a lock timeout or a deadlock is
    raised (rolled back with the claim). An account that needs batches is deferred to
    the worker (batches need their own transactions), and so is one whose run waits out
    a retry. The uncommitted claim holds the user and its lease slot: other claims pass
    them by."""
    outcome: Literal["published", "rejected", "deferred", "worker_timed_out", "idle"]
    generation: int | None = None
    with savepoint(conn) as subtransaction:
        claimed = claim(conn, lock_owner, user_id)
        if claimed is None:
            outcome = "deferred" if repo.waits_for_retry(conn, user_id) else "idle"
            remaining = repo.remaining_users(conn, user_id)
            return AccountResult(user_id, outcome, None, remaining > 0, remaining)
        stage = "compute"
        try:
            computed = compute(conn, claimed)
            stage = "publish"
            publication = publish(conn, claimed) if computed.status == "computed" else None
        except QueryCanceled as canceled:
            if not repo.budget_spent(conn, stage, canceled):
                raise
            outcome = "worker_timed_out"
            subtransaction.rollback()
        if publication is not None and publication.status in ("published", "rejected"):
            outcome = "published" if publication.status == "published" else "rejected"
            generation = claimed.target_version
        else:
            outcome = "deferred"
            subtransaction.rollback()
    remaining = repo.remaining_users(conn, user_id)
    return AccountResult(
        user_id, outcome, generation, remaining > 0, remaining, 1 if generation else 0
    )


def request_rebuild(conn: Connection, user_ids: list[UUID] | None) -> RebuildProgress:
    """Enqueue full-history ranges through the queue (never around it), one user per
    transaction (see `rebuild.py`)."""
    return rebuild.request_rebuild(conn, user_ids)


def read_pr_overview(conn: Connection, user_id: UUID, as_of: Any) -> PrOverview:
    """The fail-closed reader: raises ObjectNotInPrerequisiteState (SQLSTATE 55000)
    unless the applied generation has a snapshot for exactly this date; the overview
    says whether it is stale, rows or none."""
    return repo.read_pr_overview(conn, user_id, as_of)
