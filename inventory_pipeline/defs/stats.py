"""Dagster surface of the training stats worker.

The drain job drives the three committed stages; the database's leases and fence make
duplicated or killed runs harmless. Projections are assets whose materializations say
what was published.
"""

# No `from __future__ import annotations`: Dagster reads these signatures at definition
# time and compares the context annotation to real classes.

import contextlib
import enum
import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

import dagster as dg

from inventory_pipeline.db import Connection, DatabaseError
from inventory_pipeline.defs.resources import IN_FLIGHT, QUEUE_TAG, InventoryDatabase
from inventory_pipeline.defs.sources import STATS_GROUP, training_log
from inventory_pipeline.defs.ticks import cursor_state, logged
from inventory_pipeline.stats import maintenance, runbook, service
from inventory_pipeline.stats.models import DrainSummary

STATS_QUEUE = "stats_drain"
EXERCISE_STATS = dg.AssetKey("user_exercise_stats")
PERIOD_STATS = dg.AssetKey("user_training_period_stats")
PR_OVERVIEW = dg.AssetKey("pr_overview")

# Skippable: a drain that published nothing materializes nothing.
exercise_stats = dg.AssetSpec(
    EXERCISE_STATS,
    skippable=True,
    group_name=STATS_GROUP,
    deps=[training_log],
    kinds={"postgres"},
    description="Per user and exercise: sessions, working sets, reps, volume, heaviest "
    "weight, best estimated 1RM (Epley), first and last date.",
)
pr_overview = dg.AssetSpec(
    PR_OVERVIEW,
    skippable=True,
    group_name=STATS_GROUP,
    deps=[training_log],
    kinds={"postgres"},
    description="Per user and generation: the PR overview (best estimated 1RM all time, "
    "last 30 days, the same 30 days a year before, heaviest weight), read through "
    "`get_pr_overview`; a drain that publishes materializes it with the generations it "
    "published and the backlog still owed.",
)
period_stats = dg.AssetSpec(
    PERIOD_STATS,
    skippable=True,
    group_name=STATS_GROUP,
    deps=[training_log],
    kinds={"postgres"},
    description="Per user and period (day, ISO week, month, quarter, year): sessions, "
    "working sets, reps, volume.",
)


class DrainConfig(dg.Config):
    """A pass claims at most `max_rounds` (a claim, then its compute steps and
    publication). With `idle_seconds` above 0 the drain stays alive: it waits for the
    database's notification of new work and drains again, until nothing was claimed for
    `idle_seconds` or `lifetime_seconds` have passed."""

    max_rounds: int = service.MAX_ROUNDS
    idle_seconds: float = 0.0
    lifetime_seconds: float = 3600.0


# What the sensor launches: a drain kept alive while saves keep coming, so a save is
# published within a second instead of a sensor tick and a run start later. An idle
# deployment starts no run (the sensor launches only for waiting work), and a busy one
# about one an hour. See docs/training-stats.md#freshness.
KEPT_ALIVE = DrainConfig(idle_seconds=600.0, lifetime_seconds=3600.0)
MAX_LIFETIME_SECONDS = 3600.0
# Run monitoring ends any drain that outlived the longest lifetime by five minutes (its
# worker died unseen, or hangs): the run's slot in the queue is freed.
MAX_RUNTIME_SECONDS = int(MAX_LIFETIME_SECONDS) + 300
# Drains the stats queue runs at once (deploy/dagster.yaml's stats_drain limit). A drain
# in flight holds the sensor back only while it keeps up: claimable work waiting longer
# than BEHIND_SECONDS (a live drain takes it within a second, or at its 5 s recheck)
# means it does not (its worker died unseen, it hangs, or a backlog outruns it), and the
# sensor launches one more.
DRAINS_AT_ONCE = 2
BEHIND_SECONDS = 30.0
# A started drain run whose database session is gone (it holds no drain lock) for this
# long, on ticks this far apart, died unseen: the sensor reports it failed, which frees
# its place in the run queue, and launches a successor when work waits. A run still
# starting has not taken its lock yet, and one ending has let it go a moment before its
# status follows; neither stays without it this long.
SESSIONLESS_SECONDS = 30.0


def drain_owner(run_id: str) -> str:
    """The lock owner a Dagster drain claims as, and holds its session lock under."""
    return f"dagster:{run_id[:8]}"


