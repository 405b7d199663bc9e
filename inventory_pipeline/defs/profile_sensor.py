"""The profile sensor: it keeps the partition set in step with the libraries (a range
holding a library has a partition; a key that is not a library range is reported and
removed), plans dirty libraries and launches refresh runs for the backlog. A tick never
claims: ticks fail, are previewed and retried, and a run may wait in the queue."""

# No `from __future__ import annotations` here: Dagster reads op, asset and check
# signatures at definition time and compares the context annotation to real classes.

import json
import time
from collections.abc import Sequence

import dagster as dg

from inventory_pipeline.defs.profile_ranges import (
    PARTITION_WIDTH,
    PARTITIONS_NAME,
    is_partition_key,
    library_partitions,
    partition_of,
    range_key,
    range_low,
)
from inventory_pipeline.defs.profiles import (
    REFRESH_QUEUE,
    library_profile_refresh,
    materialization_grace,
)
from inventory_pipeline.defs.resources import QUEUE_TAG, InventoryDatabase, runs_waiting
from inventory_pipeline.defs.ticks import cursor_state, logged
from inventory_pipeline.profiles import service

# Dirty libraries a skip reason counts before it says "1000+".
DIRTY_SHOWN = 1000
# A refresh run's tag saying what the tick that launched it found.
PLAN_TAG = "inventory_pipeline/plan"


def plural(count: int, noun: str) -> str:
    """The noun for a count: one library, two libraries."""
    if count == 1:
        return noun
    return noun[:-1] + "ies" if noun.endswith("y") else noun + "s"


def _partition_order(key: str) -> tuple[int, int, str]:
    low = range_low(key)
    return (0, low, "") if low is not None else (1, 0, key)


# A full partition diff at least this often even when nothing seems to have changed:
# it restores a range partition deleted by hand in the UI, which no cheap signal shows.
FULL_SYNC_SECONDS = 60


def _newest_partition(instance: dg.DagsterInstance) -> str:
    """The newest key of the partition set (one indexed row): it changes whenever a key
    is added, by this sensor or by hand ("" for an empty set)."""
    page = instance.get_paginated_dynamic_partitions(PARTITIONS_NAME, limit=1, ascending=False)
    return page.results[0] if page.results else ""


def _partition_changes(
    context: dg.SensorEvaluationContext, wanted: set[str]
) -> tuple[list[str], list[dg.DeleteDynamicPartitionsRequest], str]:
    """The ranges that hold a library and have no partition (to add), the request
    deleting every key that is not such a range, and the warning for the foreign keys
    removed."""
    known = set(context.instance.get_dynamic_partitions(PARTITIONS_NAME))
    gone = sorted(known - wanted, key=_partition_order)
    deletes = [library_partitions.build_delete_request(gone)] if gone else []
    foreign = [key for key in gone if not is_partition_key(key)]
    removed = ""
    if foreign:
        shown = ", ".join(repr(key[:40]) for key in foreign[:5])
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        removed = f"removed partition keys that are not library id ranges: {shown}{more}; "
        context.log.warning(removed.rstrip("; "))
    return sorted(wanted - known, key=_partition_order), deletes, removed


def _add_partitions(context: dg.SensorEvaluationContext, keys: Sequence[str]) -> None:
    """Add partition keys in one statement. Returned as a request instead, the daemon
    would ask the storage about each key on a connection of its own: 10,000 new ranges
    (a first tick at 100k libraries) took minutes, during which the tick held the sensor.
    Adding a key that exists changes nothing, so a previewed tick may add them too."""
    context.instance.add_dynamic_partitions(PARTITIONS_NAME, keys)
    shown = keys[0] if len(keys) == 1 else f"{keys[0]} … {keys[-1]}"
    context.log.info(f"added {len(keys)} partitions: {shown}")


