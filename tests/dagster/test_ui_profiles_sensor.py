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
from inventory_pipeline.defs import profile_checks, profile_metadata, profile_sensor
from inventory_pipeline.defs import profile_ranges as ranges
from inventory_pipeline.defs import profiles as profile_defs
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.models import RefreshPolicy
from tests import factories as f

PARTITIONS = ranges.library_partitions.name
key_of = ranges.partition_of


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
    instance.add_dynamic_partitions(PARTITIONS, [key_of(lib), "Films"])
    result = tick(profile_sensor.library_profile_sensor, instance, db_url, None)
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
    # A bare library id (the former key) is no longer a key either.
    instance.add_dynamic_partitions(PARTITIONS, [key_of(lib), "Films", "7x", str(lib)])
    result = tick(profile_sensor.library_profile_sensor, instance, db_url, None)
    assert isinstance(result, dg.SensorResult)
    assert result.skip_reason is not None
    message = result.skip_reason.skip_message
    assert "removed partition keys that are not library id ranges: " in message
    assert all(repr(key) in message for key in ("7x", "Films", str(lib)))
    assert repr(key_of(lib)) not in message
    assert leases(conn)["leased"] == 0


def test_a_tick_says_what_it_found_and_does(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    """What "Preview tick result" shows: how many libraries there are to refresh and what
    the tick launches, or why it launches nothing while libraries are behind."""
    lib = f.library(conn)
    f.items(conn, lib, 6)
    sensor = profile_sensor.library_profile_sensor
    first = tick(sensor, instance, db_url, None)
    assert isinstance(first, dg.SensorResult)
    [request] = first.run_requests or []
    assert request.tags[profile_sensor.PLAN_TAG] == (
        "1 library to refresh (1 planned by this tick, 0 expired leases); "
        "launching 1 run of up to 5000 claims each"
    )
    # The launched run has not started yet: a second tick waits for it, and says so.
    instance.create_run_for_job(
        profile_defs.library_profile_refresh, status=dg.DagsterRunStatus.NOT_STARTED
    )
    waiting = tick(sensor, instance, db_url, None)
    assert isinstance(waiting, dg.SkipReason)
    assert waiting.skip_message == (
        "1 library to refresh (0 planned by this tick, 0 expired leases); "
        "1 run already waiting to start"
    )
    # Claimed by a run that is working on it: behind, but nothing to claim.
    [claim] = service.claim(conn, RefreshPolicy()).claims
    busy = tick(sensor, instance, db_url, None)
    assert isinstance(busy, dg.SkipReason)
    assert busy.skip_message == (
        "nothing to claim now: 1 library behind, being refreshed or not due yet"
    )
    assert service.process(conn, claim, RefreshPolicy()).outcome == "published"
    assert f.state(conn, lib)["acknowledged_revision"] == f.revision(conn, lib)
    idle = tick(sensor, instance, db_url, None)
    assert isinstance(idle, dg.SkipReason) and idle.skip_message == "nothing to refresh"


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
        tick(profile_sensor.library_profile_sensor, instance, db_url, None)
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
        [profile_defs.library_profile, profile_checks.library_profile_current],
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
        "dagster._core.definitions.events.Failure: partition keys must be library id ranges"
        " like '000000-000009', got 'Films'"
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
    # A run shows a library's whole profile when it is the one library of its range
    # that the batch refreshed: the two live in different ranges.
    big = f.library(conn, srv, name="Films")
    while key_of(big) == key_of(small):
        execute(conn, "DELETE FROM libraries WHERE id = %s", (big,))
        big = f.library(conn, srv, name="Films")
    f.items(conn, big, 30, seed=3)
    result = refresh(conn, db_url, instance)
    by_library = {}
    for e in result.get_asset_materialization_events():
        materialization = e.step_materialization_data.materialization
        shown = metadata_of(materialization)
        assert materialization.partition == key_of(shown["library_id"])
        by_library[shown["library_id"]] = shown
    tiny = by_library[small]
    assert tiny["library"] == "Shorts (movie)"
    assert tiny["media_server"] == "Basement Plex (plex)"
    assert tiny["trait/genres"] == "insufficient: 4 contributing items, need 5"
    # No coverage figure that reads as complete, and no empty distribution table.
    assert not [k for k in tiny if k.startswith(("coverage/", "distribution/", "top_genres"))]
    traits = {r.data["trait"]: r.data for r in tiny["traits"].records}
    assert set(traits) == {"genres", "rating", "primary_studio", "original_language", "identity"}
    assert all(t["status"] == "insufficient" and t["held_back"] for t in traits.values())

    full = by_library[big]
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
    assert len(full["distribution/genres"].records) <= profile_metadata.TABLE_ROWS + 1


def test_a_run_records_one_materialization_per_range_listing_its_libraries(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    """Libraries of one range refreshed in one batch make one event, not one each (a
    Dagster event costs several writes; per library they were the burst's wall)."""
    first, second = two_libraries_in_one_range(conn)
    f.items(conn, first, 30, seed=5)
    f.items(conn, second, 3, seed=6)
    result = refresh(conn, db_url, instance)
    [event] = result.get_asset_materialization_events()
    materialization = event.step_materialization_data.materialization
    assert materialization.partition == key_of(first)
    shown = metadata_of(materialization)
    rows = {r.data["library_id"]: r.data for r in shown["libraries"].records}
    assert sorted(rows) == [first, second]
    assert rows[first]["item_count"] == 30 and rows[second]["item_count"] == 3
    assert rows[first]["profile_revision"] == f.state(conn, first)["acknowledged_revision"]
    assert "genres" in rows[first]["published"] and rows[second]["published"] == ""
    assert rows[first]["outcome"] == rows[second]["outcome"] == "published"
    assert shown["library_ids"] == f"{first}, {second}"
    assert "profile" not in shown  # each profile is in the database, not repeated here


def test_share_tables_are_bounded() -> None:
    shares = {f"genre {i:03}": 0.01 for i in range(60)}
    table = profile_metadata._share_table(shares)
    assert len(table.records) == profile_metadata.TABLE_ROWS + 1
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
        dg.AssetRecordsFilter(asset_key=ranges.PROFILE_ASSET, asset_partitions=[key_of(lib)]),
        limit=1,
    ).records[0]
    assert evaluation.passed and evaluation.partition == key_of(lib)
    assert evaluation.target_materialization_data is not None
    assert evaluation.target_materialization_data.storage_id == latest.storage_id


def test_backfill_runs_the_check_step_against_the_new_materialization(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    instance.add_dynamic_partitions(PARTITIONS, [key_of(lib)])
    result = dg.materialize(
        [profile_defs.library_profile, profile_checks.library_profile_current],
        partition_key=key_of(lib),
        instance=instance,
        resources={"inventory_db": InventoryDatabase(url=db_url)},
    )
    skipped = [e for e in result.all_events if e.event_type_value == "STEP_SKIPPED"]
    assert skipped == []
    [evaluation] = result.get_asset_check_evaluations()
    assert evaluation.passed and evaluation.partition == key_of(lib)
    assert evaluation.target_materialization_data is not None
    latest = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=ranges.PROFILE_ASSET, asset_partitions=[key_of(lib)]),
        limit=1,
    ).records[0]
    assert evaluation.target_materialization_data.storage_id == latest.storage_id
    assert {m.partition for m in result.asset_materializations_for_node("library_profile")} == {
        key_of(lib)
    }


