"""What the Dagster UI shows of recovery, the TMDb key and the stats rollover, read
through the webserver's GraphQL schema over the code location `inventory_pipeline.
definitions` (in process), after runs recorded on the same instance."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest
from dagster._core.test_utils import in_process_test_workspace
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.workspace.context import WorkspaceRequestContext
from dagster_graphql.test.utils import execute_dagster_graphql, infer_sensor_selector

from inventory_pipeline.db import Connection, execute
from inventory_pipeline.definitions import defs
from inventory_pipeline.defs.resources import InventoryDatabase, TmdbResource
from inventory_pipeline.provider.standin import StandIn
from tests import factories as f
from tests.conftest import TMDB_TEST_KEY

WRONG_KEY = "wrong-key-0b5e77c1a4"

ASSET = """
query Asset($key: AssetKeyInput!) {
  assetNodeOrError(assetKey: $key) {
    ... on AssetNode {
      assetMaterializations(limit: 1) {
        runId
        description
        metadataEntries {
          label
          ... on IntMetadataEntry { intValue }
          ... on TextMetadataEntry { text }
          ... on TableMetadataEntry { table { records schema { columns { name } } } }
        }
      }
      assetChecksOrError {
        ... on AssetChecks {
          checks {
            name
            executionForLatestMaterialization {
              runId
              status
              evaluation { severity description }
            }
          }
        }
      }
    }
  }
}
"""

SENSOR_DRY_RUN = """
mutation DryRun($selector: SensorSelector!, $cursor: String) {
  sensorDryRun(selectorData: $selector, cursor: $cursor) {
    ... on DryRunInstigationTick {
      evaluationResult {
        skipReason
        runRequests { runKey }
        error { message }
      }
    }
    ... on PythonError { message }
  }
}
"""


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


@pytest.fixture
def ui(
    instance: dg.DagsterInstance, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[WorkspaceRequestContext]:
    """The UI's view: the code location loaded as the webserver loads it, its database
    resource reading the URL from the environment when a sensor is evaluated."""
    monkeypatch.setenv("INVENTORY_DATABASE_URL", db_url)
    origin = LoadableTargetOrigin(module_name="inventory_pipeline.definitions")
    with in_process_test_workspace(instance, origin) as context:
        yield context


def query(context: WorkspaceRequestContext, text: str, variables: dict[str, Any]) -> Any:
    result = execute_dagster_graphql(context, text, variables)
    assert not result.errors, result.errors
    return result.data


def asset_view(context: WorkspaceRequestContext, key: str) -> dict[str, Any]:
    """The latest materialization (metadata by label) and each check's status for it."""
    node = query(context, ASSET, {"key": {"path": [key]}})["assetNodeOrError"]
    [materialization] = node["assetMaterializations"]
    metadata = {e["label"]: e for e in materialization["metadataEntries"]}
    checks = {
        c["name"]: c["executionForLatestMaterialization"]
        for c in node["assetChecksOrError"]["checks"]
    }
    return {"run_id": materialization["runId"], "metadata": metadata, "checks": checks}


def table(entry: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(r) for r in entry["table"]["records"]]


