"""Generations never go back: one live job per user (enforced by the schema), a user's
jobs started oldest first, and a publication whose target is not newer than the applied
generation refused with its range absorbed by a newer one. Every interleaving of two
jobs of one user."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date

import pytest

from inventory_pipeline.db import (
    Connection,
    DatabaseError,
    connect,
    execute,
    fetch_all,
    fetch_one,
    transaction,
)
from inventory_pipeline.stats import service
from inventory_pipeline.stats.models import StatsClaim
from tests import stats_factories as sf

D = date(2026, 3, 10)


@pytest.fixture
def user(conn: Connection) -> uuid.UUID:
    for name in ("squat", "bench", "row"):
        sf.exercise(conn, name)
    execute(conn, "SELECT set_config('inventory.stats_today', %s, false)", (D.isoformat(),))
    return uuid.uuid4()


class _Rollback(Exception):
    """Leave the block rolling its transaction back."""


@contextmanager
def claim_in_flight(db_url: str, job_id: int) -> Iterator[None]:
    """Another worker's claim holding the pending row (uncommitted), then rolled back."""
    with connect(db_url) as claimer:
        try:
            with transaction(claimer):
                execute(
                    claimer,
                    "SELECT 1 FROM user_exercise_stats_refresh_jobs WHERE id = %s FOR UPDATE",
                    (job_id,),
                )
                yield
                raise _Rollback
        except _Rollback:
            pass


def two_pending_jobs(conn: Connection, db_url: str, user: uuid.UUID) -> tuple[int, int]:
    """J1 (squat, generation 1) and J2 (bench + row, generation 3): a claim held J1 while
    the later saves enqueued, then rolled back."""
    j1 = sf.save(conn, user, D, sf.sets(("squat", 100, 5)))["job_id"]
    with claim_in_flight(db_url, j1):
        sf.save(conn, user, D, sf.sets(("bench", 80, 5)))
        sf.save(conn, user, D, sf.sets(("row", 60, 8)))
    jobs = sf.jobs(conn, user)
    assert [(j["status"], j["requested_version"]) for j in jobs] == [
        ("pending", 1),
        ("pending", 3),
    ]
    return jobs[0]["id"], jobs[1]["id"]


def generations(conn: Connection, user: uuid.UUID) -> tuple[int, int, int, int]:
    """(applied, newest exercise-row generation, newest PR header, rollover state)."""
    row = fetch_one(
        conn,
        "SELECT s.applied_version AS applied,"
        " (SELECT max(generation) FROM user_exercise_stats e WHERE e.user_id = s.user_id) AS rows,"
        " (SELECT max(generation) FROM user_pr_overview_snapshot_headers h"
        "   WHERE h.user_id = s.user_id) AS headers,"
        " (SELECT snapshot_generation FROM user_pr_overview_rollover_state r"
        "   WHERE r.user_id = s.user_id) AS rollover"
        " FROM user_stats_refresh_state s WHERE s.user_id = %s",
        (user,),
    )
    assert row is not None
    return row["applied"], row["rows"] or 0, row["headers"] or 0, row["rollover"] or 0


def publish(conn: Connection, claimed: StatsClaim) -> str:
    assert service.compute(conn, claimed).status == "computed"
    return service.publish(conn, claimed).status


def assert_settled(
    conn: Connection, user: uuid.UUID, seen: list[tuple[int, int, int, int]]
) -> None:
    for earlier, later in itertools.pairwise(seen):
        assert all(a <= b for a, b in zip(earlier, later, strict=True)), (earlier, later)
    requested, applied = sf.versions(conn, user)
    assert requested == applied
    assert set(sf.exercise_stats(conn, user)) == {"squat", "bench", "row"}
    headers = fetch_all(
        conn,
        "SELECT DISTINCT generation FROM user_pr_overview_snapshot_headers WHERE user_id = %s",
        (user,),
    )
    assert [h["generation"] for h in headers] == [applied]
    assert generations(conn, user)[3] == applied


