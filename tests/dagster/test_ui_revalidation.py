"""What an operator sees and does in the UI, through a real webserver's GraphQL API with
the daemon running: the replacement_proposals asset's tables after a revalidation run
launched from the launchpad, the decision job's typed config, a refused decision, an
approval, and the daemon's own observation run resolving the case as replaced."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from inventory_pipeline.db import Connection, connect, fetch_one
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.settings import TMDB_BASE_URL
from tests import factories as f
from tests import revalidation_cases as rc
from tests.conftest import TMDB_TEST_KEY
from tests.dagster import graphql as gql

pytestmark = pytest.mark.daemon

LAUNCH = """
mutation ($params: ExecutionParams!) {
  launchPipelineExecution(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on PythonError { message }
  }
}
"""

RUN = """
query ($id: ID!) {
  runOrError(runId: $id) {
    ... on Run {
      status
      runConfigYaml
      eventConnection {
        events {
          __typename
          ... on MessageEvent { message level }
          ... on ExecutionStepFailureEvent { error { message } }
        }
      }
    }
  }
}
"""

CONFIG_SCHEMA = """
query ($selector: PipelineSelector!) {
  pipelineOrError(params: $selector) {
    ... on Pipeline {
      description
      solidHandles {
        solid {
          definition {
            name
            ... on SolidDefinition {
              configField {
                configType {
                  ... on CompositeConfigType {
                    fields { name isRequired description configTypeKey }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}
"""

VALID = """
query ($selector: PipelineSelector!, $config: RunConfigData) {
  isPipelineConfigValid(pipeline: $selector, mode: "default", runConfigData: $config) {
    __typename
    ... on RunConfigValidationInvalid { errors { message } }
  }
}
"""

ASSET = """
query ($key: AssetKeyInput!) {
  assetOrError(assetKey: $key) {
    ... on Asset {
      assetMaterializations(limit: 1) {
        runId
        metadataEntries {
          label
          __typename
          ... on IntMetadataEntry { intValue }
          ... on JsonMetadataEntry { jsonString }
          ... on TableMetadataEntry { table { records schema { columns { name type } } } }
        }
      }
    }
  }
}
"""


@pytest.fixture(scope="module")
def standin() -> Iterator[StandIn]:
    with StandIn(api_key=TMDB_TEST_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def ui(
    server_url: str,
    template_name: str,
    tmp_path_factory: pytest.TempPathFactory,
    standin: StandIn,
) -> Iterator[gql.Dagster]:
    """The deployment, its runs asking the stand-in (the environment they inherit)."""
    before = os.environ.get(TMDB_BASE_URL)
    os.environ[TMDB_BASE_URL] = standin.url
    try:
        with gql.running_dagster(server_url, template_name, tmp_path_factory.mktemp("ui")) as d:
            yield d
    finally:
        if before is None:
            os.environ.pop(TMDB_BASE_URL, None)
        else:
            os.environ[TMDB_BASE_URL] = before


@pytest.fixture
def app(ui: gql.Dagster) -> Iterator[Connection]:
    with connect(ui.app_url) as conn:
        yield conn


def launch(ui: gql.Dagster, repo: dict[str, str], job: str, config: dict[str, Any]) -> str:
    """What the launchpad's Launch button sends."""
    params = {
        "selector": {**repo, "pipelineName": job},
        "runConfigData": config,
        "mode": "default",
    }
    result = ui.query(LAUNCH, params=params)["launchPipelineExecution"]
    assert result["__typename"] == "LaunchRunSuccess", result
    run_id: str = result["run"]["runId"]
    return run_id


def finished(ui: gql.Dagster, run_id: str) -> dict[str, Any] | None:
    run: dict[str, Any] = ui.query(RUN, id=run_id)["runOrError"]
    return run if run["status"] in ("SUCCESS", "FAILURE", "CANCELED") else None


def latest(ui: gql.Dagster, key: str) -> dict[str, Any]:
    [mat] = ui.query(ASSET, key={"path": [key]})["assetOrError"]["assetMaterializations"]
    out: dict[str, Any] = {"run_id": mat["runId"]}
    for e in mat["metadataEntries"]:
        if e["__typename"] == "TableMetadataEntry":
            out[e["label"]] = {
                "rows": [json.loads(r) for r in e["table"]["records"]],
                "columns": [c["name"] for c in e["table"]["schema"]["columns"]],
            }
        elif e["__typename"] == "JsonMetadataEntry":
            out[e["label"]] = json.loads(e["jsonString"])
        else:
            out[e["label"]] = e.get("intValue")
    return out


def decision(ui: gql.Dagster, repo: dict[str, str], config: dict[str, Any]) -> dict[str, Any]:
    run_id = launch(
        ui,
        repo,
        "replacement_decision",
        {"ops": {"decide_replacement_proposals": {"config": config}}},
    )
    run = ui.wait_for("the decision run", lambda: finished(ui, run_id), 120)
    return {"id": run_id, **run}


def test_review_and_approve_a_replacement_from_the_ui(
    ui: gql.Dagster, app: Connection, standin: StandIn
) -> None:
    f.provider_key(app, TMDB_TEST_KEY)
    library = f.library(app, name="Films")
    with TmdbClient(standin.url, timeout_seconds=2.0) as client:
        merged = rc.merged(app, client, standin, library, 603, 9603, title="Heat", year=1995)
        ambiguous = rc.merged(
            app, client, standin, library, 604, 9604, survivor={"also": (("movie", 7),)}
        )
    repo = ui.repository()
    ui.start_daemon()

    # Launchpad: the revalidation job. The asset's latest materialization is its table.
    run_id = launch(ui, repo, "identity_revalidation", {})
    run = ui.wait_for("the revalidation run", lambda: finished(ui, run_id), 180)
    assert run["status"] == "SUCCESS"
    view = latest(ui, "replacement_proposals")
    assert view["proposals"]["columns"] == [
        "proposal",
        "state",
        "item",
        "library",
        "kind",
        "old_id",
        "candidate",
        "evidence",
        "title",
        "year",
        "age_hours",
    ]
    [row] = view["proposals"]["rows"]
    assert (row["item"], row["library"], row["old_id"], row["candidate"]) == (
        merged,
        "Films",
        603,
        9603,
    )
    assert (row["state"], row["title"], row["year"]) == (
        "proposed",
        '"Heat" = "Heat"',
        "1995 ~ 1995",
    )
    [why] = view["no_proposal"]["rows"]
    assert (why["item"], why["reason"], why["candidates"]) == (ambiguous, "ambiguous", 2)
    assert view["awaiting_decision"] == 1 and view["no_proposal_by_reason"] == {"ambiguous": 1}
    messages = [e.get("message", "") for e in run["eventConnection"]["events"]]
    assert any(f"item {merged}: replacement proposed" in m for m in messages)

    # The decision job's config is typed: the launchpad knows its fields.
    selector = {**repo, "pipelineName": "replacement_decision"}
    job = ui.query(CONFIG_SCHEMA, selector=selector)["pipelineOrError"]
    [handle] = job["solidHandles"]
    fields = {
        x["name"]: x for x in handle["solid"]["definition"]["configField"]["configType"]["fields"]
    }
    assert set(fields) == {"approve", "reject", "operator"}
    assert fields["operator"]["isRequired"] and not fields["approve"]["isRequired"]
    assert "Array.Int" in fields["approve"]["configTypeKey"]
    bad = {"ops": {"decide_replacement_proposals": {"config": {"approve": ["x"], "operator": "a"}}}}
    invalid = ui.query(VALID, selector=selector, config=bad)["isPipelineConfigValid"]
    assert invalid["__typename"] == "RunConfigValidationInvalid"
    assert any("approve" in e["message"] for e in invalid["errors"])

    # A decision the proposals do not allow fails in one line and changes nothing.
    refused = decision(ui, repo, {"approve": [row["proposal"] + 1000], "operator": "alice"})
    assert refused["status"] == "FAILURE"
    [failure] = [
        e["error"]["message"]
        for e in refused["eventConnection"]["events"]
        if e["__typename"] == "ExecutionStepFailureEvent"
    ]
    assert f"proposal {row['proposal'] + 1000} does not exist" in failure.splitlines()[0]
    assert rc.proposals(app, merged)[0]["state"] == "proposed"

    approved = decision(ui, repo, {"approve": [row["proposal"]], "operator": "alice"})
    assert approved["status"] == "SUCCESS"
    assert "alice" in approved["runConfigYaml"] and TMDB_TEST_KEY not in approved["runConfigYaml"]
    view = latest(ui, "replacement_proposals")
    assert view["run_id"] == approved["id"] and view["proposals"]["rows"][0]["state"] == "approved"

    # The daemon's observation sensor sees the approved replacement due at once, and its
    # run observes the item under the new id: the case resolves as replaced.
    def replaced() -> dict[str, Any] | None:
        return fetch_one(app, "SELECT * FROM identity_replacements WHERE item_id = %s", (merged,))

    published = ui.wait_for("the replacement's observation", replaced, 180)
    assert published["replacement_provider_id"] == "9603" and published["provider_id"] == "603"
    assert rc.case(app, merged)["recovery_resolved_at"] is not None
    assert rc.case(app, merged)["provider_id"] == "603"
