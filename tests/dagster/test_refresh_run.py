"""A refresh run against real PostgreSQL, in process: it drains a backlog larger than
one plan, names each partition's latest materialization in its check evaluations, and
does not open a storage connection per Dagster event."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from inventory_pipeline.db import Connection, connect, execute, fetch_one
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.defs import profile_checks
from inventory_pipeline.defs import profile_ranges as ranges
from inventory_pipeline.defs import profiles as profile_defs
from inventory_pipeline.defs.profile_sensor import library_profile_sensor
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.deployment import dagster_storage_url
from inventory_pipeline.profiles import service
from tests import factories as f

PARTITIONS = ranges.library_partitions.name


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


@pytest.fixture
def storage_db(server_url: str) -> Iterator[str]:
    """A scratch database for Dagster's postgres storage."""
    name = f"dagster_{uuid.uuid4().hex[:10]}"
    with connect(server_url) as admin:
        create_database(admin, name)
    try:
        yield name
    finally:
        with connect(server_url) as admin:
            drop_database(admin, name)


def ranges_of(libs: list[int]) -> list[str]:
    """The partition keys that hold the libraries."""
    return sorted({ranges.partition_of(lib) for lib in libs})


def dirty_libraries(conn: Connection, count: int) -> list[int]:
    srv = f.server(conn)
    libs = [f.library(conn, srv, name=f"lib {i}") for i in range(count)]
    for lib in libs:
        f.items(conn, lib, 3)
    return libs


