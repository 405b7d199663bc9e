"""The training stats worker on real PostgreSQL: claim -> compute -> publish."""

from __future__ import annotations

import threading
import uuid
from datetime import date

import pytest

from inventory_pipeline.db import (
    TRANSIENT,
    Connection,
    DatabaseError,
    connect,
    execute,
    fetch_all,
    fetch_one,
)
from inventory_pipeline.stats import service
from inventory_pipeline.stats.models import StatsClaim
from tests import stats_factories as sf

D = date(2026, 3, 10)  # a Tuesday


@pytest.fixture
def user(conn: Connection) -> uuid.UUID:
    for name in ("squat", "bench", "deadlift"):
        sf.exercise(conn, name)
    return uuid.uuid4()


def expire(conn: Connection, claimed: StatsClaim) -> None:
    sf.expire_run(conn, claimed.run_id, claimed.lease_token)


def claim(conn: Connection) -> StatsClaim:
    claimed = service.claim(conn, "test")
    assert claimed is not None
    return claimed


def test_projections_are_published_with_applied_version(conn: Connection, user: uuid.UUID) -> None:
    sf.save(
        conn,
        user,
        D,
        sf.sets(("squat", 60, 5, True), ("squat", 100, 5), ("squat", 110, 3), ("bench", 80, 13)),
    )
    sf.save(conn, user, date(2026, 3, 16), sf.sets(("squat", 120, 1)))
    summary = service.drain(conn, "test")
    assert len(summary.published) == 1
    stats = sf.exercise_stats(conn, user)
    squat = stats["squat"]
    assert (squat["sessions"], squat["working_sets"], squat["reps"]) == (2, 3, 9)
    assert squat["volume"] == 100 * 5 + 110 * 3 + 120 * 1
    assert squat["heaviest_kg"] == 120
    # Epley: 110 x (1 + 3/30) = 121 beats 100 x (1 + 5/30) = 116.67 and the single 120.
    assert squat["best_e1rm_kg"] == 121
    assert (squat["first_date"], squat["last_date"]) == (D, date(2026, 3, 16))
    assert stats["bench"]["best_e1rm_kg"] is None  # no estimate above 12 reps
    periods = {
        (r["period"], r["period_start"]): r
        for r in fetch_all(
            conn, "SELECT * FROM user_training_period_stats WHERE user_id = %s", (user,)
        )
    }
    assert periods[("week", date(2026, 3, 9))]["sessions"] == 1  # ISO week from Monday
    assert periods[("week", date(2026, 3, 16))]["volume"] == 120
    month = periods[("month", date(2026, 3, 1))]
    assert (month["sessions"], month["working_sets"], month["reps"]) == (2, 4, 22)
    assert periods[("quarter", date(2026, 1, 1))]["sessions"] == 2
    assert periods[("year", date(2026, 1, 1))]["sessions"] == 2
    assert sf.versions(conn, user) == (2, 2)
    assert [j["status"] for j in sf.jobs(conn, user)] == ["completed"]


def test_deleting_the_last_session_removes_projections(conn: Connection, user: uuid.UUID) -> None:
    sid = sf.save(conn, user, D, sf.sets(("squat", 100, 5)))["session_id"]
    service.drain(conn, "test")
    sf.delete(conn, user, sid)
    service.drain(conn, "test")
    assert sf.exercise_stats(conn, user) == {}
    assert fetch_all(conn, "SELECT 1 FROM user_training_period_stats") == []


def test_save_during_compute_publishes_its_own_generation(
    conn: Connection, user: uuid.UUID
) -> None:
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    claimed = claim(conn)
    assert service.compute(conn, claimed).status == "computed"
    sf.save(conn, user, date(2026, 3, 11), sf.sets(("bench", 80, 5)))  # a newer generation
    published = service.publish(conn, claimed)
    assert published.status == "published" and published.generation == 1
    assert sf.versions(conn, user) == (2, 1)
    assert [j["status"] for j in sf.jobs(conn, user)] == ["completed", "pending"]
    service.drain(conn, "test")
    assert sf.versions(conn, user) == (2, 2) and set(sf.exercise_stats(conn, user)) == {
        "squat",
        "bench",
    }


def test_moved_base_rejects_and_successor_absorbs_scope(conn: Connection, user: uuid.UUID) -> None:
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    sf.save(conn, user, D, sf.sets(("squat", 90, 5)))
    claimed = claim(conn)
    service.compute(conn, claimed)
    execute(conn, "UPDATE user_stats_refresh_state SET applied_version = 1")
    rejected = service.publish(conn, claimed)
    assert rejected.status == "rejected" and "base" in (rejected.reason or "")
    jobs = sf.jobs(conn, user)
    assert jobs[0]["status"] == "completed" and jobs[0]["error_message"].startswith("superseded")
    assert jobs[1]["status"] == "pending" and jobs[1]["exercise_ids"] == ["squat"]
    assert sf.exercise_stats(conn, user) == {}


