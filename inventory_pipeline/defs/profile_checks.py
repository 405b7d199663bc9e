"""library_profile_current: a range passes only when every library of it is current.
Evaluations name the partition's latest materialization (else Dagster drops them from
the Partitions tab); a library behind only by changes younger than the stall threshold
is a warning, and the staleness sensor fails a stalled library's range without a run."""

# No `from __future__ import annotations` here: Dagster reads op, asset and check
# signatures at definition time and compares the context annotation to real classes.

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import dagster as dg

# Not exported by dagster: the type of AssetCheckEvaluation.target_materialization_data.
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)

from inventory_pipeline.defs.profile_metadata import (
    range_statuses,
)
from inventory_pipeline.defs.profile_ranges import (
    PARTITION_WIDTH,
    PARTITIONS_NAME,
    PROFILE_ASSET,
    library_partitions,
    low_of,
    partition_of,
    range_ids,
    range_key,
    range_lows_of,
)
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.defs.ticks import logged
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.models import (
    ProfileStatus,
    StalledLibrary,
)

CHECK_NAME = "library_profile_current"
CHECK_KEY = dg.AssetCheckKey(PROFILE_ASSET, CHECK_NAME)
# Libraries named in a range's check description; the metadata counts all of them.
NAMED_LIBRARIES = 3


@dg.asset_check(
    asset=PROFILE_ASSET,
    partitions_def=library_partitions,
    description=(
        "Every library of the partition has a profile current with its inventory "
        "revision (the partition shows the worst of its libraries). Evaluated after each "
        "refresh, and failed by the staleness sensor for a library dirty longer than "
        "INVENTORY_STALL_SECONDS."
    ),
)
def library_profile_current(
    context: dg.AssetCheckExecutionContext, inventory_db: InventoryDatabase
) -> dg.AssetCheckResult:
    [low] = range_lows_of([context.partition_key])
    return range_current_result(inventory_db, low)


def range_current_result(inventory_db: InventoryDatabase, low: int) -> dg.AssetCheckResult:
    """The partition's check: passed only when every library of the range is current."""
    with inventory_db.connection() as conn:
        statuses = service.profile_status(conn, range_ids([low]))
    verdict = range_verdict(statuses, inventory_db.policy().stall_seconds)
    return dg.AssetCheckResult(
        passed=verdict.passed,
        severity=verdict.severity,
        description=verdict.description,
        metadata=verdict.metadata,
    )


@dataclass(frozen=True)
class RangeVerdict:
    passed: bool
    severity: dg.AssetCheckSeverity
    description: str
    metadata: dict[str, Any]


def range_verdict(statuses: Sequence[ProfileStatus], stall_seconds: int) -> RangeVerdict:
    """The worst of a range's libraries. A library behind only by changes younger than
    the stall threshold is catching up, and an inactive one is paused: a warning, not an
    error (red means something is wrong). The metadata are figures of the whole range,
    so its plots mean something."""
    error, warn = dg.AssetCheckSeverity.ERROR, dg.AssetCheckSeverity.WARN
    if not statuses:
        # Nothing is wrong: the partition goes on the sensor's next tick.
        empty = {"libraries": 0, "current": 0, "behind": 0, "oldest_lag_seconds": 0.0}
        return RangeVerdict(
            True, error, "no library in this range: its libraries were deleted", empty
        )
    # Libraries in error first, so the named few include one when there is one.
    behind = sorted(
        (s for s in statuses if not s.current),
        key=lambda s: s.catching_up(stall_seconds) or s.paused,
    )
    lags = [s.dirty_seconds for s in behind if s.dirty_seconds is not None]
    minutes, seconds = divmod(stall_seconds, 60)
    threshold = f"{minutes} min" if minutes and not seconds else f"{stall_seconds} s"
    metadata: dict[str, Any] = {
        "libraries": len(statuses),
        "current": len(statuses) - len(behind),
        "behind": len(behind),
        "oldest_lag_seconds": round(max(lags, default=0.0), 1),
    }
    if not behind:
        noun = "library" if len(statuses) == 1 else "libraries"
        return RangeVerdict(True, error, f"{len(statuses)} {noun} current", metadata)
    named = "; ".join(_behind(s, stall_seconds) for s in behind[:NAMED_LIBRARIES])
    more = f" and {len(behind) - NAMED_LIBRARIES} more" if len(behind) > NAMED_LIBRARIES else ""
    metadata["not_current"] = ", ".join(str(s.library_id) for s in behind)
    if all(s.catching_up(stall_seconds) or s.paused for s in behind):
        waits = (
            "paused: inactive libraries wait by design"
            if all(s.paused for s in behind)
            else f"catching up, within the {threshold} stall threshold"
        )
        return RangeVerdict(False, warn, f"{named}{more}; {waits}", metadata)
    stalled = any(s.acknowledged_revision < s.revision for s in behind)
    past = f"; stall threshold {threshold}" if stalled else ""
    return RangeVerdict(False, error, f"{named}{more}{past}", metadata)


def _behind(status: ProfileStatus, stall_seconds: int) -> str:
    """Why one library is not current; for a stall, how long its change has waited."""
    waited = ""
    if status.paused:
        waited = ", paused (library or media server inactive)"
    elif status.dirty_seconds is not None and not status.catching_up(stall_seconds):
        waited = f", waiting {int(status.dirty_seconds) // 60} min"
    return f"library {status.library_id}: {status.reason}{waited}"


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
        limit=(PARTITION_WIDTH + 1) * len(wanted),
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