def test_one_run_drains_a_backlog_larger_than_one_plan(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    """A tick plans at most planner_passes x 25 libraries; the run it launches plans the
    rest itself when it runs out of claims, instead of leaving them for later ticks."""
    libs = dirty_libraries(conn, 60)
    db = InventoryDatabase(url=db_url, planner_passes=1)
    instance.add_dynamic_partitions(PARTITIONS, ranges_of(libs))
    assert len(service.plan(conn, db.policy()).inventory) == 25  # what one tick queues
    result = profile_defs.library_profile_refresh.execute_in_process(
        instance=instance, resources={"inventory_db": db}
    )
    assert result.success
    assert result.output_for_node("refresh_claimed_profiles") == 60
    states = [f.state(conn, lib) for lib in libs]
    assert all(s["acknowledged_revision"] == s["revision"] for s in states)
    done = instance.get_materialized_partitions(ranges.PROFILE_ASSET)
    assert done == set(ranges_of(libs))


def test_run_stops_at_its_claim_budget_even_with_work_left(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    libs = dirty_libraries(conn, 30)
    db = InventoryDatabase(url=db_url, planner_passes=1, run_claims=10)
    instance.add_dynamic_partitions(PARTITIONS, ranges_of(libs))
    result = profile_defs.library_profile_refresh.execute_in_process(
        instance=instance, resources={"inventory_db": db}
    )
    assert result.output_for_node("refresh_claimed_profiles") == 10
    row = fetch_one(
        conn,
        "SELECT count(*) AS n FROM profile_refresh_requests WHERE status = 'running'",
    )
    assert row is not None and row["n"] == 0  # nothing claimed beyond the budget


def test_one_lookup_names_each_partitions_latest_materialization(
    instance: dg.DagsterInstance,
) -> None:
    """The batched lookup agrees with the one-partition lookup, also for a partition
    whose latest materialization lies beyond the newest records of the others."""
    first, second, never = (ranges.range_key(low) for low in (0, 10, 20))
    instance.add_dynamic_partitions(PARTITIONS, [first, second, never])

    def materialize(key: str) -> None:
        instance.report_runless_asset_event(
            dg.AssetMaterialization(asset_key=ranges.PROFILE_ASSET, partition=key)
        )

    materialize(second)
    # More records of `first` than the batched read takes for three partitions.
    for _ in range((ranges.PARTITION_WIDTH + 1) * 3 + 1):
        materialize(first)
    found = profile_checks.target_materializations(instance, [first, second, never])
    assert set(found) == {first, second}  # `never` was never materialized
    for key in (first, second):
        alone = profile_checks.target_materialization(instance, key)
        assert alone is not None
        assert found[key].storage_id == alone.storage_id
        assert found[key].run_id == alone.run_id


def test_run_does_not_open_a_storage_connection_per_event(
    conn: Connection, db_url: str, server_url: str, storage_db: str
) -> None:
    """Dagster's postgres storage opens a connection per call unless told to hold one,
    about six per library refreshed. A run of 25 libraries starts fewer than one more
    server backend per extra library than a run of 5."""
    storage = {
        "postgres": {"postgres_url": dagster_storage_url(url_with_database(server_url, storage_db))}
    }

    def sessions() -> int:
        time.sleep(1)  # an ended session reaches the statistics as its backend exits
        with connect(server_url) as admin:
            execute(admin, "SELECT pg_stat_clear_snapshot()")
            row = fetch_one(
                admin, "SELECT sessions FROM pg_stat_database WHERE datname = %s", (storage_db,)
            )
        assert row is not None
        return int(row["sessions"])

    def run(libraries: int) -> int:
        """Backends started for Dagster's storage by one run of `libraries` libraries."""
        libs = dirty_libraries(conn, libraries)
        with dg.instance_for_test(overrides={"storage": storage}) as instance:
            instance.add_dynamic_partitions(PARTITIONS, ranges_of(libs))
            before = sessions()
            result = profile_defs.library_profile_refresh.execute_in_process(
                instance=instance, resources={"inventory_db": InventoryDatabase(url=db_url)}
            )
            assert result.output_for_node("refresh_claimed_profiles") == libraries
        return sessions() - before

    small, large = run(5), run(25)
    assert large - small < 20


def _refresh_in_child(instance_ref: dg.InstanceRef, db_url: str) -> None:
    """A refresh run in a process of its own, for the test to kill."""
    with dg.DagsterInstance.from_ref(instance_ref) as instance:
        profile_defs.library_profile_refresh.execute_in_process(
            instance=instance, resources={"inventory_db": InventoryDatabase(url=db_url)}
        )


def test_completions_of_a_run_killed_mid_batch_are_recorded_by_the_next_run(
    conn: Connection, db_url: str, tmp_path: Path
) -> None:
    """A run records its completions in batches; killed between a completion and its
    batch's record, it leaves them marked in the database. Once they are older than a
    live run could hold them, the sensor launches a run for them (nothing else is left
    to claim) and that run records them, said to be recorded late."""
    libs = dirty_libraries(conn, 6)
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        instance.add_dynamic_partitions(PARTITIONS, ranges_of(libs))
        db = InventoryDatabase(url=db_url)
        assert service.plan(conn, db.policy()).planned == 6
        with connect(db_url) as holder:
            execute(
                holder, "SET idle_in_transaction_session_timeout = 0"
            )  # the child starts slowly
            execute(holder, "BEGIN")  # the fourth library's completion waits for its state
            execute(
                holder,
                "SELECT 1 FROM library_inventory_state WHERE library_id = %s FOR UPDATE",
                (libs[3],),
            )
            child = multiprocessing.get_context("spawn").Process(
                target=_refresh_in_child, args=(instance.get_ref(), db_url)
            )
            child.start()
            deadline = time.monotonic() + 120
            while not fetch_one(
                conn,
                "SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND query LIKE '%%completion-fence%%'",
            ):
                assert time.monotonic() < deadline and child.is_alive()
                time.sleep(0.05)
            child.kill()
            child.join()
            execute(holder, "ROLLBACK")
        assert [f.state(conn, lib)["acknowledged_revision"] for lib in libs[:3]] == [1, 1, 1]
        assert instance.get_materialized_partitions(ranges.PROFILE_ASSET) == set()
        # Time passes: the run is surely gone. Its killed claim is still leased.
        execute(
            conn,
            "UPDATE profile_refresh_requests SET finished_at = finished_at - interval '1 hour'"
            " WHERE status = 'succeeded'",
        )
        execute(
            conn,
            "UPDATE profile_refresh_requests SET available_at = now() + interval '1h'"
            " WHERE status = 'pending'",
        )
        tick = library_profile_sensor(
            dg.build_sensor_context(instance=instance, resources={"inventory_db": db})
        )
        assert isinstance(tick, dg.SensorResult) and tick.run_requests is not None
        assert len(tick.run_requests) == 1
        result = profile_defs.library_profile_refresh.execute_in_process(
            instance=instance, resources={"inventory_db": db}
        )
        assert result.success
        [event] = [
            e.event_specific_data.materialization  # type: ignore[union-attr]
            for e in result.all_events
            if e.event_type == dg.DagsterEventType.ASSET_MATERIALIZATION
        ]
        assert event.partition == ranges.partition_of(libs[0])
        assert event.description is not None and event.description.startswith("recorded late")
        assert all(str(lib) in event.description for lib in libs[:3])
        row = fetch_one(
            conn, "SELECT count(*) AS n FROM profile_refresh_requests WHERE materialization_due"
        )
        assert row is not None and row["n"] == 0
