"""Dagster's production topology, as deployed from deploy/: a code server, the webserver
and the daemon as three separate processes, each with its own DAGSTER_HOME (as on
separate hosts) and PostgreSQL instance storage. Only the code server imports the
definitions and knows the application database and the TMDb settings; the webserver
and the daemon reach it over gRPC through deploy/workspace.yaml. The code server
evaluates the sensor and starts the run; the database acknowledges the profile; the
webserver's GraphQL API shows the run as the UI reads it. The stats drain the sensor
keeps alive shares the work with a second worker host under one cap of active leases."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml

from chaos.servers import free_port
from inventory_pipeline import definitions
from inventory_pipeline.db import Connection, connect, fetch_all
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.defs import stats as stats_defs
from inventory_pipeline.deployment import (
    DAEMON_COMMAND,
    INSTANCE_MIGRATE_COMMAND,
    WEBSERVER_COMMAND,
    dagster_storage_url,
    start_dagster,
)
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.recovery.models import ProviderSettings
from inventory_pipeline.stats import runbook
from tests import factories as f
from tests import stats_factories as sf
from tests.conftest import TMDB_TEST_KEY

pytestmark = pytest.mark.daemon

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
QUEUE_TAG = "inventory_pipeline/queue"
CODE_SERVER_COMMAND = (sys.executable, "-m", "dagster", "code-server", "start")
LOCATION = "inventory_pipeline"


def queue_limits(path: Path) -> dict[str, int]:
    config = yaml.safe_load(path.read_text())
    limits = config["concurrency"]["runs"]["tag_concurrency_limits"]
    assert all(limit["key"] == QUEUE_TAG for limit in limits)
    return {limit["value"]: limit["limit"] for limit in limits}


def queue_tags() -> set[str]:
    """Every queue a run of the code location can be tagged with: job tags (sensor and
    schedule runs) and op tags (a launch of a job with other tags still queues there)."""
    defs = definitions.defs
    tags: set[str] = set()
    for job in defs.resolve_all_job_defs():
        if QUEUE_TAG in job.tags:
            tags.add(job.tags[QUEUE_TAG])
        for node in job.graph.node_defs:
            if QUEUE_TAG in node.tags:
                tags.add(node.tags[QUEUE_TAG])
    return tags


def test_deploy_instance_limits_every_queue_tag_as_the_dev_instance_does() -> None:
    tags = queue_tags()
    assert tags, "the code location tags no run with a queue"
    deployed = queue_limits(DEPLOY / "dagster.yaml")
    assert set(deployed) == tags
    assert deployed == queue_limits(ROOT / "dagster.yaml")
    # The stats sensor launches a second drain only up to the queue's limit.
    assert deployed["stats_drain"] == stats_defs.DRAINS_AT_ONCE


def test_deploy_workspace_points_only_at_a_grpc_code_server() -> None:
    workspace = yaml.safe_load((DEPLOY / "workspace.yaml").read_text())
    (entry,) = workspace["load_from"]
    assert set(entry) == {"grpc_server"}
    assert entry["grpc_server"] == {
        "host": {"env": "INVENTORY_CODE_SERVER_HOST"},
        "port": {"env": "INVENTORY_CODE_SERVER_PORT"},
        "location_name": LOCATION,
    }


def graphql(port: int, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
    """POST a query to the webserver's GraphQL endpoint, as the UI does."""
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        payload = json.loads(response.read())
    assert "errors" not in payload, payload
    return payload["data"]  # type: ignore[no-any-return]


LOCATION_QUERY = """
query {
  workspaceOrError {
    __typename
    ... on Workspace {
      locationEntries {
        name
        loadStatus
        locationOrLoadError { __typename }
      }
    }
  }
}
"""

RUNS_QUERY = """
query SensorRuns($filter: RunsFilter) {
  runsOrError(filter: $filter) {
    __typename
    ... on Runs {
      results {
        runId jobName status
        tags { key value }
        repositoryOrigin { repositoryLocationName }
      }
    }
  }
}
"""


class Topology:
    """Three Dagster processes, each in its own process group, logging to a file."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, command: list[str], env: dict[str, str]) -> None:
        # Run from the log folder: `python -m` puts the working directory first on the
        # path, and the repository's would make the pipeline importable to any process.
        with (self.logs / f"{name}.log").open("wb") as log:
            self.procs[name] = start_dagster(
                command, env, stdout=log, stderr=subprocess.STDOUT, cwd=self.logs
            )

    def tail(self) -> str:
        return "\n".join(
            f"--- {name}.log\n" + (self.logs / f"{name}.log").read_text(errors="replace")[-2500:]
            for name in self.procs
        )

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode}\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM every process group at once, wait, then SIGKILL what is left."""
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for(what: str, topology: Topology, probe: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        topology.check_alive()
        try:
            result = probe()
        except OSError:
            result = None
        if result:
            return result
        time.sleep(0.5)
    pytest.fail(f"{what} not seen within {timeout:.0f} s\n{topology.tail()}")


@pytest.fixture
def storage_url(server_url: str) -> Iterator[str]:
    """Dagster's instance storage: a second database on the application's server."""
    name = f"dagster_topology_{uuid.uuid4().hex[:10]}"
    with connect(server_url) as admin:
        create_database(admin, name)
    try:
        yield dagster_storage_url(url_with_database(server_url, name))
    finally:
        with connect(server_url) as admin:
            drop_database(admin, name)


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[Topology]:
    running = Topology(tmp_path)
    try:
        yield running
    finally:
        running.stop()


def dagster_home(root: Path, name: str) -> str:
    """A DAGSTER_HOME holding deploy/dagster.yaml, one per process as on its own host."""
    home = root / name
    home.mkdir()
    shutil.copyfile(DEPLOY / "dagster.yaml", home / "dagster.yaml")
    return str(home)


def unimportable_pipeline(root: Path) -> str:
    """A folder whose `inventory_pipeline` package fails on import, to put first on the
    path of a process that must not load the code location."""
    package = root / "unimportable" / "inventory_pipeline"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        'raise ImportError("only the code server imports inventory_pipeline")\n'
    )
    return str(package.parent)


