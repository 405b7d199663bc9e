"""The planner under a whole-population backlog: most dirty libraries already hold an
active request, and a tick must neither walk them once per pass nor miss or repeat a
library that needs planning."""

from __future__ import annotations

import pytest

from inventory_pipeline.db import Connection, connect, execute, fetch_all, fetch_one
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.models import RefreshPolicy

BACKLOG = 300
EVERY = 6  # one library in six has no active request yet

LIBRARIES = """
INSERT INTO libraries (server_id, name, media_kind)
SELECT %(server)s, 'library ' || g, 'movie' FROM generate_series(1, %(n)s) g
"""
# Distinct ages (oldest first by id) or one shared age (a burst in one statement).
DIRTY = """
UPDATE library_inventory_state
SET revision = 1, changed_at = now(),
    dirty_since = CASE WHEN %(same)s THEN now()
                       ELSE now() - make_interval(secs => 10000 - library_id) END
"""
# Every library but one in EVERY already queued: the backlog a planner walks past.
QUEUED = """
INSERT INTO profile_refresh_requests (library_id, kind, source, reason, inventory_revision)
SELECT library_id, 'inventory_change', 'inventory_revision', 'inventory_changed', 1
FROM library_inventory_state
WHERE library_id %% %(every)s <> 0
"""


def backlog(conn: Connection, same_age: bool) -> list[int]:
    """BACKLOG dirty libraries, all but one in EVERY with a pending request; returns the
    ones without, oldest first."""
    row = fetch_one(
        conn, "INSERT INTO media_servers (name, kind) VALUES ('scale', 'plex') RETURNING id"
    )
    assert row is not None
    execute(conn, LIBRARIES, {"server": row["id"], "n": BACKLOG})
    execute(conn, DIRTY, {"same": same_age})
    execute(conn, QUEUED, {"every": EVERY})
    execute(conn, "ANALYZE")
    rows = fetch_all(
        conn,
        "SELECT library_id FROM library_inventory_state WHERE library_id %% %(every)s = 0"
        " ORDER BY dirty_since, library_id",
        {"every": EVERY},
    )
    return [int(r["library_id"]) for r in rows]


@pytest.mark.parametrize("same_age", [False, True], ids=["distinct ages", "one burst"])
def test_tick_plans_each_dirty_library_once_past_a_backlog(
    conn: Connection, same_age: bool
) -> None:
    """Passes continue the walk where the previous one stopped: every library without
    an active request is planned once, oldest first, whatever lies between them."""
    waiting = backlog(conn, same_age)
    plan = service.plan(conn, RefreshPolicy())
    planned = [p.library_id for p in plan.inventory]
    assert len(planned) == len(set(planned)) == len(waiting) == BACKLOG // EVERY
    # Each pass queues its 25 in library-id order; the passes go oldest first.
    assert [sorted(planned[i : i + 25]) for i in range(0, len(planned), 25)] == [
        sorted(waiting[i : i + 25]) for i in range(0, len(waiting), 25)
    ]
    assert all(p.inventory_revision == 1 for p in plan.inventory)
    assert service.plan(conn, RefreshPolicy()).planned == 0
    active = fetch_one(
        conn,
        "SELECT count(*) AS n, count(DISTINCT library_id) AS libraries"
        " FROM profile_refresh_requests WHERE status = 'pending'",
    )
    assert active is not None and active["n"] == active["libraries"] == BACKLOG


def dirty_index_reads(db_url: str) -> int:
    """Index entries read from the dirty index so far, as the statistics show them."""
    with connect(db_url) as reader:
        execute(reader, "SELECT pg_stat_clear_snapshot()")
        row = fetch_one(
            reader,
            "SELECT idx_tup_read FROM pg_stat_user_indexes"
            " WHERE indexrelname = 'library_inventory_state_dirty'",
        )
    assert row is not None
    return int(row["idx_tup_read"])


def flush_statistics(conn: Connection) -> None:
    """Make this session's counters visible to others: flushed when it next goes idle."""
    execute(conn, "SELECT pg_stat_force_next_flush()")
    execute(conn, "SELECT 1")


def test_tick_walks_the_backlog_once_not_once_per_pass(conn: Connection, db_url: str) -> None:
    """With the dirty index driving the walk, a tick of several passes reads each dirty
    library about once (not every backlogged library again in every pass)."""
    backlog(conn, same_age=False)
    # The plan a large table gets (what a small test table would not): index walks.
    execute(conn, "SET enable_seqscan = off")
    execute(conn, "SET enable_bitmapscan = off")
    execute(conn, "SET enable_hashjoin = off")
    flush_statistics(conn)
    before = dirty_index_reads(db_url)
    plan = service.plan(conn, RefreshPolicy())
    flush_statistics(conn)
    read = dirty_index_reads(db_url) - before
    assert len(plan.inventory) == BACKLOG // EVERY
    # One walk over the BACKLOG entries plus the lock steps (450 here); a walk from the
    # start in every pass reads the backlog once per pass (900 over this tick's 3 passes).
    assert read < 2 * BACKLOG, f"{read} dirty-index entries read for {BACKLOG} dirty libraries"
