"""The Dagster path inside a harness run: the real daemon, started the way the product
starts it (its own process group, Postgres-backed instance storage, the project's
dagster.yaml), on the harness's scratch database. Its sensors plan and launch refresh
runs through Dagster's run queue alongside the harness's own workers.

The sensors whose product clocks do not fit a run of seconds are stopped in the
instance before the daemon starts (config.DAEMON_STOPPED_SENSORS).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from chaos.config import DAEMON_ENV, DAEMON_STOPPED_SENSORS
from inventory_pipeline.db import DatabaseError, connect, fetch_all, fetch_one
from inventory_pipeline.db.connection import (
    create_database,
    database_name,
    drop_database,
    url_with_database,
)
from inventory_pipeline.deployment import (
    DAEMON_COMMAND,
    dagster_storage_url,
    prepare_dagster_home,
    start_dagster,
    stop_dagster,
)
from inventory_pipeline.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
CODE = ("-m", "inventory_pipeline.definitions")
SENSOR_STOP_TIMEOUT_SECONDS = 120


class Daemon:
    def __init__(self, admin_url: str, app_url: str, standin_url: str, folder: Path) -> None:
        self.admin_url = admin_url
        self.database = f"{database_name(app_url)}_dagster"
        self.storage_url = url_with_database(admin_url, self.database)
        self.home = folder / "dagster_home"
        self.log = folder / "daemon.log"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "DAGSTER_HOME": str(self.home),
            "INVENTORY_DATABASE_URL": app_url,
            "INVENTORY_DAGSTER_STORAGE_URL": dagster_storage_url(self.storage_url),
            "INVENTORY_TMDB_BASE_URL": standin_url,
            **DAEMON_ENV,
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with connect(self.admin_url) as admin:
            create_database(admin, self.database)
        self.home.mkdir(parents=True)
        prepare_dagster_home(Settings.from_env({}), {"DAGSTER_HOME": str(self.home)})
        # One after the other: the first command creates Dagster's schema in the empty
        # storage database, and two creating it at once collide ("type event_logs
        # already exists").
        for name in DAEMON_STOPPED_SENSORS:
            stop = subprocess.run(
                [sys.executable, "-m", "dagster", "sensor", "stop", name, *CODE],
                cwd=ROOT,
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=SENSOR_STOP_TIMEOUT_SECONDS,
                check=False,
            )
            if stop.returncode != 0:
                raise RuntimeError(f"cannot stop a sensor: {stop.stderr.decode()[-400:]}")
        with self.log.open("ab") as log:
            self.process = start_dagster(
                [*DAEMON_COMMAND, "run", *CODE],
                self.env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def first_acknowledgement(self, app_url: str, timeout: float) -> float | None:
        """Wait until a Dagster run has acknowledged a profile request (the setup's
        inventory is dirty, nothing else processes it yet); seconds waited, or None."""
        started = time.monotonic()
        with connect(app_url, application_name="chaos.harness") as conn:
            while time.monotonic() - started < timeout and self.alive():
                row = fetch_one(
                    conn,
                    "SELECT EXISTS (SELECT 1 FROM chaos_profile_acks"
                    " WHERE actor NOT LIKE 'chaos.%') AS done",
                )
                if row is not None and row["done"]:
                    return time.monotonic() - started
                time.sleep(1.0)
        return None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def runs(self) -> Counter[str]:
        """Dagster runs by job and status, from the instance's run storage."""
        try:
            with connect(self.storage_url) as conn:
                rows = fetch_all(
                    conn,
                    "SELECT pipeline_name AS job, status, count(*) AS n FROM runs"
                    " GROUP BY pipeline_name, status",
                )
        except DatabaseError:
            return Counter()
        return Counter({f"{r['job']} {r['status']}": int(r["n"]) for r in rows})

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.process is not None:
            stop_dagster(self.process)
            self.process = None
        with connect(self.admin_url) as admin:
            drop_database(admin, self.database)
