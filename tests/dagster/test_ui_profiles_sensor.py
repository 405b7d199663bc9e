"""What the UI can do to the profile definitions, in process against real PostgreSQL: a
foreign partition key, a failed or previewed tick, a stalled library, and what a reader
of a partition's materialization and check sees."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest

from inventory_pipeline.db import Connection, execute, fetch_one
from inventory_pipeline.defs import profiles as profile_defs
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.models import RefreshPolicy
from tests import factories as f

PARTITIONS = profile_defs.library_partitions.name


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def leases(conn: Connection) -> dict[str, int]:
    """Claims and leases held in the outbox, whatever their state."""
    row = fetch_one(
        conn,
        "SELECT count(*) FILTER (WHERE status = 'running') AS running,"
        " count(lease_token) AS leased, count(*) AS requests FROM profile_refresh_requests",
    )
    assert row is not None
    return dict(row)


def refresh(conn: Connection, db_url: str, instance: dg.DagsterInstance) -> Any:
    """Plan as a sensor tick would, then run the refresh job."""
    service.plan(conn, RefreshPolicy())
    result = profile_defs.library_profile_refresh.execute_in_process(
        instance=instance, resources={"inventory_db": InventoryDatabase(url=db_url)}
    )
    assert result.success
    return result


def tick(
    sensor: dg.SensorDefinition, instance: dg.DagsterInstance, db_url: str, cursor: str | None
) -> Any:
    context = dg.build_sensor_context(
        instance=instance, cursor=cursor, resources={"inventory_db": InventoryDatabase(url=db_url)}
    )
    return sensor(context)


def test_foreign_partition_key_is_reported_and_removed_not_fatal(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    # What "Add partition" in the Materialize dialog does.
    instance.add_dynamic_partitions(PARTITIONS, [str(lib), "Films"])
    result = tick(profile_defs.library_profile_sensor, instance, db_url, None)
    assert isinstance(result, dg.SensorResult)
    deleted = [
        key
        for request in result.dynamic_partitions_requests or []
        if isinstance(request, dg.DeleteDynamicPartitionsRequest)
        for key in request.partition_keys
    ]
    assert deleted == ["Films"]
    # The tick still launches the refresh of the real library, and holds nothing itself.
    assert len(result.run_requests or []) == 1
    assert leases(conn) == {"running": 0, "leased": 0, "requests": 1}


def test_foreign_key_without_work_is_the_skip_reason(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    lib = f.library(conn)
    instance.add_dynamic_partitions(PARTITIONS, [str(lib), "Films", "7x"])
    result = tick(profile_defs.library_profile_sensor, instance, db_url, None)
    assert isinstance(result, dg.SensorResult)
    assert result.skip_reason is not None
    assert "not library ids: '7x', 'Films'" in result.skip_reason.skip_message
    assert leases(conn)["leased"] == 0


def test_failed_tick_leaves_no_claim_and_no_lease(
    conn: Connection, db_url: str, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tick plans (commits pending requests) and then fails: nothing is running or
    leased, so the next run claims the work at once."""
    lib = f.library(conn)
    f.items(conn, lib, 6)

    def unavailable(name: str) -> list[str]:
        raise RuntimeError("instance storage unavailable")

    monkeypatch.setattr(instance, "get_dynamic_partitions", unavailable)
    with pytest.raises(RuntimeError, match="instance storage unavailable"):
        tick(profile_defs.library_profile_sensor, instance, db_url, None)
    assert leases(conn) == {"running": 0, "leased": 0, "requests": 1}
    monkeypatch.undo()
    result = profile_defs.library_profile_refresh.execute_in_process(
        instance=instance, resources={"inventory_db": InventoryDatabase(url=db_url)}
    )
    assert result.success
    assert f.state(conn, lib)["acknowledged_revision"] == 1


