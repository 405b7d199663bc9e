"""No maintenance transaction spans more than one user: the operator's rebuild, the
backfill scanner and the catalog pass take one user per transaction, keep their
position in a row, resume after a kill, and never make a save wait."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import date

from inventory_pipeline.db import (
    Connection,
    DatabaseError,
    DatabaseUnavailable,
    connect,
    execute,
    fetch_all,
    fetch_one,
)
from inventory_pipeline.stats import maintenance, rebuild, service
from tests import stats_factories as sf

TODAY = date(2026, 3, 10)

USERS_WITH_SESSIONS = """
INSERT INTO training_sessions (id, user_id, session_date)
SELECT md5('s' || u)::uuid, md5('u' || u)::uuid, date '2025-01-01' + u %% 300
FROM generate_series(1, %(users)s) AS u
"""


def load_users(conn: Connection, users: int) -> list[uuid.UUID]:
    """`users` users with one session each, written in one statement (a rebuild's input,
    not a workout log: no state rows, no jobs)."""
    execute(conn, USERS_WITH_SESSIONS, {"users": users})
    execute(conn, "ANALYZE training_sessions")
    rows = fetch_all(conn, "SELECT DISTINCT user_id FROM training_sessions ORDER BY 1")
    return [r["user_id"] for r in rows]


def visited(conn: Connection, rebuild_pid: int) -> int:
    """Users the rebuild has reached: committed enqueues, or user locks its session holds."""
    row = fetch_one(
        conn,
        "SELECT (SELECT count(*) FROM user_exercise_stats_refresh_jobs) AS committed,"
        " (SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'advisory') AS held",
        (rebuild_pid,),
    )
    assert row is not None
    return max(int(row["committed"]), int(row["held"]))


def test_rebuild_of_100k_users_with_default_lock_table_never_makes_a_save_wait(
    conn: Connection, db_url: str
) -> None:
    row = fetch_one(conn, "SHOW max_locks_per_transaction")
    assert row is not None and row["max_locks_per_transaction"] == "64"
    sf.exercise(conn, "squat")
    users = load_users(conn, 100_000)
    errors: list[BaseException] = []
    pid: list[int] = []

    def run_rebuild() -> None:
        with connect(db_url) as c:
            backend = fetch_one(c, "SELECT pg_backend_pid() AS pid")
            assert backend is not None
            pid.append(int(backend["pid"]))
            try:
                service.request_rebuild(c, None)
            except BaseException as exc:
                errors.append(exc)

    worker = threading.Thread(target=run_rebuild)
    worker.start()
    saves: list[tuple[int, str]] = []
    during: list[bool] = []
    with connect(db_url) as saver:
        # A save that had to wait for the rebuild fails instead of waiting.
        execute(saver, "SET lock_timeout = '2s'")
        for reached in (1_000, 50_000):
            while worker.is_alive() and (not pid or visited(conn, pid[0]) < reached):
                time.sleep(0.05)
            # The first user is behind the rebuild's position, the last one ahead of it.
            for user in (users[0], users[-1]):
                try:
                    sf.save(saver, user, TODAY, sf.sets(("squat", 100, 5)))
                    saves.append((reached, "committed"))
                except DatabaseError as exc:
                    saves.append((reached, f"{exc.sqlstate}: {exc}"))
            during.append(worker.is_alive())  # the saves were issued while it ran
    worker.join()
    failures = [(type(e).__name__, getattr(e, "sqlstate", None), str(e)) for e in errors]
    assert (failures, saves, during) == (
        [],
        [(1_000, "committed")] * 2 + [(50_000, "committed")] * 2,
        [True, True],
    )
    counts = fetch_one(
        conn,
        "SELECT count(DISTINCT user_id) AS users, count(*) AS jobs,"
        " (SELECT sum(requested_version) FROM user_stats_refresh_state) AS bumps"
        " FROM user_exercise_stats_refresh_jobs WHERE status = 'pending'",
    )
    assert counts is not None
    assert counts["users"] == 100_000
    assert counts["bumps"] == 100_000 + 4  # one rebuild request per user, and the saves


def test_killed_rebuild_resumes_where_it_stopped(conn: Connection, db_url: str) -> None:
    sf.exercise(conn, "squat")
    users = load_users(conn, 3_000)
    # Users whose sessions were all deleted still have stats to rebuild.
    emptied = [uuid.uuid4() for _ in range(3)]
    for user in emptied:
        saved = sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
        sf.delete(conn, user, saved["session_id"])
    execute(conn, "DELETE FROM user_exercise_stats_refresh_jobs")
    errors: list[BaseException] = []

    def run_rebuild() -> None:
        with connect(db_url) as c:
            try:
                service.request_rebuild(c, None)
            except BaseException as exc:
                errors.append(exc)

    worker = threading.Thread(target=run_rebuild)
    worker.start()
    done_at_kill = 0
    while done_at_kill < 500:
        row = fetch_one(conn, "SELECT requested FROM stats_rebuild_passes")
        done_at_kill = 0 if row is None else int(row["requested"])
        time.sleep(0.01)
    execute(
        conn,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    worker.join()
    assert len(errors) == 1 and isinstance(errors[0], DatabaseUnavailable)
    killed = fetch_one(conn, "SELECT requested, finished_at FROM stats_rebuild_passes")
    assert killed is not None and killed["finished_at"] is None
    assert 500 <= killed["requested"] < 3_003

    [resumed] = rebuild.resume_rebuilds(conn, max_users=None, idle_seconds=0)
    assert resumed.finished and resumed.requested == 3_003
    assert resumed.enqueued_now == 3_003 - killed["requested"]  # not from the start
    # Every user exactly once: one pending job and one requested generation each.
    per_user = fetch_all(
        conn,
        "SELECT s.user_id, s.requested_version, count(j.id) AS jobs"
        " FROM user_stats_refresh_state s"
        " LEFT JOIN user_exercise_stats_refresh_jobs j ON j.user_id = s.user_id"
        " GROUP BY 1, 2",
    )
    expected = {u: 1 for u in users} | {u: 3 for u in emptied}  # save, delete, rebuild
    assert {r["user_id"]: r["requested_version"] for r in per_user} == expected
    assert {r["jobs"] for r in per_user} == {1}


def test_rebuild_of_chosen_users_walks_the_list(conn: Connection) -> None:
    sf.exercise(conn, "squat")
    a, b = uuid.uuid4(), uuid.uuid4()
    sf.save(conn, a, TODAY, sf.sets(("squat", 100, 5)))
    service.drain(conn, "test")
    progress = rebuild.request_rebuild(conn, [b, a, b])  # b has no data yet: still asked
    assert (progress.requested, progress.finished) == (2, True)
    assert sf.versions(conn, a) == (2, 1) and sf.versions(conn, b) == (1, 0)
    assert rebuild.request_rebuild(conn, []).requested == 0


def hold_enqueue_lock(holder: Connection, user: uuid.UUID) -> None:
    """Another transaction is enqueueing for this user and does not finish."""
    execute(
        holder,
        "SELECT pg_advisory_lock(hashtextextended('stats_enqueue:' || %s::text, 0))",
        (user,),
    )


def test_a_failing_scanner_page_does_not_starve_later_users(conn: Connection, db_url: str) -> None:
    execute(conn, "SET lock_timeout = '1s'")  # no statement of the scanner waits longer
    sf.exercise(conn, "squat")
    users = sorted(uuid.uuid4() for _ in range(5))
    for user in users:
        sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    # Lost jobs: sessions without rollups for every user.
    execute(conn, "UPDATE user_exercise_stats_refresh_jobs SET status = 'completed'")
    with connect(db_url) as holder:
        hold_enqueue_lock(holder, users[0])
        pages = [maintenance.scan(conn, limit=2) for _ in range(3)]
    assert [p.stale for p in pages] == [
        ((users[1], "sessions without rollups"),),
        tuple((u, "sessions without rollups") for u in users[2:4]),
        ((users[4], "sessions without rollups"),),
    ]
    assert pages[0].failed == (users[0],)
    assert [p.lap_done for p in pages] == [False, False, True]
    # The next lap finds the user whose request failed.
    assert maintenance.scan(conn, limit=2).stale == ((users[0], "sessions without rollups"),)


def test_catalog_pass_takes_one_user_per_transaction(conn: Connection, db_url: str) -> None:
    execute(conn, "SET lock_timeout = '1s'")
    sf.exercise(conn, "squat")
    users = sorted(uuid.uuid4() for _ in range(4))
    for user in users:
        sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    service.drain(conn, "test")
    maintenance.process_catalog(conn)  # the fixture's own exercise insert
    service.drain(conn, "test")
    sf.exercise(conn, "deadlift")  # a global change
    with connect(db_url) as holder:
        hold_enqueue_lock(holder, users[2])
        # The users before the held one are requested and committed; the pass stops there.
        assert maintenance.process_catalog(conn, page=10) == 2
        with connect(db_url) as observer:
            pending = fetch_all(
                observer,
                "SELECT DISTINCT user_id FROM user_exercise_stats_refresh_jobs"
                " WHERE status = 'pending' ORDER BY 1",
            )
        assert [r["user_id"] for r in pending] == users[:2]
    # Released: the pass resumes at the user it stopped at, never from the start.
    assert maintenance.process_catalog(conn, page=10) == 2
    assert all(sf.versions(conn, u)[0] == 3 for u in users)


def test_a_failing_personal_scope_does_not_hold_up_the_others(
    conn: Connection, db_url: str
) -> None:
    execute(conn, "SET lock_timeout = '1s'")
    sf.exercise(conn, "squat")
    maintenance.process_catalog(conn)  # the global insert above (nobody has stats yet)
    first, second = sorted(uuid.uuid4() for _ in range(2))
    sf.exercise(conn, "my_curl", owner=first)
    sf.exercise(conn, "my_row", owner=second)
    with connect(db_url) as holder:
        hold_enqueue_lock(holder, first)
        assert maintenance.process_catalog(conn) == 1
        assert sf.versions(conn, second) == (1, 0) and sf.versions(conn, first) == (0, 0)
    assert maintenance.process_catalog(conn) == 1
    assert sf.versions(conn, first) == (1, 0)
    assert maintenance.process_catalog(conn) == 0
