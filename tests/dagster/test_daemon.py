"""The real thing: Dagster's daemon and code location in subprocesses on
Postgres-backed instance storage. An inventory change is committed and the acknowledged
profile appears with no manual step."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from inventory_pipeline.db import connect
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.deployment import (
    DAEMON_COMMAND,
    dagster_storage_url,
    prepare_dagster_home,
    start_dagster,
    stop_dagster,
)
from inventory_pipeline.settings import Settings
from tests import factories as f

pytestmark = pytest.mark.daemon


@pytest.fixture
def dagster_env(server_url: str, db_url: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    name = f"dagster_{uuid.uuid4().hex[:10]}"
    with connect(server_url) as admin:
        create_database(admin, name)
    home = tmp_path / "dagster_home"
    home.mkdir()
    prepare_dagster_home(Settings.from_env({}), {"DAGSTER_HOME": str(home)})
    env = dict(os.environ)
    env.update(
        {
            "DAGSTER_HOME": str(home),
            "INVENTORY_DATABASE_URL": db_url,
            "INVENTORY_DAGSTER_STORAGE_URL": dagster_storage_url(
                url_with_database(server_url, name)
            ),
        }
    )
    try:
        yield env
    finally:
        with connect(server_url) as admin:
            drop_database(admin, name)


@pytest.fixture
def daemon(dagster_env: dict[str, str], tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    log = (tmp_path / "daemon.log").open("wb")
    proc = start_dagster(
        [*DAEMON_COMMAND, "run", "-m", "inventory_pipeline.definitions"],
        dagster_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        stop_dagster(proc)
        log.close()


def test_committed_change_is_acknowledged_by_the_daemon(
    db_url: str,
    dagster_env: dict[str, str],
    daemon: subprocess.Popen[bytes],
    tmp_path: Path,
) -> None:
    with connect(db_url) as conn:
        srv = f.server(conn)
        libs = [f.library(conn, srv, name=str(i)) for i in range(3)]
        for lib in libs:
            f.items(conn, lib, 9)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            states = [f.state(conn, lib) for lib in libs]
            if all(s["acknowledged_revision"] == s["revision"] == 1 for s in states):
                break
            assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()[-3000:]
            time.sleep(1)
        else:
            log = (tmp_path / "daemon.log").read_text()[-3000:]
            pytest.fail("not acknowledged in time:\n" + log)
        assert all(f.profile(conn, lib) is not None for lib in libs)

    # Dagster saw it as partition materializations of library_profile.
    saved = {k: os.environ.get(k) for k in dagster_env}
    os.environ.update(dagster_env)
    try:
        with dg.DagsterInstance.get() as instance:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                done = instance.get_materialized_partitions(dg.AssetKey("library_profile"))
                if done >= {str(lib) for lib in libs}:
                    break
                time.sleep(1)
            assert done >= {str(lib) for lib in libs}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