def test_deleted_canonical_row_rejects_with_23503(conn: Connection, user: uuid.UUID) -> None:
    sf.exercise(conn, "lunge")
    sid = sf.save(conn, user, D, sf.sets(("lunge", 40, 10)))["session_id"]
    claimed = claim(conn)
    service.compute(conn, claimed)
    execute(conn, "DELETE FROM training_sets WHERE session_id = %s", (sid,))
    execute(conn, "DELETE FROM exercises WHERE id = 'lunge'")
    rejected = service.publish(conn, claimed)
    assert rejected.status == "rejected" and "23503" in (rejected.reason or "")
    # The code is stored beside the reason, not only in its text.
    assert recorded_error(conn, claimed)[1] == "23503"


def test_lease_fence_refuses_with_its_own_sqlstate(conn: Connection, user: uuid.UUID) -> None:
    """A fence refusal is a defect, never a lock timeout a caller retries (55P03)."""
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    claim(conn)
    with pytest.raises(DatabaseError) as refused:
        execute(conn, "UPDATE user_stats_projection_runs SET phase = 'failed'")
    assert refused.value.sqlstate == "LEASE"
    assert not isinstance(refused.value, TRANSIENT)


def test_lease_fence_rejects_late_writes(conn: Connection, db_url: str, user: uuid.UUID) -> None:
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    old = claim(conn)
    with pytest.raises(DatabaseError, match="leased to another worker"):
        execute(conn, "UPDATE user_stats_projection_runs SET phase = 'failed'")
    # The lease expires: the next claim revives the job at once under a new lease.
    expire(conn, old)
    new = claim(conn)
    assert new.lease_token != old.lease_token and new.run_id != old.run_id
    assert service.compute(conn, old).status == "lost"  # the old run was retired
    assert service.compute(conn, new).status == "computed"
    # A late write from the old token to the new live run is fenced off.
    with connect(db_url) as late, pytest.raises(DatabaseError, match="leased to another worker"):
        with late.transaction():
            execute(
                late,
                "SELECT set_config('inventory.stats_lease_token', %s, true)",
                (str(old.lease_token),),
            )
            execute(
                late,
                "UPDATE user_stats_projection_runs SET payload = '{}' WHERE id = %s",
                (new.run_id,),
            )
    assert service.publish(conn, old).status == "lost"
    assert service.publish(conn, new).status == "published"
    assert sf.jobs(conn, user)[0]["attempts"] == 2


def test_active_lease_cap(conn: Connection) -> None:
    sf.exercise(conn, "squat")
    users = [uuid.uuid4() for _ in range(3)]
    for u in users:
        sf.save(conn, u, D, sf.sets(("squat", 100, 5)))
    assert service.claim(conn, "a") is not None and service.claim(conn, "b") is not None
    assert service.claim(conn, "c") is None  # two live leases by default


def test_concurrent_workers_never_share_a_job(db_url: str) -> None:
    with connect(db_url) as setup:
        sf.exercise(setup, "squat")
        execute(setup, "UPDATE stats_projection_worker_settings SET active_lease_cap = 10")
        for _ in range(12):
            sf.save(setup, uuid.uuid4(), D, sf.sets(("squat", 100, 5)))
    published: list[uuid.UUID] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        with connect(db_url) as c:
            summary = service.drain(c, name)
            with lock:
                published.extend(u for u, _, _ in summary.published)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(published) == 12 and len(set(published)) == 12


