"""Dagster surface of the training stats worker (seed 001).

The drain job drives the three committed stages; the database's leases and fence make
duplicated or killed runs harmless. Projections are assets whose materializations say
what was published.
"""

# No `from __future__ import annotations`: Dagster reads these signatures at definition
# time and compares the context annotation to real classes.

import dagster as dg

from inventory_pipeline.defs.resources import InventoryDatabase, run_in_flight
from inventory_pipeline.stats import processors

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
    """Claim -> compute -> publish within a bounded round budget; one more pass when new
    work arrived during the last one."""
    budget = int(context.op_config["max_rounds"])
    if budget < 1:
        raise dg.Failure(f"max_rounds must be at least 1, got {budget}")
    owner = f"dagster:{context.run_id[:8]}"
    with inventory_db.connection() as conn:
        summary = processors.drain(conn, owner, max_rounds=budget)
        passes = 1
        left = budget - summary.rounds
        if left > 0 and processors.pending_jobs(conn) > 0:
            extra = processors.drain(conn, owner, max_rounds=left)
            summary = type(summary)(
                summary.published + extra.published,
                summary.deferred + extra.deferred,
                summary.rejected + extra.rejected,
                summary.failed + extra.failed,
                summary.rounds + extra.rounds,
            )
            passes = 2
    metadata = {**summary.as_metadata(), "passes": passes}
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
        waiting = processors.waiting_work(conn)
    if waiting == 0:
        return dg.SkipReason("no stats work waiting")
    active = run_in_flight(context.instance, stats_drain.name)
    if active:
        return dg.SkipReason(f"{waiting} waiting; a drain is already active")
    launch = int(context.cursor or "0") + 1
    context.update_cursor(str(launch))
    return dg.RunRequest(run_key=f"stats-drain-{launch}")
