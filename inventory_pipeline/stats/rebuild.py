"""An operator's rebuild: full-history generations for chosen users or every user,
requested through the queue one user per transaction.

A rebuild is a pass row with a position. Each step enqueues the next user and moves the
position in the same transaction, so no transaction holds more than one user's locks (a
save for any user commits while a rebuild of every user runs), the lock table never
grows with the number of users, and a killed pass resumes after the last user it
committed: never from the start, never skipping one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from uuid import UUID

from inventory_pipeline.db import Connection, transaction
from inventory_pipeline.stats import maintenance_repository as repo

# A pass nobody has stepped for this long lost its driver; the maintenance tick resumes it.
ABANDONED_SECONDS = 60
RESUME_USERS_PER_TICK = 5000


@dataclass(frozen=True)
class RebuildProgress:
    """Where one pass stands after a drive: users it has enqueued in all, whether it is
    finished, and how many of them this drive enqueued."""

    pass_id: int
    requested: int
    finished: bool
    enqueued_now: int


def start_rebuild(conn: Connection, user_ids: Sequence[UUID] | None) -> int:
    """Record a rebuild pass (None: every user) and return its id; enqueues nobody yet."""
    with transaction(conn):
        return repo.rebuild_start(conn, None if user_ids is None else list(user_ids))


def continue_rebuild(
    conn: Connection, pass_id: int, max_users: int | None = None
) -> RebuildProgress:
    """Step one pass, one user per transaction (one statement in autocommit), until it
    is finished or `max_users` users were enqueued."""
    enqueued = requested = 0
    finished = False
    while max_users is None or enqueued < max_users:
        step = repo.rebuild_step(conn, pass_id)
        if step is None:  # finished by another driver
            finished = True
            break
        requested = step.requested
        if step.finished:
            finished = True
            break
        enqueued += 1
    return RebuildProgress(pass_id, requested, finished, enqueued)


def resume_rebuilds(
    conn: Connection,
    max_users: int | None = RESUME_USERS_PER_TICK,
    idle_seconds: int = ABANDONED_SECONDS,
) -> list[RebuildProgress]:
    """Drive unfinished passes nobody stepped for `idle_seconds`, oldest first, with at
    most `max_users` users enqueued in all (None: to their end)."""
    progress: list[RebuildProgress] = []
    budget = max_users
    for pass_id in repo.rebuild_open_passes(conn, idle_seconds):
        if budget is not None and budget <= 0:
            break
        done = continue_rebuild(conn, pass_id, budget)
        progress.append(done)
        if budget is not None:
            budget -= done.enqueued_now
    return progress


def request_rebuild(conn: Connection, user_ids: Sequence[UUID] | None) -> RebuildProgress:
    """Rebuild chosen users (None: every user with sessions or a stats state) and drive
    the pass to its end. Passes a killed rebuild left unfinished are finished first."""
    resume_rebuilds(conn, max_users=None, idle_seconds=0)
    pass_id = start_rebuild(conn, user_ids)
    return continue_rebuild(conn, pass_id)
