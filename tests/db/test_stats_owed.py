"""A range that was not published stays owed: merged into the user's next job, never
passed by applied_version, and the user's stats never read as current meanwhile."""

from __future__ import annotations

import uuid
from datetime import date, timedelta

import pytest

from inventory_pipeline.db import Connection, connect, execute, fetch_all, fetch_one
from inventory_pipeline.stats import maintenance, runbook, service
from inventory_pipeline.stats.models import StatsClaim
from tests import stats_factories as sf

D1 = date(2026, 3, 10)
D2 = date(2026, 3, 12)


@pytest.fixture
def user(conn: Connection) -> uuid.UUID:
    for name in ("squat", "bench"):
        sf.exercise(conn, name)
    return uuid.uuid4()


def claim(conn: Connection) -> StatsClaim:
    claimed = service.claim(conn, "test")
    assert claimed is not None
    return claimed


def exhaust_squeezed(conn: Connection, db_url: str, claimed: StatsClaim) -> list[str]:
    """Three compute attempts under a 300 ms budget while the output table is locked."""
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
            resumed = service.claim(conn, "test")
            assert resumed is not None and resumed.run_id == claimed.run_id
            results.append(service.compute(conn, resumed).status)
    execute(conn, "UPDATE stats_projection_worker_settings SET compute_budget_ms = 60000")
    return results


def owed(conn: Connection) -> list[dict[str, object]]:
    return fetch_all(conn, "SELECT * FROM user_stats_owed_ranges")


def pr_overview(conn: Connection, user: uuid.UUID) -> dict[str, bool]:
    overview = service.read_pr_overview(conn, user, D2)
    return {e.exercise_id: overview.stale for e in overview.exercises}


