"""The profile side of the UI, read and driven through a real webserver's GraphQL API
with the daemon running: what the Partitions tabs of library_profile and its check
show, a partition's metadata, a backfill of chosen partitions, and a partition key
added by hand."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest

from inventory_pipeline.db import Connection, connect, execute, fetch_one
from inventory_pipeline.defs import profiles as profile_defs
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
    return {**repo, "sensorName": profile_defs.library_profile_sensor.name}


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


def asset_view(ui: gql.Dagster, partition: str = "") -> dict[str, Any]:
    data = ui.query(gql.ASSET, key=ASSET_KEY, partition=partition)
    [node] = data["assetNodes"]
    [check] = [c for c in node["assetChecksOrError"]["checks"] if c["name"] == CHECK]
    return {
        "keys": node["partitionKeysByDimension"][0]["partitionKeys"],
        "partitions": node["assetPartitionStatuses"],
        "checks": check["partitionStatuses"],
        "latest": data["assetOrError"]["assetMaterializations"],
    }


def add_partition(ui: gql.Dagster, repo: dict[str, str], key: str) -> None:
    result = ui.query(gql.ADD_PARTITION, key=key, name=profile_defs.PARTITIONS_NAME, repo=repo)[
        "addDynamicPartition"
    ]
    assert result["__typename"] == "AddDynamicPartitionSuccess", result


def backfill(ui: gql.Dagster, partitions: list[int]) -> str:
    """What the Materialize dialog launches for chosen partitions."""
    result = ui.query(
        gql.LAUNCH_BACKFILL,
        params={
            "partitionNames": [str(p) for p in partitions],
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
    return {str(s.library_id): s.current for s in service.profile_status(conn, libraries)}


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
    full = f.library(app, srv, name="Films")
    small = f.library(app, srv, name="Shorts")
    inactive = f.library(app, srv, name="Archive", active=False)
    empty = f.library(app, srv, name="Empty")
    stalled = f.library(app, srv, name="Stalled")
    f.items(app, full, 30, seed=4)
    f.items(app, small, 4)
    f.items(app, inactive, 6)
    f.items(app, stalled, 6)
    libraries = [full, small, inactive, empty, stalled]
    for lib in libraries:
        add_partition(ui, repo, str(lib))

    good = backfill(ui, [full, small])
    bad = backfill(ui, [inactive])
    ui.start_daemon()
    assert ui.wait_for("the good backfill", lambda: backfill_status(ui, good), 180) == (
        "COMPLETED_SUCCESS"
    )
    assert ui.wait_for("the bad backfill", lambda: backfill_status(ui, bad), 180) in (
        "COMPLETED_FAILED",
        "FAILED",
    )
    assert leases(app) == (0, 0)

    view = asset_view(ui, str(small))
    partitions = view["partitions"]
    assert set(partitions["materializedPartitions"]) == {str(full), str(small)}
    assert partitions["failedPartitions"] == [str(inactive)]
    assert {str(empty), str(stalled)} <= set(partitions["unmaterializedPartitions"])

    # The check's Partitions tab agrees with the database, partition by partition.
    checks = view["checks"]
    truth = check_truth(app, libraries)
    assert set(checks["succeededPartitions"]) == {str(full), str(small)}
    assert set(checks["failedPartitions"]) == {str(inactive)}
    assert all(truth[k] for k in checks["succeededPartitions"])
    assert not any(truth[k] for k in checks["failedPartitions"])
    assert checks["skippedPartitions"] == checks["executionFailedPartitions"] == []
    assert truth[str(full)] and truth[str(small)] and not truth[str(inactive)]

    # The small library's latest materialization says why nothing is published.
    [latest] = view["latest"]
    shown = entries(latest)
    assert shown["library"] == "Shorts (movie)"
    assert shown["media_server"] == "Living Room Plex (plex)"
    assert shown["trait/genres"] == "insufficient: 4 contributing items, need 5"
    assert {row["status"] for row in shown["traits"]} == {"insufficient"}
    assert not [k for k in shown if k.startswith(("distribution/", "coverage/"))]
    [latest_full] = asset_view(ui, str(full))["latest"]
    shown_full = entries(latest_full)
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
    execute(
        app,
        "UPDATE library_inventory_state SET dirty_since = now() - interval '1 hour'"
        " WHERE library_id = %s",
        (stalled,),
    )
    context = dg.build_sensor_context(
        instance=instance, resources={"inventory_db": InventoryDatabase(url=ui.app_url)}
    )
    result = profile_defs.library_profile_staleness_sensor(context)
    assert isinstance(result, dg.SensorResult)
    for event in result.asset_events:
        instance.report_runless_asset_event(event)
    checks = asset_view(ui)["checks"]
    assert set(checks["failedPartitions"]) == {str(inactive), str(stalled)}
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
    assert evaluation["runRequests"]
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
