"""The Dagster path inside a harness run: the real daemon, started the way the product
starts it (its own process group, Postgres-backed instance storage, the project's
dagster.yaml), on the harness's scratch database. Its sensors plan and launch refresh
runs through Dagster's run queue alongside the harness's own workers.

The sensors whose product clocks do not fit a run of seconds are stopped in the
instance before the daemon starts (config.DAEMON_STOPPED_SENSORS).

Dagster must do its share: `share` counts what its runs did in the application
database, `failed_runs` lists its failed runs with their error from the run storage,
and `dagster_divergences` judges both (a share under its minimum, a run that failed
outside every injected fault). Nothing here imports Dagster: its storage is read with
SQL.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from chaos.config import (
    DAEMON_ENV,
    DAEMON_STOPPED_SENSORS,
    DAGSTER_FAULT_MARGIN_SECONDS,
    DAGSTER_MIN_SHARE,
)
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

# What `Daemon.share` counts. Sessions of the harness are named chaos.<role>.<pid>,
# Dagster's runs keep the product's names (inventory_pipeline.*).
ACKS = "profile acknowledgements"
PUBLICATIONS = "stats publications"
REVALIDATIONS = "revalidation checks"
SHARE_KINDS = (ACKS, PUBLICATIONS, REVALIDATIONS)
HARNESS_ACTOR = "chaos.%"
BY_DAGSTER = (
    "SELECT (SELECT count(*) FROM chaos_profile_acks WHERE actor NOT LIKE %(harness)s) AS acks,"
    " (SELECT count(*) FROM chaos_stats_publications WHERE actor NOT LIKE %(harness)s)"
    "   AS publications"
)
# A revalidation run's recorded checks, from the materializations of its asset (the
# application database keeps no writer of a revalidation record): each metadata count
# of a check written down (a proposal, no proposal, a fault).
REVALIDATION_JOB = "identity_revalidation"
PROPOSALS_KEY = json.dumps(["replacement_proposals"])
RECORDED_CHECKS = ("proposed", "unproposed", "faults")
MATERIALIZATIONS = (
    "SELECT e.event FROM event_logs e JOIN runs r ON r.run_id = e.run_id"
    " WHERE e.dagster_event_type = 'ASSET_MATERIALIZATION' AND e.asset_key = %(key)s"
    " AND r.pipeline_name = %(job)s"
)
# Failed runs with the failure events of their event log (a run's failure is stored
# under its legacy name, PIPELINE_FAILURE) and their time span in epoch seconds: from
# RUN_START to the failure, else from its creation to its last update (timestamps
# Dagster stores naive, in UTC).
FAILURE_EVENTS = ("PIPELINE_FAILURE", "RUN_FAILURE", "STEP_FAILURE")
FAILED_RUNS = (
    "SELECT r.run_id, r.pipeline_name AS job,"
    " coalesce(r.start_time, extract(epoch FROM r.create_timestamp AT TIME ZONE 'UTC'))::float8"
    "   AS started,"
    " coalesce(r.end_time, extract(epoch FROM r.update_timestamp AT TIME ZONE 'UTC'))::float8"
    "   AS ended,"
    " (SELECT e.event FROM event_logs e WHERE e.run_id = r.run_id"
    "   AND e.dagster_event_type = ANY(%(events)s)"
    "   ORDER BY e.dagster_event_type = 'STEP_FAILURE' DESC, e.id LIMIT 1) AS event"
    " FROM runs r WHERE r.status = 'FAILURE' ORDER BY started, r.run_id"
)
ERROR_CHARS = 300
# `failed_run_line`'s span, read back by `run_span`.
SPAN = re.compile(r"\(epoch (?P<start>[0-9.]+)-(?P<end>[0-9.]+)\)")


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
        """Wait until Dagster runs have acknowledged a profile request and published
        stats (the setup's inventory is dirty and its sessions wait for stats; nothing
        else processes them yet, and once the harness's workers start, its stats
        workers claim every job before a drain run starts); seconds waited, or None."""
        started = time.monotonic()
        with connect(app_url, application_name="chaos.harness") as conn:
            while time.monotonic() - started < timeout and self.alive():
                row = fetch_one(conn, BY_DAGSTER, {"harness": HARNESS_ACTOR})
                if row is not None and row["acks"] and row["publications"]:
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

    def failed_runs(self) -> list[str]:
        """Each Dagster run that failed, one line apiece (`failed_run_line`): its job,
        run id, time span and the error its event log gives. Unreadable run storage is
        one line without a span, so the check fails rather than sees nothing."""
        try:
            with connect(self.storage_url) as conn:
                rows = fetch_all(conn, FAILED_RUNS, {"events": list(FAILURE_EVENTS)})
        except DatabaseError as exc:
            return [f"run storage unreadable: {type(exc).__name__}: {first_line(str(exc))}"]
        return [
            failed_run_line(
                r["job"],
                r["run_id"],
                r["started"],
                r["ended"],
                "no failure event recorded" if r["event"] is None else event_error(r["event"]),
            )
            for r in rows
        ]

    def share(self, app_url: str) -> dict[str, int]:
        """What Dagster's runs did (SHARE_KINDS): profile requests acknowledged and stats
        published by a session that is not the harness's (the audit trail's actor), and
        revalidation checks its runs recorded. Empty when a database cannot be read,
        which fails every minimum."""
        try:
            with connect(app_url, application_name="chaos.harness") as conn:
                row = fetch_one(conn, BY_DAGSTER, {"harness": HARNESS_ACTOR})
            with connect(self.storage_url) as conn:
                events = fetch_all(
                    conn, MATERIALIZATIONS, {"key": PROPOSALS_KEY, "job": REVALIDATION_JOB}
                )
        except DatabaseError:
            return {}
        assert row is not None
        return {
            ACKS: int(row["acks"]),
            PUBLICATIONS: int(row["publications"]),
            REVALIDATIONS: sum(
                sum(materialization_counts(e["event"], RECORDED_CHECKS).values()) for e in events
            ),
        }

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.process is not None:
            stop_dagster(self.process)
            self.process = None
        with connect(self.admin_url) as admin:
            drop_database(admin, self.database)


def first_line(text: str, limit: int = ERROR_CHARS) -> str:
    """The first non-blank line of `text`, at most `limit` characters."""
    line = next((x.strip() for x in text.splitlines() if x.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def event_error(event: str) -> str:
    """The error of a serialized failure event: the innermost cause of its error (an
    op's exception arrives wrapped in Dagster's step error), else the event's message."""
    try:
        entry = json.loads(event)
    except ValueError:
        return "unreadable failure event"
    dagster_event = entry.get("dagster_event") or {}
    error = (dagster_event.get("event_specific_data") or {}).get("error")
    while isinstance(error, dict) and isinstance(error.get("cause"), dict):
        error = error["cause"]
    if isinstance(error, dict) and error.get("message"):
        return first_line(str(error["message"]))
    return first_line(str(dagster_event.get("message") or entry.get("user_message") or "")) or (
        "a failure event without a message"
    )