PUBLISHED_ROWS = 50  # generations listed in the PR overview's table; the counts cover all
FAILURE_LINES = 20  # failures a report logs with their reason; the counts cover all


def pr_overview_metadata(
    summary: DrainSummary, status: Mapping[str, Any] | None, rollover: Mapping[str, Any] | None
) -> dict[str, Any]:
    """What the PR overview asset shows after a drain published: the generations it
    published, and the standing backlog (users stale and owed, oldest waits, rollover)
    unless it could not be read (a drain reporting on its way out of a lost connection)."""
    published = [
        dg.TableRecord({"user": str(user), "generation": generation, "batches": batches})
        for user, generation, batches in summary.published[:PUBLISHED_ROWS]
    ]
    metadata: dict[str, Any] = {
        "published_generations": len(summary.published),
        "published": dg.MetadataValue.table(
            records=published,
            schema=dg.TableSchema(
                columns=[
                    dg.TableColumn("user", "string"),
                    dg.TableColumn("generation", "int"),
                    dg.TableColumn("batches", "int"),
                ]
            ),
        ),
    }
    if status is None or rollover is None:
        return metadata
    return metadata | {
        "users_stale": int(status.get("stale_users") or 0),
        "users_owed": int(status.get("owed_users") or 0),
        "pending_users": int(status.get("pending_users") or 0),
        "oldest_wait_seconds": float(status.get("oldest_wait_seconds") or 0),
        "oldest_owed_seconds": float(status.get("oldest_owed_seconds") or 0),
        "rollover_due": int(rollover.get("due_backlog") or 0),
        "rollover_failing_users": int(rollover.get("failing_users") or 0),
    }


@dg.multi_asset(
    specs=[exercise_stats, period_stats, pr_overview],
    name="drain_stats",
    op_tags={QUEUE_TAG: STATS_QUEUE},
)
def drain_stats(
    context: dg.AssetExecutionContext, config: DrainConfig, inventory_db: InventoryDatabase
) -> Iterator[dg.MaterializeResult[None]]:
    """Claim -> compute -> publish, pass after pass while the drain is kept alive (the
    drain policy lives in the stats package). The projections are materialized with what
    was published, as it is published (at most every half minute, and at the end); the
    run's log says what the drain did either way."""
    if config.max_rounds < 1:
        raise dg.Failure(f"max_rounds must be at least 1, got {config.max_rounds}")
    idle, lifetime = config.idle_seconds, config.lifetime_seconds
    if not (0 <= idle <= MAX_LIFETIME_SECONDS and 0 < lifetime <= MAX_LIFETIME_SECONDS):
        raise dg.Failure(
            f"idle_seconds must be 0 to {MAX_LIFETIME_SECONDS:g} and lifetime_seconds above 0"
            f" and at most {MAX_LIFETIME_SECONDS:g}, got {idle} and {lifetime}"
        )
    owner = drain_owner(context.run_id)
    with inventory_db.connection() as conn:

        def report(summary: DrainSummary) -> None:
            metadata = summary.as_metadata()
            context.log.info("drained: " + ", ".join(f"{v} {k}" for k, v in metadata.items()))
            for user, outcome, reason in summary.failures[:FAILURE_LINES]:
                context.log.warning(f"user {user}: {outcome}: {reason}")
            if summary.claim_error:
                context.log.warning(f"claiming failed: {summary.claim_error}; trying again")
            if not summary.published:
                return
            status: dict[str, Any] | None = None
            rollover: dict[str, Any] | None = None
            with contextlib.suppress(DatabaseError):
                status, rollover = service.worker_status(conn), maintenance.rollover_overview(conn)
            overview = pr_overview_metadata(summary, status, rollover)
            for key in (EXERCISE_STATS, PERIOD_STATS):
                context.log_event(dg.AssetMaterialization(asset_key=key, metadata=metadata))
            context.log_event(dg.AssetMaterialization(asset_key=PR_OVERVIEW, metadata=overview))

        end = service.keep_draining(
            conn,
            owner,
            idle_seconds=config.idle_seconds,
            lifetime_seconds=config.lifetime_seconds,
            report=report,
            max_rounds=config.max_rounds,
        )
    if end == "lifetime":
        context.log.info("drain ended: its lifetime is over; the sensor starts the next one")
    elif end == "paused":
        context.log.info("drain ended: the stats worker is paused")
    elif config.idle_seconds:
        context.log.info(f"drain ended: nothing claimed for {config.idle_seconds:g} s")
    else:
        context.log.info("drain ended: nothing left to claim")
    yield from ()


