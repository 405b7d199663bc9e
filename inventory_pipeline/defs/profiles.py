"""Dagster surface of the profile refresh.

The sensor plans and launches; runs claim as their work begins; the asset is what
analysts backfill. Correctness lives in the database: a run only ever completes claims
its lease token still holds, so a killed, duplicated or hand-launched run changes
nothing the lease would not allow.

What the UI shows follows the database: check evaluations name the partition's latest
materialization (else Dagster drops them from the Partitions tab), a stalled library's
check is failed by a sensor without a run, and a partition key that is not a library
is removed, never fatal.
"""

# No `from __future__ import annotations` here: Dagster reads op, asset and check
# signatures at definition time and compares the context annotation to real classes.

import json
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import dagster as dg

# Not exported by dagster: the type of AssetCheckEvaluation.target_materialization_data.
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)
from pydantic import Field

from inventory_pipeline.db import Connection
from inventory_pipeline.defs.resources import InventoryDatabase, runs_waiting
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.generator import held_back_reason
from inventory_pipeline.profiles.models import Completion, LibraryLabel, ProfileStatus

# Dynamic partition set names are global to the instance: keep this one distinctive.
PARTITIONS_NAME = "inventory_pipeline__library_profile"
library_partitions = dg.DynamicPartitionsDefinition(name=PARTITIONS_NAME)
PROFILE_ASSET = dg.AssetKey("library_profile")
QUEUE_TAG = "inventory_pipeline/queue"
REFRESH_QUEUE = "profile_refresh"
CHECK_NAME = "library_profile_current"
CHECK_KEY = dg.AssetCheckKey(PROFILE_ASSET, CHECK_NAME)


# Rows per distribution table: a huge library's metadata stays bounded.
TABLE_ROWS = 20
DISTRIBUTIONS = ("genres", "primary_studio", "original_language", "identity")


def _share_table(shares: dict[str, float]) -> dg.TableMetadataValue:
    """A distribution as value/share rows, the largest first, at most TABLE_ROWS."""
    rows = list(shares.items())
    records = [dg.TableRecord({"value": k, "share": float(v)}) for k, v in rows[:TABLE_ROWS]]
    if len(rows) > TABLE_ROWS:
        rest = sum(float(v) for _, v in rows[TABLE_ROWS:])
        records.append(
            dg.TableRecord({"value": f"({len(rows) - TABLE_ROWS} more)", "share": round(rest, 4)})
        )
    return dg.MetadataValue.table(
        records=records,
        schema=dg.TableSchema(
            columns=[dg.TableColumn("value", "string"), dg.TableColumn("share", "float")]
        ),
    )


def profile_metadata(profile: dict[str, Any]) -> dict[str, Any]:
    """Each trait's status and contributors, every published distribution as a table,
    why a trait is held back, and the whole profile as JSON."""
    metadata: dict[str, Any] = {}
    traits = []
    for trait, body in profile.items():
        reason = held_back_reason(body)
        metadata[f"trait/{trait}"] = reason or (
            f"published: {body['contributors']} contributing items, coverage {body['coverage']:g}"
        )
        traits.append(
            dg.TableRecord(
                {
                    "trait": trait,
                    "status": str(body["status"]),
                    "contributors": int(body["contributors"]),
                    "coverage": float(body["coverage"]),
                    "held_back": reason or "",
                }
            )
        )
    metadata["traits"] = dg.MetadataValue.table(
        records=traits,
        schema=dg.TableSchema(
            columns=[
                dg.TableColumn("trait", "string"),
                dg.TableColumn("status", "string"),
                dg.TableColumn("contributors", "int"),
                dg.TableColumn("coverage", "float"),
                dg.TableColumn("held_back", "string"),
            ]
        ),
    )
    rating = profile.get("rating", {})
    if rating.get("status") == "published":
        metadata["distribution/rating"] = dg.MetadataValue.table(
            records=[
                dg.TableRecord({"statistic": name, "value": float(rating[name])})
                for name in ("mean", "median", "p10", "p90")
            ],
            schema=dg.TableSchema(
                columns=[dg.TableColumn("statistic", "string"), dg.TableColumn("value", "float")]
            ),
        )
    for trait in DISTRIBUTIONS:
        body = profile.get(trait, {})
        if body.get("status") == "published":
            metadata[f"distribution/{trait}"] = _share_table(body["share"])
    metadata["profile"] = dg.MetadataValue.json(profile)
    return metadata


