"""The profile side of the UI, read and driven through a real webserver's GraphQL API
with the daemon running: what the Partitions tabs of library_profile and its check
show, a partition's metadata, a backfill of chosen partitions, and a partition key
added by hand."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest

from inventory_pipeline.db import Connection, connect, execute, fetch_one
from inventory_pipeline.defs import profile_checks, profile_sensor
from inventory_pipeline.defs import profile_ranges as ranges
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.profiles import service
from tests import factories as f
from tests.dagster import graphql as gql

pytestmark = pytest.mark.daemon

ASSET_KEY = {"path": ["library_profile"]}
CHECK = "library_profile_current"


@pytest.fixture(scope="module")
def ui(
    server_url: str, template_name: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[gql.Dagster]:
    with gql.running_dagster(server_url, template_name, tmp_path_factory.mktemp("ui")) as d:
        yield d


@pytest.fixture(scope="module")
def repo(ui: gql.Dagster) -> dict[str, str]:
    return ui.repository()


@pytest.fixture(scope="module")
def sensor(repo: dict[str, str]) -> dict[str, str]:
    return {**repo, "sensorName": profile_sensor.library_profile_sensor.name}


@pytest.fixture
def app(ui: gql.Dagster) -> Iterator[Connection]:
    with connect(ui.app_url) as conn:
        yield conn


@pytest.fixture
def instance(ui: gql.Dagster, monkeypatch: pytest.MonkeyPatch) -> Iterator[dg.DagsterInstance]:
    """The deployment's instance, as the daemon opens it."""
    for key in ("DAGSTER_HOME", "INVENTORY_DAGSTER_STORAGE_URL"):
        monkeypatch.setenv(key, ui.env[key])
    with dg.DagsterInstance.get() as inst:
        yield inst


def sensor_state(ui: gql.Dagster, sensor: dict[str, str]) -> dict[str, Any]:
    state: dict[str, Any] = ui.query(gql.SENSOR, selector=sensor)["sensorOrError"]["sensorState"]
    return state


def stop_sensor(ui: gql.Dagster, sensor: dict[str, str]) -> None:
    state = sensor_state(ui, sensor)
    if state["status"] == "RUNNING":
        stopped = ui.query(gql.STOP_SENSOR, id=state["id"])["stopSensor"]
        assert stopped["__typename"] == "StopSensorMutationResult", stopped


def asset_view(ui: gql.Dagster, partition: str = "", limit: int = 1) -> dict[str, Any]:
    data = ui.query(gql.ASSET, key=ASSET_KEY, partition=partition, limit=limit)
    [node] = data["assetNodes"]
    [check] = [c for c in node["assetChecksOrError"]["checks"] if c["name"] == CHECK]
    return {
        "keys": node["partitionKeysByDimension"][0]["partitionKeys"],
        "partitions": node["assetPartitionStatuses"],
        "checks": check["partitionStatuses"],
        "latest": data["assetOrError"]["assetMaterializations"],
    }


def add_partition(ui: gql.Dagster, repo: dict[str, str], key: str) -> None:
    result = ui.query(gql.ADD_PARTITION, key=key, name=ranges.PARTITIONS_NAME, repo=repo)[
        "addDynamicPartition"
    ]
    assert result["__typename"] == "AddDynamicPartitionSuccess", result


def backfill(ui: gql.Dagster, partitions: list[str]) -> str:
    """What the Materialize dialog launches for chosen partitions."""
    result = ui.query(
        gql.LAUNCH_BACKFILL,
        params={
            "partitionNames": partitions,
            "assetSelection": [ASSET_KEY],
            "fromFailure": False,
            "tags": [],
        },
    )["launchPartitionBackfill"]
    assert result["__typename"] == "LaunchBackfillSuccess", result
    backfill_id: str = result["backfillId"]
    return backfill_id


def backfill_status(ui: gql.Dagster, backfill_id: str) -> str | None:
    status: str = ui.query(gql.BACKFILL, id=backfill_id)["partitionBackfillOrError"]["status"]
    return status if status in ("COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED") else None


