"""The Dagster shell over real PostgreSQL: sensor, batched refresh job, analyst backfill
and the partitioned check, executed in process against an ephemeral instance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
import yaml

from inventory_pipeline.db import Connection, execute, fetch_one
from inventory_pipeline.definitions import defs
from inventory_pipeline.defs import profile_checks, profile_ranges, profile_sensor
from inventory_pipeline.defs import profiles as profile_defs
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.models import RefreshPolicy
from tests import factories as f


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


# The code location, by name: adding, renaming or removing one is a deliberate change here.
ASSETS = [
    "library_profile",
    "media_inventory",
    "pr_overview",
    "provider_observations",
    "replacement_proposals",
    "tmdb_credential",
    "training_log",
    "user_exercise_stats",
    "user_training_period_stats",
]
# Each asset's group (its capability) and what it is derived from.
LINEAGE = {
    "media_inventory": ("system_of_record", []),
    "training_log": ("system_of_record", []),
    "library_profile": ("library_profiles", ["media_inventory"]),
    "provider_observations": ("provider_recovery", ["media_inventory", "tmdb_credential"]),
    "replacement_proposals": ("provider_recovery", ["provider_observations"]),
    "tmdb_credential": ("credentials", []),
    "user_exercise_stats": ("training_stats", ["training_log"]),
    "user_training_period_stats": ("training_stats", ["training_log"]),
    "pr_overview": ("training_stats", ["training_log"]),
}
CHECKS = [
    "library_profile.library_profile_current",
    "provider_observations.recovery_cases_on_time",
    "tmdb_credential.tmdb_key_verified",
]
JOBS = [
    "credential_wakeup",
    "identity_revalidation",
    "library_profile_refresh",
    "profile_request_compaction",
    "provider_observation",
    "replacement_decision",
    "stats_backfill_scan",
    "stats_drain",
    "stats_rebuild",
    "stats_retention",
    "stats_rollover",
    "stats_worker_control",
]
SENSORS = [
    "credential_wakeup_sensor",
    "identity_revalidation_sensor",
    "library_profile_sensor",
    "library_profile_staleness_sensor",
    "provider_observation_sensor",
    "stats_backfill_scan_sensor",
    "stats_refresh_sensor",
    "stats_rollover_sensor",
]
SCHEDULES = [
    "profile_request_compaction_schedule",
    "stats_retention_schedule",
]
QUEUE_TAG = "inventory_pipeline/queue"


def test_definitions_snapshot() -> None:
    repo = defs.get_repository_def()
    graph = repo.asset_graph
    assert sorted(key.to_user_string() for key in graph.get_all_asset_keys()) == ASSETS
    assert (
        sorted(f"{key.asset_key.to_user_string()}.{key.name}" for key in graph.asset_check_keys)
        == CHECKS
    )
    assert sorted(j.name for j in repo.get_all_jobs() if not j.name.startswith("__")) == JOBS
    assert sorted(s.name for s in repo.sensor_defs) == SENSORS
    assert sorted(s.name for s in repo.schedule_defs) == SCHEDULES
    assert profile_ranges.library_partitions.name == "inventory_pipeline__library_profile"
    lineage = {
        key.to_user_string(): (
            graph.get(key).group_name,
            sorted(p.to_user_string() for p in graph.get(key).parent_keys),
        )
        for key in graph.get_all_asset_keys()
    }
    assert lineage == LINEAGE


def instance_settings(repo_root: Path) -> list[Path]:
    """Every instance settings file the project ships (the deployment one if present)."""
    files = [repo_root / "dagster.yaml", repo_root / "deploy" / "dagster.yaml"]
    return [path for path in files if path.exists()]


def test_every_queue_tag_has_a_limit_in_the_instance_settings(repo_root: Path) -> None:
    """A queue tag without a limit would run unbounded: the queue caps nothing."""
    repo = defs.get_repository_def()
    used: set[str] = set()
    for job in repo.get_all_jobs():
        if QUEUE_TAG in job.tags:
            used.add(job.tags[QUEUE_TAG])
        for node in job.graph.node_dict.values():
            if QUEUE_TAG in node.definition.tags:
                used.add(node.definition.tags[QUEUE_TAG])
    assert used >= {"profile_refresh", "provider_observation", "stats_drain"}
    files = instance_settings(repo_root)
    assert files
    for path in files:
        settings = yaml.safe_load(path.read_text())
        limits = {
            limit["value"]
            for limit in settings["concurrency"]["runs"]["tag_concurrency_limits"]
            if limit["key"] == QUEUE_TAG
        }
        assert used <= limits, f"{path.name}: no limit for {sorted(used - limits)}"


def materializations(result: dg.ExecuteInProcessResult) -> dict[str, dict[str, object]]:
    """What the run recorded of each library, by library id: its row of its range's
    `libraries` table, and the library's whole metadata where a materialization is of
    that library alone. Each sits on its range's partition."""
    out: dict[str, dict[str, object]] = {}
    for event in result.get_asset_materialization_events():
        mat = event.step_materialization_data.materialization
        assert mat is not None and mat.partition is not None
        rows: list[dict[str, object]] = []
        if "libraries" in mat.metadata:
            table = mat.metadata["libraries"].value
            assert isinstance(table, dg.TableMetadataValue)
            rows = [dict(record.data) for record in table.records]
        if "library_id" in mat.metadata:
            assert len(rows) <= 1
            rows = [{**(rows[0] if rows else {}), **{k: v.value for k, v in mat.metadata.items()}}]
        for row in rows:
            library_id = row["library_id"]
            assert isinstance(library_id, int)
            assert mat.partition == profile_ranges.partition_of(library_id)
            out.setdefault(str(library_id), {}).update(row)
    return out


