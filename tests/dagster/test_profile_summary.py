"""What a reader of library_profile sees per library: each range's materialization lists
every library of the range once, as the database has it, with one vocabulary of
outcomes whichever path refreshed it; each event names its libraries; and every
evaluation of the check carries figures of its range, never one library's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest

from inventory_pipeline.db import Connection, connect, execute, fetch_one
from inventory_pipeline.defs import profile_checks, profile_metadata
from inventory_pipeline.defs import profile_ranges as ranges
from inventory_pipeline.defs import profiles as profile_defs
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.models import OUTCOMES, Claim, Completion, RefreshPolicy
from tests import factories as f

PARTITIONS = ranges.library_partitions.name
key_of = ranges.partition_of
VOCABULARY = {*OUTCOMES, profile_metadata.UNCHANGED}
RANGE_FIGURES = {"libraries", "current", "behind", "oldest_lag_seconds"}


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def one_range(conn: Connection, names: list[str]) -> list[int]:
    """Libraries whose ids share one partition (ids are consecutive within a test)."""
    srv = f.server(conn, "Den Plex")
    while True:
        ids = [f.library(conn, srv, name=name) for name in names]
        if len({key_of(i) for i in ids}) == 1:
            return ids


def refresh(conn: Connection, db_url: str, instance: dg.DagsterInstance) -> Any:
    service.plan(conn, RefreshPolicy())
    result = profile_defs.library_profile_refresh.execute_in_process(
        instance=instance, resources={"inventory_db": InventoryDatabase(url=db_url)}
    )
    assert result.success
    return result


def materializations(result: Any) -> list[dg.AssetMaterialization]:
    return [
        e.step_materialization_data.materialization
        for e in result.get_asset_materialization_events()
    ]


def rows(event: dg.AssetMaterialization) -> dict[int, dict[str, Any]]:
    table = event.metadata["libraries"].value
    assert isinstance(table, dg.TableMetadataValue)
    listed = [r.data for r in table.records]
    by_id = {r["library_id"]: r for r in listed}
    assert len(by_id) == len(listed), f"a library listed twice: {listed}"
    return by_id


def test_a_range_lists_every_library_it_holds_not_only_the_last_batch(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    films, shows, empty = one_range(conn, ["Films", "Shows", "Empty"])
    f.items(conn, films, 12, seed=1)
    refresh(conn, db_url, instance)
    f.items(conn, shows, 7, seed=2)
    [event] = materializations(refresh(conn, db_url, instance))
    listed = rows(event)
    assert sorted(listed) == [films, shows, empty]
    assert listed[shows]["outcome"] == "published"
    assert listed[films]["outcome"] == listed[empty]["outcome"] == "unchanged"
    films_row = listed[films]
    assert films_row["library"] == "Films (movie)"
    assert films_row["media_server"] == "Den Plex (plex)"
    assert films_row["item_count"] == 12
    assert films_row["revision"] == films_row["acknowledged"] == f.revision(conn, films)
    assert films_row["profile_revision"] == f.revision(conn, films)
    assert films_row["published_at"]
    assert listed[empty]["profile_revision"] is None and listed[empty]["item_count"] == 0
    assert event.description == f'published {shows} "Shows"; 2 unchanged'


def test_a_library_refreshed_twice_in_one_run_is_listed_once(
    conn: Connection, db_url: str, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change arriving while the run works is planned and refreshed by the same run: the
    range's table shows the library once, at the revision it ended on."""
    films, shows = one_range(conn, ["Films", "Shows"])
    f.items(conn, films, 8, seed=3)
    f.items(conn, shows, 8, seed=4)
    process = service.process
    changed: list[int] = []

    def process_then_change(
        conn_: Connection, claim: Claim, *args: Any, **options: Any
    ) -> Completion:
        done = process(conn_, claim, *args, **options)
        if claim.library_id == films and not changed:
            with connect(db_url) as other:
                changed.extend(f.items(other, films, 1, seed=5))
        return done

    monkeypatch.setattr(service, "process", process_then_change)
    result = refresh(conn, db_url, instance)
    assert changed
    claimed = [r["library_id"] for r in f.requests(conn, films)]
    assert claimed == [films, films], "the run did not refresh the library twice"
    [event] = materializations(result)
    listed = rows(event)
    assert sorted(listed) == [films, shows]
    assert listed[films]["profile_revision"] == f.revision(conn, films)
    assert listed[films]["item_count"] == 9
    # Both of the library's completions are recorded: none is left for a late record.
    due = fetch_one(
        conn, "SELECT count(*) AS n FROM profile_refresh_requests WHERE materialization_due"
    )
    assert due is not None and due["n"] == 0


