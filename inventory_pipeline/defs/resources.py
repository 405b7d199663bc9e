"""The database resource: the URL is read from the environment at run time, so it never
appears in run config or event logs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import dagster as dg

from inventory_pipeline.db import Connection, connect
from inventory_pipeline.profiles.models import RefreshPolicy
from inventory_pipeline.settings import DATABASE_URL, Settings


class InventoryDatabase(dg.ConfigurableResource):  # type: ignore[type-arg]
    """Connections to the application database, and the refresh policy."""

    url: str

    @contextlib.contextmanager
    def connection(self) -> Iterator[Connection]:
        with connect(self.url, application_name="inventory_pipeline.dagster") as conn:
            yield conn

    def policy(self) -> RefreshPolicy:
        return Settings.from_env().policy

    def max_runs_per_tick(self) -> int:
        return Settings.from_env().max_runs_per_tick


def inventory_database() -> InventoryDatabase:
    return InventoryDatabase(url=dg.EnvVar(DATABASE_URL))


IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


WAITING = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
]


def runs_waiting(instance: dg.DagsterInstance, job_name: str) -> int:
    """Runs of this job launched but not yet started: they hold no claim, so a backlog
    is served by launching only as many as could start."""
    return instance.get_runs_count(dg.RunsFilter(job_name=job_name, statuses=WAITING))


def run_in_flight(instance: dg.DagsterInstance, job_name: str) -> bool:
    """Is a run of this job queued or running? Only saves a redundant launch: the
    database decides what a run may do, so a second run would just find nothing."""
    records = instance.get_run_records(
        dg.RunsFilter(job_name=job_name, statuses=IN_FLIGHT), limit=1
    )
    return bool(records)