def test_code_server_webserver_and_daemon_run_the_pipeline_as_separate_processes(
    db_url: str,
    storage_url: str,
    standin: StandIn,
    topology: Topology,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code_port, web_port = free_port(), free_port()
    # Nothing of the pipeline's configuration leaks in from the test's own environment.
    base = {k: v for k, v in os.environ.items() if not k.startswith(("INVENTORY_", "DAGSTER_"))}
    storage = {"INVENTORY_DAGSTER_STORAGE_URL": storage_url}
    code_env = {
        **base,
        **storage,
        "DAGSTER_HOME": dagster_home(tmp_path, "code_server_home"),
        "INVENTORY_DATABASE_URL": db_url,
        "INVENTORY_TMDB_BASE_URL": standin.url,
    }
    # The webserver and the daemon know the instance storage and where the code server
    # is; not the application database, the TMDb settings or the code: on their path
    # the pipeline's package refuses to be imported.
    control_env = {
        **base,
        **storage,
        "INVENTORY_CODE_SERVER_HOST": "127.0.0.1",
        "INVENTORY_CODE_SERVER_PORT": str(code_port),
        "PYTHONPATH": unimportable_pipeline(tmp_path),
    }
    workspace = ["-w", str(DEPLOY / "workspace.yaml")]

    started = time.monotonic()
    topology.start(
        "code_server",
        [
            *CODE_SERVER_COMMAND,
            *("-m", "inventory_pipeline.definitions"),
            *("-h", "127.0.0.1", "-p", str(code_port)),
            *("--location-name", LOCATION),
            # Runs start with this interpreter, not whichever `dagster` is on PATH.
            "--use-python-environment-entry-point",
        ],
        code_env,
    )
    # Deploy step, while the code server loads (it does not touch the instance storage):
    # create the instance's schema once, before the webserver and the daemon start (two
    # processes creating an empty storage's schema at once collide).
    migrated = subprocess.run(
        [*INSTANCE_MIGRATE_COMMAND],
        env={**control_env, "DAGSTER_HOME": dagster_home(tmp_path, "deploy_home")},
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    assert migrated.returncode == 0, migrated.stdout.decode() + migrated.stderr.decode()

    topology.start(
        "webserver",
        [*WEBSERVER_COMMAND, "-h", "127.0.0.1", "-p", str(web_port), *workspace],
        {**control_env, "DAGSTER_HOME": dagster_home(tmp_path, "webserver_home")},
    )

    def location_loaded() -> bool:
        data = graphql(web_port, LOCATION_QUERY)["workspaceOrError"]
        entries = {e["name"]: e for e in data.get("locationEntries", [])}
        entry = entries.get(LOCATION)
        return bool(
            entry
            and entry["loadStatus"] == "LOADED"
            and entry["locationOrLoadError"]["__typename"] == "RepositoryLocation"
        )

    # The webserver serves the location it loaded from the code server over gRPC.
    wait_for("the code location in the webserver", topology, location_loaded, timeout=120)
    topology.start(
        "daemon",
        [*DAEMON_COMMAND, "run", *workspace],
        {**control_env, "DAGSTER_HOME": dagster_home(tmp_path, "daemon_home")},
    )
    ready = time.monotonic() - started

    with connect(db_url) as conn:
        recovery.save_provider_settings(conn, ProviderSettings(TMDB_TEST_KEY, True, None))
        library = f.library(conn, f.server(conn), name="Topology")
        f.items(conn, library, 9)
        committed = time.monotonic()
        revision = f.revision(conn, library)

        # At least the committed revision: observing the items against TMDb may advance
        # the library again (observed languages feed the profile) while this waits.
        def acknowledged() -> bool:
            return bool(f.state(conn, library)["acknowledged_revision"] >= revision >= 1)

        wait_for("the acknowledged profile", topology, acknowledged, timeout=120)
        to_acknowledged = time.monotonic() - committed
        assert f.profile(conn, library) is not None

    # The run, as the UI sees it: launched by the sensor, started by the code server
    # (the default launcher asks the location's server), successful.
    sensor_runs = {
        "filter": {"tags": [{"key": "dagster/sensor_name", "value": "library_profile_sensor"}]}
    }

    def succeeded_run() -> dict[str, Any] | None:
        data = graphql(web_port, RUNS_QUERY, sensor_runs)["runsOrError"]
        assert data["__typename"] == "Runs", data
        done = [r for r in data["results"] if r["status"] == "SUCCESS"]
        return done[0] if done else None

    run = wait_for("a successful sensor run in GraphQL", topology, succeeded_run, timeout=60)
    assert run["jobName"] == "library_profile_refresh"
    tags = {t["key"]: t["value"] for t in run["tags"]}
    assert tags["inventory_pipeline/queue"] == "profile_refresh"
    assert run["repositoryOrigin"]["repositoryLocationName"] == LOCATION
    # The launcher records which gRPC server started the run (a tag hidden from GraphQL).
    monkeypatch.setenv("INVENTORY_DAGSTER_STORAGE_URL", storage_url)
    with dg.DagsterInstance.from_config(str(tmp_path / "webserver_home")) as instance:
        stored = instance.get_run_by_id(run["runId"])
    assert stored is not None
    grpc_info = json.loads(stored.tags[".dagster/grpc_info"])
    assert (grpc_info["host"], grpc_info["port"]) == ("127.0.0.1", code_port)
    topology.check_alive()
    split = stats_on_two_worker_hosts(db_url, topology, tmp_path, base)
    # The UI shows the sensor's drain still running, kept alive for the next save.
    drains = graphql(web_port, RUNS_QUERY, {"filter": {"pipelineName": "stats_drain"}})
    statuses = [r["status"] for r in drains["runsOrError"]["results"]]
    assert "STARTED" in statuses, statuses
    print(
        f"\ntopology: three processes ready in {ready:.1f} s; "
        f"commit to acknowledged profile {to_acknowledged:.1f} s; stats publications by "
        f"host with one lease allowed: {split}"
    )


LIVE_LEASES = """
SELECT count(*) AS n FROM user_stats_projection_runs
WHERE phase IN ('claimed', 'computed') AND lease_until > now() AND retry_not_before IS NULL
"""
PUBLISHED_BY = """
SELECT split_part(lock_owner, ':', 1) AS host,
       count(*) AS n
FROM user_stats_projection_runs WHERE phase = 'published' GROUP BY 1
"""


SECOND_HOST_WAITING = """
SELECT count(*) AS n FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'inventory_pipeline'
  AND state = 'idle' AND query NOT LIKE 'LISTEN%%'
"""


def second_host_waiting(conn: Connection) -> Any:
    return lambda: fetch_all(conn, SECOND_HOST_WAITING)[0]["n"] == 1


def stats_on_two_worker_hosts(
    db_url: str, topology: Topology, tmp_path: Path, base: dict[str, str]
) -> dict[str, int]:
    """The stats drain as deployed: the sensor's drain, kept alive on the code server's
    host, and a second worker host draining beside it (`stats drain --idle`, its own
    process and environment). The cap of active leases, set to 1, holds across them:
    sampled throughout, never two live leases; and both hosts publish."""
    users = [uuid.uuid4() for _ in range(120)]
    with connect(db_url) as conn:
        runbook.change_settings(conn, {"active_lease_cap": 1})
        sf.exercise(conn, "squat")
        sf.save(conn, users[0], date(2026, 3, 10), sf.sets(("squat", 100, 5)))

        def by_dagster() -> bool:
            return "dagster" in {r["host"]: r["n"] for r in fetch_all(conn, PUBLISHED_BY)}

        wait_for("a publication by the sensor's drain", topology, by_dagster, timeout=90)
        env = {**base, "INVENTORY_DATABASE_URL": db_url}
        with (tmp_path / "second_host.log").open("wb") as log:
            second = subprocess.Popen(
                [sys.executable, "-m", "inventory_pipeline.cli", "stats", "drain", "--idle", "5"],
                env=env,
                cwd=tmp_path,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            # The second host listens, looks once, and waits (its last statement is not
            # its LISTEN any more): from now on each save wakes both hosts.
            wait_for("the second host waiting", topology, second_host_waiting(conn), timeout=60)
            most = 0
            for index, user in enumerate(users[1:]):
                day = date(2026, 3, 1 + index % 28)
                sf.save(conn, user, day, sf.sets(("squat", 100, 5), ("squat", 90, 8)))
                most = max(most, fetch_all(conn, LIVE_LEASES)[0]["n"])

            def all_published() -> bool:
                nonlocal most
                most = max(most, fetch_all(conn, LIVE_LEASES)[0]["n"])
                return all(sf.versions(conn, u)[1] >= 1 for u in users)

            wait_for("every save published", topology, all_published, timeout=120)
            split = {r["host"]: int(r["n"]) for r in fetch_all(conn, PUBLISHED_BY)}
        finally:
            second.wait(timeout=60)
    assert second.returncode == 0, (tmp_path / "second_host.log").read_text()
    assert most == 1, f"{most} live leases with a cap of 1"
    assert set(split) == {"dagster", "cli"}, split
    return split
