"""Dagster surface of the training stats worker.

The drain job drives the three committed stages; the database's leases and fence make
duplicated or killed runs harmless. Projections are assets whose materializations say
what was published.
"""

# No `from __future__ import annotations`: Dagster reads these signatures at definition
# time and compares the context annotation to real classes.

import enum
import uuid

import dagster as dg

from inventory_pipeline.defs.resources import InventoryDatabase, run_in_flight
from inventory_pipeline.stats import maintenance, processors, runbook

QUEUE_TAG = "inventory_pipeline/queue"
STATS_QUEUE = "stats_drain"
EXERCISE_STATS = dg.AssetKey("user_exercise_stats")
PERIOD_STATS = dg.AssetKey("user_training_period_stats")

exercise_stats = dg.AssetSpec(
    EXERCISE_STATS,
    description="Per user and exercise: sessions, working sets, reps, volume, heaviest "
    "weight, best estimated 1RM (Epley), first and last date.",
)
period_stats = dg.AssetSpec(
    PERIOD_STATS,
    description="Per user and period (day, ISO week, month, quarter, year): sessions, "
    "working sets, reps, volume.",
)


@dg.op(config_schema={"max_rounds": dg.Field(int, default_value=50)}, tags={QUEUE_TAG: STATS_QUEUE})
def drain_stats(context: dg.OpExecutionContext, inventory_db: InventoryDatabase) -> dg.Output[int]:
    """Claim -> compute -> publish within a bounded round budget (the drain policy, one
    more pass when work arrived meanwhile, lives in the stats package)."""
    budget = int(context.op_config["max_rounds"])
    if budget < 1:
        raise dg.Failure(f"max_rounds must be at least 1, got {budget}")
    owner = f"dagster:{context.run_id[:8]}"
    with inventory_db.connection() as conn:
        summary = processors.drain(conn, owner, max_rounds=budget)
    metadata = summary.as_metadata()
    if summary.published:
        for key in (EXERCISE_STATS, PERIOD_STATS):
            context.log_event(dg.AssetMaterialization(asset_key=key, metadata=metadata))
    return dg.Output(len(summary.published), metadata=metadata)


@dg.job(
    executor_def=dg.in_process_executor,
    tags={QUEUE_TAG: STATS_QUEUE},
    description="Drain the stats refresh queue through claim, compute and publish.",
)
def stats_drain() -> None:
    drain_stats()


@dg.sensor(
    job=stats_drain,
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Launches a drain when stats work waits and no drain is active.",
)
def stats_refresh_sensor(
    context: dg.SensorEvaluationContext, inventory_db: InventoryDatabase
) -> dg.RunRequest | dg.SkipReason:
    with inventory_db.connection() as conn:
        work = processors.work_waiting(conn)
    if work.paused:
        return dg.SkipReason(f"the stats worker is paused ({work.waiting} waiting)")
    if work.claimable == 0:
        if work.waiting:
            return dg.SkipReason(f"{work.waiting} waiting; every lease slot is active")
        return dg.SkipReason("no stats work waiting")
    active = run_in_flight(context.instance, stats_drain.name)
    if active:
        return dg.SkipReason(f"{work.claimable} waiting; a drain is already active")
    launch = int(context.cursor or "0") + 1
    context.update_cursor(str(launch))
    return dg.RunRequest(run_key=f"stats-drain-{launch}")


class ControlAction(enum.Enum):
    """What the control job does (run config names the member: `pause`, ...)."""

    show = "show"
    settings = "settings"
    pause = "pause"
    resume = "resume"
    retry = "retry"


class StatsWorkerControlConfig(dg.Config):
    """The runbook as run config: `settings` changes the values given (budgets in
    milliseconds), `retry` needs `job_id`."""

    action: ControlAction = ControlAction.show
    job_id: int | None = None
    claim_budget_ms: int | None = None
    compute_budget_ms: int | None = None
    publish_budget_ms: int | None = None
    lease_seconds: int | None = None
    active_lease_cap: int | None = None
    max_attempts: int | None = None
    retry_backoff_seconds: int | None = None


