"""Each worker stage is one server-side call sent with its budget in one round trip: a
session that goes away during the call leaves a connection that fails cleanly. The few
statements the client still runs beside the stage calls (the batches of a large
account, a rejection after 23503, a window built outside publication) must give what
the stage calls give: the same inputs go through both paths here."""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import signal
import threading
import time
import uuid
from datetime import date
from typing import Any

import pytest

from inventory_pipeline.db import (
    ArmedCall,
    Connection,
    DatabaseError,
    DatabaseUnavailable,
    call_armed,
    connect,
    execute,
    fetch_all,
    fetch_one,
    fetch_one_armed,
    transaction,
)
from inventory_pipeline.stats import compute as compute_module
from inventory_pipeline.stats import processors, service
from inventory_pipeline.stats import publish as publish_module
from inventory_pipeline.stats import repository as repo
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
    """The claim waits for a lease slot (every one is being taken) when its session is
    terminated:
    the claim raises DatabaseUnavailable, nothing else is logged, and the connection's
    next use raises DatabaseUnavailable too (not a driver error about pipeline mode)."""
    sf.exercise(conn, "squat")
    sf.save(conn, uuid.uuid4(), D, sf.sets(("squat", 100, 5)))
    errors: list[BaseException] = []
    with connect(db_url) as worker, connect(db_url) as holder, holder.transaction():
        sf.hold_lease_slots(holder)
        row = fetch_one(worker, "SELECT pg_backend_pid() AS pid")
        assert row is not None
        pid = int(row["pid"])

        def claim() -> None:
            try:
                service.claim(worker, "w")
            except BaseException as exc:  # judged below
                errors.append(exc)

        with caplog.at_level(logging.WARNING, logger="psycopg"):
            thread = threading.Thread(target=claim)
            thread.start()
            wait_for_lock_wait(conn, pid)
            execute(conn, "SELECT pg_terminate_backend(%s)", (pid,))
            thread.join(timeout=30)
            assert not thread.is_alive()
            assert len(errors) == 1 and isinstance(errors[0], DatabaseUnavailable)
            with pytest.raises(DatabaseUnavailable):
                fetch_one(worker, "SELECT 1")
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


