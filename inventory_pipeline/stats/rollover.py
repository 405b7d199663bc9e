"""The PR overview rollover: when the database date moves on, each due user gets a new
generation requested through the queue, and the worker publishes it with a window for
the new dates; the applied generation's window is never rewritten.

Each due user is handled in a transaction of its own, in due order: a new generation is
requested (no exercise, the periods from the new date: the publication rebuilds the
window whole), or the user waits when a newer generation is already pending (its
publication builds a fresh window), or, when its state row is busy, the attempt fails
and is retried with backoff, as the operator's overview shows. A requested user is due
again ten minutes later if no publication scheduled its next rollover meanwhile.

A run keeps requesting while users are due, bounded by a time budget (so a run never
holds the maintenance queue for long) and by a pace (so the queue fills no faster than
the worker drains it, and saves made meanwhile keep their freshness): at 100,000 users
the whole population must move within the hour after midnight, so the sensor launches
the next run at once while the run reports due users left.
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

# A rollover run's time budget: one run handles every due user it reaches in this time.
ROLLOVER_BUDGET_SECONDS = 50.0
# Users a second a run requests at most: 100,000 users in under 20 minutes of runs (the
# goal is an hour), below what the worker publishes, so the queue does not grow.
ROLLOVER_PACE = 100.0


@dataclass(frozen=True)
class RolloverResult:
    """One rollover run: generations requested, users waiting for a pending generation,
    failed attempts, and whether it stopped at its budget or limit (due users may be
    left)."""

    requested: int
    failed: int
    deferred: int = 0
    more: bool = False


@dataclass(frozen=True)
class RolledUser:
    """One user's rollover: its place in due order and what happened."""

    position: tuple[datetime, UUID]
    outcome: Literal["requested", "deferred", "failed"]


_OUTCOMES: dict[str, Literal["requested", "deferred", "failed"]] = {
    "requested": "requested",
    "deferred": "deferred",
    "failed": "failed",
}


def roll_one(conn: Connection, after: tuple[datetime, UUID] | None) -> RolledUser | None:
    """The next due user after `after` (in due order), in one transaction and one
    server-side call; None when nobody is due."""
    rolled = repo.request_rollover(conn, after)
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
    counts = {"requested": 0, "deferred": 0, "failed": 0}
    after: tuple[datetime, UUID] | None = None
    started = clock()
    deadline = started + budget_seconds
    handled = 0
    while True:
        done = roll_one(conn, after)
        if done is None:
            return RolloverResult(counts["requested"], counts["failed"], counts["deferred"])
        counts[done.outcome] += 1
        handled += 1
        after = done.position
        if (limit is not None and handled >= limit) or clock() >= deadline:
            return RolloverResult(
                counts["requested"], counts["failed"], counts["deferred"], more=True
            )
        if pace is not None:
            ahead = started + handled / pace - clock()
            if ahead > 0:
                sleep(min(ahead, deadline - clock()))


def rollover_overview(conn: Connection) -> dict[str, Any]:
    """Due backlog, attempts, oldest success and the latest error."""
    return repo.rollover_overview(conn)
