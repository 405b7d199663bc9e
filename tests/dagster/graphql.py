"""A real Dagster webserver and daemon on PostgreSQL-backed instance storage, and the
GraphQL queries the UI sends to it."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from chaos.servers import free_port
from inventory_pipeline.db import connect
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.deployment import (
    DAEMON_COMMAND,
    WEBSERVER_COMMAND,
    dagster_storage_url,
    prepare_dagster_home,
    start_dagster,
    stop_dagster,
)
from inventory_pipeline.settings import Settings

T = TypeVar("T")
MODULE = "inventory_pipeline.definitions"


class GraphQLError(AssertionError):
    pass


@dataclass
class Dagster:
    """The processes of one Dagster deployment and how to reach them."""

    url: str
    app_url: str
    env: dict[str, str]
    logs: Path
    processes: list[subprocess.Popen[bytes]]

    def query(self, text: str, **variables: Any) -> dict[str, Any]:
        body = json.dumps({"query": text, "variables": variables}).encode()
        request = urllib.request.Request(
            f"{self.url}/graphql", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        if answer.get("errors"):
            raise GraphQLError(json.dumps(answer["errors"])[:2000])
        data: dict[str, Any] = answer["data"]
        return data

    def log_tail(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.logs.glob("*.log"))
        )

    def wait_for(self, what: str, probe: Callable[[], T | None], timeout: float = 120) -> T:
        deadline = time.monotonic() + timeout
        while True:
            for proc in self.processes:
                assert proc.poll() is None, f"a Dagster process exited\n{self.log_tail()}"
            value = probe()
            if value is not None and value is not False:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.log_tail()}")
            time.sleep(0.5)

    def start_daemon(self) -> None:
        """Start the daemon once. Its backfill loop runs every 30 s, first at start: a
        backfill launched before it starts is submitted at once."""
        if len(self.processes) > 1:
            return
        with (self.logs / "daemon.log").open("wb") as daemon_log:
            self.processes.append(
                start_dagster(
                    [*DAEMON_COMMAND, "run", "-m", MODULE],
                    self.env,
                    stdout=daemon_log,
                    stderr=subprocess.STDOUT,
                )
            )

    def repository(self) -> dict[str, str]:
        data = self.query(WORKSPACE)
        [entry] = data["workspaceOrError"]["locationEntries"]
        [repo] = entry["locationOrLoadError"]["repositories"]
        return {"repositoryLocationName": entry["name"], "repositoryName": repo["name"]}


def _serves(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/server_info", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def running_dagster(server_url: str, template: str, folder: Path) -> Iterator[Dagster]:
    """Application and storage databases of their own and a webserver on a free
    loopback port (the daemon when asked), all stopped and dropped afterwards."""
    suffix = uuid.uuid4().hex[:10]
    app, storage = f"inventory_ui_{suffix}", f"dagster_ui_{suffix}"
    with connect(server_url) as admin:
        create_database(admin, app, template=template)
        create_database(admin, storage)
    home = folder / "dagster_home"
    home.mkdir(parents=True)
    prepare_dagster_home(Settings.from_env({}), {"DAGSTER_HOME": str(home)})
    app_url = url_with_database(server_url, app)
    env = dict(os.environ)
    env.update(
        {
            "DAGSTER_HOME": str(home),
            "INVENTORY_DATABASE_URL": app_url,
            "INVENTORY_DAGSTER_STORAGE_URL": dagster_storage_url(
                url_with_database(server_url, storage)
            ),
        }
    )
    port = free_port()
    processes: list[subprocess.Popen[bytes]] = []
    dagster = Dagster(f"http://127.0.0.1:{port}", app_url, env, folder, processes)
    try:
        with (folder / "webserver.log").open("wb") as web_log:
            processes.append(
                start_dagster(
                    [*WEBSERVER_COMMAND, "-h", "127.0.0.1", "-p", str(port), "-m", MODULE],
                    env,
                    stdout=web_log,
                    stderr=subprocess.STDOUT,
                )
            )
        dagster.wait_for("the webserver", lambda: _serves(dagster.url))
        yield dagster
    finally:
        for proc in reversed(processes):
            # Nothing here needs a graceful stop: the group is killed after 5 s.
            stop_dagster(proc, timeout=5)
        with connect(server_url) as admin:
            drop_database(admin, app)
            drop_database(admin, storage)


WORKSPACE = """
query {
  workspaceOrError {
    ... on Workspace {
      locationEntries {
        name
        locationOrLoadError { ... on RepositoryLocation { repositories { name } } }
      }
    }
  }
}
"""

SENSOR = """
query ($selector: SensorSelector!) {
  sensorOrError(sensorSelector: $selector) {
    __typename
    ... on Sensor {
      sensorState {
        id
        status
        ticks(limit: 20) { status timestamp skipReason error { message } }
      }
    }
  }
}
"""

# A sensor's ticks with their logs: what the tick history shows for each.
SENSOR_TICK_LOGS = """
query ($selector: SensorSelector!) {
  sensorOrError(sensorSelector: $selector) {
    ... on Sensor {
      sensorState {
        ticks(limit: 20) { status timestamp logEvents { events { level message } } }
      }
    }
  }
}
"""

STOP_SENSOR = """
mutation ($id: String!) {
  stopSensor(id: $id) { __typename ... on PythonError { message } }
}
"""

START_SENSOR = """
mutation ($selector: SensorSelector!) {
  startSensor(sensorSelector: $selector) { __typename ... on PythonError { message } }
}
"""

SENSOR_DRY_RUN = """
mutation ($selector: SensorSelector!, $cursor: String) {
  sensorDryRun(selectorData: $selector, cursor: $cursor) {
    __typename
    ... on DryRunInstigationTick {
      evaluationResult {
        skipReason
        error { message }
        runRequests { runKey tags { key value } }
        dynamicPartitionsRequests { partitionKeys partitionsDefName type }
      }
    }
    ... on PythonError { message }
  }
}
"""

ADD_PARTITION = """
mutation ($key: String!, $name: String!, $repo: RepositorySelector!) {
  addDynamicPartition(partitionKey: $key, partitionsDefName: $name, repositorySelector: $repo) {
    __typename
    ... on PythonError { message }
  }
}
"""

LAUNCH_BACKFILL = """
mutation ($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message }
  }
}
"""

BACKFILL = """
query ($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    ... on PartitionBackfill { status runs { status } }
  }
}
"""

ASSET = """
query ($key: AssetKeyInput!, $partition: String!, $limit: Int = 1) {
  assetNodes(assetKeys: [$key]) {
    partitionKeysByDimension { partitionKeys }
    assetPartitionStatuses {
      ... on DefaultPartitionStatuses {
        materializedPartitions failedPartitions unmaterializedPartitions materializingPartitions
      }
    }
    assetChecksOrError {
      ... on AssetChecks {
        checks {
          name
          partitionStatuses {
            ... on AssetCheckDefaultPartitionStatuses {
              succeededPartitions failedPartitions inProgressPartitions
              skippedPartitions executionFailedPartitions
            }
          }
        }
      }
    }
  }
  assetOrError(assetKey: $key) {
    ... on Asset {
      assetMaterializations(partitions: [$partition], limit: $limit) {
        partition
        description
        metadataEntries {
          label
          __typename
          ... on TextMetadataEntry { text }
          ... on IntMetadataEntry { intValue }
          ... on JsonMetadataEntry { jsonString }
          ... on TableMetadataEntry { table { records schema { columns { name } } } }
        }
      }
    }
  }
}
"""