def test_exhausted_range_is_published_by_the_next_job(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    """Squeezed budget: J1 (squat) fails three times, J2 (bench) then publishes both."""
    execute(conn, "SELECT set_config('inventory.stats_today', %s, false)", (D2.isoformat(),))
    sf.save(conn, user, D1, sf.sets(("squat", 100, 5)))
    assert exhaust_squeezed(conn, db_url, claim(conn)) == ["retry_pending"] * 2 + ["failed"]
    sf.save(conn, user, D2, sf.sets(("bench", 80, 5)))
    service.drain(conn, "test")
    requested, applied = sf.versions(conn, user)
    assert requested == applied == 2
    # The two read models agree: the failed job's range was published with J2's.
    assert set(sf.exercise_stats(conn, user)) == {"squat", "bench"}
    assert pr_overview(conn, user) == {"squat": False, "bench": False}
    assert owed(conn) == []
    [failed, completed] = sf.jobs(conn, user)
    assert failed["status"] == "failed"  # kept for inspection
    assert completed["metadata"]["absorbed_failed_jobs"] == [failed["id"]]


def test_a_failure_a_later_job_published_asks_nothing_of_an_operator(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    """Once a later job of the user took an exhausted job's range in and published it,
    status no longer counts the failure as one to retry, and a retry is refused: it
    would only make a current user stale again."""
    sf.save(conn, user, D1, sf.sets(("squat", 100, 5)))
    exhaust_squeezed(conn, db_url, claim(conn))
    assert service.worker_status(conn)["attempt_exhausted_failures"] == 1
    sf.save(conn, user, D2, sf.sets(("bench", 80, 5)))
    service.drain(conn, "test")
    [failed, completed] = sf.jobs(conn, user)
    assert service.worker_status(conn)["attempt_exhausted_failures"] == 0
    refusal = (
        f"job {failed['id']}'s range is no longer owed: job {completed['id']} took it in"
        " and is completed"
    )
    with pytest.raises(runbook.RunbookError, match=refusal):
        runbook.retry(conn, failed["id"])


def test_import_writing_during_batches_loses_no_range(conn: Connection, user: uuid.UUID) -> None:
    """A 120-exercise account whose import keeps writing while its batched compute runs:
    the writes do not invalidate the attempt, the run publishes its own generation, and
    the writes stay a pending successor that the next job publishes."""
    sf.history(conn, user, sessions=60, exercises=120)
    claimed = claim(conn)
    steps = []
    for n in range(10):
        result = service.compute(conn, claimed)
        steps.append(result.status)
        if result.status != "batch_pending":
            break
        sf.save(conn, user, D1 + timedelta(days=n), sf.sets(("ex_1_000", 50, 5)))  # the import
    assert steps == ["batch_pending"] * 3 + ["computed"]
    assert service.publish(conn, claimed).status == "published"
    assert sf.versions(conn, user)[1] == claimed.target_version
    summary = service.drain(conn, "test")
    assert len(sf.exercise_stats(conn, user)) == 120
    assert len(summary.published) == 1
    requested, applied = sf.versions(conn, user)
    assert requested == applied
    assert owed(conn) == []
    assert [j["status"] for j in sf.jobs(conn, user)] == ["completed", "completed"]


def test_an_owed_range_waits_for_the_next_job_and_says_stale(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    sf.save(conn, user, D1, sf.sets(("squat", 100, 5)))
    exhaust_squeezed(conn, db_url, claim(conn))
    [row] = owed(conn)
    assert (row["user_id"], row["from_date"], row["exercise_ids"]) == (user, D1, ["squat"])
    # Nothing claims it by itself (the job exhausted its attempts) ...
    assert service.claim(conn, "test") is None
    # ... and no reader calls the user's stats current.
    stale = fetch_one(conn, "SELECT stats_user_is_stale(%s) AS stale", (user,))
    assert stale == {"stale": True}
    status = service.worker_status(conn)
    assert (status["owed_users"], status["stale_users"]) == (1, 1)


def test_owed_range_marks_current_versions_stale(conn: Connection, user: uuid.UUID) -> None:
    """applied = requested does not make stats current while a range is owed (a job an
    operator failed by hand after its successor was claimed)."""
    execute(conn, "SELECT set_config('inventory.stats_today', %s, false)", (D2.isoformat(),))
    sf.save(conn, user, D1, sf.sets(("squat", 100, 5)))
    service.drain(conn, "test")
    assert pr_overview(conn, user) == {"squat": False}
    execute(conn, "UPDATE user_exercise_stats_refresh_jobs SET status = 'failed'")
    assert sf.versions(conn, user) == (1, 1)
    assert pr_overview(conn, user) == {"squat": True}
    assert service.worker_status(conn)["stale_users"] == 1
    sf.save(conn, user, D2, sf.sets(("bench", 80, 5)))
    service.drain(conn, "test")
    assert pr_overview(conn, user) == {"bench": False, "squat": False}


def test_status_counts_exhausted_compute_failures(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    """Compute failures raise the run's attempts, not the job's: the status function
    still counts the exhausted job."""
    sf.save(conn, user, D1, sf.sets(("squat", 100, 5)))
    exhaust_squeezed(conn, db_url, claim(conn))
    [job] = sf.jobs(conn, user)
    assert job["status"] == "failed" and job["attempts"] == 1
    assert service.worker_status(conn)["attempt_exhausted_failures"] == 1


def test_a_claim_that_exhausts_owes_its_range(conn: Connection, user: uuid.UUID) -> None:
    """Dead workers past the attempt cap: the claim fails the job and its range is owed."""
    sf.save(conn, user, D1, sf.sets(("squat", 100, 5)))
    for _ in range(3):
        dead = claim(conn)
        sf.expire_run(conn, dead.run_id, dead.lease_token)
    assert service.claim(conn, "test") is None
    assert sf.jobs(conn, user)[0]["status"] == "failed"
    assert [r["exercise_ids"] for r in owed(conn)] == [["squat"]]


def test_scanner_requests_an_owed_range(conn: Connection, db_url: str, user: uuid.UUID) -> None:
    """With no later write for the user, the backfill scanner finds the owed range an
    hour after its last failure and requests a generation whose claim takes it in."""
    execute(conn, "SELECT set_config('inventory.stats_today', %s, false)", (D2.isoformat(),))
    sf.save(conn, user, D1 - timedelta(days=1), sf.sets(("bench", 80, 5)))
    service.drain(conn, "test")
    sf.save(conn, user, D1, sf.sets(("squat", 100, 5)))
    assert exhaust_squeezed(conn, db_url, claim(conn))[-1] == "failed"
    assert len(owed(conn)) == 1
    # A range that just failed waits an hour: a range that keeps failing is no loop.
    assert maintenance.scan(conn).stale == ()
    execute(conn, "UPDATE user_stats_owed_ranges SET updated_at = now() - interval '61 minutes'")
    found = maintenance.scan(conn)
    assert found.stale == ((user, "owed range"),)
    service.drain(conn, "test")
    requested, applied = sf.versions(conn, user)
    assert requested == applied
    assert set(sf.exercise_stats(conn, user)) == {"squat", "bench"}
    assert owed(conn) == []
