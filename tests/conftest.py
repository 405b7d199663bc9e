"""Test databases: one migrated template per session, a fresh clone per test.

The server is `INVENTORY_TEST_DATABASE_URL` (any database on it; CI points it at the
machine's PostgreSQL 15) or, when unset, an embedded PostgreSQL 18 started for the
session. Clones (`CREATE DATABASE ... TEMPLATE`) keep tests that commit, race
connections or launch Dagster runs isolated from each other.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from inventory_pipeline.db import Connection, connect
from inventory_pipeline.db.connection import (
    create_database,
    drop_database,
    url_with_database,
)
from inventory_pipeline.db.migrator import migrate
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient

TEST_URL_ENV = "INVENTORY_TEST_DATABASE_URL"
TMDB_TEST_KEY = "tmdb-test-key-5f3c9a1e"


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """A maintenance URL (database `postgres`) of the server the tests use."""
    configured = os.environ.get(TEST_URL_ENV)
    if configured:
        yield url_with_database(configured, "postgres")
        return
    from inventory_pipeline.db.embedded import EmbeddedServer

    # Its own folder, not pytest's basetemp: concurrent pytest sessions prune each
    # other's basetemp folders, which would pull the data folder from under the server.
    folder = Path(tempfile.mkdtemp(prefix="inventory-test-pg-"))
    server = EmbeddedServer(folder / "pgdata")
    server.start()
    try:
        yield server.url("postgres")
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def template_name(server_url: str) -> Iterator[str]:
    name = f"inventory_tmpl_{os.getpid()}"
    with connect(server_url) as admin:
        drop_database(admin, name)
        create_database(admin, name)
    with connect(url_with_database(server_url, name)) as conn:
        migrate(conn)
    yield name
    with connect(server_url) as admin:
        drop_database(admin, name)


@pytest.fixture
def db_url(server_url: str, template_name: str) -> Iterator[str]:
    name = f"inventory_test_{uuid.uuid4().hex[:12]}"
    with connect(server_url) as admin:
        create_database(admin, name, template=template_name)
    try:
        yield url_with_database(server_url, name)
    finally:
        with connect(server_url) as admin:
            drop_database(admin, name)
            drop_database(admin, f"{name}_dagster")  # made by the CLI's provisioning


@pytest.fixture
def conn(db_url: str) -> Iterator[Connection]:
    with connect(db_url) as connection:
        yield connection


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


@pytest.fixture
def standin() -> Iterator[StandIn]:
    """A TMDb stand-in on loopback with the test key."""
    with StandIn(api_key=TMDB_TEST_KEY) as server:
        yield server


@pytest.fixture
def client(standin: StandIn) -> Iterator[TmdbClient]:
    """A TMDb client on the stand-in: one-second deadline, 64 KiB body limit."""
    with TmdbClient(standin.url, timeout_seconds=1.0, max_body_bytes=64 * 1024) as c:
        yield c