def ranges(libraries: list[int]) -> list[str]:
    return sorted({profile_ranges.partition_of(lib) for lib in libraries})


def running_claims(conn: Connection) -> int:
    row = fetch_one(
        conn, "SELECT count(*) AS n FROM profile_refresh_requests WHERE status = 'running'"
    )
    assert row is not None
    return int(row["n"])


def test_sensor_plans_and_the_run_claims(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    srv = f.server(conn)
    libs = [f.library(conn, srv, name=str(i)) for i in range(3)]
    for lib in libs:
        f.items(conn, lib, 8)
    db = InventoryDatabase(url=db_url)
    context = dg.build_sensor_context(instance=instance, resources={"inventory_db": db})
    result = profile_sensor.library_profile_sensor(context)
    assert isinstance(result, dg.SensorResult)
    [run] = result.run_requests or []
    assert run.run_key == "profile-refresh-1" and not run.run_config
    # The tick planned but claimed nothing: a run waiting in the queue holds no lease.
    assert running_claims(conn) == 0
    assert {r["status"] for lib in libs for r in f.requests(conn, lib)} == {"pending"}
    # The tick added the partitions itself, in one statement: no request for the daemon.
    assert not result.dynamic_partitions_requests
    assert sorted(instance.get_dynamic_partitions(profile_ranges.PARTITIONS_NAME)) == ranges(libs)

    job = profile_defs.library_profile_refresh
    executed = job.execute_in_process(instance=instance, resources={"inventory_db": db})
    assert executed.success
    mats = materializations(executed)
    assert sorted(mats) == sorted(str(i) for i in libs)
    assert all(m["profile_revision"] == 1 and m["item_count"] == 8 for m in mats.values())
    # One event per partition, not per library: each costs Dagster several writes.
    events = executed.get_asset_materialization_events()
    assert len(events) == len(ranges(libs))
    assert all(f.state(conn, lib)["acknowledged_revision"] == 1 for lib in libs)
    assert all(r["attempts"] == 1 for lib in libs for r in f.requests(conn, lib))
    checks = executed.get_asset_check_evaluations()
    assert sorted(c.partition or "" for c in checks if c.passed) == ranges(libs)
    # Replaying the run (a duplicated or hand-launched run) finds nothing to claim.
    again = job.execute_in_process(instance=instance, resources={"inventory_db": db})
    assert again.success and materializations(again) == {}
    # Nothing left: the next tick skips.
    assert isinstance(profile_sensor.library_profile_sensor(context), dg.SkipReason)


def test_previewed_and_failed_ticks_leave_no_claim(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    """The UI's "Preview tick result" evaluates the sensor and launches nothing; a tick
    can fail after its work. Neither may leave a lease behind."""
    lib = f.library(conn)
    f.items(conn, lib, 6)
    db = InventoryDatabase(url=db_url)
    for _ in range(3):  # previews: evaluated, never launched
        context = dg.build_sensor_context(instance=instance, resources={"inventory_db": db})
        assert isinstance(profile_sensor.library_profile_sensor(context), dg.SensorResult)
        assert running_claims(conn) == 0
    # A run launched later claims at once, on its first attempt.
    executed = profile_defs.library_profile_refresh.execute_in_process(
        instance=instance, resources={"inventory_db": db}
    )
    assert executed.success and list(materializations(executed)) == [str(lib)]
    [request] = f.requests(conn, lib)
    assert (request["status"], request["attempts"]) == ("succeeded", 1)


def test_sensor_launches_no_more_runs_than_could_start(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    """Runs waiting in the queue count against the backlog: a backlog larger than run
    capacity does not pile up runs that would each find nothing."""
    srv = f.server(conn)
    for i in range(7):
        f.items(conn, f.library(conn, srv, name=str(i)), 2)
    db = InventoryDatabase(url=db_url, run_claims=2)
    context = dg.build_sensor_context(instance=instance, resources={"inventory_db": db})
    first = profile_sensor.library_profile_sensor(context)
    assert isinstance(first, dg.SensorResult)
    assert [r.run_key for r in first.run_requests or []] == [
        f"profile-refresh-{n}" for n in (1, 2, 3, 4)
    ]
    job = profile_defs.library_profile_refresh
    for _ in range(3):
        instance.create_run_for_job(job, status=dg.DagsterRunStatus.NOT_STARTED)
    context = dg.build_sensor_context(instance=instance, resources={"inventory_db": db}, cursor="4")
    second = profile_sensor.library_profile_sensor(context)
    assert isinstance(second, dg.SensorResult)
    assert [r.run_key for r in second.run_requests or []] == ["profile-refresh-5"]
    assert running_claims(conn) == 0


def test_backfill_goes_through_outbox(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 7)
    instance.add_dynamic_partitions(profile_ranges.library_partitions.name, ranges([lib]))
    db = InventoryDatabase(url=db_url)
    result = dg.materialize(
        [profile_defs.library_profile],
        partition_key=profile_ranges.partition_of(lib),
        instance=instance,
        resources={"inventory_db": db},
    )
    assert result.success
    assert materializations(result)[str(lib)]["acknowledged_revision"] == 1
    [request] = f.requests(conn, lib)
    assert (request["kind"], request["reason"], request["status"]) == (
        "inventory_change",
        "analyst_backfill",
        "succeeded",
    )
    # The run records the partition's check as the database sees it.
    [evaluation] = result.get_asset_check_evaluations()
    assert evaluation.passed and evaluation.partition == profile_ranges.partition_of(lib)
    # ...and fails once the inventory moves past the acknowledged revision.
    execute(conn, "UPDATE media_server_items SET rating = 2 WHERE library_id = %s", (lib,))
    stale = profile_checks.range_current_result(db, lib - lib % profile_ranges.PARTITION_WIDTH)
    assert not stale.passed and stale.severity == dg.AssetCheckSeverity.WARN
    assert stale.metadata["behind"].value == 1


@pytest.mark.parametrize("library_id", [1_000_000_000_000_000_005, 2**63 - 1])
def test_a_library_with_a_19_digit_id_backfills(
    conn: Connection, db_url: str, instance: dg.DagsterInstance, library_id: int
) -> None:
    """Every bigint id has a partition that works end to end, the largest included (its
    range's end would be past bigint)."""
    server = f.server(conn)
    execute(
        conn,
        "INSERT INTO libraries (id, server_id, name, media_kind) VALUES (%s, %s, 'Far', 'movie')",
        (library_id, server),
    )
    f.items(conn, library_id, 6)
    key = profile_ranges.partition_of(library_id)
    assert profile_ranges.range_lows_of([key]) == [library_id - library_id % 10]
    instance.add_dynamic_partitions(profile_ranges.library_partitions.name, [key])
    result = dg.materialize(
        [profile_defs.library_profile],
        partition_key=key,
        instance=instance,
        resources={"inventory_db": InventoryDatabase(url=db_url)},
    )
    assert result.success
    assert f.state(conn, library_id)["acknowledged_revision"] == 1
    [evaluation] = result.get_asset_check_evaluations()
    assert evaluation.passed and evaluation.partition == key


def test_backfill_of_inactive_library_fails_the_run(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    lib = f.library(conn, active=False)
    f.items(conn, lib, 7)
    instance.add_dynamic_partitions(profile_ranges.library_partitions.name, ranges([lib]))
    result = dg.materialize(
        [profile_defs.library_profile],
        partition_key=profile_ranges.partition_of(lib),
        instance=instance,
        resources={"inventory_db": InventoryDatabase(url=db_url)},
        raise_on_error=False,
    )
    assert not result.success
    assert f.state(conn, lib)["acknowledged_revision"] == 0


def test_killed_run_is_recovered_by_the_lease(conn: Connection, db_url: str) -> None:
    """A run that claimed and died: the lease expires, the next tick re-plans nothing new
    but recovers the request, and a new claim completes it."""
    lib = f.library(conn)
    f.items(conn, lib, 6)
    policy = RefreshPolicy()
    service.plan(conn, policy)
    [dead] = service.claim(conn, policy).claims
    execute(
        conn, "UPDATE profile_refresh_requests SET lease_expires_at = now(), available_at = now()"
    )
    assert service.plan(conn, policy).expired == 1
    execute(conn, "UPDATE profile_refresh_requests SET available_at = now()")
    [fresh] = service.claim(conn, policy).claims
    assert fresh.request_id == dead.request_id
    assert service.process(conn, dead, policy).outcome == "lost"
    assert service.process(conn, fresh, policy).outcome == "published"