def label_metadata(label: LibraryLabel | None) -> dict[str, Any]:
    if label is None:
        return {"library": "deleted"}
    return {
        "library": f"{label.name} ({label.media_kind})",
        "media_server": f"{label.server_name} ({label.server_kind})",
    }


def completion_metadata(completion: Completion, label: LibraryLabel | None) -> dict[str, Any]:
    """What a reader of one partition's materialization wants to see."""
    metadata: dict[str, Any] = {
        **label_metadata(label),
        "item_count": completion.item_count,
        "acknowledged_revision": completion.acknowledged_revision or 0,
        "observed_revision": completion.observed_revision,
        "request_kind": completion.kind,
    }
    if completion.profile is not None:
        metadata.update(profile_metadata(completion.profile))
    else:
        metadata["profile"] = "removed: the library is empty"
    return metadata


def materialization(completion: Completion, label: LibraryLabel | None) -> dg.AssetMaterialization:
    return dg.AssetMaterialization(
        asset_key=PROFILE_ASSET,
        partition=str(completion.library_id),
        metadata=completion_metadata(completion, label),
    )


def library_ids_of(partition_keys: Sequence[str]) -> list[int]:
    """Partition keys are library ids; anything else is refused before any work."""
    bad = [key for key in partition_keys if not is_library_key(key)]
    if bad:
        raise dg.Failure(f"partition keys must be library ids, got {bad[0][:40]!r}")
    return [int(key) for key in partition_keys]


def is_library_key(key: str) -> bool:
    return key.isascii() and key.isdigit() and len(key) < 19


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
# the check evaluations that follow their materializations name them from one lookup.
EVENT_BATCH = 50


@dg.op(tags={QUEUE_TAG: REFRESH_QUEUE})
def refresh_claimed_profiles(
    context: dg.OpExecutionContext, config: RefreshConfig, inventory_db: InventoryDatabase
) -> dg.Output[int]:
    """Claim requests one at a time as the work begins and process each, one
    materialization per library, until `max_claims` (default the policy's run_claims)
    were taken or nothing is left. When nothing is claimable the run plans itself (the
    same planner a tick runs) and goes on while that queues work: a backlog larger than
    one tick plans is drained by the running runs, not a tick's worth at a time. Every
    EVENT_BATCH libraries, their materializations and then their check evaluations are
    logged."""
    policy = inventory_db.policy()
    if config.max_claims is not None and config.max_claims <= 0:
        raise dg.Failure(f"max_claims must be positive, got {config.max_claims}")
    budget = config.max_claims if config.max_claims is not None else policy.run_claims
    hold_storage_connections(context.instance)
    counts = {"published": 0, "removed": 0, "lost": 0, "failed": 0}
    pending: list[Completion] = []
    with inventory_db.connection() as conn:
        planned_last = False
        while budget > 0:
            taken = 0
            for completion in service.refresh(conn, policy, budget):
                taken += 1
                counts[completion.outcome] += 1
                if completion.outcome == "failed":
                    context.log.warning(
                        f"library {completion.library_id}: attempt failed ({completion.error})"
                    )
                elif completion.outcome == "lost":
                    context.log.warning(
                        f"library {completion.library_id}: claim lost, nothing done"
                    )
                pending.append(completion)
                if len(pending) >= EVENT_BATCH:
                    log_completions(context, conn, pending)
                    pending = []
            budget -= taken
            # Planning again right after a plan that let this run claim nothing would
            # only race the other runs for what they are already taking.
            if budget <= 0 or (planned_last and taken == 0):
                break
            planned_last = True
            if service.plan(conn, policy).planned == 0:
                break
        log_completions(context, conn, pending)
    return dg.Output(counts["published"] + counts["removed"], metadata=dict(counts))


