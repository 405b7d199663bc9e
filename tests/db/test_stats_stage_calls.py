"""Each worker stage is one server-side call, sent after the statement that arms its
statement budget, both in one transaction: a session that goes away during the call
leaves a connection that fails cleanly, a failed call rolls both back and leaves the
session usable, and a batched account publishes what a single call computes."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import date
from typing import Any

import pytest

from inventory_pipeline.db import (
    Connection,
    DatabaseUnavailable,
    QueryCanceled,
    UniqueViolation,
    connect,
    execute,
    fetch_all,
    fetch_one,
    fetch_one_armed,
    transaction,
)
from inventory_pipeline.stats import repository as repo
from inventory_pipeline.stats import service
from inventory_pipeline.stats.models import StatsClaim
from tests import stats_factories as sf

D = date(2026, 3, 10)


def wait_for_lock_wait(conn: Connection, pid: int) -> None:
    for _ in range(500):
        row = fetch_one(conn, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,))
        if row is not None and row["wait_event_type"] == "Lock":
            return
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never waited on a lock")


def test_a_session_ended_during_a_stage_call_leaves_a_cleanly_failing_connection(
    conn: Connection, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The compute stage waits for a lock (another session holds the sets table) when
    its session is terminated: the call raises DatabaseUnavailable, nothing else is
    logged, and the connection's next use raises DatabaseUnavailable too (not a driver
    error about pipeline mode)."""
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    errors: list[BaseException] = []
    with connect(db_url) as worker, connect(db_url) as holder, holder.transaction():
        claimed = claimed_for(worker, user)
        execute(holder, "LOCK TABLE training_sets IN ACCESS EXCLUSIVE MODE")
        row = fetch_one(worker, "SELECT pg_backend_pid() AS pid")
        assert row is not None
        pid = int(row["pid"])

        def compute() -> None:
            try:
                service.compute(worker, claimed)
            except BaseException as exc:  # judged below
                errors.append(exc)

        with caplog.at_level(logging.WARNING, logger="psycopg"):
            thread = threading.Thread(target=compute)
            thread.start()
            wait_for_lock_wait(conn, pid)
            execute(conn, "SELECT pg_terminate_backend(%s)", (pid,))
            thread.join(timeout=30)
            assert not thread.is_alive()
            assert len(errors) == 1 and isinstance(errors[0], DatabaseUnavailable)
            with pytest.raises(DatabaseUnavailable):
                fetch_one(worker, "SELECT 1")
        assert [r.getMessage() for r in caplog.records if r.name.startswith("psycopg")] == []


