"""The PR overview window, rollover, catalog invalidation, manual PRs, scanner and
retention on real PostgreSQL. The database date is set per session (the test clock)."""

from __future__ import annotations

import threading
import uuid
from dataclasses import asdict
from datetime import date, timedelta
from decimal import Decimal

import pytest

from inventory_pipeline.db import (
    Connection,
    ObjectNotInPrerequisiteState,
    connect,
    execute,
    fetch_all,
    fetch_one,
)
from inventory_pipeline.stats import maintenance, service
from tests import stats_factories as sf

TODAY = date(2026, 3, 10)


def set_clock(conn: Connection, day: date) -> None:
    execute(conn, "SELECT set_config('inventory.stats_today', %s, false)", (day.isoformat(),))


@pytest.fixture
def user(conn: Connection) -> uuid.UUID:
    set_clock(conn, TODAY)
    sf.exercise(conn, "squat")
    sf.exercise(conn, "bench")
    return uuid.uuid4()


def read(conn: Connection, user: uuid.UUID, day: date) -> dict[str, dict[str, object]]:
    return {e.exercise_id: asdict(e) for e in service.read_pr_overview(conn, user, day).exercises}


def fails_closed(conn: Connection, user: uuid.UUID, day: date) -> bool:
    try:
        service.read_pr_overview(conn, user, day)
    except ObjectNotInPrerequisiteState:
        return True
    return False


def test_pr_values_and_the_three_day_window(conn: Connection, user: uuid.UUID) -> None:
    sf.save(
        conn, user, TODAY - timedelta(days=3), sf.sets(("squat", 100, 5), ("squat", 60, 10, True))
    )
    sf.save(conn, user, TODAY - timedelta(days=40), sf.sets(("squat", 140, 1)))
    sf.save(conn, user, TODAY - timedelta(days=370), sf.sets(("squat", 90, 3)))
    sf.save(conn, user, TODAY + timedelta(days=1), sf.sets(("bench", 80, 5)))
    service.drain(conn, "test")
    today = read(conn, user, TODAY)
    assert set(today) == {"squat"}  # bench only from tomorrow on
    squat = today["squat"]
    assert squat["best_e1rm_all_time"] == Decimal("140.00")
    assert squat["best_e1rm_30d"] == Decimal("116.67")  # 100 x (1 + 5/30)
    assert squat["best_e1rm_30d_prior_year"] == Decimal("99.00")  # 90 x (1 + 3/30)
    assert squat["heaviest_kg"] == Decimal("140.00")
    assert set(read(conn, user, TODAY + timedelta(days=1))) == {"squat", "bench"}
    assert read(conn, user, TODAY - timedelta(days=1))
    # Exactly the window: no other-date reuse, no read-time computation.
    assert fails_closed(conn, user, TODAY + timedelta(days=2))
    assert fails_closed(conn, user, TODAY - timedelta(days=2))
    assert fails_closed(conn, uuid.uuid4(), TODAY)


def test_window_moves_across_midnight_in_a_new_generation(
    conn: Connection, user: uuid.UUID
) -> None:
    sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    service.drain(conn, "test")
    _, applied = sf.versions(conn, user)
    set_clock(conn, TODAY + timedelta(days=1))  # midnight passes
    execute(conn, "UPDATE user_pr_overview_rollover_state SET due_at = now()")  # and it is due
    result = maintenance.rollover(conn)
    assert result == maintenance.RolloverResult(requested=1, failed=0)
    # A generation that recomputes no exercise, only the periods from the new date.
    [job] = [j for j in sf.jobs(conn, user) if j["status"] == "pending"]
    assert (job["event_type"], job["from_date"], job["exercise_ids"]) == (
        "pr_overview_rollover",
        TODAY + timedelta(days=1),
        None,
    )
    assert fails_closed(conn, user, TODAY + timedelta(days=2))  # until it is published
    service.drain(conn, "test")
    applied += 1
    assert sf.versions(conn, user) == (applied, applied)
    assert read(conn, user, TODAY + timedelta(days=2))
    assert fails_closed(conn, user, TODAY - timedelta(days=1))
    headers = fetch_all(
        conn, "SELECT generation, as_of_date FROM user_pr_overview_snapshot_headers ORDER BY 2"
    )
    assert [(h["generation"], h["as_of_date"]) for h in headers] == [
        (applied, TODAY + timedelta(days=d)) for d in (0, 1, 2)
    ]
    state = fetch_one(conn, "SELECT due_at, window_end FROM user_pr_overview_rollover_state")
    assert state is not None and state["window_end"] == TODAY + timedelta(days=2)


