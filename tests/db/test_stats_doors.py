"""The one-owner door, the scoped single-user processor, the status function and the
database roles."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import date

import pytest

from inventory_pipeline.db import (
    Connection,
    DatabaseError,
    QueryCanceled,
    connect,
    execute,
    fetch_all,
    fetch_one,
)
from inventory_pipeline.stats import service
from tests import stats_factories as sf

D = date(2026, 3, 10)


@pytest.fixture
def squat(conn: Connection) -> str:
    return sf.exercise(conn, "squat")


def test_one_owner_door_processes_one_account_per_call(conn: Connection, squat: str) -> None:
    users = [uuid.uuid4() for _ in range(3)]
    for u in users:
        sf.save(conn, u, D, sf.sets((squat, 100, 5)))
    seen = []
    while True:
        result = service.process_one_account(conn, "door")
        if result.user_id is None:
            break
        seen.append((result.outcome, result.has_more, result.remaining_user_count))
    assert seen == [("published", True, 2), ("published", True, 1), ("published", False, 0)]


def test_scoped_processor_publishes_only_its_user(conn: Connection, squat: str) -> None:
    mine, other = uuid.uuid4(), uuid.uuid4()
    sf.save(conn, mine, D, sf.sets((squat, 100, 5)))
    sf.save(conn, other, D, sf.sets((squat, 90, 5)))
    result = service.process_user(conn, mine, "app")
    assert (result.outcome, result.has_more) == ("published", False)
    assert sf.versions(conn, mine) == (1, 1) and sf.versions(conn, other) == (1, 0)


def test_scoped_processor_statement_timeout_keeps_job_pending(
    conn: Connection, db_url: str, squat: str
) -> None:
    user = uuid.uuid4()
    sf.save(conn, user, D, sf.sets((squat, 100, 5)))
    execute(conn, "UPDATE stats_projection_worker_settings SET compute_budget_ms = 300")
    with connect(db_url) as blocker, blocker.transaction():
        execute(blocker, "LOCK TABLE stats_output_exercise IN EXCLUSIVE MODE")
        result = service.process_user(conn, user, "app")
    assert result.outcome == "worker_timed_out" and result.has_more
    assert [j["status"] for j in sf.jobs(conn, user)] == ["pending"]
    assert fetch_all(conn, "SELECT 1 FROM user_stats_projection_runs") == []


def test_scoped_processor_reraises_other_cancellations(
    conn: Connection, db_url: str, squat: str
) -> None:
    user = uuid.uuid4()
    sf.save(conn, user, D, sf.sets((squat, 100, 5)))
    pid = fetch_one(conn, "SELECT pg_backend_pid() AS pid")["pid"]  # type: ignore[index]
    with connect(db_url) as blocker, blocker.transaction():
        execute(blocker, "LOCK TABLE stats_output_exercise IN EXCLUSIVE MODE")

        def cancel() -> None:
            time.sleep(0.5)
            with connect(db_url) as admin:
                execute(admin, "SELECT pg_cancel_backend(%s)", (pid,))

        threading.Thread(target=cancel).start()
        with pytest.raises(QueryCanceled) as canceled:
            service.process_user(conn, user, "app")
    # Canceled well inside the compute budget: not the statement timeout.
    assert canceled.value.elapsed_ms is not None and canceled.value.elapsed_ms < 60_000
    assert [j["status"] for j in sf.jobs(conn, user)] == ["pending"]


def test_scoped_processor_defers_large_accounts(conn: Connection) -> None:
    user = uuid.uuid4()
    sf.history(conn, user, sessions=60, exercises=120)
    result = service.process_user(conn, user, "app")
    assert result.outcome == "deferred"
    assert [j["status"] for j in sf.jobs(conn, user)] == ["pending"]
    assert len(service.drain(conn, "worker").published) == 1


def test_status_function(conn: Connection, squat: str) -> None:
    for _ in range(2):
        sf.save(conn, uuid.uuid4(), D, sf.sets((squat, 100, 5)))
    status = service.worker_status(conn)
    assert (status["pending_users"], status["pending_jobs"]) == (2, 2)
    assert status["settings"]["publish_budget_ms"] == 6000
    service.drain(conn, "test")
    status = service.worker_status(conn)
    assert status["completed_last_hour"] == 2 and status["compute_ms_max_last_hour"] is not None
    for key in (
        "oldest_wait_seconds",
        "active_leases",
        "expired_leases",
        "backing_off",
        "attempt_exhausted_failures",
        "failed_last_hour",
        "publish_ms_avg_last_hour",
    ):
        assert key in status


def test_application_role_boundaries(conn: Connection, squat: str) -> None:
    me, someone = uuid.uuid4(), uuid.uuid4()
    sf.save(conn, someone, D, sf.sets((squat, 200, 1)))
    with conn.transaction():
        execute(conn, "SET LOCAL ROLE inventory_app")
        execute(conn, "SELECT set_config('inventory.current_user_id', %s, true)", (str(me),))
        sf.save(conn, me, D, sf.sets((squat, 100, 5)))  # the write surface is open
        with pytest.raises(DatabaseError, match="owner"), conn.transaction():
            sf.save(conn, someone, D, sf.sets((squat, 1, 1)))  # not as somebody else
    service.drain(conn, "worker")
    for forbidden in (
        "SELECT * FROM user_exercise_stats_refresh_jobs",
        "SELECT * FROM user_stats_projection_runs",
        "SELECT * FROM stats_projection_worker_settings",
        "SELECT * FROM stats_output_exercise",
        "SELECT * FROM training_sets",
        "SELECT stats_projection_worker_status()",
        "SELECT stats_projection_statement_budget('claim')",
        "SELECT bump_stats_requested_version(gen_random_uuid())",
        "UPDATE user_exercise_stats SET volume = 0",
    ):
        with pytest.raises(DatabaseError, match="permission denied"), conn.transaction():
            execute(conn, "SET LOCAL ROLE inventory_app")
            execute(conn, forbidden)
    with conn.transaction():
        execute(conn, "SET LOCAL ROLE inventory_app")
        execute(conn, "SELECT set_config('inventory.current_user_id', %s, true)", (str(me),))
        visible = fetch_all(conn, "SELECT user_id FROM user_exercise_stats")
    assert [r["user_id"] for r in visible] == [me]  # only its own projections


def test_a_callers_transaction_keeps_its_own_statement_timeout(
    conn: Connection, squat: str
) -> None:
    """The scoped processor arms each stage's budget transaction-locally inside the
    caller's transaction: after it, the caller's statements run under the caller's
    timeout again, not the last stage's budget (and each stage's arm ran under the
    caller's, never under the stage before it)."""
    user = uuid.uuid4()
    sf.save(conn, user, D, sf.sets((squat, 100, 5)))
    with conn.transaction():
        execute(conn, "SET LOCAL statement_timeout = '123s'")
        assert service.process_user(conn, user, "app").outcome == "published"
        row = fetch_one(conn, "SELECT current_setting('statement_timeout') AS timeout")
        assert row is not None and row["timeout"] == "123s"


def test_scoped_processor_defers_a_user_whose_run_waits_out_a_retry(
    conn: Connection, db_url: str, squat: str
) -> None:
    """The user's run failed an attempt and waits out its backoff: the worker publishes
    it then, so the answer is deferred, not idle (nothing to do)."""
    user = uuid.uuid4()
    sf.save(conn, user, D, sf.sets((squat, 100, 5)))
    execute(conn, "UPDATE stats_projection_worker_settings SET compute_budget_ms = 300")
    claimed = service.claim(conn, "worker")
    assert claimed is not None
    with connect(db_url) as blocker, blocker.transaction():
        execute(blocker, "LOCK TABLE stats_output_exercise IN EXCLUSIVE MODE")
        assert service.compute(conn, claimed).status == "retry_pending"
    result = service.process_user(conn, user, "app")
    assert (result.outcome, result.has_more) == ("deferred", True)