def test_a_stage_call_on_a_connection_the_server_ended_fails_cleanly(
    conn: Connection, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server ended the session between two calls (a restart, an operator's
    terminate): the next stage call raises DatabaseUnavailable and psycopg logs nothing
    of its own."""
    with connect(db_url) as worker:
        row = fetch_one(worker, "SELECT pg_backend_pid() AS pid")
        assert row is not None
        execute(conn, "SELECT pg_terminate_backend(%s)", (row["pid"],))
        time.sleep(0.2)
        with caplog.at_level(logging.WARNING, logger="psycopg"):
            for _ in range(2):
                with pytest.raises(DatabaseUnavailable):
                    service.claim(worker, "w")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("psycopg")] == []


def claimed_for(conn: Connection, user: uuid.UUID) -> StatsClaim:
    claimed = service.claim(conn, "w", user)
    assert claimed is not None
    return claimed


def published(conn: Connection, user: uuid.UUID) -> dict[str, list[dict[str, Any]]]:
    """A user's public projections and PR overview window, without user or generation."""
    return {
        "exercises": fetch_all(
            conn,
            "SELECT exercise_id, sessions, working_sets, reps, volume, heaviest_kg,"
            " best_e1rm_kg, first_date, last_date FROM user_exercise_stats"
            " WHERE user_id = %s ORDER BY exercise_id",
            (user,),
        ),
        "periods": fetch_all(
            conn,
            "SELECT period, period_start, sessions, working_sets, reps, volume"
            " FROM user_training_period_stats WHERE user_id = %s ORDER BY 1, 2",
            (user,),
        ),
        "window": fetch_all(
            conn,
            "SELECT as_of_date, exercise_id, best_e1rm_all_time, best_e1rm_30d,"
            " best_e1rm_30d_prior_year, heaviest_kg FROM user_pr_exercise_summary_snapshots"
            " WHERE user_id = %s ORDER BY 1, 2",
            (user,),
        ),
    }


def manifest_mode(conn: Connection, user: uuid.UUID) -> str:
    row = fetch_one(
        conn,
        "SELECT payload -> 'manifest' ->> 'mode' AS mode FROM user_stats_projection_runs"
        " WHERE user_id = %s AND phase = 'published'",
        (user,),
    )
    assert row is not None
    return str(row["mode"])


def test_a_batched_account_publishes_what_a_single_compute_computes(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two users with one history of 120 exercises: one computed in batches of 100
    (preparation, two batches, finalization), the other in one step."""
    batched, whole = uuid.uuid4(), uuid.uuid4()
    for user in (batched, whole):
        sf.history(conn, user, sessions=60, exercises=120)
    assert service.process(conn, claimed_for(conn, batched)).outcome == "published"
    monkeypatch.setattr(service, "BATCH_SIZE", 1_000)
    assert service.process(conn, claimed_for(conn, whole)).outcome == "published"
    assert (manifest_mode(conn, batched), manifest_mode(conn, whole)) == ("batched", "single")
    expected = published(conn, whole)
    assert len(expected["exercises"]) == 120 and expected["periods"]
    assert published(conn, batched) == expected


def window(conn: Connection, user: uuid.UUID) -> dict[str, list[dict[str, Any]]]:
    return {
        "headers": fetch_all(
            conn,
            "SELECT generation, as_of_date, catalog_epoch, exercise_count"
            " FROM user_pr_overview_snapshot_headers WHERE user_id = %s ORDER BY 1, 2",
            (user,),
        ),
        "summaries": published(conn, user)["window"],
        "rollover": fetch_all(
            conn,
            "SELECT due_at, snapshot_generation, applied_catalog_epoch, window_end,"
            " attempt_count, next_retry_at, last_error"
            " FROM user_pr_overview_rollover_state WHERE user_id = %s",
            (user,),
        ),
    }


def test_publish_pr_window_builds_the_window_the_publish_stage_call_builds(
    conn: Connection,
) -> None:
    """A history a year back, a session yesterday and a manual record: the window the
    stage call published, dropped and built again by `publish_pr_window`, is the same."""
    today = date(2025, 1, 20)
    execute(conn, "SELECT set_config('inventory.stats_today', %s, false)", (today.isoformat(),))
    user = uuid.uuid4()
    ids = sf.history(conn, user, sessions=40, exercises=6)
    sf.save(conn, user, date(2025, 1, 19), sf.sets((ids[0], 120, 3), (ids[1], 80, 8)))
    execute(conn, "SELECT save_manual_pr(%s, %s, 150, 1, %s)", (user, ids[2], today))
    service.drain(conn, "w")
    generation = sf.versions(conn, user)[1]
    built = window(conn, user)
    assert len(built["headers"]) == 3 and built["summaries"] and built["rollover"]
    with transaction(conn):
        execute(conn, "DELETE FROM user_pr_overview_snapshot_headers WHERE user_id = %s", (user,))
        execute(conn, "DELETE FROM user_pr_overview_rollover_state WHERE user_id = %s", (user,))
        repo.publish_pr_window(conn, user, generation)
    assert window(conn, user) == built


def test_an_armed_call_is_one_transaction_under_its_budget(conn: Connection) -> None:
    """The arming statement's settings bound the call that follows it and end with their
    transaction; a call that fails rolls both back and leaves the connection usable."""
    execute(conn, "CREATE TEMPORARY TABLE armed_rows (id integer PRIMARY KEY)")
    arm = "SELECT set_config('statement_timeout', %(budget)s, true) AS armed"
    with pytest.raises(QueryCanceled):
        fetch_one_armed(conn, arm, {"budget": "200"}, "SELECT pg_sleep(2) AS slept")
    insert = "INSERT INTO armed_rows VALUES (%(id)s) RETURNING id"
    assert fetch_one_armed(conn, arm, {"budget": "5000"}, insert, {"id": 1}) == {"id": 1}
    with pytest.raises(UniqueViolation):
        fetch_one_armed(conn, arm, {"budget": "5000"}, insert, {"id": 1})
    assert fetch_one_armed(conn, arm, {"budget": "5000"}, insert, {"id": 2}) == {"id": 2}
    assert fetch_all(conn, "SELECT id FROM armed_rows ORDER BY id") == [{"id": 1}, {"id": 2}]
    timeout = fetch_one(conn, "SELECT current_setting('statement_timeout') AS t")
    assert timeout == {"t": "0"}, "the budget armed for a call ends with its transaction"


SYNCHRONOUS_COMMIT = "SELECT current_setting('synchronous_commit') AS setting"


def test_only_a_claim_or_compute_in_its_own_transaction_commits_without_a_flush(
    conn: Connection,
) -> None:
    """A claim or compute sent as its own transaction may return before its WAL is
    flushed; a publication never does, nor any stage inside a caller's transaction (its
    setting would hold for the caller's whole transaction, the publication included)."""
    for stage, expected in (("claim", "off"), ("compute", "off"), ("publish", "on")):
        arm = repo.arm_params(conn, stage, None)
        row = fetch_one_armed(conn, repo.QUERIES["arm_stage"], arm, SYNCHRONOUS_COMMIT)
        assert row == {"setting": expected}, stage

    for name in ("squat", "bench"):
        sf.exercise(conn, name)
    user = uuid.uuid4()
    sf.save(conn, user, D, sf.sets(("squat", 100, 5), ("bench", 60, 8)))
    with transaction(conn):
        answer = service.process_user(conn, user, "caller")
        assert answer.outcome == "published"
        assert fetch_one(conn, SYNCHRONOUS_COMMIT) == {"setting": "on"}
