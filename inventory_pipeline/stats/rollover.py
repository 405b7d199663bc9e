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

A run keeps rolling while users are due, bounded by a time budget (so a run never holds
the maintenance queue for long) and never by a page: at 100,000 users the whole
population must move within the hour after midnight, so the sensor launches the next
run at once while the run reports due users left.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from inventory_pipeline.db import Connection
from inventory_pipeline.stats import maintenance_repository as repo

# A rollover run's time budget: one run rolls every due user it reaches in this time.
ROLLOVER_BUDGET_SECONDS = 50.0
# Users a second a run rolls at most: 100,000 users in under 20 minutes of runs (the
# goal is an hour), leaving most of a small machine to session saves meanwhile.
ROLLOVER_PACE = 100.0
STATE_BUSY = "stats state locked by a save or publication in progress"


@dataclass(frozen=True)
class RolloverResult:
    """One rollover run: windows moved, users waiting for a pending generation, failed
    attempts, and whether it stopped at its budget or limit (due users may be left)."""

    rolled: int
    failed: int
    deferred: int = 0
    more: bool = False

    @property
    def requested(self) -> int:
        """Windows moved (the name callers of the former generation request used)."""
        return self.rolled


@dataclass(frozen=True)
class RolledUser:
    """One user's rollover: its place in due order and what happened."""

    position: tuple[datetime, UUID]
    outcome: Literal["rolled", "deferred", "failed"]


_OUTCOMES: dict[str, Literal["rolled", "deferred", "failed"]] = {
    "rolled": "rolled",
    "deferred": "deferred",
    "failed": "failed",
}


def roll_one(conn: Connection, after: tuple[datetime, UUID] | None) -> RolledUser | None:
    """Roll the next due user after `after` (in due order) in one transaction and one
    server-side call; None when nobody is due. The call locks the user's rollover row
    and, without waiting, its state row (busy: a failed attempt), defers a user whose
    newer generation is pending, and moves the window with the next rollover scheduled;
    an error while moving is recorded as a failed attempt."""
    rolled = repo.roll_one(conn, after, STATE_BUSY)
    if rolled is None:
        return None
    due_at, user_id, outcome = rolled
    return RolledUser((due_at, user_id), _OUTCOMES[outcome])


def rollover(
    conn: Connection,
    limit: int | None = None,
    budget_seconds: float = ROLLOVER_BUDGET_SECONDS,
    pace: float | None = ROLLOVER_PACE,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> RolloverResult:
    """Every due user, one per transaction, in due order, until none is due or the run
    has spent `budget_seconds` (or rolled `limit` users, when given); a run always
    handles at least one due user, and a failing user is recorded and passed over. At
    most `pace` users a second (None: as fast as it goes), so the machine's other work,
    session saves above all, keeps its share. `more` says the run stopped with users
    possibly still due."""
    counts = {"rolled": 0, "deferred": 0, "failed": 0}
    after: tuple[datetime, UUID] | None = None
    started = clock()
    deadline = started + budget_seconds
    handled = 0
    while True:
        done = roll_one(conn, after)
        if done is None:
            return RolloverResult(counts["rolled"], counts["failed"], counts["deferred"])
        counts[done.outcome] += 1
        handled += 1
        after = done.position
        if (limit is not None and handled >= limit) or clock() >= deadline:
            return RolloverResult(counts["rolled"], counts["failed"], counts["deferred"], more=True)
        if pace is not None:
            ahead = started + handled / pace - clock()
            if ahead > 0:
                sleep(min(ahead, deadline - clock()))


def rollover_overview(conn: Connection) -> dict[str, Any]:
    """Due backlog, attempts, oldest success and the latest error."""
    return repo.rollover_overview(conn)
