"""Dagster surface of stats maintenance: the operator's rebuild, the PR overview
rollover with catalog invalidation, the backfill scanner, and retention of both the
stats history and Dagster's own run history of the high-frequency stats jobs.

Every op calls one service function; the services take one user per transaction.
"""

# No `from __future__ import annotations`: Dagster reads these signatures at definition
# time and compares the context annotation to real classes.

import datetime
import uuid

import dagster as dg
import pydantic

from inventory_pipeline.defs.resources import QUEUE_TAG, InventoryDatabase, run_in_flight
from inventory_pipeline.defs.ticks import logged
from inventory_pipeline.stats import maintenance, rebuild

MAINTENANCE_QUEUE = "stats_maintenance"

# Jobs launched every few seconds or minutes: their Dagster run records are execution
# history, purged after RUN_HISTORY_DAYS. Other jobs' runs are never touched.
HIGH_FREQUENCY_JOBS = ("stats_drain", "stats_rollover", "stats_backfill_scan", "stats_retention")
RUN_HISTORY_DAYS = 7
RUN_PURGE_BATCH = 5000
FINISHED = [
    dg.DagsterRunStatus.SUCCESS,
    dg.DagsterRunStatus.FAILURE,
    dg.DagsterRunStatus.CANCELED,
]


class RebuildConfig(dg.Config):
    """Users to rebuild, as UUIDs; empty: every user."""

    user_ids: list[str] = pydantic.Field(default_factory=list)


def said(figures: dict[str, object], verb: str = "") -> str:
    """A maintenance run's figures as its one log line: what it did, in the run's log."""
    shown = ", ".join(f"{value} {name}" for name, value in figures.items())
    return f"{verb}: {shown}" if verb else shown


@dg.op
def request_stats_rebuild(
    context: dg.OpExecutionContext, config: RebuildConfig, inventory_db: InventoryDatabase
) -> dg.Output[int]:
    """Enqueue full-history ranges for chosen users (none chosen: every user), one user
    per transaction; a rebuild a killed run left unfinished is finished first."""
    raw = list(config.user_ids)
    try:
        users = [uuid.UUID(value) for value in raw]
    except ValueError:
        raise dg.Failure("user_ids must be UUIDs") from None
    with inventory_db.connection() as conn:
        progress = rebuild.request_rebuild(conn, users or None)
    context.log.info(f"rebuild requested for {progress.requested} users")
    return dg.Output(
        progress.requested,
        metadata={"users": progress.requested, "pass": progress.pass_id},
    )


@dg.job(
    executor_def=dg.in_process_executor,
    description="Rebuild stats for chosen users (or all) through the queue.",
)
def stats_rebuild() -> None:
    request_stats_rebuild()


class RolloverConfig(dg.Config):
    """Seconds a run may spend rolling windows before it ends (the sensor launches the
    next one while users are due), and users a second it rolls at most (0: no limit)."""

    budget_seconds: float = maintenance.ROLLOVER_BUDGET_SECONDS
    users_per_second: float = maintenance.ROLLOVER_PACE


@dg.op(tags={QUEUE_TAG: MAINTENANCE_QUEUE})
def roll_pr_overview(
    context: dg.OpExecutionContext, config: RolloverConfig, inventory_db: InventoryDatabase
) -> dg.Output[int]:
    """Answer catalog tokens, move the PR overview window of due users until none is due
    or the budget is spent, and resume rebuilds whose run was killed."""
    if not config.budget_seconds > 0 or not config.users_per_second >= 0:
        raise dg.Failure(
            "budget_seconds must be positive and users_per_second at least 0, got"
            f" {config.budget_seconds} and {config.users_per_second}"
        )
    pace = config.users_per_second or None
    with inventory_db.connection() as conn:
        catalog = maintenance.process_catalog(conn)
        rolled = maintenance.rollover(conn, budget_seconds=config.budget_seconds, pace=pace)
        resumed = rebuild.resume_rebuilds(conn)
        overview = maintenance.rollover_overview(conn)
    metadata: dict[str, dg.RawMetadataValue] = {
        "catalog_requests": catalog,
        "rollover_requested": rolled.requested,
        "rollover_deferred": rolled.deferred,
        "rollover_failed": rolled.failed,
        "rollover_budget_spent": rolled.more,
        "rebuild_resumed_users": sum(p.enqueued_now for p in resumed),
        "due_backlog": int(overview.get("due_backlog") or 0),
        "failing_users": int(overview.get("failing_users") or 0),
        "oldest_success": str(overview.get("oldest_success") or "-"),
    }
    context.log.info(said(metadata))
    return dg.Output(rolled.requested + catalog, metadata=metadata)


@dg.job(executor_def=dg.in_process_executor, tags={QUEUE_TAG: MAINTENANCE_QUEUE})
def stats_rollover() -> None:
    roll_pr_overview()


@dg.op
def scan_stale_stats(
    context: dg.OpExecutionContext, inventory_db: InventoryDatabase
) -> dg.Output[int]:
    """One page of the backfill scanner."""
    with inventory_db.connection() as conn:
        page = maintenance.scan(conn)
    signals: dict[str, int] = {}
    for _, signal in page.stale:
        signals[signal] = signals.get(signal, 0) + 1
    found = f"{len(page.stale)} stale users queued" + (f" {signals}" if signals else "")
    context.log.info(f"scanned a page: {found}")
    return dg.Output(
        len(page.stale),
        metadata={
            "users": len(page.stale),
            "failed": len(page.failed),
            "lap_done": page.lap_done,
            "signals": dg.MetadataValue.json(signals),
        },
    )


