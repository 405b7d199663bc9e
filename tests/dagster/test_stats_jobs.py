"""The stats sensor, drain and rebuild jobs in process on real PostgreSQL."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import date

import dagster as dg
import pytest

from inventory_pipeline.db import Connection, connect, execute
from inventory_pipeline.definitions import defs
from inventory_pipeline.defs import stats as stats_defs
from inventory_pipeline.defs import stats_maintenance as maintenance_defs
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.stats import repository as repo
from tests import stats_factories as sf


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def test_sensor_drain_and_rebuild(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    db = InventoryDatabase(url=db_url)
    context = dg.build_sensor_context(instance=instance, resources={"inventory_db": db})
    assert isinstance(stats_defs.stats_refresh_sensor(context), dg.SkipReason)
    sf.exercise(conn, "squat")
    # Ids that share their first 8 characters, as the demo's users do.
    users = [uuid.UUID(f"00000000-0000-4000-8000-{uuid.uuid4().hex[:12]}") for _ in range(3)]
    for u in users:
        sf.save(conn, u, date(2026, 3, 10), sf.sets(("squat", 100, 5)))
    request = stats_defs.stats_refresh_sensor(context)
    assert isinstance(request, dg.RunRequest) and request.run_key == "stats-drain-1"
    result = defs.resolve_job_def("stats_drain").execute_in_process(
        instance=instance, resources={"inventory_db": db}
    )
    assert result.success
    mats = [
        e.step_materialization_data.materialization
        for e in result.get_asset_materialization_events()
    ]
    by_asset = {m.asset_key.path[0]: m.metadata for m in mats}
    assert set(by_asset) == {"user_exercise_stats", "user_training_period_stats", "pr_overview"}
    stats = by_asset["user_exercise_stats"]
    assert stats["users"].value == 3 and stats["generations"].value == 3
    # The PR overview lists each published generation, and the backlog left (none).
    overview = by_asset["pr_overview"]
    assert overview["published_generations"].value == 3
    rows = overview["published"].value.records  # type: ignore[attr-defined]
    assert sorted(r.data["user"] for r in rows) == sorted(str(u) for u in users)
    assert {r.data["generation"] for r in rows} == {1}
    assert overview["users_stale"].value == 0 and overview["users_owed"].value == 0
    assert all(sf.versions(conn, u) == (1, 1) for u in users)
    assert isinstance(stats_defs.stats_refresh_sensor(context), dg.SkipReason)

    rebuild = maintenance_defs.stats_rebuild.execute_in_process(
        instance=instance,
        resources={"inventory_db": db},
        run_config={"ops": {"request_stats_rebuild": {"config": {"user_ids": [str(users[0])]}}}},
    )
    assert rebuild.success
    [job] = [j for j in sf.jobs(conn, users[0]) if j["status"] == "pending"]
    assert (job["event_type"], job["from_date"], job["exercise_ids"]) == (
        "analyst_rebuild",
        None,
        [],
    )
    bad = maintenance_defs.stats_rebuild.execute_in_process(
        instance=instance,
        resources={"inventory_db": db},
        run_config={
            "ops": {"request_stats_rebuild": {"config": {"user_ids": ["'; DROP TABLE x; --"]}}}
        },
        raise_on_error=False,
    )
    assert not bad.success
    everyone = maintenance_defs.stats_rebuild.execute_in_process(
        instance=instance, resources={"inventory_db": db}
    )
    assert everyone.output_for_node("request_stats_rebuild") == 3


def test_worker_control_job(conn: Connection, db_url: str, instance: dg.DagsterInstance) -> None:
    db = InventoryDatabase(url=db_url)

    def control(**config: object) -> dg.ExecuteInProcessResult:
        return stats_defs.stats_worker_control.execute_in_process(
            instance=instance,
            resources={"inventory_db": db},
            run_config={"ops": {"control_stats_worker": {"config": config}}},
            raise_on_error=False,
        )

    assert control(action="pause").success
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, date(2026, 3, 10), sf.sets(("squat", 100, 5)))
    context = dg.build_sensor_context(instance=instance, resources={"inventory_db": db})
    skipped = stats_defs.stats_refresh_sensor(context)
    assert isinstance(skipped, dg.SkipReason) and "paused" in (skipped.skip_message or "")
    drained = defs.resolve_job_def("stats_drain").execute_in_process(
        instance=instance, resources={"inventory_db": db}
    )
    assert drained.success and drained.get_asset_materialization_events() == []
    assert control(action="resume").success
    assert isinstance(stats_defs.stats_refresh_sensor(context), dg.RunRequest)
    changed = control(action="settings", compute_budget_ms=30000)
    assert changed.success
    assert changed.output_for_node("control_stats_worker") == "settings changed"
    for bad in (
        {"action": "settings", "publish_budget_ms": 9000},  # the table's CHECK
        {"action": "settings"},  # nothing to change
        {"action": "retry"},  # no job id
        {"action": "retry", "job_id": 424242},  # unknown job
    ):
        failed = control(**bad)
        assert not failed.success
    with pytest.raises(dg.DagsterInvalidConfigError):
        control(action="explode")


def test_the_sensor_launches_a_drain_kept_alive_and_bounded(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    db = InventoryDatabase(url=db_url)
    sf.exercise(conn, "squat")
    sf.save(conn, uuid.uuid4(), date(2026, 3, 10), sf.sets(("squat", 100, 5)))
    context = dg.build_sensor_context(instance=instance, resources={"inventory_db": db})
    request = stats_defs.stats_refresh_sensor(context)
    assert isinstance(request, dg.RunRequest)
    config = request.run_config["ops"]["drain_stats"]["config"]
    assert config["idle_seconds"] > 0 and config["lifetime_seconds"] > 0
    # Run monitoring ends any drain that outlives the longest lifetime (its worker died
    # unseen), the launchpad's too: the bound is the job's.
    job = defs.resolve_job_def("stats_drain")
    assert float(job.tags["dagster/max_runtime"]) > stats_defs.MAX_LIFETIME_SECONDS


def test_a_drain_in_flight_holds_the_sensor_back_only_while_it_keeps_up(
    conn: Connection, db_url: str, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Work claimable past BEHIND_SECONDS means the drain in flight is not keeping up,
    once that drain has had as long to take it: a drain launched just now is not behind
    (on every demo start, work saved before the first drain started made the sensor
    launch a second at once). Then the sensor launches another, up to the queue's two."""
    db = InventoryDatabase(url=db_url)
    context = dg.build_sensor_context(instance=instance, resources={"inventory_db": db})
    job = defs.resolve_job_def("stats_drain")
    sf.exercise(conn, "squat")
    sf.save(conn, uuid.uuid4(), date(2026, 3, 10), sf.sets(("squat", 100, 5)))
    execute(
        conn, "UPDATE user_exercise_stats_refresh_jobs SET created_at = now() - interval '31 s'"
    )
    with connect(db_url) as first_drain, connect(db_url) as second_drain:
        first = instance.create_run_for_job(job, status=dg.DagsterRunStatus.STARTED)
        repo.hold_drain_lock(first_drain, stats_defs.drain_owner(first.run_id))
        skipped = stats_defs.stats_refresh_sensor(context)
        assert isinstance(skipped, dg.SkipReason)
        assert skipped.skip_message == "1 waiting; a drain is already active"
        monkeypatch.setattr(stats_defs, "BEHIND_SECONDS", 0.5)
        time.sleep(0.6)
        assert isinstance(stats_defs.stats_refresh_sensor(context), dg.RunRequest)
        second = instance.create_run_for_job(job, status=dg.DagsterRunStatus.STARTED)
        repo.hold_drain_lock(second_drain, stats_defs.drain_owner(second.run_id))
        skipped = stats_defs.stats_refresh_sensor(context)
        assert isinstance(skipped, dg.SkipReason)
        assert skipped.skip_message == "1 waiting; 2 drains are already active"


