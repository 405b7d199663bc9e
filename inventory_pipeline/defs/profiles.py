"""Dagster surface of the profile refresh: the library_profile asset (what analysts
backfill), the refresh job the sensor launches, and compaction.

The sensor plans and launches (`profile_sensor`); runs claim as their work begins.
Correctness lives in the database: a run only ever completes claims its lease token
still holds, so a killed, duplicated or hand-launched run changes nothing the lease
would not allow. A partition is a range of library ids (`profile_ranges`); a run records
one materialization per range it refreshed (`profile_metadata`) and then the range's
check (`profile_checks`)."""

# No `from __future__ import annotations` here: Dagster reads op, asset and check
# signatures at definition time and compares the context annotation to real classes.

import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import dagster as dg
from pydantic import Field

from inventory_pipeline.db import Connection
from inventory_pipeline.defs.profile_checks import (
    CHECK_KEY,
    record_checks,
)
from inventory_pipeline.defs.profile_metadata import (
    UNCHANGED,
    completion_metadata,
    describe_library,
    label_metadata,
    profile_metadata,
    range_statuses,
    range_summary,
)
from inventory_pipeline.defs.profile_ranges import (
    PARTITION_WIDTH,
    PROFILE_ASSET,
    library_partitions,
    low_of,
    partition_of,
    range_key,
    range_lows_of,
)
from inventory_pipeline.defs.resources import QUEUE_TAG, InventoryDatabase
from inventory_pipeline.defs.sources import PROFILES_GROUP, media_inventory
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.models import (
    Completion,
    LibraryLabel,
    MaterializationDue,
    RefreshPolicy,
)

REFRESH_QUEUE = "profile_refresh"


class RefreshConfig(dg.Config):
    """Op config of a refresh run."""

    max_claims: int | None = Field(
        default=None,
        description="Stop after this many claims (default INVENTORY_RUN_CLAIMS).",
    )


# Instances whose storage already holds its connections open (one call per run worker).
_POOLED: "weakref.WeakSet[dg.DagsterInstance]" = weakref.WeakSet()


def hold_storage_connections(instance: dg.DagsterInstance) -> None:
    """Let the instance's storage keep a connection open for the rest of the process.
    Dagster's postgres storage opens a new connection for every call unless told
    otherwise (as its webserver does): a refresh run makes about six calls per library,
    and each new connection costs the server a backend start, several times the CPU of
    the write itself."""
    if instance in _POOLED:
        return
    instance.optimize_for_webserver(statement_timeout=0, pool_recycle=3600, max_overflow=4)
    _POOLED.add(instance)


# Libraries a run records in Dagster together: their labels are read in one query, and
# the check evaluations that follow their materializations name them from one lookup. A
# batch is recorded sooner once its first completion is RECORD_SECONDS old.
EVENT_BATCH = 50
RECORD_SECONDS = 30.0
# Completions of runs that ended before recording them, recorded by a run as it starts.
LATE_LIMIT = 500


def materialization_grace(policy: RefreshPolicy) -> float:
    """How long after it finished a completion may still be waiting in a live run: a
    batch is recorded at most RECORD_SECONDS plus one library's work (at most its lease)
    after its first completion. Past this, the run that made it has ended."""
    return policy.lease_seconds + 2 * RECORD_SECONDS


@dg.op(tags={QUEUE_TAG: REFRESH_QUEUE})
def refresh_claimed_profiles(
    context: dg.OpExecutionContext, config: RefreshConfig, inventory_db: InventoryDatabase
) -> dg.Output[int]:
    """One refresh run (`service.refresh`: claim as the work begins, plan when nothing
    is claimable) of at most `max_claims` (default the policy's run_claims), one
    materialization per library. Every EVENT_BATCH libraries (or RECORD_SECONDS), their
    materializations and then their check evaluations are logged, and the completions
    marked recorded in the database; it first records what earlier runs completed and
    ended before recording (docs/profiles.md#dagster)."""
    policy = inventory_db.policy()
    if config.max_claims is not None and config.max_claims <= 0:
        raise dg.Failure(f"max_claims must be positive, got {config.max_claims}")
    budget = config.max_claims if config.max_claims is not None else policy.run_claims
    hold_storage_connections(context.instance)
    pending: list[Completion] = []
    first_at = 0.0
    with inventory_db.connection() as conn:
        late = service.materializations_due(conn, materialization_grace(policy), LATE_LIMIT)
        if late:
            log_late_completions(context, conn, late, policy.stall_seconds)

        def record(completion: Completion) -> None:
            nonlocal first_at
            if completion.outcome == "failed":
                context.log.warning(
                    f"library {completion.library_id}: attempt failed ({completion.error})"
                )
            elif completion.outcome == "lost":
                context.log.warning(f"library {completion.library_id}: claim lost, nothing done")
            if not pending:
                first_at = time.monotonic()
            pending.append(completion)
            if len(pending) >= EVENT_BATCH or time.monotonic() - first_at >= RECORD_SECONDS:
                log_completions(context, conn, pending, policy.stall_seconds)
                pending.clear()

        run = service.refresh(conn, policy, budget, on_completion=record, materialization_due=True)
        log_completions(context, conn, pending, policy.stall_seconds)
    counts = run.outcomes
    return dg.Output(counts["published"] + counts["removed"], metadata=counts)