def log_completions(
    context: dg.OpExecutionContext, conn: Connection, completions: Sequence[Completion]
) -> None:
    """One materialization per published or removed library, then the check for every
    library the run touched, as the database sees it now."""
    if not completions:
        return
    done = [c for c in completions if c.outcome in ("published", "removed")]
    labels = service.library_labels(conn, [c.library_id for c in done]) if done else {}
    for completion in done:
        context.log_event(materialization(completion, labels.get(completion.library_id)))
    log_check_evaluations(context, conn, [c.library_id for c in completions])


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
    metadata: dict[str, Any] = {**label_metadata(label), "outcome": result.status}
    stored = service.stored_profile(conn, result.library_id)
    if stored is None:
        metadata["profile"] = "none: the library has no items"
    else:
        metadata["item_count"] = stored.item_count
        metadata["profile_revision"] = stored.inventory_revision
        metadata.update(profile_metadata(stored.profile))
    return metadata


@dg.asset(
    key=PROFILE_ASSET,
    partitions_def=library_partitions,
    output_required=False,
    description=(
        "Per-library profile: item count and, per trait, its distribution and coverage. "
        "A backfill enqueues (or joins) outbox requests and processes them under a lease, "
        "one library per run; the check then evaluates the new profile."
    ),
)
def library_profile(
    context: dg.AssetExecutionContext, inventory_db: InventoryDatabase
) -> Iterator[dg.MaterializeResult[None]]:
    library_ids = library_ids_of(context.partition_keys)
    failed: list[str] = []
    refreshed: list[tuple[int, dict[str, Any]]] = []
    # One partition per run (the default backfill policy): the output is the partition's
    # materialization, and the check step, when the run includes it, evaluates against
    # it. Otherwise (a partition range, or the check left out) this op records the check.
    single = len(library_ids) == 1
    check_step = single and CHECK_KEY in context.job_def.asset_layer.asset_graph.asset_check_keys
    with inventory_db.connection() as conn:
        labels = service.library_labels(conn, library_ids)
        for result in service.backfill(conn, library_ids, inventory_db.policy()):
            if result.status in ("refreshed", "refreshed_elsewhere", "never_stocked"):
                label = labels.get(result.library_id)
                refreshed.append((result.library_id, _backfill_metadata(conn, result, label)))
            else:
                failed.append(f"{result.library_id} ({result.error or result.status})")
        if not single:
            for library_id, metadata in refreshed:
                context.log_event(
                    dg.AssetMaterialization(
                        asset_key=PROFILE_ASSET, partition=str(library_id), metadata=metadata
                    )
                )
        elif refreshed and not failed:
            yield dg.MaterializeResult(metadata=refreshed[0][1])
        if not check_step or failed:
            # A failed run skips the check step: the evaluation says what went wrong.
            log_check_evaluations(context, conn, library_ids)
    if failed:
        raise dg.Failure(f"profiles not refreshed for libraries: {', '.join(failed)}")


@dg.asset_check(
    asset=PROFILE_ASSET,
    partitions_def=library_partitions,
    description=(
        "The profile is current with its library's inventory revision. Evaluated after "
        "each refresh, and failed by the staleness sensor for a library dirty longer than "
        "INVENTORY_STALL_SECONDS."
    ),
)
def library_profile_current(
    context: dg.AssetCheckExecutionContext, inventory_db: InventoryDatabase
) -> dg.AssetCheckResult:
    [library_id] = library_ids_of([context.partition_key])
    return profile_current_result(inventory_db, library_id)


