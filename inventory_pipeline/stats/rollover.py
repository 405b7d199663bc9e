"""The PR overview rollover: at midnight only the three-day window moves.

Each due user, in a transaction of its own, gets the applied generation's window moved
to the database date -1, 0 and +1: the new dates are built from the generation's latest
earlier snapshot and the facts after it, so a day's cost follows the days moved, not the
length of the history. The reader's fence holds: the window belongs to the applied
generation (read and written while the user's state row is held, so no publication or
write can interleave), is built in one transaction, and is never built for a generation
older than the applied one. A user whose newer generation is pending waits for it (its
publication builds a fresh window); a user whose state row is busy fails the attempt and
retries with backoff, as the operator's overview shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from inventory_pipeline.db import Connection, DatabaseError, savepoint, transaction
from inventory_pipeline.stats import maintenance_repository as repo

ROLLOVER_PAGE = 100
ROLLOVER_PAGE_MAX = 1000
STATE_BUSY = "stats state locked by a save or publication in progress"


@dataclass(frozen=True)
class RolloverResult:
    """One rollover tick: windows moved, users waiting for a pending generation, and
    failed attempts."""

    rolled: int
    failed: int
    deferred: int = 0

    @property
    def requested(self) -> int:
        """Windows moved (the name callers of the former generation request used)."""
        return self.rolled


def _error_line(exc: DatabaseError) -> str:
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return first[:200]


def roll_one(conn: Connection, handled: list[UUID]) -> str | None:
    """Roll the next due user not in `handled` in one transaction (and add it there);
    returns 'rolled', 'deferred' or 'failed', or None when nobody is due."""
    with transaction(conn):
        repo.set_lock_timeout(conn)
        user_id = repo.rollover_next(conn, handled)
        if user_id is None:
            return None
        handled.append(user_id)
        versions = repo.rollover_lock_state(conn, user_id)
        if versions is None:
            repo.rollover_failed(conn, user_id, STATE_BUSY)
            return "failed"
        if versions.requested_version != versions.applied_version:
            repo.rollover_deferred(conn, user_id)
            return "deferred"
        try:
            with savepoint(conn):
                repo.rollover_window(conn, user_id, versions.applied_version)
                repo.schedule_rollover(conn, user_id, versions.applied_version)
        except DatabaseError as exc:
            repo.rollover_failed(conn, user_id, _error_line(exc))
            return "failed"
        return "rolled"


def rollover(conn: Connection, limit: int = ROLLOVER_PAGE) -> RolloverResult:
    """Up to `limit` due users, one per transaction."""
    limit = max(1, min(limit, ROLLOVER_PAGE_MAX))
    counts = {"rolled": 0, "deferred": 0, "failed": 0}
    handled: list[UUID] = []
    for _ in range(limit):
        outcome = roll_one(conn, handled)
        if outcome is None:
            break
        counts[outcome] += 1
    return RolloverResult(counts["rolled"], counts["failed"], counts["deferred"])


def rollover_overview(conn: Connection) -> dict[str, Any]:
    """Due backlog, attempts, oldest success and the latest error."""
    return repo.rollover_overview(conn)
