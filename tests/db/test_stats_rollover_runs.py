"""A rollover run over a population: it keeps requesting new generations while users are
due, one user per transaction, bounded by its time budget and pace, a failing user never
stops the rest, and the worker's publications move every window."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import date, timedelta

from inventory_pipeline.db import Connection, connect, execute, fetch_all, fetch_one
from inventory_pipeline.stats import maintenance, service

# More than the former fixed page of 500 users a run.
POPULATION = 520


def set_clock(conn: Connection, day: date) -> None:
    execute(conn, "SELECT set_config('inventory.stats_today', %s, false)", (day.isoformat(),))


def population(conn: Connection, users: int) -> date:
    """`users` users with one session each on the server's date, generation 1 applied,
    every window due; the clock moves to the next day (a rolled window is due again at
    the midnight after it, in the future). Returns the new date."""
    row = fetch_one(conn, "SELECT current_date AS today")
    assert row is not None
    today: date = row["today"]
    set_clock(conn, today)
    execute(conn, "INSERT INTO exercises (id, name) VALUES ('squat', 'Squat')")
    execute(
        conn,
        "INSERT INTO training_sessions (id, user_id, session_date)"
        " SELECT md5('s' || u)::uuid, md5('u' || u)::uuid, %s::date"
        " FROM generate_series(1, %s) AS u",
        (today, users),
    )
    execute(
        conn,
        "INSERT INTO training_sets (session_id, position, exercise_id, weight_kg, reps, warmup)"
        " SELECT id, 1, 'squat', 100, 5, false FROM training_sessions",
    )
    execute(
        conn,
        "INSERT INTO user_stats_refresh_state (user_id, requested_version, applied_version)"
        " SELECT DISTINCT user_id, 1, 1 FROM training_sessions",
    )
    execute(
        conn,
        "INSERT INTO user_pr_overview_rollover_state (user_id, due_at, snapshot_generation)"
        " SELECT DISTINCT user_id, now() - interval '1 minute', 1 FROM training_sessions",
    )
    execute(conn, "ANALYZE")
    set_clock(conn, today + timedelta(days=1))
    return today + timedelta(days=1)


def user_ids(conn: Connection) -> list[uuid.UUID]:
    rows = fetch_all(conn, "SELECT user_id FROM user_stats_refresh_state ORDER BY 1")
    return [r["user_id"] for r in rows]


def requested_users(conn: Connection) -> int:
    """Users with a rollover generation pending."""
    row = fetch_one(
        conn,
        "SELECT count(DISTINCT user_id) AS n FROM user_exercise_stats_refresh_jobs"
        " WHERE status = 'pending' AND event_type = 'pr_overview_rollover'",
    )
    assert row is not None
    return int(row["n"])


def rolled_users(conn: Connection, day: date) -> int:
    """Users whose published window now ends the day after `day`."""
    row = fetch_one(
        conn,
        "SELECT count(*) AS n FROM user_pr_overview_rollover_state WHERE window_end = %s",
        (day + timedelta(days=1),),
    )
    assert row is not None
    return int(row["n"])


def ticks(step: float) -> Iterator[float]:
    now = 0.0
    while True:
        yield now
        now += step


def test_a_run_requests_every_due_user_one_per_transaction(conn: Connection) -> None:
    day = population(conn, POPULATION)
    users = user_ids(conn)
    result = maintenance.rollover(conn, pace=None)
    assert result == maintenance.RolloverResult(requested=POPULATION, failed=0, more=False)
    assert requested_users(conn) == POPULATION
    # Each user's rollover row was written by a transaction of its own.
    row = fetch_one(
        conn,
        "SELECT count(DISTINCT xmin::text) AS transactions, count(*) AS users"
        " FROM user_pr_overview_rollover_state",
    )
    assert row is not None and row["transactions"] == row["users"] == len(users)
    assert maintenance.due(conn).rollover_users == 0
    # The worker publishes them: the last users in due order, who do not train, read
    # their new date (a window not moved fails closed with 55000 there).
    assert len(service.drain(conn, "test").published) == POPULATION
    for user in users[-3:]:
        assert service.read_pr_overview(conn, user, day + timedelta(days=1)).exercises
    assert rolled_users(conn, day) == POPULATION
    assert maintenance.due(conn).rollover_users == 0


def test_a_run_stops_at_its_budget_and_the_next_run_goes_on(conn: Connection) -> None:
    population(conn, 30)
    clock = ticks(1.0)  # one second per user, as seen by the run's budget
    first = maintenance.rollover(conn, budget_seconds=10, pace=None, clock=lambda: next(clock))
    assert first.more and 0 < first.requested < 30
    assert maintenance.due(conn).rollover_users == 30 - first.requested
    second = maintenance.rollover(conn, pace=None)
    assert (second.requested, second.more) == (30 - first.requested, False)
    assert requested_users(conn) == 30


def test_a_failing_user_does_not_stop_the_rest(conn: Connection, db_url: str) -> None:
    population(conn, 40)
    users = user_ids(conn)
    busy = users[len(users) // 2]
    with connect(db_url) as holder, holder.transaction():
        # A save or publication of this user holds its state row.
        execute(
            holder, "SELECT 1 FROM user_stats_refresh_state WHERE user_id = %s FOR UPDATE", (busy,)
        )
        result = maintenance.rollover(conn, pace=None)
    assert (result.requested, result.failed, result.more) == (39, 1, False)
    assert requested_users(conn) == 39
    state = fetch_one(
        conn,
        "SELECT attempt_count, last_error FROM user_pr_overview_rollover_state WHERE user_id = %s",
        (busy,),
    )
    assert state is not None and state["attempt_count"] == 1 and "lock" in state["last_error"]


def test_a_save_holding_its_enqueue_turn_is_a_failed_attempt_of_that_user(
    conn: Connection, db_url: str
) -> None:
    """A save of one user holds its enqueue turn (its transaction still open) past the
    rollover's lock timeout: that user's request rolls back, the failure is recorded
    with its error and a retry time, and the rest of the run goes on."""
    population(conn, 10)
    users = user_ids(conn)
    stuck = users[3]
    with connect(db_url) as holder, holder.transaction():
        execute(
            holder,
            "SELECT pg_advisory_xact_lock(hashtextextended('stats_enqueue:' || %s::text, 0))",
            (stuck,),
        )
        result = maintenance.rollover(conn, pace=None)
    assert (result.requested, result.failed, result.more) == (9, 1, False)
    assert requested_users(conn) == 9
    state = fetch_one(
        conn,
        "SELECT attempt_count, last_error, due_at > now() AS later"
        " FROM user_pr_overview_rollover_state WHERE user_id = %s",
        (stuck,),
    )
    assert state is not None and state["attempt_count"] == 1 and state["later"]
    assert "lock timeout" in state["last_error"]
    versions = fetch_one(
        conn, "SELECT requested_version FROM user_stats_refresh_state WHERE user_id = %s", (stuck,)
    )
    assert versions == {"requested_version": 1}  # the request rolled back whole


class FakeTime:
    """A clock that moves `work` seconds per reading and by every sleep."""

    def __init__(self, work: float) -> None:
        self.now = 0.0
        self.work = work
        self.slept: list[float] = []

    def clock(self) -> float:
        self.now += self.work
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_a_run_keeps_to_its_pace(conn: Connection) -> None:
    day = population(conn, 12)
    fake = FakeTime(work=0.001)
    result = maintenance.rollover(conn, pace=4, clock=fake.clock, sleep=fake.sleep)
    assert (result.requested, result.more) == (12, False)
    assert requested_users(conn) == 12
    service.drain(conn, "test")
    # Four users a second: twelve users take three seconds, the waits fill the rest (a
    # wait before each next look, the last of which finds nobody due).
    assert 2.9 < fake.now < 3.3 and len(fake.slept) == 12
    # The next midnight: the budget bounds the waits too.
    set_clock(conn, day + timedelta(days=1))
    execute(conn, "UPDATE user_pr_overview_rollover_state SET due_at = now()")
    fake = FakeTime(work=0.001)
    result = maintenance.rollover(
        conn, budget_seconds=1.0, pace=4, clock=fake.clock, sleep=fake.sleep
    )
    assert result.more and result.requested <= 5
