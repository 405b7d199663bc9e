"""Profile capability at 1k, 10k and 100k libraries (issue goal S1): the profile
sensor's tick, idle and while a whole-population backlog drains.

The tick is the sensor's own evaluation (plan + partition sync + claimable count +
runs waiting), in process against a scratch inventory database and a Dagster instance
on dagster-postgres storage in a second scratch database, both on the bench server. The
partition requests a tick returns are applied as the daemon would before the next tick.

Idle: every library acknowledged and one partition each. Backlog: every library dirty,
all but one batch already holding a pending request (what a whole-population burst
looks like after the first ticks), and between ticks 500 of them complete as a refresh
run would (request succeeded, revision acknowledged). Sizes follow `mode.pick`: tiny
under `--smoke` (CI), 1k and 10k by default, 100k added under `--scale`.

`python -m bench.scale_profiles [--smoke | --scale]` runs it alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

import dagster as dg

from bench.common import Figure, scratch_database, server_url
from inventory_pipeline.db import connect, execute, fetch_one
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.defs import profiles as profile_defs
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.deployment import dagster_storage_url

T = TypeVar("T")
GOAL_SECONDS = 0.5

SERVER = "INSERT INTO media_servers (id, name, kind) VALUES (1, 'bench', 'plex')"
LIBRARIES = """
INSERT INTO libraries (id, server_id, name, media_kind)
SELECT g, 1, 'library ' || g, 'movie' FROM generate_series(1, %(libraries)s) g;
"""
ACKNOWLEDGE_ALL = """
UPDATE library_inventory_state
SET revision = 1, acknowledged_revision = 1, dirty_since = NULL, acknowledged_at = now()
"""
# Every library dirty (a burst in one statement shares one dirty_since).
DIRTY_ALL = """
UPDATE library_inventory_state SET revision = revision + 1, dirty_since = now(), changed_at = now()
"""
# All but the last `fresh` libraries already queued by earlier ticks.
QUEUED = """
INSERT INTO profile_refresh_requests (library_id, kind, source, reason, inventory_revision)
SELECT s.library_id, 'inventory_change', 'inventory_revision', 'inventory_changed', s.revision
FROM library_inventory_state s
WHERE s.library_id <= %(queued)s
"""
# What a refresh run does to `n` requests, oldest first: succeed and acknowledge.
DRAIN = """
WITH done AS (
    UPDATE profile_refresh_requests r
    SET status = 'succeeded', finished_at = now()
    WHERE r.id IN (SELECT id FROM profile_refresh_requests WHERE status = 'pending'
                   ORDER BY available_at, id LIMIT %(n)s)
    RETURNING r.library_id, r.inventory_revision
)
UPDATE library_inventory_state s
SET acknowledged_revision = GREATEST(s.acknowledged_revision, done.inventory_revision),
    acknowledged_at = now(),
    dirty_since = CASE WHEN done.inventory_revision >= s.revision THEN NULL ELSE s.dirty_since END
FROM done
WHERE s.library_id = done.library_id
"""


class _Mode(Protocol):
    """What this bench reads of the runner's mode (bench.common.Mode)."""

    @property
    def smoke(self) -> bool: ...

    def pick(self, smoke: T, default: T, scale: T | None = None) -> T: ...


class _LocalMode:
    """The mode when this module runs alone."""

    def __init__(self, size: str) -> None:
        self.size = size

    @property
    def smoke(self) -> bool:
        return self.size == "smoke"

    def pick(self, smoke: T, default: T, scale: T | None = None) -> T:
        if self.size == "smoke":
            return smoke
        if self.size == "scale" and scale is not None:
            return scale
        return default


@contextmanager
def _instance(admin_url: str) -> Iterator[dg.DagsterInstance]:
    name = f"inventory_bench_dagster_{uuid.uuid4().hex[:8]}"
    with connect(admin_url) as admin:
        create_database(admin, name)
    try:
        storage = {
            "postgres": {"postgres_url": dagster_storage_url(url_with_database(admin_url, name))}
        }
        with dg.instance_for_test(overrides={"storage": storage}) as instance:
            yield instance
    finally:
        with connect(admin_url) as admin:
            drop_database(admin, name)