def test_backfill_and_sensor_runs_speak_one_vocabulary(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    stocked, never = one_range(conn, ["Stocked", "Never stocked"])
    f.items(conn, stocked, 6, seed=6)
    instance.add_dynamic_partitions(PARTITIONS, [key_of(stocked)])
    result = dg.materialize(
        [profile_defs.library_profile],
        partition_key=key_of(stocked),
        instance=instance,
        resources={"inventory_db": InventoryDatabase(url=db_url)},
    )
    assert result.success
    events = materializations(result)
    summary = events[-1]
    listed = rows(summary)
    assert {r["outcome"] for r in listed.values()} <= VOCABULARY
    assert (listed[stocked]["outcome"], listed[never]["outcome"]) == ("published", "unchanged")
    # Each library's own event says which library it is and what happened to it.
    described = [e.description for e in events[:-1]]
    assert f'library {stocked} "Stocked" on "Den Plex": published' in described
    assert f'library {never} "Never stocked" on "Den Plex": unchanged' in described
    assert summary.metadata["summary"].value == f'published {stocked} "Stocked"; 1 unchanged'

    f.items(conn, stocked, 1, seed=7)
    [event] = materializations(refresh(conn, db_url, instance))
    assert {r["outcome"] for r in rows(event).values()} <= VOCABULARY


def test_a_range_event_names_its_libraries_boundedly(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    long, quoted = one_range(conn, ["x" * 300, 'Kids "best"\nof'])
    f.items(conn, long, 6, seed=8)
    f.items(conn, quoted, 6, seed=9)
    [event] = materializations(refresh(conn, db_url, instance))
    assert event.description is not None and "\n" not in event.description
    assert event.description == (
        f'published {long} "{"x" * (profile_metadata.NAME_CHARS - 1)}…", '
        f'{quoted} "Kids \\"best\\"\\nof"'
    )


def test_every_evaluation_of_the_check_carries_its_ranges_figures(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    """Refresh and stall evaluations alike: a plot of the check's metadata compares one
    range over time, never one library with another."""
    stalled, fresh = one_range(conn, ["Stalled", "Fresh"])
    f.items(conn, fresh, 6, seed=10)
    [refreshed] = refresh(conn, db_url, instance).get_asset_check_evaluations()
    assert RANGE_FIGURES <= set(refreshed.metadata)
    f.items(conn, stalled, 6, seed=11)
    execute(conn, "SELECT fold_inventory_changes()")  # the change is a revision
    execute(
        conn,
        "UPDATE library_inventory_state SET dirty_since = now() - interval '2 hours'"
        " WHERE library_id = %s",
        (stalled,),
    )
    instance.add_dynamic_partitions(PARTITIONS, [key_of(stalled)])
    context = dg.build_sensor_context(
        instance=instance, resources={"inventory_db": InventoryDatabase(url=db_url)}
    )
    result = profile_checks.library_profile_staleness_sensor(context)
    assert isinstance(result, dg.SensorResult)
    [evaluation] = result.asset_events
    assert isinstance(evaluation, dg.AssetCheckEvaluation)
    assert set(evaluation.metadata) == set(refreshed.metadata) | {"not_current"}
    assert evaluation.metadata["behind"].value == 1
    assert evaluation.metadata["oldest_lag_seconds"].value >= 7200
    assert evaluation.severity == dg.AssetCheckSeverity.ERROR
    assert evaluation.description == (
        f"library {stalled}: inventory revision 1 not yet acknowledged (acknowledged 0),"
        " waiting 120 min; stall threshold 15 min"
    )


def test_a_stored_profiles_tables_list_the_largest_first_then_the_rest() -> None:
    """A backfill that joins another run's request reads the stored jsonb profile, whose
    keys come back shortest first: the tables are still largest first, and the values
    past the table's rows and the profile's rest_share are one last row."""
    genres = {f"g{i:02d}": round(0.01 * (i + 1), 4) for i in range(22)} | {"War": 0.0417}
    profile = {
        "genres": {"status": "published", "coverage": 1.0, "contributors": 24, "share": genres},
        "primary_studio": {
            "status": "published",
            "coverage": 1.0,
            "contributors": 40,
            "share": {"other": 0.5, "A24": 0.2},
            "rest_share": 0.3,
        },
    }
    stored = dict(sorted(profile.items()))
    stored["genres"]["share"] = dict(sorted(genres.items(), key=lambda kv: (len(kv[0]), kv[0])))
    metadata = profile_metadata.profile_metadata(stored)
    rows = [r.data for r in metadata["distribution/genres"].records]
    assert [r["value"] for r in rows[:2]] == ["g21", "g20"]
    assert len(rows) == profile_metadata.TABLE_ROWS + 1 and rows[-1]["value"] == "(3 more)"
    studios = [r.data for r in metadata["distribution/primary_studio"].records]
    assert studios == [
        {"value": "other", "share": 0.5},
        {"value": "A24", "share": 0.2},
        {"value": "(the rest)", "share": 0.3},
    ]