def log_completions(
    context: dg.OpExecutionContext,
    conn: Connection,
    completions: Sequence[Completion],
    stall_seconds: int,
) -> None:
    """One materialization per range holding a published or removed library, listing
    every library of the range (one event per range, not per library: each Dagster
    event costs several writes, and per library they were a burst's wall); with a single
    library refreshed, that library's whole profile too. Then the check of every range
    the batch touched, from the same read; then the completions are marked recorded."""
    if not completions:
        return
    by_range = range_statuses(conn, sorted({low_of(c.library_id) for c in completions}))
    # A range is materialized when the batch stored a profile of it (published or
    # removed); a library's outcome is its last in the batch, and its row and profile are
    # what is stored now, so a publish followed by a failed attempt reads "failed" beside
    # the profile that stands.
    outcomes = {c.library_id: c.outcome for c in completions}
    done: dict[int, dict[int, Completion]] = {}
    for c in completions:
        if c.outcome in ("published", "removed"):
            done.setdefault(low_of(c.library_id), {})[c.library_id] = c
    for low, libraries in sorted(done.items()):
        metadata, description = range_summary(low, by_range[low], outcomes)
        if len(libraries) == 1:
            [completion] = libraries.values()
            labels = {s.library_id: s.label for s in by_range[low]}
            metadata.update(completion_metadata(completion, labels.get(completion.library_id)))
        context.log_event(
            dg.AssetMaterialization(
                asset_key=PROFILE_ASSET,
                partition=range_key(low),
                description=description,
                metadata=metadata,
            )
        )
    record_checks(context, by_range, stall_seconds)
    # Every completion the batch recorded, a library's earlier ones too.
    service.materialized(
        conn, [c.request_id for c in completions if c.outcome in ("published", "removed")]
    )


def log_late_completions(
    context: dg.OpExecutionContext,
    conn: Connection,
    late: Sequence[MaterializationDue],
    stall_seconds: int,
) -> None:
    """The materializations a run that ended first did not record: one per range, its
    libraries as the database has them now (published, or removed when no profile is
    stored), said to be recorded late; then their ranges' checks."""
    by_range = range_statuses(conn, sorted({low_of(d.library_id) for d in late}))
    done = {d.library_id for d in late}
    for low, statuses in sorted(by_range.items()):
        outcomes = {
            s.library_id: "published" if s.profile_revision is not None else "removed"
            for s in statuses
            if s.library_id in done
        }
        if not outcomes:
            continue  # the libraries were deleted since
        metadata, description = range_summary(low, statuses, outcomes)
        context.log_event(
            dg.AssetMaterialization(
                asset_key=PROFILE_ASSET,
                partition=range_key(low),
                description=f"recorded late (completed by a run that ended first): {description}",
                metadata={**metadata, "recorded_late": True},
            )
        )
    record_checks(context, by_range, stall_seconds)
    service.materialized(conn, [d.request_id for d in late])


@dg.job(
    executor_def=dg.in_process_executor,
    tags={QUEUE_TAG: REFRESH_QUEUE},
    description="Claim and process profile refresh requests one at a time, planning more "
    "when none is claimable, until the run's claim budget is spent or no work is left.",
)
def library_profile_refresh() -> None:
    refresh_claimed_profiles()


def _backfill_metadata(
    conn: Connection, result: service.BackfillResult, label: LibraryLabel | None
) -> dict[str, Any]:
    """A refresh done by this run shows what it generated; one done by another worker
    meanwhile shows the profile stored now."""
    if result.completion is not None:
        return completion_metadata(result.completion, label)
    metadata: dict[str, Any] = {"library_id": result.library_id, **label_metadata(label)}
    stored = service.stored_profile(conn, result.library_id)
    if stored is None:
        metadata["profile"] = "none: the library has no items"
    else:
        metadata["item_count"] = stored.item_count
        metadata["profile_revision"] = stored.inventory_revision
        metadata.update(profile_metadata(stored.profile))
    return metadata


