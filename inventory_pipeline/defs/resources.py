"""Settings as resources, read when a run or tick starts and bound in `definitions.py`.

The code location binds resources that read the environment when a run or tick
initializes them (`bound_resources`): a value never appears in run config, the
Launchpad or event logs, and a variable that is unset keeps the field's default. A bad
value fails the run or tick with one line naming the variable (`dg.Failure`). Tests
and tools build `InventoryDatabase` and `TmdbResource` directly with the values they
want.

Settings shared by every process and changed at runtime (the TMDb key and language, the
stats worker's budgets, admission state) live in the database, not here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, fields

import dagster as dg

# Public in Dagster only as a field of AssetCheckEvaluation: the type has no top-level export.
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)

from inventory_pipeline.db import Connection, InvalidDatabaseUrl, connect
from inventory_pipeline.profiles.models import RefreshPolicy
from inventory_pipeline.settings import (
    DATABASE_URL,
    DEFAULT_MAX_RUNS_PER_TICK,
    MAX_RUNS_PER_TICK,
    SettingsError,
    TmdbSettings,
    checked_policy,
    checked_positive,
    checked_tmdb,
    database_url_from_env,
    max_runs_from_env,
    policy_from_env,
    tmdb_from_env,
)

_POLICY_DEFAULTS = RefreshPolicy()
# The run tag that dagster.yaml's `tag_concurrency_limits` key on: every job and op of a
# capability carries it, valued with that capability's queue name.
QUEUE_TAG = "inventory_pipeline/queue"


class InventoryDatabase(dg.ConfigurableResource):  # type: ignore[type-arg]
    """Connections to the application database, and the refresh policy (each field a
    `RefreshPolicy` field of the same name)."""

    url: str
    lease_seconds: int = _POLICY_DEFAULTS.lease_seconds
    retry_seconds: int = _POLICY_DEFAULTS.retry_seconds
    circuit_probe_seconds: int = _POLICY_DEFAULTS.circuit_probe_seconds
    native_max_age_seconds: int = _POLICY_DEFAULTS.native_max_age_seconds
    planner_passes: int = _POLICY_DEFAULTS.planner_passes
    run_claims: int = _POLICY_DEFAULTS.run_claims
    retention_days: int = _POLICY_DEFAULTS.retention_days
    compaction_batch: int = _POLICY_DEFAULTS.compaction_batch
    stall_seconds: int = _POLICY_DEFAULTS.stall_seconds
    runs_per_tick: int = DEFAULT_MAX_RUNS_PER_TICK

    @contextlib.contextmanager
    def connection(
        self, application_name: str = "inventory_pipeline.dagster"
    ) -> Iterator[Connection]:
        with connect(self.url, application_name=application_name) as conn:
            yield conn

    def policy(self) -> RefreshPolicy:
        """The refresh policy; an invalid value fails the run or tick in one line."""
        values = {f.name: getattr(self, f.name) for f in fields(RefreshPolicy)}
        try:
            return checked_policy(values)
        except SettingsError as exc:
            raise dg.Failure(str(exc)) from None

    def max_runs_per_tick(self) -> int:
        try:
            return checked_positive(MAX_RUNS_PER_TICK, self.runs_per_tick)
        except SettingsError as exc:
            raise dg.Failure(str(exc)) from None


class TmdbResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """Where and how fast TMDb is asked. The key and language are not here: they live in
    the database, shared by every process and changed without a restart."""

    base_url: str = TmdbSettings.base_url
    rate: int = TmdbSettings.rate
    workers: int = TmdbSettings.workers
    max_items: int = TmdbSettings.max_items
    revalidations_per_hour: int = TmdbSettings.revalidations_per_hour

    def settings(self) -> TmdbSettings:
        """The validated values; an invalid one fails the run or tick in one line (a URL
        is shown without its query, user or password)."""
        try:
            return checked_tmdb(
                self.base_url,
                self.rate,
                self.workers,
                self.max_items,
                self.revalidations_per_hour,
            )
        except SettingsError as exc:
            raise dg.Failure(str(exc)) from None


def inventory_database(env: Mapping[str, str] | None = None) -> InventoryDatabase:
    """The database resource as the environment has it now; a bad value fails the run or
    tick in one line naming its variable."""
    env = os.environ if env is None else env
    try:
        url = database_url_from_env(env)
        policy = policy_from_env(env)
        runs_per_tick = max_runs_from_env(env)
    except (SettingsError, InvalidDatabaseUrl) as exc:
        raise dg.Failure(str(exc)) from None
    if url is None:
        raise dg.Failure(f"{DATABASE_URL} is not set: the application database's URL")
    return InventoryDatabase(url=url, runs_per_tick=runs_per_tick, **asdict(policy))


def tmdb_resource(env: Mapping[str, str] | None = None) -> TmdbResource:
    """The TMDb resource as the environment has it now (its own variables only)."""
    try:
        tmdb = tmdb_from_env(os.environ if env is None else env)
    except SettingsError as exc:
        raise dg.Failure(str(exc)) from None
    return TmdbResource(**asdict(tmdb))


def bound_resources() -> dict[str, dg.ResourceDefinition]:
    """The resources of the code location: read from the environment each time a run or
    tick starts, and with no run config. Settings are deployment facts, not launch
    choices: the Launchpad shows only the op's config, and a value typed there could not
    quietly override the environment every other process reads."""
    return {
        "inventory_db": dg.ResourceDefinition(
            resource_fn=lambda _: inventory_database(),
            description="The application database (INVENTORY_DATABASE_URL) and the "
            "profile refresh policy (INVENTORY_* variables), read when a run or tick starts.",
        ),
        "tmdb": dg.ResourceDefinition(
            resource_fn=lambda _: tmdb_resource(),
            description="Where and how fast TMDb is asked (INVENTORY_TMDB_* variables), "
            "read when a run or tick starts; the key lives in the database.",
        ),
    }


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
    return runs_in_flight(instance, job_name, limit=1) > 0


def runs_in_flight(instance: dg.DagsterInstance, job_name: str, limit: int) -> int:
    """How many runs of this job are queued or running, counted up to `limit`."""
    records = instance.get_run_records(
        dg.RunsFilter(job_name=job_name, statuses=IN_FLIGHT), limit=limit
    )
    return len(records)


def latest_materialization(
    instance: dg.DagsterInstance, key: dg.AssetKey
) -> AssetCheckEvaluationTargetMaterializationData | None:
    """The asset's latest materialization, as the target a check evaluation refers to:
    the UI shows a check's status against the materialization it was evaluated for."""
    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key), limit=1)
    if not records.records:
        return None
    record = records.records[0]
    return AssetCheckEvaluationTargetMaterializationData(
        storage_id=record.storage_id,
        run_id=record.run_id,
        timestamp=record.timestamp,
    )
