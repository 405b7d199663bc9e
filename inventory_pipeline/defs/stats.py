"""Dagster surface of the training stats worker.

The drain job drives the three committed stages; the database's leases and fence make
duplicated or killed runs harmless. Projections are assets whose materializations say
what was published.
"""

# No `from __future__ import annotations`: Dagster reads these signatures at definition
# time and compares the context annotation to real classes.

import enum

import dagster as dg

from inventory_pipeline.defs.resources import InventoryDatabase, run_in_flight
from inventory_pipeline.stats import processors, runbook

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