def test_rollover_failing_two_days_running_fails_closed_then_recovers(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    service.drain(conn, "test")
    with connect(db_url) as holder, holder.transaction():
        execute(
            holder, "SELECT 1 FROM user_stats_refresh_state WHERE user_id = %s FOR UPDATE", (user,)
        )
        for day in (1, 2):
            set_clock(conn, TODAY + timedelta(days=day))
            execute(conn, "UPDATE user_pr_overview_rollover_state SET due_at = now()")
            assert maintenance.rollover(conn) == maintenance.RolloverResult(requested=0, failed=1)
        overview = maintenance.rollover_overview(conn)
    assert overview["max_attempts"] == 2 and overview["failing_users"] == 1
    assert "lock" in overview["last_error"]
    assert fails_closed(conn, user, TODAY + timedelta(days=2))  # the window ran out
    execute(conn, "UPDATE user_pr_overview_rollover_state SET due_at = now()")
    assert maintenance.rollover(conn).requested == 1
    service.drain(conn, "test")
    assert read(conn, user, TODAY + timedelta(days=2))
    state = fetch_one(
        conn,
        "SELECT attempt_count, last_error, last_success_at FROM user_pr_overview_rollover_state",
    )
    assert state is not None and state["attempt_count"] == 0 and state["last_error"] is None


def test_manual_pr_refreshes_the_snapshot(conn: Connection, user: uuid.UUID) -> None:
    sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    service.drain(conn, "test")
    row = fetch_one(conn, "SELECT save_manual_pr(%s, 'squat', 150, 1, %s) AS r", (user, TODAY))
    assert row is not None
    assert [j["event_type"] for j in sf.jobs(conn, user) if j["status"] == "pending"] == [
        "manual_pr_changed"
    ]
    service.drain(conn, "test")
    assert read(conn, user, TODAY)["squat"]["best_e1rm_all_time"] == Decimal("150.00")
    execute(conn, "SELECT delete_manual_pr(%s, %s)", (user, row["r"]["record_id"]))
    service.drain(conn, "test")
    assert read(conn, user, TODAY)["squat"]["best_e1rm_all_time"] == Decimal("116.67")


def pending_users(conn: Connection, event: str) -> set[uuid.UUID]:
    rows = fetch_all(
        conn,
        "SELECT DISTINCT user_id FROM user_exercise_stats_refresh_jobs"
        " WHERE status = 'pending' AND (event_type = %s OR metadata->>'latest_event_type' = %s)",
        (event, event),
    )
    return {r["user_id"] for r in rows}


def test_catalog_changes_racing_user_pages(conn: Connection, user: uuid.UUID) -> None:
    users = [uuid.uuid4() for _ in range(25)]
    for u in users:
        sf.save(conn, u, TODAY, sf.sets(("squat", 100, 5)))
    service.drain(conn, "test")
    maintenance.process_catalog(conn)  # the fixture's own exercise inserts
    service.drain(conn, "test")
    sf.exercise(conn, "deadlift")  # a global change
    assert maintenance.process_catalog(conn, page=10) == 10
    sf.exercise(conn, "row")  # another global change while the pass runs
    assert maintenance.process_catalog(conn, page=10) == 10  # the pass goes on, not restarted
    assert maintenance.process_catalog(conn, page=10) == 5
    assert pending_users(conn, "catalog_changed") == set(users)
    service.drain(conn, "test")
    # The follow-up pass for the latest token still happens.
    assert maintenance.process_catalog(conn, page=100) == 25
    service.drain(conn, "test")
    assert maintenance.process_catalog(conn, page=100) == 0
    # A personal exercise requests only its owner.
    sf.exercise(conn, "my_curl", owner=users[3])
    assert maintenance.process_catalog(conn) == 1
    assert pending_users(conn, "catalog_changed") == {users[3]}


def test_late_commit_and_log_retention_lose_no_request(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    service.drain(conn, "test")
    maintenance.process_catalog(conn)
    service.drain(conn, "test")
    done = threading.Event()
    with connect(db_url) as early, early.transaction():
        execute(early, "INSERT INTO exercises (id, name) VALUES ('early', 'Early')")  # lower seq

        def later() -> None:
            with connect(db_url) as late:
                execute(late, "INSERT INTO exercises (id, name) VALUES ('later', 'Later')")
            done.set()

        threading.Thread(target=later).start()
        assert maintenance.process_catalog(conn) == 0  # the open change is skipped, not lost
    done.wait(10)
    execute(conn, "UPDATE exercise_catalog_changes SET changed_at = now() - interval '8 days'")
    assert maintenance.prune(conn)["catalog_changes"] >= 2  # the log is gone...
    assert maintenance.process_catalog(conn) == 1  # ...the request is not
    assert pending_users(conn, "catalog_changed") == {user}


def test_backfill_scanner(conn: Connection, user: uuid.UUID) -> None:
    other = uuid.uuid4()
    sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    sf.save(conn, other, TODAY, sf.sets(("squat", 100, 5)))
    # A lost job: the sessions exist but no rollups were ever built.
    execute(
        conn,
        "UPDATE user_exercise_stats_refresh_jobs SET status = 'completed',"
        " completed_at = now() WHERE user_id = %s",
        (user,),
    )
    service.drain(conn, "test")
    assert maintenance.scan(conn).stale == ((user, "sessions without rollups"),)
    [job] = [j for j in sf.jobs(conn, user) if j["status"] == "pending"]
    assert (job["event_type"], job["from_date"], job["exercise_ids"]) == (
        "scheduled_stats_backfill",
        None,
        [],
    )
    assert maintenance.scan(conn).stale == ()  # open work is left to the worker
    service.drain(conn, "test")
    execute(conn, "DELETE FROM user_pr_overview_snapshot_headers WHERE user_id = %s", (other,))
    execute(conn, "DELETE FROM user_training_period_stats WHERE user_id = %s", (user,))
    assert sorted(maintenance.scan(conn).stale) == sorted(
        [(user, "rollups without period stats"), (other, "PR snapshot gap")]
    )


def projections(conn: Connection, user: uuid.UUID) -> list[tuple[object, ...]]:
    """The user's exercise and period projections, without their generation."""
    rows = fetch_all(
        conn,
        "SELECT 'exercise' AS kind, exercise_id AS key, NULL::date AS start, sessions,"
        " working_sets, reps, volume FROM user_exercise_stats WHERE user_id = %(u)s"
        " UNION ALL SELECT period, period, period_start, sessions, working_sets, reps, volume"
        " FROM user_training_period_stats WHERE user_id = %(u)s ORDER BY 1, 2, 3",
        {"u": user},
    )
    return [tuple(r.values()) for r in rows]


def window(conn: Connection, user: uuid.UUID) -> dict[date, dict[str, tuple[object, ...]]]:
    """The three dates around the database date, as the reader serves them."""
    today = fetch_one(conn, "SELECT stats_clock_date() AS d")
    assert today is not None
    out: dict[date, dict[str, tuple[object, ...]]] = {}
    for offset in (-1, 0, 1):
        day = today["d"] + timedelta(days=offset)
        out[day] = {e: tuple(r.values()) for e, r in read(conn, user, day).items()}
    return out


def test_rolled_window_equals_a_full_rebuild(conn: Connection, user: uuid.UUID) -> None:
    """Rolled forward by a day, by days, and past a year: the rollover's generation (no
    exercise recomputed, the periods from the new date) publishes exactly what a
    full-history rebuild publishes (best of all time, 30-day windows and the year-earlier
    windows from their own dates, manual PRs, every projection)."""
    sf.exercise(conn, "deadlift")
    for back, spec in (
        (400, ("squat", 90, 3)),
        (370, ("bench", 70, 12)),
        (366, ("squat", 95, 2)),
        (335, ("deadlift", 150, 1)),
        (40, ("squat", 140, 1)),
        (29, ("bench", 80, 5)),
        (30, ("squat", 120, 3)),
        (1, ("deadlift", 160, 15)),  # no estimate above twelve reps
        (-1, ("bench", 85, 4)),
        (-2, ("squat", 130, 2)),
        (-5, ("bench", 90, 1)),
        (-33, ("squat", 150, 1)),
    ):
        sf.save(conn, user, TODAY - timedelta(days=back), sf.sets(spec))
    execute(conn, "SELECT save_manual_pr(%s, 'deadlift', 170, 1, %s)", (user, TODAY + timedelta(3)))
    service.drain(conn, "test")
    generation = sf.versions(conn, user)[1]
    for jump in (1, 3, 30, 400):
        set_clock(conn, fetch_one(conn, "SELECT stats_clock_date() AS d")["d"] + timedelta(jump))  # type: ignore[index]
        execute(conn, "UPDATE user_pr_overview_rollover_state SET due_at = now()")
        assert maintenance.rollover(conn).requested == 1
        service.drain(conn, "test")
        assert sf.versions(conn, user)[1] == generation + 1  # a new generation
        rolled = (window(conn, user), projections(conn, user))
        service.request_rebuild(conn, [user])
        service.drain(conn, "test")
        generation = sf.versions(conn, user)[1]
        assert (window(conn, user), projections(conn, user)) == rolled, f"after {jump} days"


def test_rollover_waits_for_a_pending_generation(conn: Connection, user: uuid.UUID) -> None:
    sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    service.drain(conn, "test")
    sf.save(conn, user, TODAY + timedelta(days=1), sf.sets(("squat", 200, 1)))  # pending
    set_clock(conn, TODAY + timedelta(days=1))
    execute(conn, "UPDATE user_pr_overview_rollover_state SET due_at = now()")
    assert maintenance.rollover(conn) == maintenance.RolloverResult(
        requested=0, failed=0, deferred=1
    )
    # Nothing was built for the older generation from facts it does not hold.
    assert fails_closed(conn, user, TODAY + timedelta(days=2))
    service.drain(conn, "test")
    assert read(conn, user, TODAY + timedelta(days=2))["squat"]["heaviest_kg"] == Decimal("200.00")
    state = fetch_one(
        conn, "SELECT window_end, snapshot_generation FROM user_pr_overview_rollover_state"
    )
    assert state is not None
    assert (state["window_end"], state["snapshot_generation"]) == (
        TODAY + timedelta(days=2),
        sf.versions(conn, user)[1],
    )