def profile_current_result(inventory_db: InventoryDatabase, library_id: int) -> dg.AssetCheckResult:
    """Current = acknowledged up to the revision and the stored profile matches the items;
    a failure says why."""
    with inventory_db.connection() as conn:
        statuses = service.profile_status(conn, [library_id])
    if not statuses:
        return dg.AssetCheckResult(
            passed=False, description="library not found", metadata={"reason": "deleted"}
        )
    [status] = statuses
    return dg.AssetCheckResult(
        passed=status.current, description=status.reason, metadata=_check_metadata(status)
    )


def _check_metadata(status: ProfileStatus) -> dict[str, int]:
    return {
        "revision": status.revision,
        "acknowledged_revision": status.acknowledged_revision,
        "profile_revision": status.profile_revision or 0,
        "items": status.items,
    }


def target_materialization(
    instance: dg.DagsterInstance, partition: str
) -> AssetCheckEvaluationTargetMaterializationData | None:
    """The partition's latest materialization, which an evaluation must name: Dagster
    shows a partition's check status only while the evaluation targets the partition's
    latest materialization (the same lookup its own check steps do)."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=PROFILE_ASSET, asset_partitions=[partition]), limit=1
    ).records
    if not records:
        return None
    return AssetCheckEvaluationTargetMaterializationData(
        run_id=records[0].run_id, storage_id=records[0].storage_id, timestamp=records[0].timestamp
    )


def target_materializations(
    instance: dg.DagsterInstance, partitions: Sequence[str]
) -> dict[str, AssetCheckEvaluationTargetMaterializationData]:
    """`target_materialization` for many partitions in one read: newest first, a
    partition's first record is its latest. A partition the read did not reach is
    looked up alone; one never materialized is absent."""
    wanted = set(partitions)
    found: dict[str, AssetCheckEvaluationTargetMaterializationData] = {}
    if not wanted:
        return found
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=PROFILE_ASSET, asset_partitions=sorted(wanted)),
        limit=2 * len(wanted),
    ).records
    for record in records:
        key = record.partition_key
        if key in wanted and key not in found:
            found[key] = AssetCheckEvaluationTargetMaterializationData(
                run_id=record.run_id, storage_id=record.storage_id, timestamp=record.timestamp
            )
    for key in sorted(wanted - found.keys()):
        target = target_materialization(instance, key)
        if target is not None:
            found[key] = target
    return found


def log_check_evaluations(
    context: dg.OpExecutionContext | dg.AssetExecutionContext,
    conn: Connection,
    library_ids: Sequence[int],
) -> None:
    """Record the check for every partition a run touched, as the database sees it now,
    against the partition's latest materialization."""
    statuses = service.profile_status(conn, library_ids)
    targets = target_materializations(context.instance, [str(s.library_id) for s in statuses])
    for status in statuses:
        partition = str(status.library_id)
        # AssetCheckEvaluation is accepted at run time; the annotation predates it.
        context.log_event(
            dg.AssetCheckEvaluation(  # type: ignore[arg-type]
                asset_key=PROFILE_ASSET,
                check_name=CHECK_NAME,
                passed=status.current,
                partition=partition,
                description=status.reason,
                metadata=_check_metadata(status),
                target_materialization_data=targets.get(partition),
            )
        )


def _partition_order(key: str) -> tuple[int, int, str]:
    return (0, int(key), "") if is_library_key(key) else (1, 0, key)


# A full partition diff at least this often even when nothing seems to have changed:
# it restores a library partition deleted by hand in the UI, which no cheap signal shows.
FULL_SYNC_SECONDS = 600


def _read_cursor(cursor: str | None) -> dict[str, Any]:
    """The profile sensor's cursor: runs launched so far and the last synced partition
    state. A bare integer is the older cursor (runs launched only)."""
    if not cursor:
        return {"runs": 0}
    if cursor.isdigit():
        return {"runs": int(cursor)}
    try:
        state = json.loads(cursor)
    except ValueError:
        return {"runs": 0}
    return state if isinstance(state, dict) and isinstance(state.get("runs"), int) else {"runs": 0}


