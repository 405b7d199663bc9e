"""Bounded stats maintenance: catalog invalidation, the backfill scanner and history
retention (the rollover is in `rollover.py`, the operator's rebuild in `rebuild.py`).

No transaction spans more than one user: every pass over users takes one user per
transaction and keeps its position in a row (the catalog pass in its token row, the
scanner in its cursor row), so a restart resumes it and one failing user never holds up
the users after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from inventory_pipeline.db import Connection, DatabaseError, DatabaseUnavailable, transaction
from inventory_pipeline.stats import maintenance_repository as repo
from inventory_pipeline.stats.maintenance_repository import MaintenanceDue
from inventory_pipeline.stats.rebuild import ABANDONED_SECONDS
from inventory_pipeline.stats.rollover import (
    ROLLOVER_BUDGET_SECONDS,
    ROLLOVER_PACE,
    RolloverResult,
    rollover,
    rollover_overview,
)

CATALOG_USER_PAGE = 100
SCAN_PAGE = 500
RETENTION_DAYS = 7
RETENTION_BATCH = 5000

__all__ = [
    "CATALOG_USER_PAGE",
    "RETENTION_BATCH",
    "RETENTION_DAYS",
    "ROLLOVER_BUDGET_SECONDS",
    "ROLLOVER_PACE",
    "SCAN_PAGE",
    "MaintenanceDue",
    "RolloverResult",
    "ScanResult",
    "due",
    "process_catalog",
    "prune",
    "rollover",
    "rollover_overview",
    "scan",
]


def _personal_step(conn: Connection, skipped: list[str]) -> bool | None:
    """Answer one personal catalog scope: only its owner gets a generation. Returns
    True when answered, False when its request failed (the scope joins `skipped` and is
    answered next time), None when no scope is left."""
    scope: tuple[str, int] | None = None
    try:
        with transaction(conn):
            repo.set_lock_timeout(conn)
            scope = repo.catalog_next_personal(conn, skipped)
            if scope is None:
                return None
            owner, token = scope
            repo.request_generation(conn, UUID(owner), "catalog_changed", "catalog changed", None)
            repo.personal_scope_done(conn, owner, token)
            return True
    except DatabaseUnavailable:
        raise
    except DatabaseError:
        if scope is None:
            raise
        skipped.append(scope[0])
        return False


def _global_step(conn: Connection) -> tuple[bool, bool]:
    """One user of the global pass: (a user was requested, the pass may go on)."""
    with transaction(conn):
        repo.set_lock_timeout(conn)
        scope = repo.catalog_global_pass(conn)
        if scope is None:
            return False, False
        # A running pass is never restarted; a later token waits for the follow-up pass.
        pass_token = scope.pass_token if scope.pass_token is not None else scope.token
        user_id = repo.user_after(conn, scope.cursor)
        if user_id is None:
            repo.global_pass_progress(conn, pass_token, None, done=True)
            return False, False
        repo.request_generation(conn, user_id, "catalog_changed", "catalog changed", None)
        repo.global_pass_progress(conn, pass_token, user_id, done=False)
        return True, True


def process_catalog(conn: Connection, page: int = CATALOG_USER_PAGE) -> int:
    """Answer catalog change tokens, one user per transaction: each personal change
    requests its owner; a global change pages through users (at most `page` per call).
    Returns the users requested. A personal scope whose request fails (its user's lock
    not available in time) is answered next time without holding up the others; a
    global pass stops at such a user and resumes there next time."""
    requested = 0
    skipped: list[str] = []
    while requested + len(skipped) < page:
        answered = _personal_step(conn, skipped)
        if answered is None:
            break
        requested += int(answered)
    global_users = 0
    more = True
    try:
        while more and global_users < page:
            asked, more = _global_step(conn)
            global_users += int(asked)
    except DatabaseUnavailable:
        raise
    except DatabaseError:
        pass  # the pass resumes at this user next time; never skipped
    return requested + global_users


@dataclass(frozen=True)
class ScanResult:
    """One scanner page: stale users merged into the queue, users whose request failed
    (found again next lap), whether the page ended a lap, and whether no page was read
    because another scanner holds the cursor."""

    stale: tuple[tuple[UUID, str], ...]
    failed: tuple[UUID, ...]
    lap_done: bool
    busy: bool = False


def scan(conn: Connection, limit: int = SCAN_PAGE) -> ScanResult:
    """One page of the backfill scanner. The cursor moves past the page before its users
    are looked at, so a page that fails cannot keep the scanner from later users; each
    stale user is requested in its own transaction as `scheduled_stats_backfill` with a
    full-history range."""
    with transaction(conn):
        page = repo.scan_page(conn, limit)
        if page is None:  # another scanner holds the cursor
            return ScanResult((), (), False, busy=True)
        lap_done = len(page.user_ids) < limit
        repo.scan_advance(conn, None if lap_done else page.user_ids[-1])
    if not page.user_ids:
        return ScanResult((), (), lap_done)
    stale = repo.stale_users(conn, page.user_ids)
    found: list[tuple[UUID, str]] = []
    failed: list[UUID] = []
    for user_id, signal in stale:
        try:
            with transaction(conn):
                repo.set_lock_timeout(conn)
                repo.request_generation(
                    conn, user_id, "scheduled_stats_backfill", f"backfill: {signal}", None
                )
            found.append((user_id, signal))
        except DatabaseUnavailable:
            raise
        except DatabaseError:
            failed.append(user_id)
    return ScanResult(tuple(found), tuple(failed), lap_done)


def prune(
    conn: Connection, days: int = RETENTION_DAYS, batch: int = RETENTION_BATCH
) -> dict[str, int]:
    """One bounded retention pass (at most `batch` rows per statement) over the catalog
    change log older than `days` (execution history: the catalog tokens carry every
    request). Refresh jobs and projection runs are the worker's record and are never
    deleted here (docs/training-stats.md#retention)."""
    return {"catalog_changes": repo.prune_catalog_log(conn, days, batch)}


def due(conn: Connection, idle_seconds: int = ABANDONED_SECONDS) -> MaintenanceDue:
    """What a rollover run would find now: due PR overview windows, unanswered catalog
    tokens, rebuilds a killed run left. The rollover sensor launches only when any is."""
    return repo.maintenance_due(conn, idle_seconds)
