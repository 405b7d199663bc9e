"""Where the databases are: the embedded default or a configured server.

With no INVENTORY_DATABASE_URL, an embedded PostgreSQL runs from the data folder and
holds two databases (application and Dagster storage). With the URL, that server is
used and none is started. Either way the application database is migrated and the
Dagster storage database exists before Dagster starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from inventory_pipeline.db import connect
from inventory_pipeline.db.connection import (
    create_database,
    database_exists,
    database_name,
    url_with_database,
    validate_url,
)
from inventory_pipeline.db.embedded import EmbeddedServer
from inventory_pipeline.db.migrator import migrate
from inventory_pipeline.settings import Settings, SettingsError

# Dagster's processes, run with this interpreter (no reliance on console scripts on PATH).
DAEMON_COMMAND = (sys.executable, "-m", "dagster._daemon")
WEBSERVER_COMMAND = (sys.executable, "-m", "dagster_webserver")


def start_dagster(
    command: list[str], env: dict[str, str], **popen: object
) -> subprocess.Popen[bytes]:
    """Start a Dagster process in its own process group: the code servers it spawns
    outlive a SIGTERM to it, so stopping means stopping the whole group."""
    return subprocess.Popen(command, env=env, start_new_session=True, **popen)  # type: ignore[call-overload, no-any-return]


def stop_dagster(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left of it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


APP_DATABASE = "inventory"
DAGSTER_DATABASE = "inventory_dagster"
DAGSTER_YAML = Path(__file__).resolve().parents[1] / "dagster.yaml"


@dataclass(frozen=True)
class Deployment:
    app_url: str
    dagster_url: str
    embedded_pid: int | None


def dagster_storage_url(url: str) -> str:
    """dagster-postgres must run on psycopg2 (with psycopg 3 beside SQLAlchemy 2.1 its
    event writes fail), so its URL names the driver explicitly."""
    for prefix in ("postgresql+psycopg2://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg2://" + url[len(prefix) :]
    raise SettingsError(f"Dagster storage URL must be a PostgreSQL URL, got {url.split(':')[0]}:")


def ensure_database(admin_url: str, name: str) -> None:
    with connect(admin_url) as admin:
        if not database_exists(admin, name):
            create_database(admin, name)


@contextlib.contextmanager
def provision(settings: Settings) -> Iterator[Deployment]:
    """Start (or reach) the server, create both databases, migrate the application one."""
    server: EmbeddedServer | None = None
    if settings.database_url is None:
        server = EmbeddedServer(settings.data_dir / "pgdata")
        server.start()
        admin_url = server.url("postgres")
        app_url = server.url(APP_DATABASE)
        ensure_database(admin_url, APP_DATABASE)
    else:
        app_url = settings.database_url
        admin_url = app_url
    try:
        if settings.dagster_storage_url is not None:
            validate_url(settings.dagster_storage_url.replace("+psycopg2", ""))
            dagster_url = settings.dagster_storage_url
        else:
            name = DAGSTER_DATABASE if server else database_name(app_url) + "_dagster"
            ensure_database(admin_url, name)
            dagster_url = url_with_database(app_url, name)
        with connect(app_url) as conn:
            migrate(conn)
        yield Deployment(app_url, dagster_storage_url(dagster_url), server.pid if server else None)
    finally:
        if server is not None:
            server.stop()


def prepare_dagster_home(settings: Settings, env: dict[str, str] | None = None) -> Path:
    """DAGSTER_HOME if set (it must exist), else a folder in the data folder; it gets the
    project's dagster.yaml unless it has its own."""
    env = dict(os.environ) if env is None else env
    configured = env.get("DAGSTER_HOME")
    if configured:
        home = Path(configured)
        if not home.is_dir():
            raise SettingsError(f"DAGSTER_HOME {home} does not exist or is not a folder")
    else:
        home = settings.data_dir / "dagster_home"
        home.mkdir(parents=True, exist_ok=True)
    target = home / "dagster.yaml"
    if not configured or not target.exists():
        shutil.copyfile(DAGSTER_YAML, target)
    return home.resolve()
