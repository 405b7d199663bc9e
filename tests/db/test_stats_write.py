"""The training stats write surface and queue on real PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import date

import pytest

from inventory_pipeline.db import Connection, DatabaseError, connect, execute, fetch_all
from inventory_pipeline.stats import service
from tests import stats_factories as sf

D = date(2026, 3, 10)


@pytest.fixture
def user(conn: Connection) -> uuid.UUID:
    for name in ("squat", "bench", "deadlift", "row"):
        sf.exercise(conn, name)
    return uuid.uuid4()


def test_save_is_atomic_with_receipt_job_and_version(conn: Connection, user: uuid.UUID) -> None:
    result = sf.save(conn, user, D, sf.sets(("squat", 100, 5), ("bench", 80, 8)))
    assert result["requested_version"] == 1
    [job] = sf.jobs(conn, user)
    assert (job["status"], job["from_date"], job["exercise_ids"]) == (
        "pending",
        D,
        ["bench", "squat"],
    )
    assert job["event_type"] == "session_saved" and job["requested_version"] == 1
    receipts = fetch_all(conn, "SELECT * FROM stats_mutation_receipts")
    assert len(receipts) == 1 and receipts[0]["operation"] == "save"


@pytest.mark.parametrize("expected", [None, "other"])
def test_missing_or_mismatched_owner_writes_nothing(
    conn: Connection, user: uuid.UUID, expected: str | None
) -> None:
    owner = uuid.uuid4() if expected == "other" else None
    with pytest.raises(DatabaseError, match="owner"):
        sf.save(conn, user, D, sf.sets(("squat", 100, 5)), expected=owner)
    for table in (
        "training_sessions",
        "training_sets",
        "stats_mutation_receipts",
        "user_exercise_stats_refresh_jobs",
        "user_stats_refresh_state",
    ):
        assert fetch_all(conn, f"SELECT 1 FROM {table}") == []


def test_other_users_session_cannot_be_updated_or_deleted(
    conn: Connection, user: uuid.UUID
) -> None:
    sid = uuid.UUID(sf.save(conn, user, D, sf.sets(("squat", 100, 5)))["session_id"])
    intruder = uuid.uuid4()
    with pytest.raises(DatabaseError, match="owner"):
        sf.save(conn, intruder, D, sf.sets(("row", 1, 1)), session_id=sid)
    with pytest.raises(DatabaseError, match="owner"):
        sf.delete(conn, intruder, sid)


def test_dirty_ranges(conn: Connection, user: uuid.UUID) -> None:
    sid = uuid.UUID(sf.save(conn, user, D, sf.sets(("squat", 100, 5)))["session_id"])
    execute(
        conn,
        "UPDATE user_exercise_stats_refresh_jobs SET status = 'completed', completed_at = now()",
    )
    # Date moves later and an exercise is replaced: earlier date, union of exercises.
    sf.save(conn, user, date(2026, 3, 20), sf.sets(("bench", 60, 5)), session_id=sid)
    job = sf.jobs(conn, user)[-1]
    assert (job["from_date"], job["exercise_ids"]) == (D, ["bench", "squat"])
    execute(
        conn,
        "UPDATE user_exercise_stats_refresh_jobs SET status = 'completed', completed_at = now()",
    )
    sf.delete(conn, user, sid)
    job = sf.jobs(conn, user)[-1]
    assert (job["event_type"], job["from_date"], job["exercise_ids"]) == (
        "session_deleted",
        date(2026, 3, 20),
        ["bench"],
    )


def test_merge_semantics(conn: Connection, user: uuid.UUID) -> None:
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    sf.save(conn, user, date(2026, 3, 1), sf.sets(("bench", 80, 5)))
    sf.save(conn, user, date(2026, 3, 5), sf.sets(("bench", 80, 5)))
    [job] = sf.jobs(conn, user)
    assert job["from_date"] == date(2026, 3, 1)
    assert job["exercise_ids"] == ["bench", "squat"]
    assert job["reason"] == "session created"  # appended once
    assert job["metadata"]["merge_count"] == 2 and job["requested_version"] == 3
    assert job["metadata"]["latest_source_ref"].startswith("session:")
    # NULL means full history; empty means every exercise.
    execute(conn, "SELECT request_stats_refresh(%s, NULL, '{}', 'full rebuild')", (user,))
    [job] = sf.jobs(conn, user)
    assert (job["from_date"], job["exercise_ids"]) == (None, [])
    assert job["reason"] == "session created; full rebuild"


def test_enqueue_never_touches_processing_and_skips_locked_pending(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    claim = service.claim(conn, "test")
    assert claim is not None
    sf.save(conn, user, date(2026, 3, 11), sf.sets(("bench", 80, 5)))
    first, second = sf.jobs(conn, user)
    assert first["status"] == "processing" and first["exercise_ids"] == ["squat"]
    assert second["status"] == "pending" and second["exercise_ids"] == ["bench"]
    # A worker holding the pending row's lock (mid-claim) does not block enqueue.
    with connect(db_url) as worker, worker.transaction():
        execute(
            worker,
            "SELECT 1 FROM user_exercise_stats_refresh_jobs WHERE id = %s FOR UPDATE",
            (second["id"],),
        )
        sf.save(conn, user, date(2026, 3, 12), sf.sets(("row", 50, 10)))
    statuses = [(j["status"], j["exercise_ids"]) for j in sf.jobs(conn, user)]
    assert statuses == [("processing", ["squat"]), ("pending", ["bench"]), ("pending", ["row"])]
    sf.save(conn, user, date(2026, 3, 13), sf.sets(("row", 50, 10)))
    assert len(sf.jobs(conn, user)) == 3  # later writes merge again


def test_settings_checks(conn: Connection) -> None:
    with pytest.raises(DatabaseError, match="check constraint"):
        execute(conn, "UPDATE stats_projection_worker_settings SET publish_budget_ms = 8000")
    with pytest.raises(DatabaseError, match="lease_covers_work"):
        execute(conn, "UPDATE stats_projection_worker_settings SET lease_seconds = 60")
    with pytest.raises(DatabaseError):
        execute(conn, "INSERT INTO stats_projection_worker_settings (id) VALUES (2)")