def test_a_newer_job_waits_while_a_claim_holds_the_older_one(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    """J1 (generation 1) is held by another claim in flight: a claim passes the user by
    rather than start J2 (generation 3) first, so a user's generations publish in the
    order their jobs were made and a newer one never lands before an older."""
    j1, j2 = two_pending_jobs(conn, db_url, user)
    with claim_in_flight(db_url, j1):
        assert service.claim(conn, "w2") is None
    seen = []
    for job, generation in ((j1, 1), (j2, 3)):
        claimed = service.claim(conn, "w")
        assert claimed is not None and (claimed.job_id, claimed.target_version) == (
            job,
            generation,
        )
        assert publish(conn, claimed) == "published"
        seen.append(generations(conn, user))
    assert_settled(conn, user, seen)
    assert sf.versions(conn, user) == (3, 3)


def test_older_job_published_first_then_newer(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    two_pending_jobs(conn, db_url, user)
    seen = []
    for expected in (1, 3):
        claimed = service.claim(conn, "w")
        assert claimed is not None and claimed.target_version == expected
        assert publish(conn, claimed) == "published"
        seen.append(generations(conn, user))
    assert_settled(conn, user, seen)
    assert sf.versions(conn, user) == (3, 3)


def test_claim_rollback_while_enqueue_skipped_then_drains(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    """Two pending jobs of one user: the drain never runs both at once and settles."""
    two_pending_jobs(conn, db_url, user)
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 10")
    first = service.claim(conn, "w")
    assert first is not None
    assert service.claim(conn, "w") is None  # the user's other job waits
    service.process(conn, first)
    service.drain(conn, "w")
    assert_settled(conn, user, [])


def test_schema_allows_one_live_job_per_user(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    _, j2 = two_pending_jobs(conn, db_url, user)
    assert service.claim(conn, "w") is not None
    with pytest.raises(DatabaseError) as refused:
        execute(
            conn,
            "UPDATE user_exercise_stats_refresh_jobs SET status = 'processing',"
            " locked_at = now(), lock_owner = 'x' WHERE id = %s",
            (j2,),
        )
    assert refused.value.sqlstate == "23505"


def wait_until_blocked(conn: Connection, pid: int, thread: threading.Thread) -> None:
    """Until the backend waits on a lock (or the thread is done without waiting)."""
    for _ in range(500):
        row = fetch_one(
            conn,
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
            (pid,),
        )
        if not thread.is_alive() or (row is not None and row["wait_event_type"] == "Lock"):
            return
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} neither finished nor waited on a lock")


def claim_while_first_start_is_uncommitted(
    conn: Connection, db_url: str, j1: int
) -> list[StatsClaim | BaseException | None]:
    """A second worker's claim made while another session has started J1 but not yet
    committed: the claim blocks on the one-live-job index until that commit."""
    results: list[StatsClaim | BaseException | None] = []
    with connect(db_url) as first, connect(db_url) as second:
        pid = fetch_one(second, "SELECT pg_backend_pid() AS pid")["pid"]  # type: ignore[index]

        def late_claim() -> None:
            try:
                results.append(service.claim(second, "w2"))
            except BaseException as exc:  # reported below
                results.append(exc)

        with first.transaction():
            execute(
                first,
                "UPDATE user_exercise_stats_refresh_jobs SET status = 'processing',"
                " locked_at = now(), lock_owner = 'w1' WHERE id = %s",
                (j1,),
            )
            thread = threading.Thread(target=late_claim)
            thread.start()
            wait_until_blocked(conn, pid, thread)
        thread.join(timeout=30)
    return results


def test_stale_not_exists_cannot_start_a_second_live_job(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    """A claim whose NOT EXISTS check saw J1 still pending (J1's claim not yet
    committed) takes J2: the one-live-job index makes it wait and then refuses it."""
    j1, _ = two_pending_jobs(conn, db_url, user)
    results = claim_while_first_start_is_uncommitted(conn, db_url, j1)
    live = fetch_all(
        conn,
        "SELECT id FROM user_exercise_stats_refresh_jobs WHERE status = 'processing'",
    )
    assert [r["id"] for r in live] == [j1]
    assert results == [None]


def test_a_refused_start_is_claimed_again_past_that_user(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    """The refusal above rolls the stage call back whole; the call made again sees J1
    live, passes that user by and claims another user's pending job."""
    j1, _ = two_pending_jobs(conn, db_url, user)
    other = uuid.uuid4()
    sf.save(conn, other, D, sf.sets(("squat", 90, 5)))
    results = claim_while_first_start_is_uncommitted(conn, db_url, j1)
    [claimed] = results
    assert isinstance(claimed, StatsClaim) and claimed.user_id == other
    live = fetch_all(
        conn,
        "SELECT user_id FROM user_exercise_stats_refresh_jobs WHERE status = 'processing'"
        " ORDER BY id",
    )
    assert [r["user_id"] for r in live] == [user, other]