def entries(materialization: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for e in materialization["metadataEntries"]:
        kind = e["__typename"]
        if kind == "TableMetadataEntry":
            out[e["label"]] = [json.loads(r) for r in e["table"]["records"]]
        elif kind == "JsonMetadataEntry":
            out[e["label"]] = json.loads(e["jsonString"])
        else:
            out[e["label"]] = e.get("text", e.get("intValue"))
    return out


def leases(conn: Connection) -> tuple[int, int]:
    row = fetch_one(
        conn,
        "SELECT count(*) FILTER (WHERE status = 'running') AS running,"
        " count(lease_token) AS leased FROM profile_refresh_requests",
    )
    assert row is not None
    return row["running"], row["leased"]


def check_truth(conn: Connection, libraries: list[int]) -> dict[str, bool]:
    """Each partition's check as the database sees it: every library of it current."""
    truth: dict[str, bool] = {}
    for s in service.profile_status(conn, libraries):
        key = ranges.partition_of(s.library_id)
        truth[key] = truth.get(key, True) and s.current
    return truth


def first_of_range(conn: Connection, srv: int, name: str, active: bool = True) -> int:
    """A library with the lowest id of its range: the next ones join its partition."""
    while True:
        lib = f.library(conn, srv, name=name, active=active)
        if lib % ranges.PARTITION_WIDTH == 0:
            return lib
        execute(conn, "DELETE FROM libraries WHERE id = %s", (lib,))


def test_backfill_of_chosen_partitions_and_what_the_partition_tabs_show(
    ui: gql.Dagster,
    sensor: dict[str, str],
    repo: dict[str, str],
    app: Connection,
    instance: dg.DagsterInstance,
) -> None:
    # The planning sensor stays off here: only the backfills touch these libraries.
    stop_sensor(ui, sensor)
    srv = f.server(app, "Living Room Plex")
    # Three partitions: two libraries to refresh, one inactive, two left alone.
    full = first_of_range(app, srv, "Films")
    small = f.library(app, srv, name="Shorts")
    inactive = first_of_range(app, srv, "Archive", active=False)
    empty = first_of_range(app, srv, "Empty")
    stalled = f.library(app, srv, name="Stalled")
    f.items(app, full, 30, seed=4)
    f.items(app, small, 4)
    f.items(app, inactive, 6)
    f.items(app, stalled, 6)
    libraries = [full, small, inactive, empty, stalled]
    key = ranges.partition_of
    refreshed, archive, idle = key(full), key(inactive), key(empty)
    assert key(small) == refreshed and key(stalled) == idle
    assert len({refreshed, archive, idle}) == 3
    for partition in (refreshed, archive, idle):
        add_partition(ui, repo, partition)

    good = backfill(ui, [refreshed])
    bad = backfill(ui, [archive])
    ui.start_daemon()
    assert ui.wait_for("the good backfill", lambda: backfill_status(ui, good), 180) == (
        "COMPLETED_SUCCESS"
    )
    assert ui.wait_for("the bad backfill", lambda: backfill_status(ui, bad), 180) in (
        "COMPLETED_FAILED",
        "FAILED",
    )
    assert leases(app) == (0, 0)

    view = asset_view(ui, refreshed, limit=10)
    partitions = view["partitions"]
    assert partitions["materializedPartitions"] == [refreshed]
    assert partitions["failedPartitions"] == [archive]
    assert idle in partitions["unmaterializedPartitions"]

    # The check's Partitions tab agrees with the database, partition by partition.
    checks = view["checks"]
    truth = check_truth(app, libraries)
    assert checks["succeededPartitions"] == [refreshed]
    assert checks["failedPartitions"] == [archive]
    assert all(truth[k] for k in checks["succeededPartitions"])
    assert not any(truth[k] for k in checks["failedPartitions"])
    assert checks["skippedPartitions"] == checks["executionFailedPartitions"] == []
    assert truth[refreshed] and not truth[archive]

    # The partition's latest materialization lists its libraries; before it, one per
    # library, and the small one says why nothing is published.
    latest, *earlier = view["latest"]
    listed = entries(latest)
    assert [row["library_id"] for row in listed["libraries"]] == [full, small]
    assert [row["outcome"] for row in listed["libraries"]] == ["published", "published"]
    assert listed["summary"] == f'published {full} "Films", {small} "Shorts"'
    by_library = {entries(m)["library_id"]: entries(m) for m in earlier}
    assert set(by_library) == {full, small}
    # Each event names its library in its description (the Events tab's rows).
    assert sorted(m["description"] for m in earlier) == [
        f'library {full} "Films" on "Living Room Plex": published',
        f'library {small} "Shorts" on "Living Room Plex": published',
    ]
    shown = by_library[small]
    assert shown["library"] == "Shorts (movie)"
    assert shown["media_server"] == "Living Room Plex (plex)"
    assert shown["trait/genres"] == "insufficient: 4 contributing items, need 5"
    assert {row["status"] for row in shown["traits"]} == {"insufficient"}
    assert not [k for k in shown if k.startswith(("distribution/", "coverage/"))]
    shown_full = by_library[full]
    stored = f.profile(app, full)
    assert stored is not None
    assert shown_full["profile"] == stored["profile"]
    assert [r["statistic"] for r in shown_full["distribution/rating"]] == [
        "mean",
        "median",
        "p10",
        "p90",
    ]
    assert {"distribution/genres", "distribution/identity"} <= set(shown_full)

    # A library nothing refreshes turns red once it waits beyond the threshold: the
    # staleness sensor's evaluation, reported as the daemon reports sensor events.
    execute(app, "SELECT fold_inventory_changes()")  # the change is a revision
    execute(
        app,
        "UPDATE library_inventory_state SET dirty_since = now() - interval '1 hour'"
        " WHERE library_id = %s",
        (stalled,),
    )
    context = dg.build_sensor_context(
        instance=instance, resources={"inventory_db": InventoryDatabase(url=ui.app_url)}
    )
    result = profile_checks.library_profile_staleness_sensor(context)
    assert isinstance(result, dg.SensorResult)
    for event in result.asset_events:
        instance.report_runless_asset_event(event)
    checks = asset_view(ui)["checks"]
    assert set(checks["failedPartitions"]) == {archive, idle}
    assert leases(app) == (0, 0)


def test_partition_added_by_hand_breaks_neither_preview_nor_tick(
    ui: gql.Dagster, sensor: dict[str, str], repo: dict[str, str], app: Connection
) -> None:
    stop_sensor(ui, sensor)  # so the preview, not a tick, is the first to see the key
    f.items(app, f.library(app, name="Later"), 6)
    add_partition(ui, repo, "Films")
    # "Preview tick result": evaluates without launching, and holds nothing.
    preview = ui.query(gql.SENSOR_DRY_RUN, selector=sensor, cursor=None)["sensorDryRun"]
    assert preview["__typename"] == "DryRunInstigationTick", preview
    evaluation = preview["evaluationResult"]
    assert evaluation["error"] is None
    removed = [
        key
        for r in evaluation["dynamicPartitionsRequests"]
        if r["type"] == "DELETE_PARTITIONS"
        for key in r["partitionKeys"]
    ]
    assert removed == ["Films"]
    # The preview says what the tick found and would launch.
    [request] = evaluation["runRequests"]
    plan = {t["key"]: t["value"] for t in request["tags"]}[profile_sensor.PLAN_TAG]
    # (Libraries of the test before are behind too.)
    assert re.fullmatch(
        r"\d+ librar(y|ies) to refresh \(\d+ planned by this tick, 0 expired leases\); "
        r"launching 1 run of up to 5000 claims each",
        plan,
    ), plan
    assert leases(app) == (0, 0)

    ui.start_daemon()
    started_at = time.time()
    started = ui.query(gql.START_SENSOR, selector=sensor)["startSensor"]
    assert started["__typename"] == "Sensor", started

    def ticked() -> list[dict[str, Any]] | None:
        ticks = [
            t
            for t in sensor_state(ui, sensor)["ticks"]
            if t["timestamp"] >= started_at and t["status"] != "STARTED"
        ]
        return ticks or None

    ticks = ui.wait_for("a sensor tick", ticked, 60)
    assert [t for t in ticks if t["status"] == "FAILURE"] == []
    assert "Films" not in asset_view(ui)["keys"]

    # The tick history shows what each tick did and removed, not "No logs to display".
    def tick_lines() -> list[tuple[str, str]]:
        state = ui.query(gql.SENSOR_TICK_LOGS, selector=sensor)["sensorOrError"]["sensorState"]
        return [
            (e["level"], e["message"])
            for t in state["ticks"]
            if t["timestamp"] >= started_at
            for e in t["logEvents"]["events"]
        ]

    # A later tick finds nothing new to launch: its skip reason is in its log too.
    def with_a_skip() -> list[tuple[str, str]] | None:
        lines = tick_lines()
        return lines if any(m.startswith("skipped: ") for _, m in lines) else None

    lines = ui.wait_for("a skipped tick's log", with_a_skip, 60)
    assert (
        "WARNING",
        "removed partition keys that are not library id ranges: 'Films'",
    ) in lines, lines
    assert ("INFO", "launching 1 run") in lines, lines


ASSET_GRAPH = """
query {
  assetNodes {
    assetKey { path } groupName isMaterializable dependencyKeys { path }
    targetingInstigators { ... on Sensor { name } }
  }
}
"""


def test_the_asset_graph_shows_capabilities_and_lineage(ui: gql.Dagster) -> None:
    """What the asset graph draws: one group per capability, the system of record as
    external assets, and edges from what each asset is derived from (before: seven
    unconnected nodes in group `default`)."""
    nodes = {"/".join(n["assetKey"]["path"]): n for n in ui.query(ASSET_GRAPH)["assetNodes"]}
    assert {n["groupName"] for n in nodes.values()} == {
        "system_of_record",
        "library_profiles",
        "provider_recovery",
        "credentials",
        "training_stats",
    }
    edges = {
        name: sorted("/".join(d["path"]) for d in n["dependencyKeys"])
        for name, n in nodes.items()
        if n["dependencyKeys"]
    }
    assert edges["library_profile"] == ["media_inventory"]
    assert edges["pr_overview"] == ["training_log"]
    assert edges["replacement_proposals"] == ["provider_observations"]
    assert not nodes["training_log"]["isMaterializable"]
    assert not nodes["media_inventory"]["isMaterializable"]
    # The asset page's "Automation": the sensor whose runs materialize the asset.
    automation = {
        name: sorted(i["name"] for i in n["targetingInstigators"]) for name, n in nodes.items()
    }
    assert automation["provider_observations"] == ["provider_observation_sensor"]
    assert automation["replacement_proposals"] == ["identity_revalidation_sensor"]
    assert automation["tmdb_credential"] == ["credential_wakeup_sensor"]
    for stats in ("user_exercise_stats", "user_training_period_stats", "pr_overview"):
        assert automation[stats] == ["stats_refresh_sensor"], stats
