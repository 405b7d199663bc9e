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

from inventory_pipeline.db import connect, execute, fetch_one
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.defs import profile_ranges as ranges
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
                if done >= {ranges.partition_of(lib) for lib in libs}:
                    break
                time.sleep(1)
            assert done >= {ranges.partition_of(lib) for lib in libs}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# 400 keep CI short and are already far beyond what one run can process inside a lease
# here; INVENTORY_TEST_BACKLOG_LIBRARIES=3000 is the full-size run.
BACKLOG_LIBRARIES = int(os.environ.get("INVENTORY_TEST_BACKLOG_LIBRARIES", "400"))


def test_backlog_larger_than_run_capacity_spends_no_attempt_on_expired_leases(
    db_url: str, dagster_env: dict[str, str], tmp_path: Path
) -> None:
    """A backlog of dirty libraries, one refresh run at a time and short leases: runs wait in
    Dagster's queue far longer than a lease, yet no request loses an attempt to a lease
    that ran out before its work began, and every library is acknowledged."""
    home = Path(dagster_env["DAGSTER_HOME"])
    yaml = (home / "dagster.yaml").read_text()
    single = yaml.replace(
        "value: profile_refresh\n        limit: 2", "value: profile_refresh\n        limit: 1"
    )
    assert single != yaml
    (home / "dagster.yaml").write_text(single)
    env = {**dagster_env, "INVENTORY_LEASE_SECONDS": "10"}
    with connect(db_url) as conn:
        srv = f.server(conn, "backlog")
        execute(
            conn,
            "INSERT INTO libraries (server_id, name, media_kind)"
            " SELECT %(srv)s, 'lib ' || n, 'movie' FROM generate_series(1, %(n)s) AS n",
            {"srv": srv, "n": BACKLOG_LIBRARIES},
        )
        execute(
            conn,
            "INSERT INTO media_server_items (library_id, title, year, provider,"
            " provider_kind, provider_id, rating, genres, primary_studio, original_language)"
            " SELECT l.id, 'Title ' || i, 1950 + i, 'tmdb', 'movie', (l.id * 10 + i)::text,"
            " i % 10, ARRAY['Drama', 'Comedy'], 'A24', 'en'"
            " FROM libraries l CROSS JOIN generate_series(1, 6) AS i",
        )
    log_path = tmp_path / "daemon.log"
    with log_path.open("wb") as log:
        proc = start_dagster(
            [*DAEMON_COMMAND, "run", "-m", "inventory_pipeline.definitions"],
            env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            with connect(db_url) as conn:
                deadline = time.monotonic() + 900
                while time.monotonic() < deadline:
                    execute(conn, "SELECT fold_inventory_changes()")
                    row = fetch_one(
                        conn,
                        "SELECT count(*) FILTER (WHERE revision > acknowledged_revision) AS dirty,"
                        " (SELECT count(*) FROM profile_refresh_requests"
                        "  WHERE attempts > 1 OR last_error IS NOT NULL) AS burned"
                        " FROM library_inventory_state",
                    )
                    assert row is not None
                    assert row["burned"] == 0, "an attempt was spent on an expired lease"
                    if row["dirty"] == 0:
                        break
                    assert proc.poll() is None, log_path.read_text()[-3000:]
                    time.sleep(2)
                else:
                    pytest.fail(
                        "backlog not acknowledged in time:\n" + log_path.read_text()[-3000:]
                    )
                done = fetch_one(
                    conn,
                    "SELECT count(*) AS n, max(attempts) AS attempts FROM profile_refresh_requests"
                    " WHERE status = 'succeeded'",
                )
                assert done is not None
                assert (done["n"], done["attempts"]) == (BACKLOG_LIBRARIES, 1)
        finally:
            stop_dagster(proc)