def test_a_batched_account_publishes_what_the_compute_stage_call_computes(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two users with one history of 120 exercises: one computed in batches of 100 by
    the client's statements, the other whole by the stage call."""
    batched, whole = uuid.uuid4(), uuid.uuid4()
    for user in (batched, whole):
        sf.history(conn, user, sessions=60, exercises=120)
    assert processors.process_claim(conn, claimed_for(conn, batched)).outcome == "published"
    monkeypatch.setattr(compute_module, "BATCH_SIZE", 1_000)
    assert processors.process_claim(conn, claimed_for(conn, whole)).outcome == "published"
    assert (manifest_mode(conn, batched), manifest_mode(conn, whole)) == ("batched", "single")
    expected = published(conn, whole)
    assert len(expected["exercises"]) == 120 and expected["periods"]
    assert published(conn, batched) == expected


def rejection(conn: Connection, user: uuid.UUID, reason: str) -> dict[str, Any]:
    """What a rejection left: the run, the private output, the user's jobs (job ids as
    positions, session ids and the rejection's reason as placeholders, no times) and
    versions."""
    runs = fetch_all(
        conn,
        "SELECT r.phase, r.error, r.finished_at IS NOT NULL AS finished,"
        " (SELECT count(*) FROM stats_output_exercise o WHERE o.run_id = r.id)"
        " + (SELECT count(*) FROM stats_output_period o WHERE o.run_id = r.id) AS outputs"
        " FROM user_stats_projection_runs r WHERE r.user_id = %s ORDER BY r.id",
        (user,),
    )
    jobs = sf.jobs(conn, user)
    position = {job["id"]: n for n, job in enumerate(jobs)}

    def text(value: str | None) -> str | None:
        if value is None:
            return None
        value = re.sub(r"session:[0-9a-f-]+", "session:*", value.replace(reason, "<reason>"))
        return re.sub(r"job:(\d+)", lambda m: f"job:#{position[int(m[1])]}", value)

    volatile = {"id", "user_id", "created_at", "updated_at", "completed_at", "locked_at"}
    kept = []
    for job in jobs:
        row = {k: v for k, v in job.items() if k not in volatile}
        row["error_message"] = text(row["error_message"])
        row["source_ref"] = text(row["source_ref"])
        row["metadata"] = {
            k: f"#{position[v]}" if k == "superseded_by" else text(v) if k.endswith("ref") else v
            for k, v in row["metadata"].items()
            if k != "last_enqueued_at"
        }
        kept.append(row)
    for run in runs:
        run["error"] = text(run["error"])
    return {"runs": runs, "jobs": kept, "versions": sf.versions(conn, user)}


def test_a_rejection_after_23503_leaves_what_the_publish_stage_call_s_rejection_leaves(
    conn: Connection,
) -> None:
    """Two users computed alike, both behind a published generation: the stage call
    rejects one, the client's rejection (the path after a deleted referenced row) the
    other; runs, jobs, successors and versions end alike."""
    sf.exercise(conn, "squat")
    server_side, client_side = uuid.uuid4(), uuid.uuid4()
    claims = {}
    for user in (server_side, client_side):
        sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
        claims[user] = claimed_for(conn, user)
        assert service.compute(conn, claims[user]).status == "computed"
    execute(
        conn,
        "UPDATE user_stats_refresh_state SET applied_version = requested_version"
        " WHERE user_id = ANY (%s)",
        ([server_side, client_side],),
    )
    by_server = service.publish(conn, claims[server_side])
    by_client = publish_module._reject_deleted_reference(conn, claims[client_side])
    assert (by_server.status, by_client.status) == ("rejected", "rejected")
    assert by_server.reason is not None and by_client.reason is not None
    assert rejection(conn, server_side, by_server.reason) == rejection(
        conn, client_side, by_client.reason
    )
    assert [j["status"] for j in sf.jobs(conn, client_side)] == ["completed", "pending"]


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
    processors.drain(conn, "w")
    generation = sf.versions(conn, user)[1]
    built = window(conn, user)
    assert len(built["headers"]) == 3 and built["summaries"] and built["rollover"]
    with transaction(conn):
        execute(conn, "DELETE FROM user_pr_overview_snapshot_headers WHERE user_id = %s", (user,))
        execute(conn, "DELETE FROM user_pr_overview_rollover_state WHERE user_id = %s", (user,))
        repo.publish_pr_window(conn, user, generation)
    assert window(conn, user) == built


SYNCHRONOUS_COMMIT = "SELECT current_setting('synchronous_commit') AS level"


@pytest.mark.parametrize("async_commit", [True, False])
def test_a_stage_of_its_own_commits_asynchronously_only_when_asked(
    conn: Connection, async_commit: bool
) -> None:
    """Claim and compute in a transaction of their own commit without waiting for their
    WAL flush; publication (not asked) and any stage inside a caller's transaction keep
    the session's level, so the caller's commit is left as it is."""
    row = fetch_one(conn, SYNCHRONOUS_COMMIT)
    assert row is not None
    level = row["level"]
    arm = {"stage": "claim", "lease_token": ""}
    own = fetch_one_armed(
        conn, repo.QUERIES["arm_stage_call"], arm, SYNCHRONOUS_COMMIT, async_commit=async_commit
    )
    assert own is not None and own["level"] == ("off" if async_commit else level)
    with transaction(conn):
        inside = fetch_one_armed(
            conn, repo.QUERIES["arm_stage_call"], arm, SYNCHRONOUS_COMMIT, async_commit=True
        )
        after = fetch_one(conn, SYNCHRONOUS_COMMIT)
    assert inside is not None and inside["level"] == level
    assert after is not None and after["level"] == level


RUN_VERSIONS = (
    "SELECT n_tup_upd AS updates FROM pg_stat_xact_user_tables"
    " WHERE relname = 'user_stats_projection_runs'"
)


def test_the_compute_stage_writes_its_run_once(conn: Connection) -> None:
    """Renewing the lease and recording the manifest are one update of the run: one new
    row version (with an entry in every index of the runs table), not two. The
    renewed lease and the attempt count are written all the same."""
    user = uuid.uuid4()
    sf.exercise(conn, "squat")
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    claimed = service.claim(conn, "test", user)
    assert claimed is not None
    sf.expire_run(conn, claimed.run_id, claimed.lease_token)  # resumed: one more attempt
    with transaction(conn):  # the counts include earlier transactions not yet reported
        before = fetch_one(conn, RUN_VERSIONS)
        assert service.compute(conn, claimed).status == "computed"
        after = fetch_one(conn, RUN_VERSIONS)
    assert before is not None and after is not None
    assert after["updates"] - before["updates"] == 1
    run = fetch_one(
        conn,
        "SELECT phase, attempts, lease_until > now() + interval '1 minute' AS renewed"
        " FROM user_stats_projection_runs WHERE id = %s",
        (claimed.run_id,),
    )
    assert run == {"phase": "computed", "attempts": 2, "renewed": True}


def test_a_call_whose_commit_fails_answers_its_own_error(conn: Connection) -> None:
    """A deferred constraint fails at the call's commit, after its statements answered:
    that call answers the error and wrote nothing, the next call of the round commits,
    and the connection stays usable."""
    execute(
        conn,
        "CREATE TEMPORARY TABLE armed_parents (id integer PRIMARY KEY,"
        " parent integer REFERENCES armed_parents DEFERRABLE INITIALLY DEFERRED)",
    )
    arm = "SELECT set_config('statement_timeout', %(budget)s, true) AS armed"

    def insert(row_id: int, parent: int | None) -> ArmedCall:
        return ArmedCall(
            arm,
            {"budget": "5000"},
            "INSERT INTO armed_parents VALUES (%(id)s, %(parent)s) RETURNING id",
            {"id": row_id, "parent": parent},
        )

    failed, committed = call_armed(conn, [insert(1, 99), insert(2, None)])
    assert isinstance(failed, DatabaseError) and failed.sqlstate == "23503"
    assert committed == {"id": 2}
    assert fetch_all(conn, "SELECT id FROM armed_parents ORDER BY id") == [{"id": 2}]


def test_a_worker_killed_mid_round_leaves_the_rest_of_its_round_unrun(
    conn: Connection, db_url: str
) -> None:
    """The calls after the running one are already with the server when the worker dies
    (SIGKILL during a long compute): the server notices the closed connection within a
    second and runs none of them, so no claim is left that no one works on."""
    execute(conn, "CREATE TABLE armed_after_death (id integer)")

    def round_then_die() -> None:
        with connect(db_url) as doomed:
            call_armed(
                doomed,
                [
                    ArmedCall(
                        repo.QUERIES["arm_stage_call"],
                        {"stage": "compute", "lease_token": None},
                        "SELECT pg_sleep(3)::text AS slept",
                    ),
                    ArmedCall(
                        repo.QUERIES["arm_stage_call"],
                        {"stage": "claim", "lease_token": None},
                        "INSERT INTO armed_after_death VALUES (1) RETURNING id",
                    ),
                ],
            )

    worker = multiprocessing.get_context("fork").Process(target=round_then_die)
    worker.start()
    sleeping = None
    for _ in range(500):
        sleeping = fetch_one(
            conn,
            "SELECT pid FROM pg_stat_activity"
            " WHERE query LIKE 'SELECT pg_sleep(3)%%' AND state = 'active'",
        )
        if sleeping is not None:
            break
        time.sleep(0.01)
    assert sleeping is not None
    os.kill(worker.pid or 0, signal.SIGKILL)
    worker.join()
    for _ in range(500):  # the backend ends when it notices (at most the check interval)
        if (
            fetch_one(
                conn, "SELECT 1 AS alive FROM pg_stat_activity WHERE pid = %s", (sleeping["pid"],)
            )
            is None
        ):
            break
        time.sleep(0.01)
    time.sleep(3.5)  # past the sleep: without the check the insert would commit by now
    assert fetch_all(conn, "SELECT id FROM armed_after_death") == []


class _Interrupted(BaseException):
    """What a run's termination raises in the worker's main thread."""


def test_an_interrupted_round_closes_its_connection(conn: Connection) -> None:
    """Interrupted while it waits for a round's answers, the worker's connection is
    closed (a pipeline left half read cannot be used again), and the interruption goes
    on up."""

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(_Interrupted):
            call_armed(
                conn,
                [
                    ArmedCall(
                        repo.QUERIES["arm_stage_call"],
                        {"stage": "compute", "lease_token": None},
                        "SELECT pg_sleep(1)::text AS slept",
                    )
                ],
            )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert conn.closed