def record_checks(
    context: dg.OpExecutionContext | dg.AssetExecutionContext,
    by_range: dict[int, list[ProfileStatus]],
    stall_seconds: int,
) -> None:
    """Record the check of every range a run touched, from its libraries as the database
    has them (`range_statuses`), against the range's latest materialization."""
    targets = target_materializations(context.instance, [range_key(low) for low in by_range])
    for low, statuses in sorted(by_range.items()):
        partition = range_key(low)
        verdict = range_verdict(statuses, stall_seconds)
        # AssetCheckEvaluation is accepted at run time; the annotation predates it.
        context.log_event(
            dg.AssetCheckEvaluation(  # type: ignore[arg-type]
                asset_key=PROFILE_ASSET,
                check_name=CHECK_NAME,
                passed=verdict.passed,
                severity=verdict.severity,
                partition=partition,
                description=verdict.description,
                metadata=verdict.metadata,
                target_materialization_data=targets.get(partition),
            )
        )


# Stalled libraries reported per tick; the rest follow on later ticks, oldest first.
STALL_BATCH = 500


@dg.sensor(
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Fails library_profile_current for the partition of every library whose "
    "inventory change waits longer than INVENTORY_STALL_SECONDS, and records it again once "
    "the library is current, without a run and without claiming.",
)
@logged
def library_profile_staleness_sensor(
    context: dg.SensorEvaluationContext, inventory_db: InventoryDatabase
) -> dg.SensorResult | dg.SkipReason:
    """A stall turns the check red even when no run touches the library, and the check
    turns back once the library is current, whoever made it so. Each tick reads the next
    page of stalled libraries (STALL_BATCH, oldest first, from where the previous tick
    stopped, then from the start again: every stalled library is read within
    ceil(stalled / STALL_BATCH) ticks) and records one evaluation for each partition
    holding a newly stalled revision. The cursor remembers, per library, the revision
    reported; a reported library since acknowledged, paused or deleted has its partition
    evaluated again from the database and is forgotten. An inactive library is paused,
    not stalled: never reported."""
    policy = inventory_db.policy()
    reported, after = _staleness_cursor(context.cursor)
    known = set(context.instance.get_dynamic_partitions(PARTITIONS_NAME))
    newly: dict[int, list[StalledLibrary]] = {}
    with inventory_db.connection() as conn:
        page = service.stalled_libraries(conn, policy, STALL_BATCH, after)
        after = (page[-1].dirty_since, page[-1].library_id) if len(page) == STALL_BATCH else None
        seen = set()
        for lib in page:
            if partition_of(lib.library_id) not in known:
                continue  # the partition sync adds it; reported on a later tick
            seen.add(lib.library_id)
            if reported.get(lib.library_id) != lib.revision:
                newly.setdefault(low_of(lib.library_id), []).append(lib)
            reported[lib.library_id] = lib.revision
        others = [i for i in reported if i not in seen]
        progress = service.acknowledged_revisions(conn, others)

        def moved_on_from(library_id: int) -> bool:
            """Deleted, paused, or acknowledged up to the revision reported."""
            if library_id not in progress:
                return True
            acknowledged, paused = progress[library_id]
            return paused or acknowledged >= reported[library_id]

        moved_on = [i for i in others if moved_on_from(i)]
        for library_id in moved_on:
            del reported[library_id]
        # Each range's verdict from all of its libraries: the same figures as every
        # evaluation of this check, so its plots compare like with like.
        lows = sorted(set(newly) | {low_of(i) for i in moved_on if partition_of(i) in known})
        by_range = range_statuses(conn, lows)
        for low in lows:
            by_range.setdefault(low, [])  # its libraries are gone: the range passes
    targets = target_materializations(context.instance, [range_key(low) for low in by_range])
    events = []
    for low, statuses in sorted(by_range.items()):
        verdict = range_verdict(statuses, policy.stall_seconds)
        events.append(
            dg.AssetCheckEvaluation(
                asset_key=PROFILE_ASSET,
                check_name=CHECK_NAME,
                passed=verdict.passed,
                severity=verdict.severity,
                partition=range_key(low),
                description=verdict.description,
                metadata=verdict.metadata,
                target_materialization_data=targets.get(range_key(low)),
            )
        )
    cursor = _staleness_cursor_text(reported, after)
    if not events:
        if cursor != (context.cursor or ""):
            context.update_cursor(cursor)
        return dg.SkipReason(f"no newly stalled library ({len(reported)} stalled)")
    if newly:
        context.log.warning(
            f"{sum(map(len, newly.values()))} libraries newly stalled in {len(newly)}"
            f" partitions ({len(reported)} stalled)"
        )
    return dg.SensorResult(asset_events=events, cursor=cursor)


def _staleness_cursor(text: str | None) -> tuple[dict[int, int], tuple[datetime, int] | None]:
    """The libraries reported stalled (id -> revision) and where the next page starts. An
    earlier version's cursor is the bare id -> revision map."""
    state = json.loads(text) if text else {}
    if "reported" not in state:
        state = {"reported": state, "after": None}
    after = state.get("after")
    position = (datetime.fromisoformat(after[0]), int(after[1])) if after else None
    return {int(k): int(v) for k, v in state["reported"].items()}, position


def _staleness_cursor_text(reported: dict[int, int], after: tuple[datetime, int] | None) -> str:
    position = [after[0].isoformat(), after[1]] if after is not None else None
    return json.dumps(
        {"reported": {str(k): v for k, v in sorted(reported.items())}, "after": position},
        sort_keys=True,
    )
