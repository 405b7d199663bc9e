"""Smaller worker defects: a statement timeout in publish backs off, process
inside a caller's transaction returns, the first retry waits one backoff, personal
exercises of other users, the application role without a caller, a session without
sets, and the exact Epley estimate."""

from __future__ import annotations

import threading
import uuid
from datetime import date

import pytest

from inventory_pipeline.db import (
    Connection,
    DatabaseError,
    connect,
    execute,
    fetch_one,
    transaction,
)
from inventory_pipeline.stats import service
from inventory_pipeline.stats.models import ProcessResult, StatsClaim
from tests import stats_factories as sf
from tests.roles import acting_as

D = date(2026, 3, 10)


@pytest.fixture
def user(conn: Connection) -> uuid.UUID:
    for name in ("squat", "bench"):
        sf.exercise(conn, name)
    return uuid.uuid4()


def claim(conn: Connection) -> StatsClaim:
    claimed = service.claim(conn, "test")
    assert claimed is not None
    return claimed


def test_statement_timeout_in_publish_backs_off(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    claimed = claim(conn)
    assert service.compute(conn, claimed).status == "computed"
    execute(conn, "UPDATE stats_projection_worker_settings SET publish_budget_ms = 300")
    with connect(db_url) as blocker, blocker.transaction():
        execute(blocker, "LOCK TABLE user_exercise_stats IN EXCLUSIVE MODE")
        result = service.publish(conn, claimed)
    assert result.status == "retry_pending" and "57014" in (result.reason or "")
    assert result.retry_not_before is not None
    assert [j["status"] for j in sf.jobs(conn, user)] == ["processing"]
    assert service.worker_status(conn)["backing_off"] == 1
    assert service.claim(conn, "test") is None  # no immediate retry
    execute(conn, "UPDATE stats_projection_worker_settings SET publish_budget_ms = 6000")
    execute(conn, "UPDATE user_stats_projection_runs SET retry_not_before = now()")
    summary = service.drain(conn, "test")
    assert [u for u, _, _ in summary.published] == [user]  # the computed output, kept
    assert sf.versions(conn, user) == (1, 1)


def test_process_returns_inside_a_transaction(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    """A large account inside a caller's transaction: the cursor cannot advance, so
    process returns batch_pending instead of calling compute forever."""
    sf.history(conn, user, sessions=60, exercises=120)
    claimed = claim(conn)
    results: list[ProcessResult | BaseException] = []
    with connect(db_url) as worker:
        pid = fetch_one(worker, "SELECT pg_backend_pid() AS pid")["pid"]  # type: ignore[index]

        def inside_transaction() -> None:
            try:
                with transaction(worker):
                    results.append(service.process(worker, claimed))
            except BaseException as exc:  # reported by the assertion below
                results.append(exc)

        thread = threading.Thread(target=inside_transaction, daemon=True)
        thread.start()
        thread.join(timeout=60)
        looping = thread.is_alive()
        if looping:  # end the endless loop so the test can report it
            execute(conn, "SELECT pg_terminate_backend(%s)", (pid,))
            thread.join(timeout=30)
    assert not looping, "process kept calling compute inside one transaction"
    [result] = results
    assert isinstance(result, ProcessResult)
    assert (result.status, result.publication) == ("batch_pending", None)
    assert service.process(conn, claimed).outcome == "published"  # outside: advances


def test_first_retry_waits_one_backoff(conn: Connection, db_url: str, user: uuid.UUID) -> None:
    """Attempt n waits n x backoff: the first retry one backoff (1000 s here)."""
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    claimed = claim(conn)
    execute(
        conn,
        "UPDATE stats_projection_worker_settings SET compute_budget_ms = 300,"
        " retry_backoff_seconds = 1000",
    )
    with connect(db_url) as blocker, blocker.transaction():
        execute(blocker, "LOCK TABLE stats_output_exercise IN EXCLUSIVE MODE")
        result = service.compute(conn, claimed)
    assert result.status == "retry_pending"
    row = fetch_one(
        conn,
        "SELECT extract(epoch FROM retry_not_before - now())::float AS wait"
        " FROM user_stats_projection_runs WHERE id = %s",
        (claimed.run_id,),
    )
    assert row is not None and 900 < row["wait"] <= 1000, row


def test_manual_pr_refuses_another_users_personal_exercise(
    conn: Connection, user: uuid.UUID
) -> None:
    other = uuid.uuid4()
    sf.exercise(conn, "others_lift", owner=other)
    with pytest.raises(DatabaseError, match="personal exercise") as refused:
        execute(
            conn,
            "SELECT save_manual_pr(%s, 'others_lift', 100, 1, %s)",
            (user, D),
        )
    assert refused.value.sqlstate == "42501"
    execute(conn, "SELECT save_manual_pr(%s, 'others_lift', 100, 1, %s)", (other, D))


@pytest.mark.parametrize(
    "call",
    [
        "SELECT save_training_session(%(user)s, jsonb_build_object('user_id', %(user)s::text,"
        " 'session_date', '2026-03-10', 'sets', '[]'::jsonb))",
        "SELECT delete_training_session(%(user)s, %(session)s)",
        "SELECT request_stats_refresh(%(user)s, NULL, '{}', 'x')",
        "SELECT save_manual_pr(%(user)s, 'squat', 100, 1, '2026-03-10')",
        "SELECT * FROM get_pr_overview(%(user)s, '2026-03-10')",
    ],
)
@pytest.mark.parametrize("role", ["inventory_app", "member"])
def test_application_role_without_caller_fails_closed(
    conn: Connection, db_url: str, user: uuid.UUID, call: str, role: str
) -> None:
    """Without inventory.current_user_id the application role (or a role holding it) is
    refused, never trusted like a service caller."""
    execute(conn, "SELECT set_config('inventory.stats_today', '2026-03-10', false)")
    session = sf.save(conn, user, D, sf.sets(("squat", 100, 5)))["session_id"]
    service.drain(conn, "test")
    member = f"test_app_member_{uuid.uuid4().hex[:12]}"
    execute(conn, f"CREATE ROLE {member} NOLOGIN IN ROLE inventory_app")
    try:
        with pytest.raises(DatabaseError, match=r"inventory\.current_user_id") as refused:
            with acting_as(conn, "inventory_app" if role == "inventory_app" else member):
                execute(conn, call, {"user": user, "session": session})
        assert refused.value.sqlstate == "42501"
    finally:
        execute(conn, f"DROP ROLE {member}")
    assert sf.versions(conn, user) == (1, 1)  # nothing written


def test_application_role_with_caller_is_served(conn: Connection, user: uuid.UUID) -> None:
    execute(conn, "SELECT set_config('inventory.stats_today', '2026-03-10', false)")
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    service.drain(conn, "test")
    with acting_as(conn, "inventory_app"):
        execute(conn, "SELECT set_config('inventory.current_user_id', %s, true)", (str(user),))
        row = fetch_one(conn, "SELECT count(*) AS n FROM get_pr_overview(%s, %s)", (user, D))
    assert row == {"n": 1}


def test_session_without_sets_dirties_no_exercise(conn: Connection, user: uuid.UUID) -> None:
    sf.save(conn, user, D, sf.sets(("squat", 100, 5), ("bench", 80, 5)))
    service.drain(conn, "test")
    sf.save(conn, user, date(2026, 3, 11), [])
    [job] = [j for j in sf.jobs(conn, user) if j["status"] == "pending"]
    assert (job["from_date"], job["exercise_ids"]) == (date(2026, 3, 11), None)
    service.drain(conn, "test")
    generations = {e: r["generation"] for e, r in sf.exercise_stats(conn, user).items()}
    assert generations == {"squat": 1, "bench": 1}  # untouched
    day = fetch_one(
        conn,
        "SELECT sessions, working_sets FROM user_training_period_stats"
        " WHERE user_id = %s AND period = 'day' AND period_start = '2026-03-11'",
        (user,),
    )
    assert day == {"sessions": 1, "working_sets": 0}
    assert sf.versions(conn, user) == (2, 2)
    # A later write with exercises merges into such a job as its own list.
    sf.save(conn, user, date(2026, 3, 12), [])
    sf.save(conn, user, date(2026, 3, 13), sf.sets(("bench", 90, 5)))
    [job] = [j for j in sf.jobs(conn, user) if j["status"] == "pending"]
    assert (job["from_date"], job["exercise_ids"]) == (date(2026, 3, 12), ["bench"])


def test_epley_estimate_is_exact(conn: Connection) -> None:
    row = fetch_one(conn, "SELECT estimated_one_rep_max(101.25, 7) AS e1rm")
    assert row is not None and str(row["e1rm"]) == "124.88"  # 101.25 x 37 / 30 = 124.875