def big_account(conn: Connection, user: uuid.UUID, exercises: int = 230) -> None:
    sf.history(conn, user, sessions=exercises // 2, exercises=exercises)


def test_large_account_computes_in_committed_batches(conn: Connection, user: uuid.UUID) -> None:
    big_account(conn, user)
    claimed = claim(conn)
    steps = []
    while (result := service.compute(conn, claimed)).status == "batch_pending":
        steps.append((result.stage, result.next_offset, result.total_exercises))
    assert result.status == "computed"
    assert steps == [
        ("batches", 0, 230),
        ("batches", 100, 230),
        ("batches", 200, 230),
        ("finalize", 230, 230),
    ]
    assert service.publish(conn, claimed).status == "published"
    assert len(sf.exercise_stats(conn, user)) == 230


def test_repeated_call_in_one_transaction_needs_a_boundary(
    conn: Connection, user: uuid.UUID
) -> None:
    big_account(conn, user)
    claimed = claim(conn)
    with conn.transaction():
        first = service.compute(conn, claimed)
        second = service.compute(conn, claimed)
    assert first.status == "batch_pending" and first.next_offset == 0
    assert (second.status, second.reason) == ("batch_pending", "transaction_boundary_required")
    assert service.compute(conn, claimed).next_offset == 100  # a new transaction advances


def test_batch_resumes_after_a_killed_worker(conn: Connection, user: uuid.UUID) -> None:
    big_account(conn, user)
    dead = claim(conn)
    service.compute(conn, dead)
    service.compute(conn, dead)  # one batch committed, then the worker dies
    expire(conn, dead)
    resumed = claim(conn)
    assert (resumed.run_id, resumed.lease_token) == (dead.run_id, dead.lease_token)
    result = service.compute(conn, resumed)
    assert (result.stage, result.next_offset) == ("batches", 200)  # same cursor
    processed = service.process(conn, resumed)
    assert processed.status == "computed" and processed.outcome == "published"
    run = fetch_one(
        conn, "SELECT attempts FROM user_stats_projection_runs WHERE id = %s", (dead.run_id,)
    )
    assert run is not None and run["attempts"] == 2  # the resume consumed a retry


def test_statement_timeout_in_a_batch_rolls_back_and_backs_off(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    big_account(conn, user)
    claimed = claim(conn)
    service.compute(conn, claimed)  # preparation
    service.compute(conn, claimed)  # batch 1 committed
    execute(conn, "UPDATE stats_projection_worker_settings SET compute_budget_ms = 300")
    with connect(db_url) as blocker, blocker.transaction():
        execute(blocker, "LOCK TABLE stats_output_exercise IN EXCLUSIVE MODE")
        result = service.compute(conn, claimed)
    assert result.status == "retry_pending" and "57014" in (result.reason or "")
    assert result.retry_not_before is not None
    kept = fetch_one(
        conn, "SELECT count(*) AS n FROM stats_output_exercise WHERE run_id = %s", (claimed.run_id,)
    )
    assert kept is not None and kept["n"] == 100  # committed predecessors preserved
    assert recorded_error(conn, claimed) == ("compute: statement budget spent (57014)", "57014")
    assert service.compute(conn, claimed).status == "retry_pending"  # no immediate retry
    execute(conn, "UPDATE user_stats_projection_runs SET retry_not_before = now()")
    execute(conn, "UPDATE stats_projection_worker_settings SET compute_budget_ms = 60000")
    resumed = claim(conn)  # the claim takes it back: same run, token and cursor
    assert (resumed.run_id, resumed.lease_token) == (claimed.run_id, claimed.lease_token)
    assert service.process(conn, resumed).outcome == "published"
    assert recorded_error(conn, claimed) == (None, None)  # cleared with the error


def recorded_error(conn: Connection, claimed: StatsClaim) -> tuple[str | None, str | None]:
    run = fetch_one(
        conn,
        "SELECT error, error_sqlstate FROM user_stats_projection_runs WHERE id = %s",
        (claimed.run_id,),
    )
    assert run is not None
    return run["error"], run["error_sqlstate"]


def test_changed_inputs_invalidate_a_batch_attempt(conn: Connection, user: uuid.UUID) -> None:
    """The published base moving under a batch run (an operator's repair) invalidates
    the attempt; a save does not (its writes stay a pending successor)."""
    big_account(conn, user)
    claimed = claim(conn)
    service.compute(conn, claimed)
    service.compute(conn, claimed)
    execute(
        conn,
        "UPDATE user_stats_refresh_state SET applied_version = applied_version + 1,"
        " requested_version = requested_version + 1",
    )
    result = service.compute(conn, claimed)
    assert (result.status, result.reason) == (
        "retry_pending",
        "inputs changed: the published base moved",
    )
    left = fetch_one(conn, "SELECT count(*) AS n FROM stats_output_exercise")
    assert left is not None and left["n"] == 0


def test_failed_attempts_exhaust(conn: Connection, db_url: str, user: uuid.UUID) -> None:
    big_account(conn, user)
    claimed = claim(conn)
    service.compute(conn, claimed)
    execute(
        conn,
        "UPDATE stats_projection_worker_settings SET compute_budget_ms = 300,"
        " retry_backoff_seconds = 0",
    )
    with connect(db_url) as blocker, blocker.transaction():
        execute(blocker, "LOCK TABLE training_sets IN ACCESS EXCLUSIVE MODE")
        results = [service.compute(conn, claimed).status]
        for _ in range(2):
            # Each retry: the claim takes the run back once its retry time has come.
            results.append(service.compute(conn, claim(conn)).status)
    assert results == ["retry_pending", "retry_pending", "failed"]
    assert sf.jobs(conn, user)[0]["status"] == "failed"


def test_incident_account_with_default_lock_table(conn: Connection, user: uuid.UUID) -> None:
    """The incident account (658 sessions, 296 exercises) completes with
    max_locks_per_transaction = 64: no per-exercise relations."""
    row = fetch_one(conn, "SHOW max_locks_per_transaction")
    assert row is not None and row["max_locks_per_transaction"] == "64"
    sf.history(conn, user, sessions=658, exercises=296, seed=7)
    summary = service.drain(conn, "test")
    assert len(summary.published) == 1 and summary.published[0][2] == 4  # three batches + final
    assert len(sf.exercise_stats(conn, user)) == 296
    requested, applied = sf.versions(conn, user)
    assert requested == applied == 658
