"""A claim reads the live runs and the front of the queue, not the queue's history:
however many runs have finished or jobs wait, and whether the planner's statistics
are current or were taken while the table was empty or short, one claim touches a
handful of the table's pages."""

from __future__ import annotations

import uuid

import pytest

from inventory_pipeline.db import Connection, connect, execute, fetch_one
from inventory_pipeline.stats import service

FINISHED = 3000
PAGES_PER_CLAIM = 60

READ = """
SELECT coalesce(sum(t.heap_blks_hit + t.heap_blks_read), 0)
       + coalesce(sum(t.idx_blks_hit + t.idx_blks_read), 0) AS pages
FROM pg_statio_user_tables t WHERE t.relname = 'user_stats_projection_runs'
"""


def finished_runs(conn: Connection, count: int) -> None:
    """`count` users whose one job ran and published: each run was claimed under a live
    lease and then finished, as a worker leaves it (the old row versions stay behind
    in the live-run indexes until vacuum)."""
    execute(
        conn,
        "SELECT request_stats_refresh(gen_random_uuid(), NULL, '{}', 'test')"
        " FROM generate_series(1, %s)",
        (count,),
    )
    execute(
        conn,
        "INSERT INTO user_stats_projection_runs (job_id, user_id, phase, lease_token,"
        " lease_until, lock_owner, target_version, base_applied_version, exercise_ids)"
        " SELECT j.id, j.user_id, 'claimed', gen_random_uuid(), now() + interval '1 hour',"
        " 'test', j.requested_version, 0, '{}' FROM user_exercise_stats_refresh_jobs j",
    )
    # Finishing them as the stage calls do, each under its own token, is what the fence
    # allows; the setup finishes them all at once without the fence.
    with conn.transaction():
        execute(conn, "SET LOCAL session_replication_role = replica")
        execute(
            conn,
            "UPDATE user_stats_projection_runs SET phase = 'published', finished_at = now()",
        )
        execute(
            conn,
            "UPDATE user_exercise_stats_refresh_jobs SET status = 'completed',"
            " completed_at = now()",
        )


@pytest.mark.parametrize("statistics", ["taken_while_empty", "current"])
def test_a_claim_reads_a_handful_of_pages_however_many_runs_have_finished(
    conn: Connection, db_url: str, statistics: str
) -> None:
    """3,000 finished runs, then two pending jobs claimed in a fresh session (its plans
    are made now): the second claim reads fewer than PAGES_PER_CLAIM pages of the runs
    table and its indexes. Walking the history reads every finished run's page each
    time; a bitmap scan of the live-run index reads the page of every run finished
    within a lease time (it never marks their entries dead)."""
    execute(conn, "ALTER TABLE user_stats_projection_runs SET (autovacuum_enabled = off)")
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 4")
    if statistics == "taken_while_empty":
        execute(conn, "ANALYZE user_stats_projection_runs")
    finished_runs(conn, FINISHED)
    if statistics == "current":
        execute(conn, "ANALYZE user_stats_projection_runs")
    first, second = uuid.uuid4(), uuid.uuid4()
    for user in (first, second):
        execute(conn, "SELECT request_stats_refresh(%s, NULL, '{}', 'test')", (user,))
    execute(conn, "SELECT pg_stat_force_next_flush()")  # the setup's reads are counted
    execute(conn, "SELECT 1")  # before the claim's are

    with connect(db_url) as worker:
        execute(worker, "SET stats_fetch_consistency = 'none'")
        assert service.claim(worker, "test") is not None  # the session's first claim
        execute(worker, "SELECT pg_stat_force_next_flush()")
        before = fetch_one(worker, READ)
        claimed = service.claim(worker, "test")
        execute(worker, "SELECT pg_stat_force_next_flush()")
        after = fetch_one(worker, READ)
    assert claimed is not None and claimed.user_id == second
    assert before is not None and after is not None
    assert after["pages"] - before["pages"] < PAGES_PER_CLAIM, after["pages"] - before["pages"]


PENDING = 5000
WARM_CLAIMS = 7  # past the five custom plans a session makes before a generic one

READ_JOBS = READ.replace("user_stats_projection_runs", "user_exercise_stats_refresh_jobs")


def test_a_claim_reads_the_front_of_a_long_queue(conn: Connection, db_url: str) -> None:
    """Statistics taken while the queue was short (as autovacuum last saw it before a
    rebuild request), then 5,000 pending jobs: a claim made after the session's plans
    settled reads fewer than PAGES_PER_CLAIM pages of the queue table and its indexes.
    A claim that orders every pending job before taking the first reads them all, on
    every claim of a drain."""
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 10")
    execute(
        conn,
        "SELECT request_stats_refresh(gen_random_uuid(), NULL, '{}', 'test')"
        " FROM generate_series(1, 20)",
    )
    execute(conn, "ANALYZE user_exercise_stats_refresh_jobs")
    execute(
        conn,
        "SELECT request_stats_refresh(gen_random_uuid(), NULL, '{}', 'test')"
        " FROM generate_series(1, %s)",
        (PENDING,),
    )
    execute(conn, "SELECT pg_stat_force_next_flush()")  # the setup's reads are counted
    execute(conn, "SELECT 1")  # before the claim's are

    with connect(db_url) as worker:
        execute(worker, "SET stats_fetch_consistency = 'none'")
        for _ in range(WARM_CLAIMS):
            assert service.claim(worker, "test") is not None
        execute(worker, "SELECT pg_stat_force_next_flush()")
        before = fetch_one(worker, READ_JOBS)
        claimed = service.claim(worker, "test")
        execute(worker, "SELECT pg_stat_force_next_flush()")
        after = fetch_one(worker, READ_JOBS)
    assert claimed is not None
    assert before is not None and after is not None
    assert after["pages"] - before["pages"] < PAGES_PER_CLAIM, after["pages"] - before["pages"]
