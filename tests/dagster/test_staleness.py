"""The staleness sensor at scale and over time: every stalled library is evaluated
within a bounded number of ticks whatever the backlog, inactive libraries are paused
(never stalled), and a red check turns back once the database is current, whoever made
it so."""

from __future__ import annotations

import json
from collections.abc import Iterator

import dagster as dg
import pytest

from inventory_pipeline.db import Connection, execute
from inventory_pipeline.defs import profile_checks
from inventory_pipeline.defs import profile_ranges as ranges
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.models import RefreshPolicy
from tests import factories as f

PARTITIONS = ranges.library_partitions.name


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def stalled(conn: Connection, library_id: int, hours: float) -> None:
    """Items in the library, its change waiting `hours`."""
    f.items(conn, library_id, 5)
    execute(conn, "SELECT fold_inventory_changes()")  # the change is a revision
    execute(
        conn,
        "UPDATE library_inventory_state SET dirty_since = now() - make_interval(hours => %s)"
        " WHERE library_id = %s",
        (hours, library_id),
    )


def tick(
    instance: dg.DagsterInstance, db_url: str, cursor: str | None
) -> tuple[dict[str, dg.AssetCheckEvaluation], str | None]:
    """One tick: its evaluations by partition, and the cursor it leaves."""
    context = dg.build_sensor_context(
        instance=instance,
        resources={"inventory_db": InventoryDatabase(url=db_url)},
        cursor=cursor,
    )
    result = profile_checks.library_profile_staleness_sensor(context)
    if isinstance(result, dg.SkipReason):
        return {}, context.cursor
    assert isinstance(result, dg.SensorResult)
    events = {e.partition: e for e in result.asset_events if isinstance(e, dg.AssetCheckEvaluation)}
    return events, result.cursor


def test_more_stalled_libraries_than_a_page_are_each_evaluated_within_bounded_ticks(
    conn: Connection, db_url: str, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page of two: the paused libraries of an inactive server, dirty longest, fill no
    page; the five stalled active libraries are all evaluated within three ticks."""
    monkeypatch.setattr(profile_checks, "STALL_BATCH", 2)
    off = f.server(conn, "Retired Plex")
    paused = [f.library(conn, off, name=f"Old {n}") for n in range(4)]
    for library_id in paused:
        stalled(conn, library_id, hours=48)
    execute(conn, "UPDATE media_servers SET active = false WHERE id = %s", (off,))
    on = f.server(conn, "Den Plex")
    active = [f.library(conn, on, name=f"Shelf {n}") for n in range(5)]
    for n, library_id in enumerate(active):
        stalled(conn, library_id, hours=5 - n)
    instance.add_dynamic_partitions(
        PARTITIONS, sorted({ranges.partition_of(i) for i in paused + active})
    )
    seen: set[str] = set()
    cursor = None
    reported = []
    for _ in range(3):
        events, cursor = tick(instance, db_url, cursor)
        seen |= set(events)
        assert cursor is not None
        state = json.loads(cursor)
        reported.append(sorted(int(i) for i in state.get("reported", state)))
    # Two a tick, oldest first; the paused libraries never.
    assert reported == [active[:2], active[:4], active]
    assert seen == {ranges.partition_of(i) for i in active}
    # The next ticks report nothing new: each stalled revision was reported once.
    for _ in range(3):
        events, cursor = tick(instance, db_url, cursor)
        assert events == {}


def test_a_red_check_turns_back_once_the_library_is_current_whoever_refreshed_it(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    """One library is refreshed outside Dagster, another deleted: the next tick records
    each partition's check again from the database, and both pass."""
    server = f.server(conn, "Den Plex")
    refreshed, deleted = f.library(conn, server, name="A"), f.library(conn, server, name="B")
    while ranges.partition_of(refreshed) == ranges.partition_of(deleted):
        deleted = f.library(conn, server, name="B")
    for library_id in (refreshed, deleted):
        stalled(conn, library_id, hours=2)
    instance.add_dynamic_partitions(
        PARTITIONS, [ranges.partition_of(refreshed), ranges.partition_of(deleted)]
    )
    events, cursor = tick(instance, db_url, None)
    assert {p: e.passed for p, e in events.items()} == {
        ranges.partition_of(refreshed): False,
        ranges.partition_of(deleted): False,
    }
    service.refresh(conn, RefreshPolicy())  # `inventory-pipeline refresh`
    execute(conn, "DELETE FROM libraries WHERE id = %s", (deleted,))
    events, cursor = tick(instance, db_url, cursor)
    assert {p: e.passed for p, e in events.items()} == {
        ranges.partition_of(refreshed): True,
        ranges.partition_of(deleted): True,
    }
    events, cursor = tick(instance, db_url, cursor)
    assert events == {}


def test_an_inactive_librarys_range_is_paused_not_an_error(conn: Connection) -> None:
    server = f.server(conn, "Den Plex")
    library_id = f.library(conn, server, name="Shelved")
    stalled(conn, library_id, hours=3)
    execute(conn, "UPDATE libraries SET active = false WHERE id = %s", (library_id,))
    statuses = service.profile_status(conn, [library_id])
    verdict = profile_checks.range_verdict(statuses, RefreshPolicy().stall_seconds)
    assert not verdict.passed and verdict.severity == dg.AssetCheckSeverity.WARN
    assert "paused" in verdict.description