def test_failed_check_says_why(conn: Connection, db_url: str) -> None:
    """Behind by a fresh change is catching up: a warning, not red. Past the stall
    threshold it is an error. The figures are the range's, not one library's."""
    lib = f.library(conn)
    f.items(conn, lib, 6)
    low = lib - lib % ranges.PARTITION_WIDTH
    db = InventoryDatabase(url=db_url)
    result = profile_checks.range_current_result(db, low)
    assert not result.passed and result.severity == dg.AssetCheckSeverity.WARN
    assert result.description == (
        f"library {lib}: inventory revision 1 not yet acknowledged (acknowledged 0);"
        " catching up, within the 15 min stall threshold"
    )
    assert set(result.metadata) == {
        "libraries",
        "current",
        "behind",
        "oldest_lag_seconds",
        "not_current",
    }
    assert result.metadata["behind"].value == 1
    # A range mixing a library catching up with a stalled one is red, and names the
    # stalled one first (whatever the ids).
    late = f.library(conn, name="late")
    f.items(conn, late, 2)
    assert late // ranges.PARTITION_WIDTH == lib // ranges.PARTITION_WIDTH
    execute(conn, "SELECT fold_inventory_changes()")  # the change is a revision
    execute(
        conn,
        "UPDATE library_inventory_state SET dirty_since = now() - interval '16 minutes'"
        " WHERE library_id = %s",
        (late,),
    )
    stalled = profile_checks.range_current_result(db, low)
    assert not stalled.passed and stalled.severity == dg.AssetCheckSeverity.ERROR
    assert stalled.description == (
        f"library {late}: inventory revision 1 not yet acknowledged (acknowledged 0), "
        f"waiting 16 min; library {lib}: inventory revision 1 not yet acknowledged "
        "(acknowledged 0); stall threshold 15 min"
    )
    assert stalled.metadata["oldest_lag_seconds"].value >= 960


