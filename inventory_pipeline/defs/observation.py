"""Dagster surface of provider observation and recovery (docs/provider-recovery.md).

The sensor only counts due items; the job claims items itself, so a duplicated, killed
or hand-launched run is harmless: claims are compare-and-set with leases, completions
are guarded by lease token and source generation.
"""

# No `from __future__ import annotations`: Dagster reads these signatures at definition
# time and compares the context annotation to real classes.

import json
from typing import Any

import dagster as dg

from inventory_pipeline.db import Connection
from inventory_pipeline.defs.credentials import CREDENTIAL
from inventory_pipeline.defs.resources import (
    QUEUE_TAG,
    InventoryDatabase,
    TmdbResource,
    run_in_flight,
)
from inventory_pipeline.defs.sources import PROVIDER_GROUP, media_inventory
from inventory_pipeline.defs.ticks import logged
from inventory_pipeline.recovery import service
from inventory_pipeline.recovery.models import CaseAge, OpenCase

OBSERVATIONS = dg.AssetKey("provider_observations")
OBSERVATION_QUEUE = "provider_observation"
OVERDUE_GRACE_SECONDS = 900
RECOVERY_CHECK = "recovery_cases_on_time"


def case_table(ages: list[CaseAge]) -> dg.TableMetadataValue:
    """Open cases by category: count, age of the oldest (minutes) and how many are due."""
    return dg.MetadataValue.table(
        records=[
            dg.TableRecord(
                {
                    "category": a.category,
                    "open": a.open_cases,
                    "oldest_age_minutes": a.oldest_age_seconds // 60,
                    "due_now": a.due_now,
                }
            )
            for a in ages
        ],
        schema=dg.TableSchema(
            columns=[
                dg.TableColumn("category", "string"),
                dg.TableColumn("open", "int"),
                dg.TableColumn("oldest_age_minutes", "int"),
                dg.TableColumn("due_now", "int"),
            ]
        ),
    )


OLDEST_CASES = 20  # open cases listed by the asset's `oldest_open_cases` table


def oldest_case_table(cases: list[OpenCase]) -> dg.TableMetadataValue:
    """The open cases failing longest: which items fail, found without reading logs."""
    return dg.MetadataValue.table(
        records=[
            dg.TableRecord(
                {
                    "item": c.item_id,
                    "title": c.title[:80],
                    "library": c.library[:40],
                    "tmdb_id": f"{c.provider_kind or '-'} {(c.provider_id or '')[:20]}",
                    "category": c.category,
                    "attempts": c.attempts,
                    "failing_since": c.first_failed_at.isoformat(timespec="seconds"),
                    "next_attempt": (
                        c.next_attempt_at.isoformat(timespec="seconds")
                        if c.next_attempt_at
                        else "-"
                    ),
                }
            )
            for c in cases
        ],
        schema=dg.TableSchema(
            columns=[
                dg.TableColumn("item", "int"),
                dg.TableColumn("title", "string"),
                dg.TableColumn("library", "string"),
                dg.TableColumn("tmdb_id", "string"),
                dg.TableColumn("category", "string"),
                dg.TableColumn("attempts", "int"),
                dg.TableColumn("failing_since", "string"),
                dg.TableColumn("next_attempt", "string"),
            ]
        ),
    )


@dg.asset(
    key=OBSERVATIONS,
    group_name=PROVIDER_GROUP,
    deps=[media_inventory, CREDENTIAL],
    kinds={"postgres"},
    op_tags={QUEUE_TAG: OBSERVATION_QUEUE},
    description="Validated TMDb observations of movie/TV items, and one recovery record "
    "per item whose last observation failed. A materialization observes the due items "
    "(claimed under leases, so a duplicated or hand-launched run is harmless) and shows "
    "the open cases as the database holds them after it.",
)
def provider_observations(
    context: dg.AssetExecutionContext, inventory_db: InventoryDatabase, tmdb: TmdbResource
) -> dg.MaterializeResult[None]:
    """Observe due items, warn on each new case or changed cause, and materialize the
    standing view of open cases as the database holds it after the run."""

    def report(level: str, message: str) -> None:
        # Logged as soon as its own completion has committed, so a run that fails later
        # has still reported every case it opened.
        (context.log.warning if level == "warning" else context.log.info)(message)

    summary = service.observe_due(inventory_db.url, tmdb.settings(), report)
    with inventory_db.connection() as conn:
        ages = service.case_ages(conn)
        oldest = service.oldest_open_cases(conn, OLDEST_CASES)
    return dg.MaterializeResult(
        metadata={
            "open_cases": case_table(ages),
            "oldest_open_cases": oldest_case_table(oldest),
            "open_cases_total": sum(a.open_cases for a in ages),
            "due_now": sum(a.due_now for a in ages),
            "items": len(summary.results),
            "observed": summary.observed,
            "by_category": dg.MetadataValue.json(summary.by_category),
            "cases_opened": summary.opened,
            "cases_resolved": summary.resolved,
        }
    )


def recovery_check_result(
    conn: Connection,
) -> tuple[bool, str | None, dict[str, Any]]:
    """Passed, the description of a failure, and metadata: no open case an observation
    may claim past its deadline by more than the grace without an attempt. Cases of
    inactive libraries or servers wait for their owner and are reported apart."""
    overdue = service.overdue_cases(conn, OVERDUE_GRACE_SECONDS)
    oldest = overdue.oldest
    ages = service.case_ages(conn)
    metadata: dict[str, dg.RawMetadataValue] = {
        "overdue": overdue.total,
        "oldest_due": oldest[0].due_at.isoformat() if oldest else "-",
        "open_cases": case_table(ages),
        "overdue_items": json.dumps([c.item_id for c in oldest]),
        "waiting_in_inactive_libraries": overdue.inactive,
    }
    description = None
    if oldest:
        description = (
            f"{overdue.total} open recovery cases are more than {OVERDUE_GRACE_SECONDS // 60}"
            f" minutes past their retry deadline without an attempt (oldest due "
            f"{oldest[0].due_at.isoformat(timespec='seconds')}): observation is not keeping up"
        )
    return not oldest, description, metadata


# The observation run: the asset, then its check (an asset selection includes its checks).
provider_observation = dg.define_asset_job(
    "provider_observation",
    selection=dg.AssetSelection.assets(OBSERVATIONS),
    executor_def=dg.in_process_executor,
    tags={QUEUE_TAG: OBSERVATION_QUEUE},
    description="Claim due items and observe them against TMDb, then evaluate the recovery check.",
)


@dg.sensor(
    job=provider_observation,
    minimum_interval_seconds=10,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Launches an observation run when items are due (never observed, source "
    "changed, retry due, lease expired, or an approved replacement awaiting its first "
    "observation), admission is not paused by throttling, and none is already queued or "
    "running.",
)
@logged
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
    name=RECOVERY_CHECK,
    description="No open recovery case is past its retry deadline without an attempt. "
    "Evaluated after every observation run.",
)
def recovery_cases_on_time(
    context: dg.AssetCheckExecutionContext, inventory_db: InventoryDatabase
) -> dg.AssetCheckResult:
    with inventory_db.connection() as conn:
        passed, description, metadata = recovery_check_result(conn)
    if description is not None:
        context.log.warning(description)  # the run's log says it, not only the check
    return dg.AssetCheckResult(passed=passed, metadata=metadata, description=description)
