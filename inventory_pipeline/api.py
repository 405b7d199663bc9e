"""The public Python API: what another program (an application, a learning flow) may
import and call. Everything else in the package is internal and may change.

Each function takes a connection from `connect` (autocommit, dict rows) and owns its
transactions as its docstring says; called inside the caller's `transaction(conn)` it
joins that transaction instead (a subtransaction where it opens one), so its effect
commits or rolls back with the caller's. Database refusals raise `DatabaseError`, whose
`sqlstate` names the cause.

`request_learning_refresh` and `process_user` run as the pipeline's own role (the one
that applies the migrations). `read_pr_overview` also serves the application role
`inventory_app`, once the session sets `inventory.current_user_id` to the user it reads
(another user, or no user set, is refused with SQLSTATE 42501).
"""

from __future__ import annotations

from datetime import date
from uuid import UUID

from inventory_pipeline.db import Connection, DatabaseError, connect, transaction
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.stats import service as stats
from inventory_pipeline.stats.models import AccountResult, PrExercise, PrOverview

__all__ = [
    "AccountResult",
    "Connection",
    "DatabaseError",
    "PrExercise",
    "PrOverview",
    "connect",
    "process_user",
    "read_pr_overview",
    "request_learning_refresh",
    "transaction",
]


def request_learning_refresh(
    conn: Connection,
    library_id: int,
    learning_id: int,
    classification_id: int,
    candidate_id: int | None = None,
) -> int | None:
    """Queue a refresh of a library's profile on behalf of the learning flow.

    The learning flow calls it when a learning result (a classification, optionally a
    candidate) concerns a library: the profile is regenerated through the same outbox,
    lease and acknowledgement path as an inventory change, and the request carries the
    learning identifiers. Returns the request's id, or None when the library already has
    a pending or running request (of any kind): then nothing is queued.

    Transaction: one INSERT. On an autocommit connection it commits at once; inside the
    caller's transaction it commits with it, so the caller can queue the refresh
    atomically with its own writes. An unknown or deleted library raises `DatabaseError`
    (SQLSTATE 23503).

    Example::

        with connect(url) as conn:
            request_id = request_learning_refresh(conn, 12345, learning_id=7,
                                                  classification_id=3)
    """
    return profiles.request_learning_refresh(
        conn, library_id, learning_id, classification_id, candidate_id
    )


def process_user(conn: Connection, user_id: UUID, lock_owner: str) -> AccountResult:
    """Claim, compute and publish one user's pending stats now, in the caller's process.

    An application calls it right after saving a user's training session (through
    `save_training_session`) when it wants that user's stats published before it
    answers, instead of waiting for the Dagster drain. `lock_owner` names the caller on
    the claim (e.g. "app"). The result's `outcome`: `published` (its `generation` is now
    applied), `rejected` (the computed payload could not be published: an older
    generation, a moved base or a deleted row; its range went to a newer job),
    `idle` (nothing claimable for the user now: no pending job, the worker paused, every
    lease slot taken, or another claim holding the user), `deferred` (the account needs
    batched computation, or its run waits out a retry: the worker publishes it) or
    `worker_timed_out` (a stage ran out of its statement budget: the job stays pending
    for the worker). `has_more`
    says whether the user still has pending or processing work.

    Transaction: claim, compute and publish run in one transaction (a subtransaction
    inside the caller's, which must then commit for the publication to count). A
    statement timeout rolls it back and is reported, never raised; any other database
    error is raised with nothing changed.

    Example::

        with connect(url) as conn:
            result = process_user(conn, user_id, "app")
            if result.outcome == "published":
                overview = read_pr_overview(conn, user_id, date.today())
    """
    return stats.process_user(conn, user_id, lock_owner)


def read_pr_overview(conn: Connection, user_id: UUID, as_of: date) -> PrOverview:
    """A user's PR overview for one date: the generation it serves, whether it is
    stale, and one entry per exercise.

    An application calls it to show a user's personal records. It reads the snapshot
    of the user's applied generation for exactly that date; snapshots exist for the
    database date and the day either side, and nothing is computed at read time. It
    fails closed: for any other date, or a user with no published stats, it raises
    `DatabaseError` with SQLSTATE 55000 rather than answer from another date. `stale` is
    true while a newer generation than the one it serves is requested or a range of the
    user's is owed, so the caller can say the figures are catching up; it says so even
    when `exercises` is empty (a user whose only save is not yet published, or whose
    sessions were all deleted), where "no records" would otherwise read as current.

    Transaction: one read-only statement (the header and the exercises from one
    snapshot); it takes no lock a writer waits for.

    Example::

        with connect(url) as conn:
            overview = read_pr_overview(conn, user_id, date.today())
            for exercise in overview.exercises:
                print(exercise.exercise_id, exercise.best_e1rm_all_time)
            if overview.stale:
                print("catching up")
    """
    return stats.read_pr_overview(conn, user_id, as_of)