@dg.sensor(
    job=library_profile_refresh,
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Keeps partitions in step with libraries, plans dirty libraries and "
    "launches refresh runs for the backlog; the runs claim when they start.",
)
@logged
def library_profile_sensor(
    context: dg.SensorEvaluationContext, inventory_db: InventoryDatabase
) -> dg.SensorResult | dg.SkipReason:
    """A tick never claims: ticks fail, are previewed from the UI and are retried, and a
    run may wait in the queue for minutes. It launches enough runs for the backlog
    (`run_claims` each), never more than `max_runs_per_tick` waiting to start. Partition
    keys that are not library id ranges (added by hand in the UI) are reported and
    removed.

    The partition sync reads neither key set while the library set's fingerprint and
    the newest partition key are those of the last sync (the cursor keeps both). When
    only libraries were created since, it adds the keys of their ranges; any other
    change (a library deleted, a key added by hand) or FULL_SYNC_SECONDS since the last
    diff diffs the ranges that hold a library with the partition keys: a range loses
    its partition when its last library is deleted."""
    policy = inventory_db.policy()
    max_runs = inventory_db.max_runs_per_tick()
    state = cursor_state(context.cursor, "runs")
    newest = _newest_partition(context.instance)
    partition_requests: list[dg.DeleteDynamicPartitionsRequest] = []
    added: list[str] = []
    removed = ""
    with inventory_db.connection() as conn:
        plan = service.plan(conn, policy)
        claimable = service.claimable(conn, max_runs * policy.run_claims)
        behind = service.dirty(conn, DIRTY_SHOWN) if claimable == 0 else 0
        # Completions a run that ended first did not record: a run records them as it
        # starts; with no other work, one is launched for them.
        late = (
            bool(service.materializations_due(conn, materialization_grace(policy), 1))
            if claimable == 0
            else False
        )
        fingerprint = service.library_fingerprint(conn)
        # A cursor of another width (one key per library before) was synced to other keys.
        recent = (
            state.get("newest") == newest
            and state.get("width") == PARTITION_WIDTH
            and time.time() - float(state.get("synced_at", 0)) < FULL_SYNC_SECONDS
        )
        if not (recent and state.get("libraries") == fingerprint.token):
            appended = (
                service.library_ids_after(conn, int(state.get("max_id", 0))) if recent else []
            )
            count = int(state.get("count", -1))
            if appended and fingerprint.libraries == count + len(appended):
                # Only libraries created since the last sync: add the keys of their
                # ranges, no diff. Only the range of the last synced id can exist.
                synced = partition_of(int(state["max_id"])) if state.get("max_id") else None
                added = sorted({partition_of(i) for i in appended} - {synced}, key=_partition_order)
            else:
                ranges = {range_key(low) for low in service.library_ranges(conn, PARTITION_WIDTH)}
                added, partition_requests, removed = _partition_changes(context, ranges)
            if added:
                _add_partitions(context, added)
            deletes = bool(partition_requests)
            # The newest key is now the last one added (keys are added in order); after
            # a deletion it is not known, and the next tick diffs again.
            if added:
                newest = added[-1]
            state = {
                **state,
                "libraries": fingerprint.token,
                "count": fingerprint.libraries,
                "max_id": fingerprint.max_id,
                "newest": None if deletes else newest,
                "synced_at": time.time(),
                "width": PARTITION_WIDTH,
            }
    wanted = min(max_runs, -(-claimable // policy.run_claims)) or int(late)
    waiting = runs_waiting(context.instance, library_profile_refresh.name)
    launches = max(0, wanted - waiting)
    first = int(state["runs"])
    # What the tick found and does, the same line in each request's tags and in the
    # skip reason: a preview from the UI shows one of the two.
    # The count stops at what the runs it may launch can claim.
    more = "+" if claimable >= max_runs * policy.run_claims else ""
    found = (
        f"{claimable}{more} {plural(claimable, 'library')} to refresh "
        f"({plan.planned} planned by this tick, {plan.expired} expired leases)"
    )
    if late:
        found += "; completions of a run that ended before recording them"
    runs = [
        dg.RunRequest(
            # Unique per launch: Dagster never re-fires a run_key whose run failed.
            run_key=f"profile-refresh-{first + n + 1}",
            tags={
                QUEUE_TAG: REFRESH_QUEUE,
                "inventory_pipeline/claimable": str(claimable),
                PLAN_TAG: f"{found}; launching {launches} {plural(launches, 'run')} "
                f"of up to {policy.run_claims} claims each",
            },
        )
        for n in range(launches)
    ]
    state = {**state, "runs": first + len(runs)}
    cursor = json.dumps(state, sort_keys=True)
    if cursor != context.cursor:
        context.update_cursor(cursor)
    if claimable == 0 and behind == 0:
        reason = "nothing to refresh"
    elif claimable == 0:
        # Claimed by a run, waiting for a retry or a closed circuit, or inactive.
        reason = (
            f"nothing to claim now: {behind}{'+' if behind == DIRTY_SHOWN else ''} "
            f"{plural(behind, 'library')} behind, being refreshed or not due yet"
        )
    else:
        reason = f"{found}; {waiting} {plural(waiting, 'run')} already waiting to start"
    skip = f"{removed}{reason}"
    if added:
        skip = f"added {len(added)} partitions; {skip}"
    if not runs and not partition_requests:
        return dg.SkipReason(skip)
    context.log.info(found)
    return dg.SensorResult(
        run_requests=runs,
        dynamic_partitions_requests=partition_requests,
        skip_reason=None if runs else skip,
    )