@dg.job(executor_def=dg.in_process_executor)
def stats_backfill_scan() -> None:
    scan_stale_stats()


def purge_run_history(
    instance: dg.DagsterInstance,
    job_names: tuple[str, ...],
    older_than: datetime.datetime,
    batch: int,
) -> dict[str, int]:
    """Delete at most `batch` finished runs (success, failure, canceled) of these jobs
    last updated before `older_than`, oldest first. Runs in progress or queued, and
    other jobs' runs, are never touched."""
    deleted: dict[str, int] = {}
    budget = batch
    for name in job_names:
        if budget <= 0:
            break
        records = instance.get_run_records(
            filters=dg.RunsFilter(job_name=name, statuses=FINISHED, updated_before=older_than),
            limit=budget,
            ascending=True,
        )
        for record in records:
            instance.delete_run(record.dagster_run.run_id)
        deleted[name] = len(records)
        budget -= len(records)
    return deleted


class RetentionConfig(dg.Config):
    """At most `run_batch` Dagster runs deleted per run; history older than `days` goes."""

    run_batch: int = RUN_PURGE_BATCH
    days: int = RUN_HISTORY_DAYS


@dg.op
def prune_stats_history(
    context: dg.OpExecutionContext, config: RetentionConfig, inventory_db: InventoryDatabase
) -> dg.Output[int]:
    """Bounded retention of the catalog change log, then of the high-frequency stats
    jobs' Dagster runs; refresh jobs and projection runs are never deleted."""
    batch = config.run_batch
    days = config.days
    if batch < 1 or days < 1:
        raise dg.Failure(f"run_batch and days must be at least 1, got {batch} and {days}")
    with inventory_db.connection() as conn:
        deleted = maintenance.prune(conn, days=days)
    cutoff = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=days)
    runs = purge_run_history(context.instance, HIGH_FREQUENCY_JOBS, cutoff, batch)
    metadata: dict[str, dg.RawMetadataValue] = {
        **deleted,
        "dagster_runs": sum(runs.values()),
        "dagster_runs_by_job": dg.MetadataValue.json(runs),
    }
    context.log.info(said({**deleted, "dagster_runs": sum(runs.values())}, "deleted"))
    return dg.Output(sum(deleted.values()) + sum(runs.values()), metadata=metadata)


@dg.job(executor_def=dg.in_process_executor)
def stats_retention() -> None:
    prune_stats_history()


maintenance_jobs = [stats_rebuild, stats_rollover, stats_backfill_scan, stats_retention]


# The daemon's own cadence: while users are due, a run that spent its budget is
# followed by the next at the first tick after it ends (a minute's wait between runs
# would leave 100,000 users for hours after midnight).
ROLLOVER_SENSOR_SECONDS = 5


@dg.sensor(
    job=stats_rollover,
    minimum_interval_seconds=ROLLOVER_SENSOR_SECONDS,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Launches a rollover run when a PR overview window is due, a catalog token "
    "is unanswered or a killed rebuild waits, and again as soon as the last run ends while "
    "any remains; otherwise skips (no idle runs).",
)
@logged
def stats_rollover_sensor(
    context: dg.SensorEvaluationContext, inventory_db: InventoryDatabase
) -> dg.RunRequest | dg.SkipReason:
    with inventory_db.connection() as conn:
        due = maintenance.due(conn)
    if not due.any:
        return dg.SkipReason("no PR overview window, catalog token or rebuild is due")
    if run_in_flight(context.instance, stats_rollover.name):
        return dg.SkipReason("a rollover run is already queued or running")
    launch = int(context.cursor or "0") + 1
    context.update_cursor(str(launch))
    return dg.RunRequest(
        run_key=f"stats-rollover-{launch}",
        tags={
            "inventory_pipeline/rollover_users": str(due.rollover_users),
            "inventory_pipeline/catalog_scopes": str(due.catalog_scopes),
            "inventory_pipeline/abandoned_rebuilds": str(due.abandoned_rebuilds),
        },
    )


SCAN_SENSOR_SECONDS = 60


@dg.sensor(
    minimum_interval_seconds=SCAN_SENSOR_SECONDS,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Every minute, one page of the backfill scanner in the tick itself: stale "
    "users it finds are queued and the stats drain sensor publishes them. No run: an idle "
    "minute leaves only a tick, with what it scanned in its log.",
)
@logged
def stats_backfill_scan_sensor(
    context: dg.SensorEvaluationContext, inventory_db: InventoryDatabase
) -> dg.SkipReason:
    """The scan in the tick: its writes are one page's requests, each its own
    transaction, and the drain that publishes them is launched by the stats sensor. A
    preview of the tick scans too: a request merges into the user's pending work, so an
    extra page is harmless."""
    with inventory_db.connection() as conn:
        page = maintenance.scan(conn)
    if page.busy:
        return dg.SkipReason("another scanner holds the cursor; nothing scanned")
    signals = sorted({signal for _, signal in page.stale})
    found = f"{len(page.stale)} stale users queued ({', '.join(signals)})" if page.stale else ""
    failed = f"; {len(page.failed)} left for the next lap" if page.failed else ""
    lap = "; lap done" if page.lap_done else ""
    return dg.SkipReason(f"scanned a page: {found or 'no stale user'}{failed}{lap}")


maintenance_sensors = [stats_rollover_sensor, stats_backfill_scan_sensor]

maintenance_schedules = [
    dg.ScheduleDefinition(
        job=stats_retention,
        cron_schedule="7-59/10 * * * *",
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Every ten minutes: bounded stats history and Dagster run retention.",
    ),
]
