"""Dagster surface of provider observation and recovery (seed 003).

The sensor only counts due items; the job claims items itself, so a duplicated, killed
or hand-launched run is harmless: claims are compare-and-set with leases, completions
are guarded by lease token and source generation.
"""

# No `from __future__ import annotations`: Dagster reads these signatures at definition
# time and compares the context annotation to real classes.

import json

import dagster as dg

from inventory_pipeline.db import connect
from inventory_pipeline.defs.resources import InventoryDatabase, run_in_flight
from inventory_pipeline.provider import admission
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service
from inventory_pipeline.recovery.models import ObservationResult
from inventory_pipeline.recovery.policy import RetryPolicy
from inventory_pipeline.settings import Settings

OBSERVATIONS = dg.AssetKey("provider_observations")
QUEUE_TAG = "inventory_pipeline/queue"
OBSERVATION_QUEUE = "provider_observation"
OVERDUE_GRACE_SECONDS = 900

provider_observations = dg.AssetSpec(
    OBSERVATIONS,
    description="Validated TMDb observations of movie/TV items, and one recovery record "
    "per item whose last observation failed.",
)


@dg.op(tags={QUEUE_TAG: OBSERVATION_QUEUE})
def observe_provider_items(
    context: dg.OpExecutionContext, inventory_db: InventoryDatabase
) -> dg.Output[int]:
    settings = Settings.from_env()
    with inventory_db.connection() as conn:
        admission.set_rate(conn, settings.tmdb_rate)

    def report(result: ObservationResult) -> None:
        # Warnings only after commit, on a new case or a changed cause; one informational
        # line per recovery. Each is logged as soon as its own completion has committed,
        # so a run that fails later has still reported every case it opened.
        notice = service.notice(result)
        if notice is not None:
            level, message = notice
            (context.log.warning if level == "warning" else context.log.info)(message)

    with TmdbClient(settings.tmdb_base_url) as client:
        summary = service.observe(
            lambda: connect(inventory_db.url, application_name="inventory_pipeline.observer"),
            client,
            RetryPolicy(),
            max_items=settings.observation_max_items,
            workers=settings.observation_workers,
            on_result=report,
        )
    metadata: dict[str, dg.RawMetadataValue] = {
        "items": len(summary.results),
        "observed": summary.observed,
        "by_category": dg.MetadataValue.json(summary.by_category),
        "cases_opened": summary.opened,
        "cases_resolved": summary.resolved,
    }
    context.log_event(dg.AssetMaterialization(asset_key=OBSERVATIONS, metadata=metadata))
    return dg.Output(summary.observed, metadata=metadata)


@dg.job(
    executor_def=dg.in_process_executor,
    tags={QUEUE_TAG: OBSERVATION_QUEUE},
    description="Claim due items and observe them against TMDb.",
)
def provider_observation() -> None:
    observe_provider_items()


@dg.sensor(
    job=provider_observation,
    minimum_interval_seconds=10,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Launches an observation run when items are due (never observed, source "
    "changed, retry due or lease expired), admission is not paused by throttling, and "
    "none is already queued or running.",
)
def provider_observation_sensor(
    context: dg.SensorEvaluationContext, inventory_db: InventoryDatabase
) -> dg.RunRequest | dg.SkipReason:
    with inventory_db.connection() as conn:
        due = service.due_items(conn)
        paused = service.admission_paused_seconds(conn) if due else 0.0
    if due == 0:
        return dg.SkipReason("no items due for observation")
    if paused > 0:
        return dg.SkipReason(
            f"{due} items due; admission paused for {paused:.0f} s after TMDb throttled"
        )
    active = run_in_flight(context.instance, provider_observation.name)
    if active:
        # Only saves a redundant launch; a second run would just find nothing to claim.
        return dg.SkipReason(f"{due} items due; an observation run is already active")
    launch = int(context.cursor or "0") + 1
    context.update_cursor(str(launch))
    return dg.RunRequest(run_key=f"observe-{launch}", tags={"inventory_pipeline/due": str(due)})


@dg.asset_check(
    asset=OBSERVATIONS,
    description="No open recovery case is past its retry deadline without an attempt.",
)
def recovery_cases_on_time(inventory_db: InventoryDatabase) -> dg.AssetCheckResult:
    with inventory_db.connection() as conn:
        overdue = service.overdue_cases(conn, OVERDUE_GRACE_SECONDS)
        open_cases = service.case_overview(conn)
    return dg.AssetCheckResult(
        passed=not overdue,
        metadata={
            "overdue": len(overdue),
            "oldest_due": overdue[0].due_at.isoformat() if overdue else "-",
            "open_cases": dg.MetadataValue.json(open_cases),
            "overdue_items": json.dumps([c.item_id for c in overdue[:20]]),
        },
    )