def _newest_partition(instance: dg.DagsterInstance) -> str:
    """The newest key of the partition set (one indexed row): it changes whenever a key
    is added, by this sensor or by hand ("" for an empty set)."""
    page = instance.get_paginated_dynamic_partitions(PARTITIONS_NAME, limit=1, ascending=False)
    return page.results[0] if page.results else ""


def _partition_requests(
    context: dg.SensorEvaluationContext, library_ids: set[str]
) -> tuple[list[dg.AddDynamicPartitionsRequest | dg.DeleteDynamicPartitionsRequest], str]:
    """Add a partition for each library without one and delete every key that is not a
    library; also returns the warning for the foreign keys removed."""
    known = set(context.instance.get_dynamic_partitions(PARTITIONS_NAME))
    requests: list[dg.AddDynamicPartitionsRequest | dg.DeleteDynamicPartitionsRequest] = []
    if library_ids - known:
        requests.append(library_partitions.build_add_request(sorted(library_ids - known, key=int)))
    gone = sorted(known - library_ids, key=_partition_order)
    if gone:
        requests.append(library_partitions.build_delete_request(gone))
    foreign = [key for key in gone if not is_library_key(key)]
    removed = ""
    if foreign:
        shown = ", ".join(repr(key[:40]) for key in foreign[:5])
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        removed = f"removed partition keys that are not library ids: {shown}{more}; "
        context.log.warning(removed.rstrip("; "))
    return requests, removed


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
    (`run_claims` each), never more than `max_runs_per_tick` waiting to start. Partition
    keys that are not libraries (added by hand in the UI) are reported and removed.

    The partition sync reads neither key set while the library set's fingerprint and
    the newest partition key are those of the last sync (the cursor keeps both). When
    only libraries were created since, it adds their keys; any other change (a library
    deleted, a key added by hand) or FULL_SYNC_SECONDS since the last diff diffs both
    sets."""
    policy = inventory_db.policy()
    max_runs = inventory_db.max_runs_per_tick()
    state = _read_cursor(context.cursor)
    newest = _newest_partition(context.instance)
    partition_requests: list[dg.AddDynamicPartitionsRequest | dg.DeleteDynamicPartitionsRequest]
    partition_requests, removed = [], ""
    with inventory_db.connection() as conn:
        plan = service.plan(conn, policy)
        claimable = service.claimable(conn, max_runs * policy.run_claims)
        fingerprint = service.library_fingerprint(conn)
        recent = (
            state.get("newest") == newest
            and time.time() - float(state.get("synced_at", 0)) < FULL_SYNC_SECONDS
        )
        if not (recent and state.get("libraries") == fingerprint.token):
            appended = (
                service.library_ids_after(conn, int(state.get("max_id", 0))) if recent else []
            )
            count = int(state.get("count", -1))
            if appended and fingerprint.libraries == count + len(appended):
                # Only libraries created since the last sync: add their keys, no diff.
                added = [str(i) for i in appended]
                partition_requests.append(library_partitions.build_add_request(added))
            else:
                library_ids = {str(i) for i in service.library_ids(conn)}
                partition_requests, removed = _partition_requests(context, library_ids)
            adds = [r for r in partition_requests if isinstance(r, dg.AddDynamicPartitionsRequest)]
            deletes = len(partition_requests) > len(adds)
            # Once applied, the newest key is the last one added (keys are added in
            # order); after a deletion it is not known, and the next tick diffs again.
            if adds:
                newest = list(adds[-1].partition_keys or [newest])[-1]
            state = {
                **state,
                "libraries": fingerprint.token,
                "count": fingerprint.libraries,
                "max_id": fingerprint.max_id,
                "newest": None if deletes else newest,
                "synced_at": time.time(),
            }
    wanted = min(max_runs, -(-claimable // policy.run_claims))
    launches = max(0, wanted - runs_waiting(context.instance, library_profile_refresh.name))
    first = int(state["runs"])
    runs = [
        dg.RunRequest(
            # Unique per launch: Dagster never re-fires a run_key whose run failed.
            run_key=f"profile-refresh-{first + n + 1}",
            tags={QUEUE_TAG: REFRESH_QUEUE, "inventory_pipeline/claimable": str(claimable)},
        )
        for n in range(launches)
    ]
    state = {**state, "runs": first + len(runs)}
    cursor = json.dumps(state, sort_keys=True)
    if cursor != context.cursor:
        context.update_cursor(cursor)
    reason = "nothing to refresh" if claimable == 0 else "runs already waiting to start"
    skip = f"{removed}{reason} (claimable: {claimable}, expired leases: {plan.expired})"
    if not runs and not partition_requests:
        return dg.SkipReason(skip)
    context.log.info(
        f"planned {len(plan.inventory)} inventory and {len(plan.native)} native requests; "
        f"{claimable} claimable, launching {len(runs)} runs"
    )
    return dg.SensorResult(
        run_requests=runs,
        dynamic_partitions_requests=partition_requests,
        skip_reason=None if runs else skip,
    )


# Stalled libraries reported per tick; the rest follow on later ticks, oldest first.
STALL_BATCH = 500


@dg.sensor(
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Fails library_profile_current for every library whose inventory change "
    "waits longer than INVENTORY_STALL_SECONDS, without a run and without claiming.",
)
def library_profile_staleness_sensor(
    context: dg.SensorEvaluationContext, inventory_db: InventoryDatabase
) -> dg.SensorResult | dg.SkipReason:
    """A stall turns the check red even when no run touches the library: the tick reads
    the stalled libraries and records one failed evaluation per newly stalled revision
    (the cursor remembers which were reported), in one batch and without a run. The
    refresh that acknowledges the library records the passing evaluation."""
    policy = inventory_db.policy()
    with inventory_db.connection() as conn:
        stalled = service.stalled_libraries(conn, policy, STALL_BATCH)
    reported: dict[str, int] = json.loads(context.cursor) if context.cursor else {}
    known = set(context.instance.get_dynamic_partitions(PARTITIONS_NAME))
    events = []
    now_reported: dict[str, int] = {}
    for lib in stalled:
        partition = str(lib.library_id)
        if partition not in known:
            continue  # the partition sync adds it; reported on a later tick
        now_reported[partition] = lib.revision
        if reported.get(partition) == lib.revision:
            continue
        events.append(
            dg.AssetCheckEvaluation(
                asset_key=PROFILE_ASSET,
                check_name=CHECK_NAME,
                passed=False,
                partition=partition,
                description=(
                    f"stalled: inventory revision {lib.revision} waiting "
                    f"{lib.stalled_seconds // 60} min (acknowledged {lib.acknowledged_revision}, "
                    f"threshold {policy.stall_seconds // 60} min)"
                ),
                metadata={
                    "revision": lib.revision,
                    "acknowledged_revision": lib.acknowledged_revision,
                    "dirty_since": lib.dirty_since.isoformat(),
                    "stalled_seconds": lib.stalled_seconds,
                },
                target_materialization_data=target_materialization(context.instance, partition),
            )
        )
    cursor = json.dumps(now_reported, sort_keys=True)
    if not events:
        if cursor != (context.cursor or "{}"):
            context.update_cursor(cursor)
        return dg.SkipReason(f"no newly stalled library ({len(now_reported)} stalled)")
    context.log.warning(f"{len(events)} libraries newly stalled ({len(now_reported)} stalled)")
    return dg.SensorResult(asset_events=events, cursor=cursor)


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
    description="Terminal refresh requests older than the retention, in bounded batches.",
)

# Registered in definitions.py next to the definitions above.
profile_sensors = [library_profile_staleness_sensor]