def backfill_outcome(result: service.BackfillResult) -> str:
    """A backfill's result in the vocabulary of every range summary."""
    if result.completion is not None:
        return result.completion.outcome
    return "failed" if result.status in ("failed", "inactive") else UNCHANGED


class LibraryProfileConfig(dg.Config):
    """Run config of a backfill: by default every library of the chosen partitions."""

    libraries: list[int] = Field(
        default_factory=list,
        description="Refresh only these library ids (each inside one of the run's partitions).",
    )


@dg.asset(
    key=PROFILE_ASSET,
    partitions_def=library_partitions,
    group_name=PROFILES_GROUP,
    deps=[media_inventory],
    kinds={"postgres"},
    output_required=False,
    description=(
        "Per-library profile: item count and, per trait, its distribution and coverage. "
        f"A partition is a range of {PARTITION_WIDTH} library ids. A backfill enqueues (or "
        "joins) an outbox request for each library of the partition and processes them "
        "under a lease, recording one materialization per library and one listing them; "
        "the check then evaluates the partition (the worst of its libraries). The run "
        "config `libraries` narrows it to chosen libraries. Kept fresh by "
        "library_profile_sensor: its library_profile_refresh runs record each range they "
        "refresh (one run serves whichever ranges have work, so Dagster does not list the "
        "sensor under this asset's Automation)."
    ),
)
def library_profile(
    context: dg.AssetExecutionContext,
    config: LibraryProfileConfig,
    inventory_db: InventoryDatabase,
) -> Iterator[dg.MaterializeResult[None]]:
    lows = range_lows_of(context.partition_keys)
    failed: list[str] = []
    outcomes: dict[int, str] = {}
    # One partition per run (the default backfill policy): the output is the partition's
    # materialization, and the check step, when the run includes it, evaluates against
    # it. Otherwise (a partition range, or the check left out) this op records the check.
    single = len(lows) == 1
    check_step = single and CHECK_KEY in context.job_def.asset_layer.asset_graph.asset_check_keys
    with inventory_db.connection() as conn:
        library_ids = service.library_ids_in_ranges(conn, lows, PARTITION_WIDTH)
        if config.libraries:
            outside = sorted(set(config.libraries) - set(library_ids))
            if outside:
                raise dg.Failure(
                    f"libraries not in the run's partitions: {', '.join(map(str, outside[:5]))}"
                )
            library_ids = sorted(set(config.libraries))
        if not library_ids:
            raise dg.Failure(f"no library in partitions {', '.join(context.partition_keys)[:200]}")
        labels = service.library_labels(conn, library_ids)
        for result in service.backfill(conn, library_ids, inventory_db.policy()):
            label = labels.get(result.library_id)
            outcome = outcomes[result.library_id] = backfill_outcome(result)
            if result.status in ("refreshed", "refreshed_elsewhere", "never_stocked"):
                context.log_event(
                    dg.AssetMaterialization(
                        asset_key=PROFILE_ASSET,
                        partition=partition_of(result.library_id),
                        description=describe_library(result.library_id, label, outcome),
                        metadata=_backfill_metadata(conn, result, label),
                    )
                )
            else:
                failed.append(f"{result.library_id} ({result.error or result.status})")
        by_range = range_statuses(conn, lows)
        touched = {low_of(library_id) for library_id in outcomes}
        summaries = {
            low: range_summary(low, by_range[low], outcomes) for low in lows if low in touched
        }
        if not single:
            for low, (summary, description) in summaries.items():
                context.log_event(
                    dg.AssetMaterialization(
                        asset_key=PROFILE_ASSET,
                        partition=range_key(low),
                        description=description,
                        metadata=summary,
                    )
                )
        elif not failed:
            summary, description = summaries[lows[0]]
            yield dg.MaterializeResult(metadata={**summary, "summary": description})
        if not check_step or failed:
            # A failed run skips the check step: the evaluation says what went wrong.
            record_checks(context, by_range, inventory_db.policy().stall_seconds)
    if failed:
        raise dg.Failure(f"profiles not refreshed for libraries: {', '.join(failed)}")


@dg.op
def compact_refresh_requests(
    context: dg.OpExecutionContext, inventory_db: InventoryDatabase
) -> dg.Output[int]:
    with inventory_db.connection() as conn:
        deleted = service.compact(conn, inventory_db.policy())
    context.log.info(f"deleted {deleted} terminal refresh requests past the retention")
    return dg.Output(deleted, metadata={"deleted": deleted})


@dg.job(executor_def=dg.in_process_executor)
def profile_request_compaction() -> None:
    compact_refresh_requests()


compaction_schedule = dg.ScheduleDefinition(
    job=profile_request_compaction,
    cron_schedule="17 3 * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Terminal refresh requests older than the retention, in bounded batches.",
)
