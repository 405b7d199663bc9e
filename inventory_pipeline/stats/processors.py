"""Drivers of the stats worker's stages (seed 001 D08): the drain loop, the one-owner
synchronous door, the scoped single-user processor, and the status, rebuild and reader
entry points. The state transitions themselves are in `service.py`."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from inventory_pipeline.db import Connection, DatabaseError, transaction
from inventory_pipeline.db.connection import is_error
from inventory_pipeline.stats import rebuild
from inventory_pipeline.stats import repository as repo
from inventory_pipeline.stats.models import AccountResult, DrainSummary, PublishResult, StatsClaim
from inventory_pipeline.stats.rebuild import RebuildProgress
from inventory_pipeline.stats.service import (
    STATEMENT_TIMEOUT,
    TIMEOUT_MESSAGE,
    claim,
    compute,
    publish,
)

# -- drivers -------------------------------------------------------------------------


def process_claim(conn: Connection, claim: StatsClaim) -> tuple[str, int, PublishResult | None]:
    """Compute (committing between calls) until a terminal response, then publish.
    Returns the last compute status, the number of batches and the publication."""
    batches = 0
    while True:
        result = compute(conn, claim)
        if result.status != "batch_pending":
            break
        batches += 1
    if result.status != "computed":
        return result.status, batches, None
    return "computed", max(batches, 1), publish(conn, claim)


def drain(conn: Connection, lock_owner: str, max_rounds: int = 50) -> DrainSummary:
    """Work through claims until none is left or the round budget is spent."""
    published: list[tuple[UUID, int, int]] = []
    deferred = rejected = failed = rounds = 0
    while rounds < max_rounds:
        claimed = claim(conn, lock_owner)
        if claimed is None:
            break
        rounds += 1
        status, batches, publication = process_claim(conn, claimed)
        if publication is not None and publication.status == "published":
            published.append((claimed.user_id, claimed.target_version, batches))
        elif publication is not None and publication.status == "rejected":
            rejected += 1
        elif status == "retry_pending":
            deferred += 1
        else:
            failed += 1
    return DrainSummary(tuple(published), deferred, rejected, failed, rounds)


def _remaining(conn: Connection, user_id: UUID | None = None) -> int:
    row = repo.one(conn, "remaining_users", {"user_id": user_id})
    return 0 if row is None else int(row["users"])


def process_one_account(conn: Connection, lock_owner: str) -> AccountResult:
    """The one-owner synchronous door: exactly one account per call; a caller drains by
    looping while has_more. A pending batch is deferred, not counted as completed."""
    claimed = claim(conn, lock_owner)
    if claimed is None:
        remaining = _remaining(conn)
        return AccountResult(None, "idle", None, remaining > 0, remaining)
    status, batches, publication = process_claim(conn, claimed)
    remaining = _remaining(conn)
    outcome: Any
    if publication is not None:
        outcome = "published" if publication.status == "published" else "rejected"
    else:
        outcome = "deferred" if status == "retry_pending" else "failed"
    return AccountResult(
        claimed.user_id, outcome, claimed.target_version, remaining > 0, remaining, batches
    )


def process_user(conn: Connection, user_id: UUID, lock_owner: str) -> AccountResult:
    """The scoped single-user processor: claim, compute and publish inside one
    subtransaction. Exactly a statement timeout (57014, "canceling statement due to
    statement timeout") rolls it back and reports worker_timed_out with the job still
    pending; any other cancellation is re-raised. An account that needs batches is
    deferred to the worker (batches need their own transactions)."""
    try:
        with transaction(conn):
            claimed = claim(conn, lock_owner, user_id)
            if claimed is None:
                remaining = _remaining(conn, user_id)
                return AccountResult(user_id, "idle", None, remaining > 0, remaining)
            result = compute(conn, claimed, record_interruptions=False)
            if result.status != "computed":
                raise _Deferred(result.status)
            publication = publish(conn, claimed)
    except _Deferred:
        remaining = _remaining(conn, user_id)
        return AccountResult(user_id, "deferred", None, remaining > 0, remaining)
    except DatabaseError as exc:
        if is_error(exc, STATEMENT_TIMEOUT) and str(exc).startswith(TIMEOUT_MESSAGE):
            remaining = _remaining(conn, user_id)
            return AccountResult(user_id, "worker_timed_out", None, remaining > 0, remaining)
        raise
    remaining = _remaining(conn, user_id)
    outcome: Any = "published" if publication.status == "published" else "rejected"
    return AccountResult(user_id, outcome, claimed.target_version, remaining > 0, remaining, 1)


class _Deferred(Exception):
    """Roll the scoped subtransaction back: the account goes to the worker."""


def pending_jobs(conn: Connection) -> int:
    row = repo.one(conn, "pending_work")
    return 0 if row is None else int(row["jobs"])


def waiting_work(conn: Connection) -> int:
    """What a drain would pick up now (the sensor's question)."""
    row = repo.one(conn, "waiting_work")
    return 0 if row is None else int(row["waiting"])


def worker_status(conn: Connection) -> dict[str, Any]:
    row = repo.one(conn, "worker_status")
    return {} if row is None else dict(row["status"])


def request_rebuild(conn: Connection, user_ids: list[UUID] | None) -> RebuildProgress:
    """Enqueue full-history ranges through the queue (never around it), one user per
    transaction (see `rebuild.py`)."""
    return rebuild.request_rebuild(conn, user_ids)


def read_pr_overview(conn: Connection, user_id: UUID, as_of: Any) -> list[dict[str, Any]]:
    """The fail-closed reader: raises (SQLSTATE 55000) unless the applied generation has a
    snapshot for exactly this date."""
    return repo.many(conn, "read_pr_overview", {"user_id": user_id, "as_of": as_of})
