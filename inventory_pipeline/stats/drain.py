"""Drivers of the worker's stages and the one drain policy: the drain loop (what the
Dagster drain and `stats drain` run), the one-owner synchronous door and the scoped
single-user processor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal
from uuid import UUID

from inventory_pipeline.db import Connection, DatabaseError, QueryCanceled, transaction
from inventory_pipeline.stats import repository as repo
from inventory_pipeline.stats.claim import claim
from inventory_pipeline.stats.compute import compute
from inventory_pipeline.stats.compute import stage_call as compute_stage_call
from inventory_pipeline.stats.models import (
    TRANSACTION_BOUNDARY,
    AccountResult,
    ComputeResult,
    DrainSummary,
    ProcessResult,
    StatsClaim,
    WorkWaiting,
)
from inventory_pipeline.stats.publish import publish

MAX_ROUNDS = 50
# A drain that finds claimable work again when its claims ran out (it arrived during
# the pass) makes one more pass, no more: a pass ends when a claim finds nothing.
MAX_PASSES = 2


def work_waiting(conn: Connection) -> WorkWaiting:
    """The one definition of work waiting, for the sensor and the drain alike."""
    return repo.waiting_work(conn)


def process_claim(conn: Connection, claimed: StatsClaim) -> ProcessResult:
    """Compute (committing between calls) until a terminal response, then publish.
    Inside a caller's transaction the cursor cannot advance: the first
    transaction_boundary_required ends the call with batch_pending."""
    return _process(conn, claimed, None)[0]


def _process(
    conn: Connection, claimed: StatsClaim, lock_owner: str | None
) -> tuple[ProcessResult, StatsClaim | None]:
    """`process_claim` with its compute and publish calls sent in one round trip, each
    its own transaction: the publication commits after the computation, and finds
    nothing to publish when the run is not computed. Given a lock owner, the worker's
    next claim goes in the same round trip after the publication; it takes nothing while
    this run is still open, and is made again once the run is done with. Returns the
    result and the next claim (None: nothing claimed, or no owner)."""
    calls = [compute_stage_call(claimed), repo.publish_call(claimed)]
    if lock_owner is not None:
        calls.append(repo.claim_call(lock_owner, None, True, after_run=claimed.run_id))
    answers = repo.stage_round(conn, calls)
    first: list[ComputeResult | None] = []

    def first_compute() -> ComputeResult | None:
        first.append(repo.computed(answers[0]))
        return first[0]

    batches = 0
    answered: Callable[[], ComputeResult | None] | None = first_compute
    while True:
        result = compute(conn, claimed, answered=answered)
        answered = None
        if result.status != "batch_pending":
            break
        if result.reason == TRANSACTION_BOUNDARY:
            return ProcessResult("batch_pending", batches), _next(conn, lock_owner, answers)
        batches += 1
    if result.status != "computed":
        return ProcessResult(result.status, batches, reason=result.reason), _next(
            conn, lock_owner, answers
        )
    # The publication of the round trip found the run computed only when the first
    # compute call computed it (or found it computed).
    in_round = bool(first) and first[0] is not None and first[0].status == "computed"
    publication = publish(
        conn, claimed, answered=(lambda: repo.published(claimed, answers[1])) if in_round else None
    )
    row = answers[1] if in_round else None
    ended = isinstance(row, dict) and row["publish_status"] in ("published", "rejected")
    return ProcessResult("computed", max(batches, 1), publication), _next(
        conn, lock_owner, answers, ended
    )


def _next(
    conn: Connection, lock_owner: str | None, answers: list[repo.Answer], ended: bool = False
) -> StatsClaim | None:
    """The worker's next claim. When the round trip's publication ended the run, the
    claim after it stands as it is; otherwise it may have waited for the run, so a
    claim it did not make is made now."""
    if lock_owner is None:
        return None
    answer = answers[2]
    if ended:
        return claim(conn, lock_owner, answered=lambda: repo.claimed(answer))
    made = None if isinstance(answer, DatabaseError) else repo.claimed(answer)
    return made if isinstance(made, StatsClaim) else claim(conn, lock_owner)


def drain(conn: Connection, lock_owner: str, max_rounds: int = MAX_ROUNDS) -> DrainSummary:
    """Claim and process until a claim finds nothing or the round budget is spent; one
    more pass when claimable work arrived meanwhile. Nothing is claimed while paused."""
    summary = _pass(conn, lock_owner, max_rounds)
    while (
        summary.passes < MAX_PASSES
        and summary.rounds < max_rounds
        and work_waiting(conn).claimable > 0
    ):
        summary = summary.then(_pass(conn, lock_owner, max_rounds - summary.rounds))
    return summary


def _pass(conn: Connection, lock_owner: str, max_rounds: int) -> DrainSummary:
    published: list[tuple[UUID, int, int]] = []
    deferred = rejected = failed = rounds = 0
    claimed = claim(conn, lock_owner) if max_rounds > 0 else None
    while claimed is not None:
        rounds += 1
        # While rounds remain, the next claim rides with this one's publication.
        result, following = _process(conn, claimed, lock_owner if rounds < max_rounds else None)
        outcome = result.outcome
        if outcome == "published":
            published.append((claimed.user_id, claimed.target_version, result.batches))
        elif outcome == "rejected":
            rejected += 1
        elif outcome == "deferred":
            deferred += 1
        else:
            failed += 1
        claimed = following
    return DrainSummary(tuple(published), deferred, rejected, failed, rounds)


def process_one_account(conn: Connection, lock_owner: str) -> AccountResult:
    """The one-owner synchronous door: exactly one account per call; a caller drains by
    looping while has_more. A pending batch is deferred, not counted as completed."""
    claimed = claim(conn, lock_owner)
    if claimed is None:
        remaining = repo.remaining_users(conn)
        return AccountResult(None, "idle", None, remaining > 0, remaining)
    result = process_claim(conn, claimed)
    remaining = repo.remaining_users(conn)
    return AccountResult(
        claimed.user_id,
        result.outcome,
        claimed.target_version,
        remaining > 0,
        remaining,
        result.batches,
    )


Stage = Literal["claim", "compute", "publish"]


def _ran_out_its_budget(conn: Connection, stage: Stage, exc: QueryCanceled) -> bool:
    """Was this cancellation the stage's statement timeout? PostgreSQL reports a
    statement timeout and a client's or operator's cancel with the same SQLSTATE (57014);
    the timeout fires exactly when a statement has run for the stage's budget, so a
    canceled call that ran at least that long was the timeout. Only a cancel landing
    within a round trip of the budget could be taken for one."""
    elapsed = exc.elapsed_ms
    return elapsed is not None and elapsed >= repo.read_settings(conn).budget_ms(stage)


class _Deferred(Exception):
    """Roll the scoped subtransaction back: the account goes to the worker."""


def process_user(conn: Connection, user_id: UUID, lock_owner: str) -> AccountResult:
    """The scoped single-user processor: claim, compute and publish inside one
    subtransaction. Exactly a statement timeout (57014 after the stage's budget) rolls
    it back and reports worker_timed_out with the job still pending; any other
    cancellation is re-raised. An account that needs batches is deferred to the worker
    (batches need their own transactions). Its claim stays uncommitted until the end,
    holding the turn to count leases: it never waits for that turn (idle if another
    claim has it), and other claims wait for it at most their claim budget."""
    stage: Stage = "claim"
    try:
        with transaction(conn):
            claimed = claim(conn, lock_owner, user_id, wait=False)
            if claimed is None:
                remaining = repo.remaining_users(conn, user_id)
                return AccountResult(user_id, "idle", None, remaining > 0, remaining)
            stage = "compute"
            result = compute(conn, claimed, record_interruptions=False)
            if result.status != "computed":
                raise _Deferred(result.status)
            stage = "publish"
            publication = publish(conn, claimed, record_interruptions=False)
            if publication.status not in ("published", "rejected"):
                raise _Deferred(publication.status)
    except _Deferred:
        remaining = repo.remaining_users(conn, user_id)
        return AccountResult(user_id, "deferred", None, remaining > 0, remaining)
    except QueryCanceled as exc:
        if not _ran_out_its_budget(conn, stage, exc):
            raise
        remaining = repo.remaining_users(conn, user_id)
        return AccountResult(user_id, "worker_timed_out", None, remaining > 0, remaining)
    remaining = repo.remaining_users(conn, user_id)
    outcome: Literal["published", "rejected"] = (
        "published" if publication.status == "published" else "rejected"
    )
    return AccountResult(user_id, outcome, claimed.target_version, remaining > 0, remaining, 1)