def test_partition_keys_are_ranges_of_library_ids() -> None:
    width = ranges.PARTITION_WIDTH
    assert width == 10
    assert [key_of(i) for i in (0, 9, 10, 12345, 1_234_567)] == [
        "000000-000009",
        "000000-000009",
        "000010-000019",
        "012340-012349",
        "1234560-1234569",
    ]
    assert ranges.range_low("012340-012349") == 12340
    # Only the keys the sensor writes: no other width, padding, order or text.
    for key in ("12340-12349", "012341-012350", "012340-012340", "012340", "Films", "-", ""):
        assert ranges.range_low(key) is None, key


def two_libraries_in_one_range(conn: Connection) -> tuple[int, int]:
    """Two libraries whose ids share a partition (ids are consecutive within a test)."""
    srv = f.server(conn)
    first = f.library(conn, srv, name="first")
    while key_of(first + 1) != key_of(first):
        first = f.library(conn, srv, name="first")
    second = f.library(conn, srv, name="second")
    assert key_of(second) == key_of(first)
    return first, second


def test_backfill_of_a_range_refreshes_each_library_and_lists_them(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    first, second = two_libraries_in_one_range(conn)
    f.items(conn, first, 6)
    f.items(conn, second, 3, seed=2)
    key = key_of(first)
    instance.add_dynamic_partitions(PARTITIONS, [key])
    db = InventoryDatabase(url=db_url)
    result = dg.materialize(
        [profile_defs.library_profile, profile_checks.library_profile_current],
        partition_key=key,
        instance=instance,
        resources={"inventory_db": db},
    )
    assert result.success
    # Each library through the outbox, as its own request.
    for lib in (first, second):
        [request] = f.requests(conn, lib)
        assert (request["reason"], request["status"]) == ("analyst_backfill", "succeeded")
    shown = [metadata_of(m) for m in result.asset_materializations_for_node("library_profile")]
    assert sorted(m["library_id"] for m in shown if "library_id" in m) == [first, second]
    # The partition's latest materialization lists its libraries.
    latest = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=ranges.PROFILE_ASSET, asset_partitions=[key]),
        limit=1,
    ).records[0]
    event = latest.asset_materialization
    assert event is not None
    summary = metadata_of(event)
    assert [r.data["library_id"] for r in summary["libraries"].records] == [first, second]
    assert summary["library_ids"] == f"{first}, {second}"
    [evaluation] = result.get_asset_check_evaluations()
    assert evaluation.passed and evaluation.partition == key
    # The check is the worst of the range: one library moving on fails the partition.
    f.items(conn, second, 1, seed=8)
    stale = profile_checks.range_current_result(db, first - first % ranges.PARTITION_WIDTH)
    assert not stale.passed
    assert stale.description is not None and stale.description.startswith(f"library {second}:")
    assert (stale.metadata["libraries"].value, stale.metadata["current"].value) == (2, 1)


