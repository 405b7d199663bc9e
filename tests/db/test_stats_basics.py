"""The basics of the stats worker where users meet it: which pending job a save merges
into, how a claim that cannot get a user goes on, what the write surface accepts, a
save during a batched compute, the rollover's new generation, retention, and the
receipts of manual PR writes. Each test reproduces a defect seen on an earlier version."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from datetime import date, timedelta
from typing import Any

import pytest

from inventory_pipeline.db import (
    Connection,
    DatabaseError,
    connect,
    execute,
    fetch_all,
    fetch_one,
    jsonb,
)
from inventory_pipeline.stats import maintenance, service
from tests import stats_factories as sf

D = date(2026, 3, 10)


@pytest.fixture
def user(conn: Connection) -> uuid.UUID:
    for name in ("squat", "bench", "deadlift"):
        sf.exercise(conn, name)
    return uuid.uuid4()


def stale(conn: Connection, user: uuid.UUID) -> bool:
    row = fetch_one(conn, "SELECT stats_user_is_stale(%s) AS stale", (user,))
    assert row is not None
    return bool(row["stale"])


def stale_users(conn: Connection) -> int:
    return int(service.worker_status(conn)["stale_users"])


@contextlib.contextmanager
def rolled_back(conn: Connection) -> Iterator[None]:
    """A transaction of `conn` that ends in a rollback, as a claim's does when its
    caller gives up."""
    execute(conn, "BEGIN")
    try:
        yield
    finally:
        execute(conn, "ROLLBACK")


def published_exercises(conn: Connection, user: uuid.UUID) -> set[str]:
    return set(sf.exercise_stats(conn, user))


def drain_everything(conn: Connection) -> None:
    for _ in range(10):
        summary = service.drain(conn, "test")
        if not summary.published and not summary.rejected:
            return


# -- which pending job a save merges into -------------------------------------------


def test_a_save_after_a_rolled_back_claim_merges_into_the_newest_pending_job(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    """A claim locks the oldest pending job and rolls back; a save meanwhile creates the
    next job, and a later save must merge into that newer job: had it merged into the
    older one, that job would publish the later save's generation without the save
    between them, and the user would read as current with a save unpublished."""
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    [first] = sf.jobs(conn, user)
    with connect(db_url) as claimer, rolled_back(claimer):
        # What a claim does to the job it starts, before it rolls back (a scoped
        # processor's timeout, a deferred batch, a claim timeout).
        execute(
            claimer,
            "SELECT 1 FROM user_exercise_stats_refresh_jobs WHERE id = %s FOR UPDATE",
            (first["id"],),
        )
        sf.save(conn, user, D, sf.sets(("bench", 80, 5)))  # finds it locked: a new job
    sf.save(conn, user, D, sf.sets(("deadlift", 140, 3)))
    jobs = sf.jobs(conn, user)
    assert len(jobs) == 2
    assert jobs[0]["exercise_ids"] == ["squat"], "the older job keeps its own range"
    assert jobs[1]["requested_version"] == 3

    # One account at a time, so the reader can look between the publications.
    while service.process_one_account(conn, "test").outcome != "idle":
        if not stale(conn, user):
            assert published_exercises(conn, user) == {"squat", "bench", "deadlift"}
        else:
            assert stale_users(conn) == 1
    assert sf.versions(conn, user) == (3, 3)
    assert published_exercises(conn, user) == {"squat", "bench", "deadlift"}
    assert not stale(conn, user)


# -- a claim that cannot get a user in budget ----------------------------------------


def test_a_drain_goes_past_a_user_whose_claim_another_caller_holds(
    conn: Connection, db_url: str, user: uuid.UUID
) -> None:
    """A scoped single-user call holds its claim uncommitted through its compute; a
    drain that meets that user's next job skips the user and publishes the others,
    instead of waiting on the one-live-job index until its claim budget ends."""
    other = uuid.uuid4()
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    execute(conn, "UPDATE stats_projection_worker_settings SET claim_budget_ms = 500")
    with connect(db_url) as scoped, rolled_back(scoped):
        held = service.claim(scoped, "app", user)
        assert held is not None
        sf.save(conn, user, D, sf.sets(("bench", 80, 5)))  # the user's next job
        sf.save(conn, other, D, sf.sets(("squat", 60, 5)))
        summary = service.drain(conn, "test")
        assert [u for u, _, _ in summary.published] == [other]
    drain_everything(conn)
    assert sf.versions(conn, user) == (2, 2)
    assert published_exercises(conn, user) == {"squat", "bench"}


# -- what the write surface accepts --------------------------------------------------


def save_payload(conn: Connection, user: uuid.UUID, payload: dict[str, Any]) -> Any:
    payload = {"user_id": str(user), **payload}
    row = fetch_one(conn, "SELECT save_training_session(%s, %s) AS r", (user, jsonb(payload)))
    assert row is not None
    return row["r"]


def nothing_written(conn: Connection, user: uuid.UUID) -> bool:
    row = fetch_one(
        conn,
        "SELECT (SELECT count(*) FROM training_sessions WHERE user_id = %(u)s)"
        " + (SELECT count(*) FROM user_exercise_stats_refresh_jobs WHERE user_id = %(u)s)"
        " + (SELECT count(*) FROM user_stats_refresh_state WHERE user_id = %(u)s)"
        " + (SELECT count(*) FROM user_manual_pr_records WHERE user_id = %(u)s) AS n",
        {"u": user},
    )
    return row is not None and row["n"] == 0


@pytest.mark.parametrize(
    "session_date",
    ["300000-01-01", "10000-01-01", "0044-03-15 BC", "infinity", "-infinity"],
)
def test_a_date_the_worker_cannot_compute_is_refused(
    conn: Connection, user: uuid.UUID, session_date: str
) -> None:
    with pytest.raises(DatabaseError) as refused:
        save_payload(
            conn,
            user,
            {"session_date": session_date, "sets": sf.sets(("squat", 100, 5))},
        )
    assert refused.value.sqlstate == "22008"
    assert "session_date" in str(refused.value).splitlines()[0]
    assert nothing_written(conn, user)


def test_the_first_and_last_accepted_dates_publish_and_read_back(
    conn: Connection, user: uuid.UUID
) -> None:
    """The accepted range's ends: the worker computes them, and a reader in Python (whose
    dates end at year 9999) loads what it published."""
    sf.save(conn, user, date(1, 1, 1), sf.sets(("squat", 100, 5)))
    sf.save(conn, user, date(9999, 12, 31), sf.sets(("squat", 110, 5)))
    execute(conn, "SELECT save_manual_pr(%s, 'bench', 90, 1, '9999-12-31')", (user,))
    drain_everything(conn)
    assert sf.versions(conn, user) == (3, 3)
    squat = sf.exercise_stats(conn, user)["squat"]
    assert (squat["first_date"], squat["last_date"]) == (date(1, 1, 1), date(9999, 12, 31))
    periods = fetch_all(
        conn,
        "SELECT period, period_start FROM user_training_period_stats WHERE user_id = %s"
        " AND period = 'year' ORDER BY 2",
        (user,),
    )
    assert [p["period_start"] for p in periods] == [date(1, 1, 1), date(9999, 1, 1)]


def test_a_manual_pr_date_the_worker_cannot_compute_is_refused(
    conn: Connection, user: uuid.UUID
) -> None:
    with pytest.raises(DatabaseError) as refused:
        execute(conn, "SELECT save_manual_pr(%s, 'squat', 100, 1, '300000-01-01')", (user,))
    assert refused.value.sqlstate == "22008"
    assert "recorded_on" in str(refused.value).splitlines()[0]
    assert nothing_written(conn, user)


@pytest.mark.parametrize("weight", ["NaN", "Infinity", "-Infinity"])
def test_a_weight_that_is_not_a_finite_number_is_refused(
    conn: Connection, user: uuid.UUID, weight: str
) -> None:
    with pytest.raises(DatabaseError) as refused:
        save_payload(
            conn,
            user,
            {
                "session_date": D.isoformat(),
                "sets": [{"exercise_id": "squat", "weight_kg": weight, "reps": 5}],
            },
        )
    assert refused.value.sqlstate == "22023"
    assert "weight_kg" in str(refused.value).splitlines()[0]
    with pytest.raises(DatabaseError) as refused_pr:
        execute(conn, "SELECT save_manual_pr(%s, 'squat', %s::numeric, 1, %s)", (user, weight, D))
    assert refused_pr.value.sqlstate == "22023"
    assert "weight_kg" in str(refused_pr.value).splitlines()[0]
    assert nothing_written(conn, user)


def test_a_nan_weight_cannot_be_written_around_the_write_surface(
    conn: Connection, user: uuid.UUID
) -> None:
    """The tables refuse it too (a repair script, an import), so no reader ever meets a
    NaN volume or estimate."""
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    with pytest.raises(DatabaseError) as refused:
        execute(conn, "UPDATE training_sets SET weight_kg = 'NaN'")
    assert refused.value.sqlstate == "23514"
    with pytest.raises(DatabaseError):
        execute(
            conn,
            "INSERT INTO user_manual_pr_records (user_id, exercise_id, weight_kg, reps,"
            " recorded_on) VALUES (%s, 'squat', 'NaN', 1, %s)",
            (user, D),
        )


@pytest.mark.parametrize(
    ("field", "value", "state"),
    [
        ("reps", -1, "22023"),
        ("reps", 1001, "22023"),
        ("reps", 2.5, "22023"),
        ("reps", "five", "22023"),
        ("weight_kg", -5, "22023"),
        ("weight_kg", 100000, "22023"),
        ("weight_kg", "heavy", "22023"),
        ("exercise_id", None, "22023"),
        ("exercise_id", "no_such_exercise", "22023"),
        ("warmup", "perhaps", "22023"),
    ],
)
def test_every_set_field_is_checked_with_one_clear_error(
    conn: Connection, user: uuid.UUID, field: str, value: Any, state: str
) -> None:
    a_set: dict[str, Any] = {"exercise_id": "squat", "weight_kg": 100, "reps": 5}
    a_set[field] = value
    with pytest.raises(DatabaseError) as refused:
        save_payload(conn, user, {"session_date": D.isoformat(), "sets": [a_set]})
    assert refused.value.sqlstate == state
    assert field in str(refused.value).splitlines()[0]
    assert nothing_written(conn, user)


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"session_date": "2026-13-40"}, "session_date"),
        ({"session_date": "2026-03-10", "notes": "x" * 10_001}, "notes"),
        ({"session_date": "2026-03-10", "id": "not-a-uuid"}, "id"),
        ({"session_date": "2026-03-10", "sets": [1, 2]}, "sets"),
    ],
)
def test_every_session_field_is_checked_with_one_clear_error(
    conn: Connection, user: uuid.UUID, payload: dict[str, Any], field: str
) -> None:
    with pytest.raises(DatabaseError) as refused:
        save_payload(conn, user, payload)
    assert refused.value.sqlstate in ("22023", "22008")
    assert field in str(refused.value).splitlines()[0]
    assert nothing_written(conn, user)


def test_a_session_with_too_many_sets_is_refused(conn: Connection, user: uuid.UUID) -> None:
    too_many = [{"exercise_id": "squat", "weight_kg": 100, "reps": 5}] * 1001
    with pytest.raises(DatabaseError) as refused:
        save_payload(conn, user, {"session_date": D.isoformat(), "sets": too_many})
    assert refused.value.sqlstate == "22023"
    assert "sets" in str(refused.value).splitlines()[0]
    assert nothing_written(conn, user)


# -- a save during a batched compute --------------------------------------------------


def test_a_save_during_a_batched_compute_keeps_its_work(conn: Connection, user: uuid.UUID) -> None:
    """Saves while a large account computes in batches do not invalidate the attempt:
    the run publishes its own generation and the saves stay a pending successor."""
    sf.history(conn, user, sessions=60, exercises=250)
    requested, _ = sf.versions(conn, user)
    claimed = service.claim(conn, "test")
    assert claimed is not None
    steps = []
    for n in range(10):
        result = service.compute(conn, claimed)
        steps.append(result.status)
        if result.status != "batch_pending":
            break
        # Someone logging sets during their workout, between every two batches.
        sf.save(conn, user, D, sf.sets(("squat", 100 + n, 5)))
    assert steps[-1] == "computed" and "retry_pending" not in steps
    run = fetch_one(
        conn,
        "SELECT attempts, error FROM user_stats_projection_runs WHERE id = %s",
        (claimed.run_id,),
    )
    assert run is not None and run["attempts"] == 1 and run["error"] is None
    assert service.publish(conn, claimed).status == "published"
    assert sf.versions(conn, user)[1] == requested
    assert stale(conn, user)  # the saves during it are a pending successor
    drain_everything(conn)
    assert sf.versions(conn, user)[0] == sf.versions(conn, user)[1]
    assert sf.exercise_stats(conn, user)["squat"]["heaviest_kg"] == 100 + len(steps) - 2


# -- the rollover requests a new generation -------------------------------------------


def set_clock(conn: Connection, day: date) -> None:
    execute(conn, "SELECT set_config('inventory.stats_today', %s, false)", (day.isoformat(),))


def test_the_rollover_requests_a_new_generation_and_never_rewrites_the_applied_one(
    conn: Connection, user: uuid.UUID
) -> None:
    set_clock(conn, D)
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    drain_everything(conn)
    _, applied = sf.versions(conn, user)
    before = fetch_all(
        conn,
        "SELECT generation, as_of_date, built_at FROM user_pr_overview_snapshot_headers"
        " WHERE user_id = %s ORDER BY as_of_date",
        (user,),
    )
    set_clock(conn, D + timedelta(days=1))  # midnight passes
    execute(conn, "UPDATE user_pr_overview_rollover_state SET due_at = now()")
    maintenance.rollover(conn)
    after = fetch_all(
        conn,
        "SELECT generation, as_of_date, built_at FROM user_pr_overview_snapshot_headers"
        " WHERE user_id = %s ORDER BY as_of_date",
        (user,),
    )
    assert after == before, "the applied generation's window is not rewritten"
    assert sf.versions(conn, user) == (applied + 1, applied)
    [job] = [j for j in sf.jobs(conn, user) if j["status"] == "pending"]
    assert job["event_type"] == "pr_overview_rollover"
    drain_everything(conn)
    assert sf.versions(conn, user) == (applied + 1, applied + 1)
    headers = fetch_all(
        conn,
        "SELECT generation, as_of_date FROM user_pr_overview_snapshot_headers"
        " WHERE user_id = %s ORDER BY as_of_date",
        (user,),
    )
    assert [(h["generation"], h["as_of_date"]) for h in headers] == [
        (applied + 1, D + timedelta(days=d)) for d in (0, 1, 2)
    ]


# -- retention, exhausted batch output, a lapsed lease, manual PR receipts ------------


def test_retention_keeps_refresh_jobs_and_projection_runs(
    conn: Connection, user: uuid.UUID
) -> None:
    for day in range(3):
        sf.save(conn, user, D - timedelta(days=day), sf.sets(("squat", 100, 5)))
        drain_everything(conn)
    execute(
        conn,
        "UPDATE user_exercise_stats_refresh_jobs SET completed_at = now() - interval '90 days'",
    )
    jobs = fetch_one(conn, "SELECT count(*) AS n FROM user_exercise_stats_refresh_jobs")
    runs = fetch_one(conn, "SELECT count(*) AS n FROM user_stats_projection_runs")
    maintenance.prune(conn)
    assert fetch_one(conn, "SELECT count(*) AS n FROM user_exercise_stats_refresh_jobs") == jobs
    assert fetch_one(conn, "SELECT count(*) AS n FROM user_stats_projection_runs") == runs


def test_an_exhausted_batch_run_leaves_no_private_output(conn: Connection, user: uuid.UUID) -> None:
    """A batch run whose worker died at its last attempt: the claim resumes it, its
    compute finds the attempts spent and fails it, and its private output goes."""
    sf.history(conn, user, sessions=40, exercises=250)
    execute(conn, "UPDATE stats_projection_worker_settings SET max_attempts = 1")
    claimed = service.claim(conn, "test")
    assert claimed is not None
    assert service.compute(conn, claimed).status == "batch_pending"  # prepared
    assert service.compute(conn, claimed).status == "batch_pending"  # one batch written
    sf.expire_run(conn, claimed.run_id, claimed.lease_token)  # its worker died
    resumed = service.claim(conn, "test")
    assert resumed is not None and resumed.run_id == claimed.run_id
    assert service.compute(conn, resumed).status == "failed"
    leftover = fetch_one(
        conn,
        "SELECT (SELECT count(*) FROM stats_output_exercise WHERE run_id = %(r)s)"
        " + (SELECT count(*) FROM stats_output_period WHERE run_id = %(r)s) AS n",
        {"r": claimed.run_id},
    )
    assert leftover is not None and leftover["n"] == 0


def test_a_lapsed_lease_whose_slot_was_taken_is_not_a_failed_compute(
    conn: Connection, user: uuid.UUID
) -> None:
    other = uuid.uuid4()
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 1")
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    claimed = service.claim(conn, "test")
    assert claimed is not None
    sf.expire_run(conn, claimed.run_id, claimed.lease_token)
    sf.save(conn, other, D, sf.sets(("squat", 60, 5)))
    # A claim scoped to the other user fills the slot the lapsed lease held.
    taken = service.claim(conn, "other worker", other)
    assert taken is not None and taken.user_id == other
    result = service.compute(conn, claimed)
    assert result.status == "lost", "the claim's recovery takes the run back"
    assert service.process(conn, taken).outcome == "published"
    drain_everything(conn)
    assert sf.versions(conn, user) == (1, 1) and sf.versions(conn, other) == (1, 1)


def test_manual_pr_writes_record_mutation_receipts(conn: Connection, user: uuid.UUID) -> None:
    saved = fetch_one(conn, "SELECT save_manual_pr(%s, 'squat', 120, 1, %s) AS r", (user, D))
    assert saved is not None
    record = saved["r"]["record_id"]
    deleted = fetch_one(conn, "SELECT delete_manual_pr(%s, %s) AS r", (user, record))
    assert deleted is not None
    receipts = fetch_all(
        conn,
        "SELECT id, operation, manual_pr_record_id, requested_version"
        " FROM stats_mutation_receipts WHERE user_id = %s ORDER BY id",
        (user,),
    )
    assert [
        (r["operation"], r["manual_pr_record_id"], r["requested_version"]) for r in receipts
    ] == [
        ("save", record, 1),
        ("delete", record, 2),
    ]
    assert [saved["r"]["receipt_id"], deleted["r"]["receipt_id"]] == [r["id"] for r in receipts]


def test_a_refresh_request_records_a_mutation_receipt(conn: Connection, user: uuid.UUID) -> None:
    """Every writer records a receipt with the generation it asked for, an explicit
    refresh request too (it changes no fact: its receipt names no session or record)."""
    asked = fetch_one(
        conn, "SELECT request_stats_refresh(%s, %s, '{squat}', 'coach asked') AS r", (user, D)
    )
    assert asked is not None
    receipts = fetch_all(
        conn,
        "SELECT id, operation, session_id, manual_pr_record_id, requested_version"
        " FROM stats_mutation_receipts WHERE user_id = %s",
        (user,),
    )
    assert [(r["operation"], r["session_id"], r["manual_pr_record_id"]) for r in receipts] == [
        ("refresh", None, None)
    ]
    assert asked["r"]["receipt_id"] == receipts[0]["id"]
    assert receipts[0]["requested_version"] == asked["r"]["requested_version"] == 1