@dg.op
def control_stats_worker(
    config: StatsWorkerControlConfig, inventory_db: InventoryDatabase
) -> dg.Output[str]:
    """Change a budget, pause or resume claiming, or retry an exhausted job."""
    changes = {name: getattr(config, name) for name in runbook.SETTING_NAMES}
    try:
        with inventory_db.connection() as conn:
            if config.action is ControlAction.retry:
                if config.job_id is None:
                    raise runbook.RunbookError("retry needs job_id")
                retried = runbook.retry(conn, config.job_id)
                done = f"job {retried.job_id} retried as job {retried.successor_id}"
            elif config.action is ControlAction.pause:
                runbook.pause(conn)
                done = "paused: no claim starts until resumed"
            elif config.action is ControlAction.resume:
                runbook.resume(conn)
                done = "resumed"
            elif config.action is ControlAction.settings:
                if all(value is None for value in changes.values()):
                    raise runbook.RunbookError("settings needs at least one value to change")
                runbook.change_settings(conn, changes)
                done = "settings changed"
            else:
                done = "settings shown"
            current = runbook.settings(conn)
    except runbook.RunbookError as exc:
        raise dg.Failure(str(exc)) from None
    metadata: dict[str, dg.RawMetadataValue] = {
        name: getattr(current, name) for name in runbook.SETTING_NAMES
    }
    metadata["paused"] = current.paused
    return dg.Output(done, metadata=metadata)


@dg.job(
    executor_def=dg.in_process_executor,
    description="The stats worker runbook: change a budget, pause, resume, retry a job.",
)
def stats_worker_control() -> None:
    control_stats_worker()


@dg.op(config_schema={"user_ids": dg.Field([str], default_value=[])})
def request_stats_rebuild(
    context: dg.OpExecutionContext, inventory_db: InventoryDatabase
) -> dg.Output[int]:
    """Enqueue full-history ranges for chosen users (none chosen: every user)."""
    raw = list(context.op_config["user_ids"])
    try:
        users = [uuid.UUID(value) for value in raw]
    except ValueError:
        raise dg.Failure("user_ids must be UUIDs") from None
    with inventory_db.connection() as conn:
        queued = processors.request_rebuild(conn, users or None)
    return dg.Output(len(queued), metadata={"users": len(queued)})


@dg.job(
    executor_def=dg.in_process_executor,
    description="Rebuild stats for chosen users (or all) through the queue.",
)
def stats_rebuild() -> None:
    request_stats_rebuild()


@dg.op(tags={QUEUE_TAG: "stats_maintenance"})
def roll_pr_overview(inventory_db: InventoryDatabase) -> dg.Output[int]:
    """Answer catalog tokens, then request new generations for one due page of users."""
    with inventory_db.connection() as conn:
        catalog = maintenance.process_catalog(conn)
        rolled = maintenance.rollover(conn)
        overview = maintenance.rollover_overview(conn)
    metadata: dict[str, dg.RawMetadataValue] = {
        "catalog_requests": catalog,
        "rollover_requested": rolled.requested,
        "rollover_failed": rolled.failed,
        "due_backlog": int(overview.get("due_backlog") or 0),
        "failing_users": int(overview.get("failing_users") or 0),
        "oldest_success": str(overview.get("oldest_success") or "-"),
    }
    return dg.Output(rolled.requested + catalog, metadata=metadata)


@dg.job(executor_def=dg.in_process_executor, tags={QUEUE_TAG: "stats_maintenance"})
def stats_rollover() -> None:
    roll_pr_overview()


@dg.op
def scan_stale_stats(inventory_db: InventoryDatabase) -> dg.Output[int]:
    with inventory_db.connection() as conn:
        stale = maintenance.scan(conn)
    signals: dict[str, int] = {}
    for _, signal in stale:
        signals[signal] = signals.get(signal, 0) + 1
    return dg.Output(
        len(stale), metadata={"users": len(stale), "signals": dg.MetadataValue.json(signals)}
    )


@dg.job(executor_def=dg.in_process_executor)
def stats_backfill_scan() -> None:
    scan_stale_stats()


@dg.op
def prune_stats_history(inventory_db: InventoryDatabase) -> dg.Output[int]:
    with inventory_db.connection() as conn:
        deleted = maintenance.prune(conn)
    return dg.Output(sum(deleted.values()), metadata=dict(deleted))


@dg.job(executor_def=dg.in_process_executor)
def stats_retention() -> None:
    prune_stats_history()


stats_schedules = [
    dg.ScheduleDefinition(
        job=stats_rollover,
        cron_schedule="* * * * *",
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Every minute: catalog invalidation and one due page of PR windows.",
    ),
    dg.ScheduleDefinition(
        job=stats_backfill_scan,
        cron_schedule="23 * * * *",
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Hourly backfill scanner.",
    ),
    dg.ScheduleDefinition(
        job=stats_retention,
        cron_schedule="7-59/10 * * * *",
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Every ten minutes: finished stats history older than seven days.",
    ),
]