def test_drains_whose_workers_died_unseen_are_reported_failed_and_replaced(
    conn: Connection, db_url: str, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both drains died where Dagster cannot see it (their runs stay STARTED and hold the
    queue's two places until their maximum runtime, 65 minutes): their database
    sessions are gone. Once each has been without its session for SESSIONLESS_SECONDS
    the sensor reports it failed and launches a successor; a drain whose session lives
    is left alone however long it runs."""
    monkeypatch.setattr(stats_defs, "SESSIONLESS_SECONDS", 0.5)
    db = InventoryDatabase(url=db_url)
    context = dg.build_sensor_context(instance=instance, resources={"inventory_db": db})
    job = defs.resolve_job_def("stats_drain")
    dead = [instance.create_run_for_job(job, status=dg.DagsterRunStatus.STARTED) for _ in "ab"]
    sf.exercise(conn, "squat")
    sf.save(conn, uuid.uuid4(), date(2026, 3, 10), sf.sets(("squat", 100, 5)))
    skipped = stats_defs.stats_refresh_sensor(context)
    assert isinstance(skipped, dg.SkipReason)
    assert skipped.skip_message == "1 waiting; 2 drains are already active"
    time.sleep(0.6)
    assert isinstance(stats_defs.stats_refresh_sensor(context), dg.RunRequest)
    statuses = [instance.get_run_by_id(run.run_id).status for run in dead]  # type: ignore[union-attr]
    assert statuses == [dg.DagsterRunStatus.FAILURE] * 2

    live = instance.create_run_for_job(job, status=dg.DagsterRunStatus.STARTED)
    with connect(db_url) as drain:
        repo.hold_drain_lock(drain, stats_defs.drain_owner(live.run_id))
        for _ in range(2):
            stats_defs.stats_refresh_sensor(context)
            time.sleep(0.6)
        running = instance.get_run_by_id(live.run_id)
        assert running is not None and running.status == dg.DagsterRunStatus.STARTED


def test_a_drain_kept_alive_publishes_and_materializes_work_saved_while_it_waits(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    db = InventoryDatabase(url=db_url)
    sf.exercise(conn, "squat")
    early, late = uuid.uuid4(), uuid.uuid4()
    sf.save(conn, early, date(2026, 3, 10), sf.sets(("squat", 100, 5)))

    def save_once_the_first_is_published() -> None:
        # Its own connection: the run executes in this process's main thread (Dagster
        # captures the process's output there).
        with connect(db_url) as saver:
            deadline = time.monotonic() + 60
            while sf.versions(saver, early) != (1, 1) and time.monotonic() < deadline:
                time.sleep(0.1)
            sf.save(saver, late, date(2026, 3, 10), sf.sets(("squat", 90, 5)))

    saver = threading.Thread(target=save_once_the_first_is_published)
    saver.start()
    try:
        result = defs.resolve_job_def("stats_drain").execute_in_process(
            instance=instance,
            resources={"inventory_db": db},
            run_config={"ops": {"drain_stats": {"config": {"idle_seconds": 3}}}},
        )
    finally:
        saver.join(90)
    assert result.success
    assert sf.versions(conn, late) == (1, 1)
    published = {
        r.data["user"]
        for e in result.get_asset_materialization_events()
        if e.asset_key == stats_defs.PR_OVERVIEW
        for r in e.step_materialization_data.materialization.metadata["published"].value.records  # type: ignore[attr-defined]
    }
    assert published == {str(early), str(late)}
    logged = [entry.user_message for entry in instance.all_logs(result.run_id)]
    assert "drain ended: nothing claimed for 3 s" in logged


def test_a_drain_logs_each_failed_attempt_with_its_reason(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, date(2026, 3, 10), sf.sets(("squat", 100, 5)))
    execute(conn, "UPDATE stats_projection_worker_settings SET compute_budget_ms = 300")
    with connect(db_url) as blocker, blocker.transaction():
        execute(blocker, "LOCK TABLE stats_output_exercise IN EXCLUSIVE MODE")
        result = defs.resolve_job_def("stats_drain").execute_in_process(
            instance=instance, resources={"inventory_db": InventoryDatabase(url=db_url)}
        )
    assert result.success
    warnings = [
        entry.user_message
        for entry in instance.all_logs(result.run_id)
        if entry.level == logging.WARNING
    ]
    assert warnings == [f"user {user}: interrupted: compute: statement budget spent (57014)"]