def test_run_config_refreshes_one_library_of_a_range(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    first, second = two_libraries_in_one_range(conn)
    f.items(conn, first, 6)
    f.items(conn, second, 6)
    instance.add_dynamic_partitions(PARTITIONS, [key_of(first)])
    db = InventoryDatabase(url=db_url)
    config = {"ops": {"library_profile": {"config": {"libraries": [second]}}}}
    result = dg.materialize(
        [profile_defs.library_profile],
        partition_key=key_of(first),
        instance=instance,
        resources={"inventory_db": db},
        run_config=config,
    )
    assert result.success
    assert f.requests(conn, first) == []
    assert [r["status"] for r in f.requests(conn, second)] == ["succeeded"]
    # The partition's check still reads every library of it: the other is behind.
    [evaluation] = result.get_asset_check_evaluations()
    assert not evaluation.passed and evaluation.description is not None
    assert evaluation.description.startswith(f"library {first}:")
    # A library outside the run's partitions is refused before any work.
    elsewhere = f.library(conn, name="elsewhere")
    while key_of(elsewhere) == key_of(first):
        elsewhere = f.library(conn, name="elsewhere")
    refused = dg.materialize(
        [profile_defs.library_profile],
        partition_key=key_of(first),
        instance=instance,
        resources={"inventory_db": db},
        run_config={"ops": {"library_profile": {"config": {"libraries": [elsewhere]}}}},
        raise_on_error=False,
    )
    assert not refused.success
    assert f.requests(conn, elsewhere) == []


def test_stalled_library_fails_its_check_without_a_run_or_a_claim(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    stalled, fresh = two_libraries_in_one_range(conn)
    elsewhere = f.library(conn, name="elsewhere")
    while key_of(elsewhere) == key_of(stalled):
        elsewhere = f.library(conn, name="elsewhere")
    for lib in (stalled, fresh, elsewhere):
        f.items(conn, lib, 6)
    instance.add_dynamic_partitions(PARTITIONS, [key_of(stalled), key_of(elsewhere)])
    execute(conn, "SELECT fold_inventory_changes()")  # the change is a revision
    execute(
        conn,
        "UPDATE library_inventory_state SET dirty_since = now() - interval '2 hours'"
        " WHERE library_id = %s",
        (stalled,),
    )
    sensor = profile_checks.library_profile_staleness_sensor
    result = tick(sensor, instance, db_url, None)
    assert isinstance(result, dg.SensorResult)
    # The stalled library's partition turns red; its fresh neighbour does not hide it.
    [evaluation] = result.asset_events
    assert isinstance(evaluation, dg.AssetCheckEvaluation)
    assert (evaluation.partition, evaluation.passed) == (key_of(stalled), False)
    assert evaluation.description is not None
    assert evaluation.description.startswith(
        f"library {stalled}: inventory revision 1 not yet acknowledged (acknowledged 0),"
        " waiting 120 min"
    )
    assert leases(conn) == {"running": 0, "leased": 0, "requests": 0}
    assert instance.get_runs_count() == 0
    # Reported once per stalled revision; a new revision is reported again.
    again = tick(sensor, instance, db_url, result.cursor)
    assert isinstance(again, dg.SkipReason)
    f.items(conn, stalled, 1, seed=9)
    moved = tick(sensor, instance, db_url, result.cursor)
    assert isinstance(moved, dg.SensorResult)
    assert [e.partition for e in moved.asset_events] == [key_of(stalled)]


LIBRARY = "INSERT INTO libraries (id, server_id, name, media_kind) VALUES (%s, %s, %s, 'movie')"


def test_partition_sync_reads_the_key_sets_only_when_they_changed(
    conn: Connection, db_url: str, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick in step reads neither key set; new libraries add their ranges without a
    diff; a range whose last library is deleted, a key added by hand and the periodic
    full diff still converge."""
    sensor = profile_sensor.library_profile_sensor
    srv = f.server(conn)

    def add_library(library_id: int) -> int:
        execute(conn, LIBRARY, (library_id, srv, str(library_id)))
        return library_id

    # Ids of our choosing, above any the sequence handed out: two ranges.
    a, b, c = add_library(100_001), add_library(100_007), add_library(100_012)
    ranges = [key_of(a), key_of(c)]
    assert ranges == ["100000-100009", "100010-100019"]
    reads: list[str] = []
    read_keys = instance.get_dynamic_partitions

    def counted(name: str) -> Any:
        reads.append(name)
        return read_keys(name)

    monkeypatch.setattr(instance, "get_dynamic_partitions", counted)

    def sync(cursor: str | None) -> tuple[list[str], list[str], str | None]:
        """One tick, its deletions applied as the daemon would (it adds keys itself):
        (added, deleted, cursor)."""
        before = set(read_keys(PARTITIONS))  # not counted: the test's own reads
        context = dg.build_sensor_context(
            instance=instance,
            cursor=cursor,
            resources={"inventory_db": InventoryDatabase(url=db_url)},
        )
        result = sensor(context)
        added = [k for k in read_keys(PARTITIONS) if k not in before]
        deleted: list[str] = []
        if isinstance(result, dg.SensorResult):
            for request in result.dynamic_partitions_requests or []:
                assert isinstance(request, dg.DeleteDynamicPartitionsRequest)
                for key in request.partition_keys or []:
                    instance.delete_dynamic_partition(PARTITIONS, key)
                    deleted.append(key)
        return added, deleted, context.cursor

    added, deleted, cursor = sync(None)
    assert (added, deleted, len(reads)) == (ranges, [], 1)
    # In step: no key set is read, nothing is requested.
    added, deleted, cursor = sync(cursor)
    assert (added, deleted, len(reads)) == ([], [], 1)
    # A new library in the last range: nothing to add, no key set read.
    add_library(100_015)
    added, deleted, cursor = sync(cursor)
    assert (added, deleted, len(reads)) == ([], [], 1)
    # New libraries in a new range: its key alone is added, still without a diff.
    new = add_library(100_023)
    add_library(100_024)
    added, deleted, cursor = sync(cursor)
    assert (added, deleted, len(reads)) == ([key_of(new)], [], 1)
    assert sync(cursor)[:2] == ([], [])
    # A library deleted (any SQL) while its range holds another: the range stays.
    execute(conn, "DELETE FROM libraries WHERE id = %s", (a,))
    added, deleted, cursor = sync(cursor)
    assert (added, deleted, len(reads)) == ([], [], 2)
    # The range's last library deleted: its partition goes on the next tick; the tick
    # after diffs once more, then not.
    execute(conn, "DELETE FROM libraries WHERE id = %s", (b,))
    added, deleted, cursor = sync(cursor)
    assert (added, deleted, len(reads)) == ([], [key_of(b)], 3)
    added, deleted, cursor = sync(cursor)
    added, deleted, cursor = sync(cursor)
    assert (added, deleted, len(reads)) == ([], [], 4)
    # A key added by hand moves the newest key: diffed and removed.
    instance.add_dynamic_partitions(PARTITIONS, ["Films"])
    added, deleted, cursor = sync(cursor)
    assert (added, deleted) == ([], ["Films"])
    added, deleted, cursor = sync(cursor)  # after a deletion: one more diff
    # A range key deleted by hand shows in no cheap signal: the periodic full diff
    # restores it.
    instance.delete_dynamic_partition(PARTITIONS, key_of(c))
    before = len(reads)
    added, deleted, cursor = sync(cursor)
    assert (added, deleted, len(reads)) == ([], [], before)
    assert cursor is not None
    stale = {**json.loads(cursor), "synced_at": 0}
    added, deleted, cursor = sync(json.dumps(stale))
    assert (added, deleted) == ([key_of(c)], [])
    assert sorted(instance.get_dynamic_partitions(PARTITIONS)) == [key_of(c), key_of(new)]


def test_keys_of_one_partition_per_library_are_replaced_on_the_first_tick(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    """A deployment that kept one key per library: the first tick after the upgrade
    diffs, although its cursor says the library set did not change."""
    srv = f.server(conn)
    libs = [f.library(conn, srv, name=str(i)) for i in range(3)]
    instance.add_dynamic_partitions(PARTITIONS, [str(lib) for lib in libs])
    fingerprint = service.library_fingerprint(conn)
    cursor = json.dumps(
        {
            "runs": 0,
            "libraries": fingerprint.token,
            "count": fingerprint.libraries,
            "max_id": fingerprint.max_id,
            "newest": str(libs[-1]),
            "synced_at": 4e9,
        }
    )
    before = set(instance.get_dynamic_partitions(PARTITIONS))
    result = tick(profile_sensor.library_profile_sensor, instance, db_url, cursor)
    assert isinstance(result, dg.SensorResult)
    added = [k for k in instance.get_dynamic_partitions(PARTITIONS) if k not in before]
    deleted = [
        key
        for request in result.dynamic_partitions_requests or []
        for key in request.partition_keys or []
    ]
    assert sorted(added) == sorted({key_of(lib) for lib in libs})
    assert sorted(deleted) == sorted(str(lib) for lib in libs)
