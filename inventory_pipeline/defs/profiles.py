"""Dagster surface of the profile refresh (seed 000).

The sensor plans and launches; runs claim as their work begins; the asset is what
analysts backfill. Correctness lives in the database: a run only ever completes claims
its lease token still holds, so a killed, duplicated or hand-launched run changes
nothing the lease would not allow.
"""

# No `from __future__ import annotations` here: Dagster reads op, asset and check
# signatures at definition time and compares the context annotation to real classes.

from collections.abc import Iterator, Sequence
from typing import Any

import dagster as dg

from inventory_pipeline.db import Connection
from inventory_pipeline.defs.resources import InventoryDatabase, runs_waiting
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.generator import top_genres
from inventory_pipeline.profiles.models import Completion, ProfileStatus

# Dynamic partition set names are global to the instance: keep this one distinctive.
PARTITIONS_NAME = "inventory_pipeline__library_profile"
library_partitions = dg.DynamicPartitionsDefinition(name=PARTITIONS_NAME)
PROFILE_ASSET = dg.AssetKey("library_profile")
QUEUE_TAG = "inventory_pipeline/queue"
REFRESH_QUEUE = "profile_refresh"


def materialization(completion: Completion) -> dg.AssetMaterialization:
    """One partition materialization with what a reader of the profile wants to see."""
    metadata: dict[str, Any] = {
        "acknowledged_revision": completion.acknowledged_revision or 0,
        "observed_revision": completion.observed_revision,
        "request_kind": completion.kind,
        "item_count": completion.item_count,
    }
    if completion.profile is not None:
        for trait, body in completion.profile.items():
            metadata[f"coverage/{trait}"] = dg.MetadataValue.float(float(body["coverage"]))
        genres = top_genres(completion.profile)
        metadata["top_genres"] = dg.MetadataValue.table(
            records=[dg.TableRecord({"genre": g, "share": s}) for g, s in genres],
            schema=dg.TableSchema(
                columns=[
                    dg.TableColumn("genre", "string"),
                    dg.TableColumn("share", "float"),
                ]
            ),
        )
    else:
        metadata["profile"] = "removed: the library is empty"
    return dg.AssetMaterialization(
        asset_key=PROFILE_ASSET,
        partition=str(completion.library_id),
        metadata=metadata,
    )


def library_ids_of(partition_keys: Sequence[str]) -> list[int]:
    """Partition keys are library ids; anything else is refused before any work."""
    bad = [key for key in partition_keys if not key.isascii() or not key.isdigit()]
    if bad:
        raise dg.Failure(f"partition keys must be library ids, got {bad[0][:40]!r}")
    return [int(key) for key in partition_keys]


@dg.op(
    config_schema={
        "max_claims": dg.Field(
            dg.IntSource,
            is_required=False,
            description="Stop after this many claims (default INVENTORY_RUN_CLAIMS).",
        )
    },
    tags={QUEUE_TAG: REFRESH_QUEUE},
)
def refresh_claimed_profiles(
    context: dg.OpExecutionContext, inventory_db: InventoryDatabase
) -> dg.Output[int]:
    """Claim requests one at a time as the work begins and process each, one
    materialization per library, until nothing is claimable."""
    policy = inventory_db.policy()
    max_claims = context.op_config.get("max_claims")
    if max_claims is not None and max_claims <= 0:
        raise dg.Failure(f"max_claims must be positive, got {max_claims}")
    counts = {"published": 0, "removed": 0, "lost": 0, "failed": 0}
    touched: list[int] = []
    with inventory_db.connection() as conn:
        for completion in service.refresh(conn, policy, max_claims):
            counts[completion.outcome] += 1
            touched.append(completion.library_id)
            if completion.outcome in ("published", "removed"):
                context.log_event(materialization(completion))
            elif completion.outcome == "failed":
                context.log.warning(
                    f"library {completion.library_id}: attempt failed ({completion.error})"
                )
            else:
                context.log.warning(f"library {completion.library_id}: claim lost, nothing done")
        log_check_evaluations(context, conn, touched)
    return dg.Output(counts["published"] + counts["removed"], metadata=dict(counts))


@dg.job(
    executor_def=dg.in_process_executor,
    tags={QUEUE_TAG: REFRESH_QUEUE},
    description="Process one claimed batch of profile refresh requests.",
)
def library_profile_refresh() -> None:
    refresh_claimed_profiles()


@dg.asset(
    key=PROFILE_ASSET,
    partitions_def=library_partitions,
    backfill_policy=dg.BackfillPolicy.single_run(),
    output_required=False,
    description=(
        "Per-library profile: item count and, per trait, its distribution and coverage. "
        "A backfill enqueues (or joins) outbox requests and processes them under a lease."
    ),
)
def library_profile(
    context: dg.AssetExecutionContext, inventory_db: InventoryDatabase
) -> Iterator[dg.Output[None]]:
    library_ids = library_ids_of(context.partition_keys)
    failed: list[str] = []
    with inventory_db.connection() as conn:
        for result in service.backfill(conn, library_ids, inventory_db.policy()):
            if result.status == "refreshed" and result.completion is not None:
                context.log_event(materialization(result.completion))
            elif result.status in ("refreshed_elsewhere", "never_stocked"):
                context.log_event(
                    dg.AssetMaterialization(
                        asset_key=PROFILE_ASSET,
                        partition=str(result.library_id),
                        metadata={"outcome": result.status},
                    )
                )
            else:
                failed.append(f"{result.library_id} ({result.error or result.status})")
        log_check_evaluations(context, conn, library_ids)
    if failed:
        raise dg.Failure(f"profiles not refreshed for libraries: {', '.join(failed)}")
    yield from ()