def _apply(instance: dg.DagsterInstance, result: Any) -> None:
    """What the daemon does with a tick's partition requests."""
    if not isinstance(result, dg.SensorResult):
        return
    for request in result.dynamic_partitions_requests or []:
        keys = list(request.partition_keys or [])
        if isinstance(request, dg.AddDynamicPartitionsRequest):
            for start in range(0, len(keys), 10_000):
                instance.add_dynamic_partitions(
                    request.partitions_def_name, keys[start : start + 10_000]
                )
        else:
            for key in keys:
                instance.delete_dynamic_partition(request.partitions_def_name, key)


def _tick(
    instance: dg.DagsterInstance, db: InventoryDatabase, cursor: str | None
) -> tuple[float, str | None]:
    context = dg.build_sensor_context(
        instance=instance, cursor=cursor, resources={"inventory_db": db}
    )
    start = time.perf_counter()
    result = profile_defs.library_profile_sensor(context)
    elapsed = time.perf_counter() - start
    _apply(instance, result)
    return elapsed, context.cursor


def _figures(size: int, state: str, samples: list[float], judged: bool) -> list[Figure]:
    p50 = statistics.median(samples)
    worst = max(samples)
    goal = f"<= {GOAL_SECONDS} s at 100k"
    met = None if not judged else worst <= GOAL_SECONDS
    note = f"{len(samples)} ticks"
    return [
        Figure(
            f"S1 tick p50, {state}, {size} libraries",
            p50,
            " s",
            goal,
            None if not judged else p50 <= GOAL_SECONDS,
            note,
        ),
        Figure(f"S1 tick max, {state}, {size} libraries", worst, " s", goal, met, note),
    ]


def measure(admin_url: str, size: int, ticks: int, judged: bool) -> list[Figure]:
    """Idle and backlog tick figures at one size."""
    with scratch_database(admin_url) as url, connect(url) as conn, _instance(admin_url) as instance:
        execute(conn, SERVER)
        execute(conn, LIBRARIES, {"libraries": size})
        execute(conn, ACKNOWLEDGE_ALL)
        execute(conn, "ANALYZE")
        db = InventoryDatabase(url=url)
        cold, cursor = _tick(instance, db, None)  # adds every partition
        _full, cursor = _tick(instance, db, cursor)  # diffs once more after its own adds
        idle = [_tick(instance, db, cursor)[0] for _ in range(ticks)]
        # The periodic full diff (every FULL_SYNC_SECONDS, or after a library change).
        resync = [_tick(instance, db, None)[0] for _ in range(3)]
        figures = _figures(size, "idle", idle, judged)
        figures.append(
            Figure(
                f"S1 tick, full partition diff, {size} libraries",
                statistics.median(resync),
                " s",
                "every 10 min or on a library change",
                None,
                f"first tick {cold:.2f} s",
            )
        )
        fresh = min(size, 25)
        execute(conn, DIRTY_ALL)
        execute(conn, QUEUED, {"queued": size - fresh})
        execute(conn, "ANALYZE")
        backlog = []
        for _ in range(ticks):
            elapsed, cursor = _tick(instance, db, cursor)
            backlog.append(elapsed)
            execute(conn, DRAIN, {"n": 500})
        row = fetch_one(
            conn, "SELECT count(*) AS n FROM profile_refresh_requests WHERE status = 'pending'"
        )
        left = int(row["n"]) if row else 0
        figures.extend(_figures(size, "backlog", backlog, judged))
        figures[-1] = Figure(
            figures[-1].name,
            figures[-1].value,
            figures[-1].unit,
            figures[-1].goal,
            figures[-1].met,
            f"{ticks} ticks, {left} requests still pending after",
        )
        return figures


def run(admin_url: str, mode: _Mode) -> list[Figure]:
    """S1 figures at the sizes `mode` selects; only the 100k size is judged."""
    sizes: list[int] = mode.pick(
        smoke=[200], default=[1_000, 10_000], scale=[1_000, 10_000, 100_000]
    )
    ticks = mode.pick(smoke=3, default=15, scale=15)
    figures: list[Figure] = []
    for size in sizes:
        figures.extend(measure(admin_url, size, ticks, judged=size >= 100_000))
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale_profiles")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--smoke", action="store_true")
    group.add_argument("--scale", action="store_true")
    args = parser.parse_args()
    mode = _LocalMode("smoke" if args.smoke else "scale" if args.scale else "default")
    with server_url() as admin_url:
        for figure in run(admin_url, mode):
            print(figure.line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
