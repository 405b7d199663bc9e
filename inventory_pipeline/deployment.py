"""Where the databases are: the embedded default or a configured server.

With no INVENTORY_DATABASE_URL, an embedded PostgreSQL runs from the data folder and
holds two databases (application and Dagster storage). With the URL, that server is
used and none is started. `provision` (for `dev` and `migrate`) creates both databases
and migrates the application one; `reach` (every other command) only checks that the
schema is current and says to run `inventory-pipeline migrate` when it is not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from inventory_pipeline.db import SchemaBehind, connect
from inventory_pipeline.db.connection import (
    create_database,
    database_exists,
    database_name,
    url_with_database,
    validate_url,
    with_keepalives,
)
from inventory_pipeline.db.embedded import EmbeddedServer
from inventory_pipeline.db.migrator import migrate, require_current
from inventory_pipeline.settings import Settings, SettingsError

# Dagster's processes, run with this interpreter (no reliance on console scripts on PATH).
DAEMON_COMMAND = (sys.executable, "-m", "dagster._daemon")
WEBSERVER_COMMAND = (sys.executable, "-m", "dagster_webserver")
# Creates (or upgrades) the instance storage's schema. It runs once before the webserver
# and the daemon start: two processes creating an empty storage's schema at once collide
# ("type job_ticks already exists").
INSTANCE_MIGRATE_COMMAND = (sys.executable, "-m", "dagster", "instance", "migrate")


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
# The repository's dagster.yaml, shipped inside the package (see pyproject.toml).
DAGSTER_YAML = "dagster.yaml"


def packaged(name: str) -> bytes:
    """A file the package ships (dagster.yaml, migrations/...)."""
    return resources.files("inventory_pipeline").joinpath(name).read_bytes()


@dataclass(frozen=True)
class Deployment:
    app_url: str
    dagster_url: str
    embedded_pid: int | None


def dagster_storage_url(url: str) -> str:
    """dagster-postgres must run on psycopg2 (with psycopg 3 beside SQLAlchemy 2.1 its
    event writes fail), so its URL names the driver explicitly; it carries the same
    bounds on a silent network as the pipeline's own connections (`with_keepalives`)."""
    for prefix in ("postgresql+psycopg2://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            plain = with_keepalives("postgresql://" + url[len(prefix) :])
            return "postgresql+psycopg2://" + plain[len("postgresql://") :]
    raise SettingsError(f"Dagster storage URL must be a PostgreSQL URL, got {url.split(':')[0]}:")


def ensure_database(admin_url: str, name: str) -> None:
    with connect(admin_url) as admin:
        if not database_exists(admin, name):
            create_database(admin, name)


@contextlib.contextmanager
def _server(settings: Settings) -> Iterator[tuple[str, str, int | None]]:
    """The admin URL, application URL and embedded server pid (None for a configured
    server) while the server is in use; an embedded one is let go of afterwards."""
    if settings.database_url is not None:
        yield settings.database_url, settings.database_url, None
        return
    server = EmbeddedServer(settings.data_dir / "pgdata")
    server.start()
    try:
        yield server.url("postgres"), server.url(APP_DATABASE), server.pid
    finally:
        server.stop()


def _dagster_url(settings: Settings, app_url: str, embedded: bool) -> tuple[str, str | None]:
    """Dagster's storage URL and the database to create for it (None when configured)."""
    if settings.dagster_storage_url is not None:
        validate_url(settings.dagster_storage_url.replace("+psycopg2", ""))
        return settings.dagster_storage_url, None
    name = DAGSTER_DATABASE if embedded else database_name(app_url) + "_dagster"
    return url_with_database(app_url, name), name


@contextlib.contextmanager
def provision(settings: Settings) -> Iterator[Deployment]:
    """Start (or reach) the server, create both databases, migrate the application one."""
    with _server(settings) as (admin_url, app_url, pid):
        if pid is not None:
            ensure_database(admin_url, APP_DATABASE)
        dagster_url, create = _dagster_url(settings, app_url, pid is not None)
        if create is not None:
            ensure_database(admin_url, create)
        with connect(app_url) as conn:
            migrate(conn)
        yield Deployment(app_url, dagster_storage_url(dagster_url), pid)


@contextlib.contextmanager
def reach(settings: Settings) -> Iterator[Deployment]:
    """Start (or reach) the server and check the schema is current; creates nothing."""
    with _server(settings) as (admin_url, app_url, pid):
        if pid is not None:
            with connect(admin_url) as admin:
                if not database_exists(admin, APP_DATABASE):
                    raise SchemaBehind(
                        "the embedded database is not set up; run `inventory-pipeline migrate`"
                    )
        with connect(app_url) as conn:
            require_current(conn)
        dagster_url, _ = _dagster_url(settings, app_url, pid is not None)
        yield Deployment(app_url, dagster_storage_url(dagster_url), pid)


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
        target.write_bytes(packaged(DAGSTER_YAML))
    return home.resolve()