@dg.asset_check(
    asset=PROFILE_ASSET,
    partitions_def=library_partitions,
    description="The profile is current with its library's inventory revision.",
)
def library_profile_current(
    context: dg.AssetCheckExecutionContext, inventory_db: InventoryDatabase
) -> dg.AssetCheckResult:
    [library_id] = library_ids_of([context.partition_key])
    return profile_current_result(inventory_db, library_id)


def _check_metadata(status: ProfileStatus) -> dict[str, int]:
    return {
        "revision": status.revision,
        "acknowledged_revision": status.acknowledged_revision,
        "profile_revision": status.profile_revision or 0,
        "items": status.items,
    }


def profile_current_result(inventory_db: InventoryDatabase, library_id: int) -> dg.AssetCheckResult:
    """Current = acknowledged up to the revision and the stored profile matches the items."""
    with inventory_db.connection() as conn:
        statuses = service.profile_status(conn, [library_id])
    if not statuses:
        return dg.AssetCheckResult(passed=False, metadata={"reason": "library not found"})
    return dg.AssetCheckResult(passed=statuses[0].current, metadata=_check_metadata(statuses[0]))


def log_check_evaluations(
    context: dg.OpExecutionContext | dg.AssetExecutionContext,
    conn: Connection,
    library_ids: Sequence[int],
) -> None:
    """Record the check for every partition a run touched, as the database sees it now."""
    for status in service.profile_status(conn, library_ids):
        # AssetCheckEvaluation is accepted at run time; the annotation predates it.
        context.log_event(
            dg.AssetCheckEvaluation(  # type: ignore[arg-type]
                asset_key=PROFILE_ASSET,
                check_name="library_profile_current",
                passed=status.current,
                partition=str(status.library_id),
                metadata=_check_metadata(status),
            )
        )


@dg.sensor(
    job=library_profile_refresh,
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Keeps partitions in step with libraries, plans dirty libraries and "
    "launches refresh runs for the backlog; the runs claim when they start.",
)
def library_profile_sensor(
    context: dg.SensorEvaluationContext, inventory_db: InventoryDatabase
) -> dg.SensorResult | dg.SkipReason:
    """A tick never claims: ticks fail, are previewed from the UI and are retried, and a
    run may wait in the queue for minutes. It launches enough runs for the backlog
    (`run_claims` each), never more than `max_runs_per_tick` waiting to start."""
    policy = inventory_db.policy()
    max_runs = inventory_db.max_runs_per_tick()
    with inventory_db.connection() as conn:
        library_ids = {str(i) for i in service.library_ids(conn)}
        plan = service.plan(conn, policy)
        claimable = service.claimable(conn, max_runs * policy.run_claims)
    known = set(context.instance.get_dynamic_partitions(PARTITIONS_NAME))
    partition_requests: list[dg.AddDynamicPartitionsRequest | dg.DeleteDynamicPartitionsRequest]
    partition_requests = []
    if library_ids - known:
        partition_requests.append(
            library_partitions.build_add_request(sorted(library_ids - known, key=int))
        )
    if known - library_ids:
        partition_requests.append(
            library_partitions.build_delete_request(sorted(known - library_ids, key=int))
        )
    wanted = min(max_runs, -(-claimable // policy.run_claims))
    launches = max(0, wanted - runs_waiting(context.instance, library_profile_refresh.name))
    first = int(context.cursor or "0")
    runs = [
        dg.RunRequest(
            # Unique per launch: Dagster never re-fires a run_key whose run failed.
            run_key=f"profile-refresh-{first + n + 1}",
            tags={QUEUE_TAG: REFRESH_QUEUE, "inventory_pipeline/claimable": str(claimable)},
        )
        for n in range(launches)
    ]
    if runs:
        context.update_cursor(str(first + len(runs)))
    if not runs and not partition_requests:
        reason = "nothing to refresh" if claimable == 0 else "runs already waiting to start"
        return dg.SkipReason(f"{reason} (claimable: {claimable}, expired leases: {plan.expired})")
    context.log.info(
        f"planned {len(plan.inventory)} inventory and {len(plan.native)} native requests; "
        f"{claimable} claimable, launching {len(runs)} runs"
    )
    return dg.SensorResult(run_requests=runs, dynamic_partitions_requests=partition_requests)


@dg.op
def compact_refresh_requests(inventory_db: InventoryDatabase) -> dg.Output[int]:
    with inventory_db.connection() as conn:
        deleted = service.compact(conn, inventory_db.policy())
    return dg.Output(deleted, metadata={"deleted": deleted})


@dg.job(executor_def=dg.in_process_executor)
def profile_request_compaction() -> None:
    compact_refresh_requests()


compaction_schedule = dg.ScheduleDefinition(
    job=profile_request_compaction,
    cron_schedule="17 3 * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="seed 000: terminal requests older than 30 days, in bounded batches.",
)
