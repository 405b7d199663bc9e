"""Stats maintenance jobs in process on real PostgreSQL, and the purge of Dagster's own
run history of the high-frequency stats jobs on a real (temporary) Dagster instance."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterator
from datetime import date

import dagster as dg
import pytest
from dagster._core.storage.dagster_run import DagsterRun
from dagster._core.storage.runs.schema import RunsTable

from inventory_pipeline.db import Connection, connect, execute, transaction
from inventory_pipeline.definitions import defs
from inventory_pipeline.defs import stats_maintenance as maintenance_defs
from inventory_pipeline.defs.resources import InventoryDatabase
from tests import stats_factories as sf

NOW = datetime.datetime.now(datetime.UTC)


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def test_maintenance_jobs_report_counts(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    db = InventoryDatabase(url=db_url)
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, date(2026, 3, 10), sf.sets(("squat", 100, 5)))
    defs.resolve_job_def("stats_drain").execute_in_process(
        instance=instance, resources={"inventory_db": db}
    )
    conn.execute("UPDATE user_pr_overview_rollover_state SET due_at = now()")
    for job, expected in (
        (maintenance_defs.stats_rollover, "rollover_requested"),
        (maintenance_defs.stats_backfill_scan, "users"),
        (maintenance_defs.stats_retention, "dagster_runs"),
    ):
        result = job.execute_in_process(instance=instance, resources={"inventory_db": db})
        assert result.success
        [output] = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
        assert expected in output.event_specific_data.metadata  # type: ignore[union-attr]
    assert {s.name for s in maintenance_defs.maintenance_schedules} == {
        "stats_retention_schedule",
    }


def test_the_backfill_scan_runs_in_its_tick_without_a_run(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    """Every minute a scan page, and no run for it: an idle minute was a run each
    (1,440 a day); a stale user found is queued for the drain sensor."""
    context = dg.build_sensor_context(
        instance=instance, resources={"inventory_db": InventoryDatabase(url=db_url)}
    )
    idle = maintenance_defs.stats_backfill_scan_sensor(context)
    assert isinstance(idle, dg.SkipReason)
    assert idle.skip_message == "scanned a page: no stale user; lap done"
    # Another scanner (the job run by hand, a preview) holds the cursor: said so.
    with connect(db_url) as other, transaction(other):
        execute(other, "SELECT 1 FROM stats_scan_cursor WHERE id = 1 FOR UPDATE")
        busy = maintenance_defs.stats_backfill_scan_sensor(context)
    assert isinstance(busy, dg.SkipReason)
    assert busy.skip_message == "another scanner holds the cursor; nothing scanned"
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, date(2026, 3, 10), sf.sets(("squat", 100, 5)))
    db = InventoryDatabase(url=db_url)
    defs.resolve_job_def("stats_drain").execute_in_process(
        instance=instance, resources={"inventory_db": db}
    )
    conn.execute("DELETE FROM user_training_period_stats WHERE user_id = %s", (user,))
    found = maintenance_defs.stats_backfill_scan_sensor(context)
    assert isinstance(found, dg.SkipReason)
    assert found.skip_message is not None
    assert found.skip_message == (
        "scanned a page: 1 stale users queued (rollups without period stats); lap done"
    )
    assert [j["event_type"] for j in sf.jobs(conn, user) if j["status"] == "pending"] == [
        "scheduled_stats_backfill"
    ]


def test_purged_jobs_are_jobs_of_the_code_location() -> None:
    """A renamed job would silently keep its run history forever."""
    names = {job.name for job in defs.resolve_all_job_defs()}
    assert set(maintenance_defs.HIGH_FREQUENCY_JOBS) <= names


def add_run(
    instance: dg.DagsterInstance,
    job_name: str,
    status: dg.DagsterRunStatus,
    age: datetime.timedelta,
) -> str:
    """A run of `job_name` last updated `age` ago (backdated in the run storage)."""
    run = instance.add_run(DagsterRun(job_name=job_name, run_id=str(uuid.uuid4()), status=status))
    then = NOW - age
    with instance.run_storage.connect() as c:  # type: ignore[attr-defined]
        c.execute(
            RunsTable.update()
            .where(RunsTable.c.run_id == run.run_id)
            .values(create_timestamp=then, update_timestamp=then)
        )
    return run.run_id


def run_ids(instance: dg.DagsterInstance) -> set[str]:
    return {r.dagster_run.run_id for r in instance.get_run_records()}


def test_run_history_purge_is_bounded_and_selective(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    old, recent = datetime.timedelta(days=8), datetime.timedelta(days=6, hours=23)
    ok, failed = dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE
    doomed = {
        add_run(instance, "stats_drain", ok, old),
        add_run(instance, "stats_drain", failed, old),
        add_run(instance, "stats_drain", dg.DagsterRunStatus.CANCELED, old),
        add_run(instance, "stats_rollover", ok, old),
        add_run(instance, "stats_backfill_scan", ok, old),
    }
    kept = {
        add_run(instance, "stats_drain", ok, recent),
        add_run(instance, "stats_drain", dg.DagsterRunStatus.STARTED, old),  # in progress
        add_run(instance, "stats_rollover", dg.DagsterRunStatus.STARTING, old),
        add_run(instance, "stats_rebuild", ok, old),  # an operator's job
        add_run(instance, "library_profile_refresh", ok, old),
    }
    db = InventoryDatabase(url=db_url)
    config = {"ops": {"prune_stats_history": {"config": {"run_batch": 2}}}}
    passes = []
    for _ in range(4):
        result = maintenance_defs.stats_retention.execute_in_process(
            instance=instance, resources={"inventory_db": db}, run_config=config
        )
        assert result.success
        [output] = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
        passes.append(output.event_specific_data.metadata["dagster_runs"].value)  # type: ignore[union-attr]
        # The run's log says what it did, not only its metadata.
        said = [
            e.message
            for e in instance.all_logs(result.run_id)
            if e.user_message.startswith("deleted: ")
        ]
        assert said and f"{passes[-1]} dagster_runs" in said[0], said
    assert passes == [2, 2, 1, 0]  # bounded batches
    left = run_ids(instance)
    assert kept <= left and not (doomed & left)
    # The retention runs themselves are recent: still there.
    assert len(left - kept) == 4


def test_run_history_purge_through_the_instance_api(instance: dg.DagsterInstance) -> None:
    ok = dg.DagsterRunStatus.SUCCESS
    for _ in range(3):
        add_run(instance, "stats_drain", ok, datetime.timedelta(days=30))
    other = add_run(instance, "stats_rebuild", ok, datetime.timedelta(days=30))
    cutoff = NOW - datetime.timedelta(days=7)
    first = maintenance_defs.purge_run_history(instance, ("stats_drain",), cutoff, batch=2)
    second = maintenance_defs.purge_run_history(instance, ("stats_drain",), cutoff, batch=2)
    assert (first, second) == ({"stats_drain": 2}, {"stats_drain": 1})
    assert run_ids(instance) == {other}


def test_rollover_sensor_relaunches_at_once_while_users_are_due(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    """A run that spent its budget leaves users due: the next tick after it ends (the
    daemon's cadence, not a minute) launches the next run, until none is due."""
    db = InventoryDatabase(url=db_url)
    resources = {"inventory_db": db}
    assert maintenance_defs.stats_rollover_sensor.minimum_interval_seconds == 5
    conn.execute(
        "INSERT INTO user_stats_refresh_state (user_id, requested_version, applied_version)"
        " SELECT gen_random_uuid(), 1, 1 FROM generate_series(1, 3)"
    )
    conn.execute(
        "INSERT INTO user_pr_overview_rollover_state (user_id, due_at, snapshot_generation)"
        " SELECT user_id, now() - interval '1 minute', 1 FROM user_stats_refresh_state"
    )

    def tick(cursor: str | None) -> dg.RunRequest | dg.SkipReason:
        context = dg.build_sensor_context(instance=instance, resources=resources, cursor=cursor)
        result = maintenance_defs.stats_rollover_sensor(context)
        assert isinstance(result, dg.RunRequest | dg.SkipReason)
        return result

    launches = []
    cursor: str | None = None
    for _ in range(5):
        request = tick(cursor)
        if isinstance(request, dg.SkipReason):
            break
        launches.append(request.run_key)
        cursor = str(len(launches))
        # A budget so small that each run rolls exactly one user and stops.
        result = maintenance_defs.stats_rollover.execute_in_process(
            instance=instance,
            resources=resources,
            run_config={"ops": {"roll_pr_overview": {"config": {"budget_seconds": 1e-9}}}},
        )
        assert result.success
        assert result.output_for_node("roll_pr_overview") == 1
    assert launches == ["stats-rollover-1", "stats-rollover-2", "stats-rollover-3"]
    row = conn.execute(
        "SELECT count(*) AS due FROM user_pr_overview_rollover_state WHERE due_at <= now()"
    ).fetchone()
    assert row is not None and row["due"] == 0


def test_rollover_sensor_waits_for_the_run_in_flight(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    resources = {"inventory_db": InventoryDatabase(url=db_url)}
    conn.execute(
        "INSERT INTO user_pr_overview_rollover_state (user_id, due_at)"
        " VALUES (gen_random_uuid(), now() - interval '1 minute')"
    )
    add_run(instance, "stats_rollover", dg.DagsterRunStatus.STARTED, datetime.timedelta(0))
    context = dg.build_sensor_context(instance=instance, resources=resources)
    result = maintenance_defs.stats_rollover_sensor(context)
    assert isinstance(result, dg.SkipReason) and "already" in str(result.skip_message)