def materialization_counts(event: str, labels: tuple[str, ...]) -> dict[str, int]:
    """The integer metadata of a serialized materialization event under `labels`
    (Dagster writes a materialization's metadata as labelled entries; a newer writer
    may use a mapping)."""
    try:
        entry = json.loads(event)
    except ValueError:
        return {}
    data = (entry.get("dagster_event") or {}).get("event_specific_data") or {}
    materialization = data.get("materialization") or {}
    values: dict[str, Any] = {
        str(e.get("label")): (e.get("entry_data") or {}).get("value")
        for e in materialization.get("metadata_entries") or []
        if isinstance(e, dict)
    }
    for label, value in (materialization.get("metadata") or {}).items():
        values[label] = value.get("value") if isinstance(value, dict) else value
    return {
        label: int(values[label])
        for label in labels
        if isinstance(values.get(label), int) and not isinstance(values.get(label), bool)
    }


def _clock(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%H:%M:%S.%f")[:-5]


def failed_run_line(job: str, run_id: str, started: float, ended: float, error: str) -> str:
    """One failed run: `job run <id, 8 chars> failed HH:MM:SS.s-HH:MM:SS.s UTC (epoch
    S-E): error`, the span readable by people and by `run_span`."""
    return (
        f"{job} run {run_id[:8]} failed {_clock(started)}-{_clock(ended)} UTC"
        f" (epoch {started:.1f}-{ended:.1f}): {error}"
    )


def run_span(line: str) -> tuple[float, float] | None:
    """The epoch span of a `failed_run_line`; None when the line has none."""
    match = SPAN.search(line)
    return None if match is None else (float(match["start"]), float(match["end"]))


def dagster_divergences(
    share: Mapping[str, int],
    failed: list[str],
    faults: list[tuple[str, float, float]],
    minimums: Mapping[str, int] = DAGSTER_MIN_SHARE,
    margin: float = DAGSTER_FAULT_MARGIN_SECONDS,
) -> list[str]:
    """Dagster did its share: each count of `share` at least its minimum (a missing
    count is 0), and each failed run (`failed_run_line`) inside an injected fault,
    its span overlapping a fault window (kind, start, end in epoch seconds) widened by
    `margin` on each side. One line per violation."""
    out = [
        f"Dagster: {share.get(kind, 0)} {kind} by Dagster runs (minimum {least})"
        for kind, least in minimums.items()
        if share.get(kind, 0) < least
    ]
    for line in failed:
        span = run_span(line)
        if span is None or not any(
            span[0] <= end + margin and span[1] >= start - margin for _, start, end in faults
        ):
            out.append(f"Dagster run failed outside any injected fault: {line}")
    return out