def test_materializing_a_foreign_key_fails_in_one_line_without_a_claim(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    instance.add_dynamic_partitions(PARTITIONS, ["Films"])
    result = dg.materialize(
        [profile_defs.library_profile, profile_defs.library_profile_current],
        partition_key="Films",
        instance=instance,
        resources={"inventory_db": InventoryDatabase(url=db_url)},
        raise_on_error=False,
    )
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert failure.step_failure_data.error is not None
    message = failure.step_failure_data.error.message
    assert message.strip().splitlines() == [
        "dagster._core.definitions.events.Failure: partition keys must be library ids, got 'Films'"
    ]
    assert leases(conn) == {"running": 0, "leased": 0, "requests": 0}


def metadata_of(event: dg.AssetMaterialization) -> dict[str, Any]:
    return {k: v.value for k, v in event.metadata.items()}


def test_small_library_says_why_every_trait_is_held_back(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    srv = f.server(conn, "Basement Plex")
    small = f.library(conn, srv, name="Shorts")
    f.items(conn, small, 4)
    big = f.library(conn, srv, name="Films")
    f.items(conn, big, 30, seed=3)
    result = refresh(conn, db_url, instance)
    by_partition = {
        e.step_materialization_data.materialization.partition: metadata_of(
            e.step_materialization_data.materialization
        )
        for e in result.get_asset_materialization_events()
    }
    tiny = by_partition[str(small)]
    assert tiny["library"] == "Shorts (movie)"
    assert tiny["media_server"] == "Basement Plex (plex)"
    assert tiny["trait/genres"] == "insufficient: 4 contributing items, need 5"
    # No coverage figure that reads as complete, and no empty distribution table.
    assert not [k for k in tiny if k.startswith(("coverage/", "distribution/", "top_genres"))]
    traits = {r.data["trait"]: r.data for r in tiny["traits"].records}
    assert set(traits) == {"genres", "rating", "primary_studio", "original_language", "identity"}
    assert all(t["status"] == "insufficient" and t["held_back"] for t in traits.values())

    full = by_partition[str(big)]
    assert {
        "distribution/rating",
        "distribution/genres",
        "distribution/primary_studio",
        "distribution/original_language",
        "distribution/identity",
    } <= set(full)
    rating = {r.data["statistic"]: r.data["value"] for r in full["distribution/rating"].records}
    stored = f.profile(conn, big)
    assert stored is not None
    assert rating == {k: stored["profile"]["rating"][k] for k in ("mean", "median", "p10", "p90")}
    assert full["profile"] == json.loads(json.dumps(stored["profile"]))
    assert len(full["distribution/genres"].records) <= profile_defs.TABLE_ROWS + 1


def test_share_tables_are_bounded() -> None:
    shares = {f"genre {i:03}": 0.01 for i in range(60)}
    table = profile_defs._share_table(shares)
    assert len(table.records) == profile_defs.TABLE_ROWS + 1
    assert table.records[-1].data == {"value": "(40 more)", "share": 0.4}


def test_refresh_evaluations_target_the_partition_materialization(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    """Dagster shows a partition's check status only while the evaluation names the
    partition's latest materialization."""
    lib = f.library(conn)
    f.items(conn, lib, 6)
    result = refresh(conn, db_url, instance)
    [evaluation] = result.get_asset_check_evaluations()
    latest = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=profile_defs.PROFILE_ASSET, asset_partitions=[str(lib)]),
        limit=1,
    ).records[0]
    assert evaluation.passed and evaluation.partition == str(lib)
    assert evaluation.target_materialization_data is not None
    assert evaluation.target_materialization_data.storage_id == latest.storage_id


def test_backfill_runs_the_check_step_against_the_new_materialization(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    instance.add_dynamic_partitions(PARTITIONS, [str(lib)])
    result = dg.materialize(
        [profile_defs.library_profile, profile_defs.library_profile_current],
        partition_key=str(lib),
        instance=instance,
        resources={"inventory_db": InventoryDatabase(url=db_url)},
    )
    skipped = [e for e in result.all_events if e.event_type_value == "STEP_SKIPPED"]
    assert skipped == []
    [evaluation] = result.get_asset_check_evaluations()
    assert evaluation.passed and evaluation.partition == str(lib)
    assert evaluation.target_materialization_data is not None
    assert [m.partition for m in result.asset_materializations_for_node("library_profile")] == [
        str(lib)
    ]


def test_failed_check_says_why(conn: Connection, db_url: str) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    result = profile_defs.profile_current_result(InventoryDatabase(url=db_url), lib)
    assert not result.passed
    assert result.description == "inventory revision 1 not yet acknowledged (acknowledged 0)"


def test_stalled_library_fails_its_check_without_a_run_or_a_claim(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    srv = f.server(conn)
    stalled, fresh = f.library(conn, srv, name="stalled"), f.library(conn, srv, name="fresh")
    f.items(conn, stalled, 6)
    f.items(conn, fresh, 6)
    instance.add_dynamic_partitions(PARTITIONS, [str(stalled), str(fresh)])
    execute(
        conn,
        "UPDATE library_inventory_state SET dirty_since = now() - interval '2 hours'"
        " WHERE library_id = %s",
        (stalled,),
    )
    sensor = profile_defs.library_profile_staleness_sensor
    result = tick(sensor, instance, db_url, None)
    assert isinstance(result, dg.SensorResult)
    [evaluation] = result.asset_events
    assert isinstance(evaluation, dg.AssetCheckEvaluation)
    assert (evaluation.partition, evaluation.passed) == (str(stalled), False)
    assert evaluation.description is not None
    assert evaluation.description.startswith("stalled: inventory revision 1 waiting 120 min")
    assert leases(conn) == {"running": 0, "leased": 0, "requests": 0}
    assert instance.get_runs_count() == 0
    # Reported once per stalled revision; a new revision is reported again.
    again = tick(sensor, instance, db_url, result.cursor)
    assert isinstance(again, dg.SkipReason)
    f.items(conn, stalled, 1, seed=9)
    moved = tick(sensor, instance, db_url, result.cursor)
    assert isinstance(moved, dg.SensorResult)
    assert [e.partition for e in moved.asset_events] == [str(stalled)]


def test_partition_sync_reads_the_key_sets_only_when_they_changed(
    conn: Connection, db_url: str, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick in step reads neither key set; new libraries are added without a diff; a
    deleted library, a key added by hand and the periodic full diff still converge."""
    sensor = profile_defs.library_profile_sensor
    srv = f.server(conn)
    libs = [f.library(conn, srv, name=str(i)) for i in range(3)]
    reads: list[str] = []
    read_keys = instance.get_dynamic_partitions

    def counted(name: str) -> Any:
        reads.append(name)
        return read_keys(name)

    monkeypatch.setattr(instance, "get_dynamic_partitions", counted)

    def sync(cursor: str | None) -> tuple[list[str], list[str], str | None]:
        """One tick, its requests applied as the daemon would: (added, deleted, cursor)."""
        context = dg.build_sensor_context(
            instance=instance,
            cursor=cursor,
            resources={"inventory_db": InventoryDatabase(url=db_url)},
        )
        result = sensor(context)
        added: list[str] = []
        deleted: list[str] = []
        if isinstance(result, dg.SensorResult):
            for request in result.dynamic_partitions_requests or []:
                keys = list(request.partition_keys or [])
                if isinstance(request, dg.AddDynamicPartitionsRequest):
                    instance.add_dynamic_partitions(PARTITIONS, keys)
                    added += keys
                else:
                    for key in keys:
                        instance.delete_dynamic_partition(PARTITIONS, key)
                    deleted += keys
        return added, deleted, context.cursor

    added, deleted, cursor = sync(None)
    assert (added, deleted, len(reads)) == ([str(i) for i in libs], [], 1)
    # In step: no key set is read, nothing is requested.
    added, deleted, cursor = sync(cursor)
    assert (added, deleted, len(reads)) == ([], [], 1)
    # A new library: its key alone is added, still without reading the key sets.
    new = f.library(conn, srv, name="new")
    added, deleted, cursor = sync(cursor)
    assert (added, deleted, len(reads)) == ([str(new)], [], 1)
    assert sync(cursor)[:2] == ([], [])
    # A deleted library: diffed and removed; the tick after diffs once more, then not.
    execute(conn, "DELETE FROM libraries WHERE id = %s", (libs[0],))
    added, deleted, cursor = sync(cursor)
    assert (added, deleted, len(reads)) == ([], [str(libs[0])], 2)
    added, deleted, cursor = sync(cursor)
    added, deleted, cursor = sync(cursor)
    assert (added, deleted, len(reads)) == ([], [], 3)
    # A key added by hand moves the newest key: diffed and removed.
    instance.add_dynamic_partitions(PARTITIONS, ["Films"])
    added, deleted, cursor = sync(cursor)
    assert (added, deleted) == ([], ["Films"])
    added, deleted, cursor = sync(cursor)  # after a deletion: one more diff
    # A library key deleted by hand shows in no cheap signal: the periodic full diff
    # restores it.
    instance.delete_dynamic_partition(PARTITIONS, str(libs[1]))
    before = len(reads)
    added, deleted, cursor = sync(cursor)
    assert (added, deleted, len(reads)) == ([], [], before)
    assert cursor is not None
    stale = {**json.loads(cursor), "synced_at": 0}
    added, deleted, cursor = sync(json.dumps(stale))
    assert (added, deleted) == ([str(libs[1])], [])
    assert sorted(instance.get_dynamic_partitions(PARTITIONS), key=int) == [
        str(i) for i in (*libs[1:], new)
    ]