stats_drain = dg.define_asset_job(
    "stats_drain",
    selection=dg.AssetSelection.assets(EXERCISE_STATS, PERIOD_STATS, PR_OVERVIEW),
    executor_def=dg.in_process_executor,
    tags={QUEUE_TAG: STATS_QUEUE, "dagster/max_runtime": str(MAX_RUNTIME_SECONDS)},
    description="Drain the stats refresh queue through claim, compute and publish.",
)


@dg.sensor(
    job=stats_drain,
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Launches a drain, kept alive while work keeps coming, when stats work "
    "waits and no drain is active; reports failed a drain whose worker died unseen.",
)
@logged
def stats_refresh_sensor(
    context: dg.SensorEvaluationContext, inventory_db: InventoryDatabase
) -> dg.RunRequest | dg.SkipReason:
    state = cursor_state(context.cursor, "launches")
    with inventory_db.connection() as conn:
        work = service.work_waiting(conn)
        if work.paused:
            return dg.SkipReason(f"the stats worker is paused ({work.waiting} waiting)")
        if work.claimable == 0:
            if work.waiting:
                return dg.SkipReason(f"{work.waiting} waiting; every lease slot is active")
            return dg.SkipReason("no stats work waiting")
        active = drains_in_flight(context, conn, state)
    context.update_cursor(json.dumps(state))
    if len(active) >= DRAINS_AT_ONCE:
        return dg.SkipReason(f"{work.claimable} waiting; {len(active)} drains are already active")
    # A drain in flight is behind only once work waited past BEHIND_SECONDS since it
    # became claimable and the newest drain has had as long to take it.
    newest = max((record.create_timestamp.timestamp() for record in active), default=0.0)
    behind = min(work.oldest_wait_seconds, time.time() - newest)
    if active and behind <= BEHIND_SECONDS:
        return dg.SkipReason(f"{work.claimable} waiting; a drain is already active")
    state["launches"] += 1
    context.update_cursor(json.dumps(state))
    if active:
        context.log.info(
            f"the oldest of {work.claimable} waiting has waited {work.oldest_wait_seconds:.0f}"
            " s though a drain is active: launching another"
        )
    return dg.RunRequest(
        run_key=f"stats-drain-{state['launches']}",
        run_config=dg.RunConfig(ops={"drain_stats": KEPT_ALIVE}),
    )


def drains_in_flight(
    context: dg.SensorEvaluationContext, conn: Connection, state: dict[str, Any]
) -> list[dg.RunRecord]:
    """The drain runs queued, starting or started whose worker lives. A started run
    whose database session has been gone for SESSIONLESS_SECONDS (its worker died where
    Dagster cannot see it) is reported failed and left out; `state["sessionless"]` keeps
    since when each started run was seen without its session."""
    records = context.instance.get_run_records(
        dg.RunsFilter(job_name=stats_drain.name, statuses=IN_FLIGHT), limit=DRAINS_AT_ONCE * 4
    )
    started = {
        record.dagster_run.run_id: record
        for record in records
        if record.dagster_run.status == dg.DagsterRunStatus.STARTED
    }
    live = service.live_drains(conn, [drain_owner(run_id) for run_id in started])
    now = time.time()
    before: dict[str, float] = state.get("sessionless") or {}
    sessionless = {
        run_id: float(before.get(run_id, now))
        for run_id in started
        if drain_owner(run_id) not in live
    }
    dead = {run_id for run_id, since in sessionless.items() if now - since >= SESSIONLESS_SECONDS}
    for run_id in dead:
        message = (
            f"the drain's database session has been gone for {now - sessionless[run_id]:.0f} s:"
            " its worker died unseen (reported failed by stats_refresh_sensor)"
        )
        context.instance.report_run_failed(started[run_id].dagster_run, message)
        context.log.warning(f"drain run {run_id[:8]}: {message}")
        del sessionless[run_id]
    state["sessionless"] = sessionless
    return [record for record in records if record.dagster_run.run_id not in dead]


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
