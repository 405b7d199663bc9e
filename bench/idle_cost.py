"""What an idle deployment costs the application database, under the real daemon:
statements a minute (`xact_commit + xact_rollback` of its database; every autocommit
statement is one) with nothing ever saved, and after one save while the stats drain it
started waits for more. A waiting drain may cost at most one statement a second."""

from __future__ import annotations

import time
import uuid
from datetime import date

from bench.common import Figure, Mode, scratch_database
from bench.orchestration import daemon
from inventory_pipeline.db import Connection, connect, execute, fetch_one, jsonb
from inventory_pipeline.db.connection import database_name

WAITING_DRAIN_GOAL = 60.0  # statements a minute a waiting drain may add


def statements(admin: Connection, database: str) -> int:
    execute(admin, "SELECT pg_stat_clear_snapshot()")
    row = fetch_one(
        admin,
        "SELECT xact_commit + xact_rollback AS n FROM pg_stat_database WHERE datname = %s",
        (database,),
    )
    assert row is not None
    return int(row["n"])


def per_minute(admin: Connection, database: str, window: float) -> float:
    """Statements a minute over `window` seconds (the stats collector reports a
    backend's counts at its transactions' ends, within a second)."""
    before = statements(admin, database)
    time.sleep(window)
    return (statements(admin, database) - before) * 60 / window


def run(admin_url: str, mode: Mode) -> list[Figure]:
    warm_up, window = mode.pick(smoke=(20.0, 10.0), default=(45.0, 60.0))
    with scratch_database(admin_url) as url, connect(url) as conn, connect(admin_url) as admin:
        database = database_name(url)
        execute(conn, "INSERT INTO exercises (id, name) VALUES ('squat', 'Squat')")
        with daemon(admin_url, url, {}):
            time.sleep(warm_up)  # the daemon and its code server start; the first ticks
            idle = per_minute(admin, database, window)
            user = uuid.uuid4()
            session = {
                "user_id": str(user),
                "session_date": str(date(2026, 3, 1)),
                "sets": [{"exercise_id": "squat", "weight_kg": 100, "reps": 5}],
            }
            execute(conn, "SELECT save_training_session(%s, %s)", (user, jsonb(session)))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                row = fetch_one(
                    conn,
                    "SELECT applied_version FROM user_stats_refresh_state WHERE user_id = %s",
                    (user,),
                )
                if row is not None and row["applied_version"] >= 1:
                    break
                time.sleep(0.5)
            else:
                raise RuntimeError("the save was not published within 120 s")
            time.sleep(mode.pick(smoke=2.0, default=10.0))
            waiting = per_minute(admin, database, window)
    added = waiting - idle
    return [
        Figure("statements a minute, idle, nothing saved", idle, "", "for scale"),
        Figure("statements a minute, idle, a drain waiting", waiting, "", "for scale"),
        Figure(
            "statements a minute a waiting drain adds",
            added,
            "",
            f"goal <= {WAITING_DRAIN_GOAL:g} (one a second)",
            None if mode.smoke else added <= WAITING_DRAIN_GOAL,
        ),
    ]