def warnings_of(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    return [e.user_message for e in instance.all_logs(run_id) if e.level == logging.WARNING]


def test_open_cases_and_the_recovery_check_are_current_after_every_run(
    conn: Connection,
    db_url: str,
    instance: dg.DagsterInstance,
    standin: StandIn,
    ui: WorkspaceRequestContext,
) -> None:
    f.provider_key(conn, TMDB_TEST_KEY)
    lib = f.library(conn)
    for tmdb_id in range(1, 9):
        f.tmdb_item(conn, lib, tmdb_id)
    standin.set_available("movie", 3, False)
    standin.set_fault("status", status=502, ids=[5, 6])
    resources = {
        "inventory_db": InventoryDatabase(url=db_url),
        "tmdb": TmdbResource(base_url=standin.url, rate=200),
    }
    first = defs.resolve_job_def("provider_observation").execute_in_process(
        instance=instance, resources=resources
    )
    assert first.success
    # Each case warning names the cause, as an HTTP status class.
    warned = warnings_of(instance, first.run_id)
    assert sum("opened (transient: HTTP 5xx)" in w for w in warned) == 2
    assert sum("opened (not_found: HTTP 404)" in w for w in warned) == 1

    view = asset_view(ui, "provider_observations")
    assert view["run_id"] == first.run_id
    rows = {r["category"]: r for r in table(view["metadata"]["open_cases"])}
    assert set(rows) == {"not_found", "transient"}
    assert (rows["transient"]["open"], rows["transient"]["due_now"]) == (2, 0)
    assert rows["not_found"]["open"] == 1
    assert view["metadata"]["open_cases_total"]["intValue"] == 3
    check = view["checks"]["recovery_cases_on_time"]
    assert (check["runId"], check["status"]) == (first.run_id, "SUCCEEDED")

    # Observation stalls (throttled for an hour) while the cases' deadlines pass: the
    # next run observes nothing, yet its materialization shows the cases due and its
    # check evaluation fails with a description.
    execute(
        conn,
        "UPDATE media_server_items SET observation_due_at = now() - interval '2 hours',"
        " recovery_first_failed_at = now() - interval '3 hours'"
        " WHERE recovery_case_id IS NOT NULL",
    )
    execute(conn, "UPDATE provider_admission SET paused_until = now() + interval '1 hour'")
    stalled = defs.resolve_job_def("provider_observation").execute_in_process(
        instance=instance, resources=resources
    )
    assert stalled.success
    view = asset_view(ui, "provider_observations")
    assert view["run_id"] == stalled.run_id
    rows = {r["category"]: r for r in table(view["metadata"]["open_cases"])}
    assert (rows["transient"]["due_now"], rows["transient"]["oldest_age_minutes"]) == (2, 180)
    check = view["checks"]["recovery_cases_on_time"]
    assert (check["runId"], check["status"]) == (stalled.run_id, "FAILED")
    assert "3 open recovery cases" in check["evaluation"]["description"]
    assert any("3 open recovery cases" in w for w in warnings_of(instance, stalled.run_id))


def test_a_rejected_key_is_a_warning_and_a_failed_check(
    conn: Connection,
    db_url: str,
    instance: dg.DagsterInstance,
    standin: StandIn,
    ui: WorkspaceRequestContext,
) -> None:
    f.provider_key(conn, WRONG_KEY)
    f.auth_cases(conn, f.library(conn), 3)
    resources = {
        "inventory_db": InventoryDatabase(url=db_url),
        "tmdb": TmdbResource(base_url=standin.url),
    }
    rejected = defs.resolve_job_def("credential_wakeup").execute_in_process(
        instance=instance, resources=resources
    )
    assert rejected.success
    assert any("TMDb rejected key generation" in w for w in warnings_of(instance, rejected.run_id))
    view = asset_view(ui, "tmdb_credential")
    assert view["metadata"]["verification"]["text"] == "auth"
    check = view["checks"]["tmdb_key_verified"]
    assert (check["runId"], check["status"]) == (rejected.run_id, "FAILED")
    assert check["evaluation"]["severity"] == "ERROR"
    assert "rejected" in check["evaluation"]["description"]

    # A new key is verified at the next run: the check turns green for it.
    f.provider_key(conn, TMDB_TEST_KEY)
    accepted = defs.resolve_job_def("credential_wakeup").execute_in_process(
        instance=instance, resources=resources
    )
    assert accepted.success
    check = asset_view(ui, "tmdb_credential")["checks"]["tmdb_key_verified"]
    assert (check["runId"], check["status"]) == (accepted.run_id, "SUCCEEDED")
    for run in instance.get_runs():
        for entry in instance.all_logs(run.run_id):
            assert WRONG_KEY not in str(entry) and TMDB_TEST_KEY not in str(entry)


def test_rollover_sensor_launches_only_when_a_page_is_due(
    conn: Connection, ui: WorkspaceRequestContext
) -> None:
    selector = infer_sensor_selector(ui, "stats_rollover_sensor")
    idle = query(ui, SENSOR_DRY_RUN, {"selector": selector, "cursor": None})["sensorDryRun"][
        "evaluationResult"
    ]
    assert idle["error"] is None and idle["runRequests"] == []
    assert "no PR overview window" in idle["skipReason"]
    execute(
        conn,
        "INSERT INTO user_pr_overview_rollover_state (user_id, due_at)"
        " VALUES (gen_random_uuid(), now() - interval '1 minute')",
    )
    due = query(ui, SENSOR_DRY_RUN, {"selector": selector, "cursor": "41"})
    result = due["sensorDryRun"]["evaluationResult"]
    assert result["error"] is None
    assert [r["runKey"] for r in result["runRequests"]] == ["stats-rollover-42"]
