"""Settling the stats side: the operator's runbook retries what the product calls stale,
and what the product records as owed or stale after settling is a divergence."""

from __future__ import annotations

import uuid
from datetime import date

from chaos import invariants
from chaos.run import retry_exhausted
from inventory_pipeline.db import Connection, execute, fetch_all
from inventory_pipeline.stats import service
from tests import stats_factories as sf

TODAY = date(2026, 11, 30)


def _failed_job(conn: Connection, user: uuid.UUID) -> int:
    """The user's pending job fails as exhausted attempts leave it."""
    [job] = [j for j in sf.jobs(conn, user) if j["status"] == "pending"]
    execute(
        conn,
        "UPDATE user_exercise_stats_refresh_jobs SET status = 'failed',"
        " error_message = 'attempts exhausted', completed_at = now() WHERE id = %s",
        (job["id"],),
    )
    return int(job["id"])


def test_an_owed_range_and_a_stale_user_after_settling_are_seen(conn: Connection) -> None:
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    failed = _failed_job(conn, user)
    assert invariants.nothing_owed(conn) == [
        f"user {user}: owes a range (from {TODAY}, failed jobs [{failed}]) after settling",
        f"user {user}: stats stale after settling",
        "status function: owed_users = 1 after settling",
        "status function: stale_users = 1 after settling",
    ]


def test_the_runbook_retries_only_what_the_product_calls_stale(conn: Connection) -> None:
    """A stale user's exhausted job is retried and published; an exhausted job of a user
    the product calls current is left for the checks (a range dropped silently)."""
    sf.exercise(conn, "squat")
    stale, current = uuid.uuid4(), uuid.uuid4()
    for user in (stale, current):
        sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    failed = _failed_job(conn, stale)
    silent = _failed_job(conn, current)
    # The product forgets the current user's range: nothing owed, applied caught up.
    execute(conn, "DELETE FROM user_stats_owed_ranges WHERE user_id = %s", (current,))
    execute(
        conn,
        "UPDATE user_stats_refresh_state SET applied_version = requested_version"
        " WHERE user_id = %s",
        (current,),
    )
    assert retry_exhausted(conn) == 1
    assert retry_exhausted(conn) == 0  # retried already
    while service.drain(conn, "test").rounds:
        pass
    assert invariants.nothing_owed(conn) == []
    assert [line.split(":")[0] for line in invariants.owed_ranges(conn)] == [f"user {current}"]
    assert f"failed job {silent} " in invariants.owed_ranges(conn)[0]
    retried = fetch_all(
        conn,
        "SELECT id FROM user_exercise_stats_refresh_jobs WHERE metadata ? 'retried_by'",
    )
    assert [r["id"] for r in retried] == [failed]


def test_stats_read_as_current_while_a_range_is_owed_are_seen(conn: Connection) -> None:
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    failed = _failed_job(conn, user)
    assert invariants.current_while_owed(conn) == []  # the product says stale
    execute(conn, "DELETE FROM user_stats_owed_ranges WHERE user_id = %s", (user,))
    assert invariants.current_while_owed(conn) == []  # still behind: requested > applied
    execute(
        conn,
        "UPDATE user_stats_refresh_state SET applied_version = requested_version"
        " WHERE user_id = %s",
        (user,),
    )
    assert invariants.current_while_owed(conn) == [
        f"user {user}: stats read as current while the range of failed job {failed} was owed"
    ]
