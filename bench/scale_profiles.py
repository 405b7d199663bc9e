"""Profile capability at 1k, 10k and 100k libraries (BENCHMARKS.md, S1): the profile
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
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

import dagster as dg

from bench.common import Figure, scratch_database, server_url
from chaos.servers import free_port
from inventory_pipeline.db import connect, execute, fetch_one
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.defs import profile_ranges as ranges
from inventory_pipeline.defs import profile_sensor
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.deployment import (
    WEBSERVER_COMMAND,
    dagster_storage_url,
    prepare_dagster_home,
    start_dagster,
    stop_dagster,
)
from inventory_pipeline.settings import Settings

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
    """What the daemon does with a tick's partition requests (the tick adds keys itself;
    a request adding them is still applied the daemon's way, one call per slice)."""
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
    result = profile_sensor.library_profile_sensor(context)
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
        resync = [_tick(instance, db, None)[0] for _ in range(5)]
        figures = _figures(size, "idle", idle, judged)
        figures.append(
            Figure(
                f"S1 tick, full partition diff, {size} libraries",
                statistics.median(resync),
                " s",
                f"<= {GOAL_SECONDS} s at 100k (every minute or on a library change)",
                None if not judged else max(resync) <= GOAL_SECONDS,
                f"median of 5, min {min(resync):.2f}, max {max(resync):.2f} s; "
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


HEALTH = """
query PartitionHealthQuery($assetKey: AssetKeyInput!) {
  assetNodeOrError(assetKey: $assetKey) {
    ... on AssetNode {
      id
      partitionKeysByDimension { name type partitionKeys }
      assetPartitionStatuses {
        ... on DefaultPartitionStatuses {
          materializedPartitions materializingPartitions failedPartitions
        }
      }
    }
  }
}
"""


def _post(url: str, query: str, variables: dict[str, Any]) -> bytes:
    body = json.dumps({"query": query, "variables": variables}).encode()
    request = urllib.request.Request(
        f"{url}/graphql", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return bytes(response.read())


def _serves(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/server_info", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def partition_keys(libraries: int) -> list[str]:
    """The partition keys the sensor keeps for libraries 1..`libraries`."""
    lows = range(0, libraries + 1, ranges.PARTITION_WIDTH)
    return [ranges.range_key(low) for low in lows if low + ranges.PARTITION_WIDTH > 1]


def partitions_tab(
    admin_url: str, size: int, browser: bool, per_library: bool = False
) -> list[Figure]:
    """S4: the asset's Partitions tab at `size` libraries (their range partitions) and no
    materialization: the partition-health query the UI sends (time, response size) on a
    real webserver, and with `browser`, Chromium's time from navigation to the tab's
    partition bar. `per_library` measures the former mapping instead, one key per
    library, for a before/after under the same load."""
    with (
        scratch_database(admin_url) as url,
        tempfile.TemporaryDirectory(prefix="inventory-bench-ui-") as home,
    ):
        storage_name = f"inventory_bench_dagster_{uuid.uuid4().hex[:8]}"
        with connect(admin_url) as admin:
            create_database(admin, storage_name)
        storage_url = dagster_storage_url(url_with_database(admin_url, storage_name))
        proc = None
        try:
            storage = {"postgres": {"postgres_url": storage_url}}
            with dg.instance_for_test(overrides={"storage": storage}) as instance:
                keys = [str(i) for i in range(1, size + 1)] if per_library else partition_keys(size)
                for start in range(0, len(keys), 10_000):
                    instance.add_dynamic_partitions(
                        ranges.PARTITIONS_NAME, keys[start : start + 10_000]
                    )
            prepare_dagster_home(Settings.from_env({}), {"DAGSTER_HOME": home})
            env = dict(os.environ)
            env.update(
                {
                    "DAGSTER_HOME": home,
                    "INVENTORY_DATABASE_URL": url,
                    "INVENTORY_DAGSTER_STORAGE_URL": storage_url,
                }
            )
            port = free_port()  # below the ephemeral range its code server draws from
            web = f"http://127.0.0.1:{port}"
            with (Path(home) / "webserver.log").open("wb") as log:
                proc = start_dagster(
                    [
                        *WEBSERVER_COMMAND,
                        "-h",
                        "127.0.0.1",
                        "-p",
                        str(port),
                        "-m",
                        "inventory_pipeline.definitions",
                    ],
                    env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            deadline = time.monotonic() + 180
            while not _serves(web):
                if time.monotonic() > deadline:
                    raise RuntimeError("the webserver did not start")
                time.sleep(0.5)
            variables = {"assetKey": {"path": ["library_profile"]}}
            _post(web, HEALTH, variables)  # warm: code location loaded
            samples = []
            size_bytes = 0
            for _ in range(5):
                start = time.perf_counter()
                size_bytes = len(_post(web, HEALTH, variables))
                samples.append(time.perf_counter() - start)
            judged = size >= 100_000
            figures = [
                Figure(
                    f"S4 partition-health query, {size} libraries ({len(keys)} partitions)",
                    statistics.median(samples),
                    " s",
                    "tab <= 2 s at 100k",
                    None,
                    f"max {max(samples):.2f} s, response {size_bytes / 1000:.0f} KB, 5 runs",
                ),
            ]
            if browser:
                figures.append(_browser(web, size, len(keys), judged))
            return figures
        finally:
            if proc is not None:
                stop_dagster(proc, timeout=5)
            with connect(admin_url) as admin:
                drop_database(admin, storage_name)


def _browser(web: str, size: int, partitions: int, judged: bool) -> Figure:
    """Chromium: from navigation to the Partitions tab until its partition-health
    response has arrived, and until the page went quiet (Playwright's network idle: no
    request for 500 ms, which it includes), the median and range of 5 loads after a first
    one."""
    from playwright.sync_api import sync_playwright

    health_at: list[float] = []
    quiet_at: list[float] = []
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path="/usr/bin/chromium")
        try:
            for _ in range(6):
                page = chromium.new_page()
                start = time.perf_counter()
                with page.expect_response(
                    lambda r: "PartitionHealthQuery" in (r.request.post_data or ""),
                    timeout=120_000,
                ) as health:
                    page.goto(f"{web}/assets/library_profile?view=partitions")
                health.value.finished()
                health_at.append(time.perf_counter() - start)
                page.wait_for_load_state("networkidle", timeout=120_000)
                quiet_at.append(time.perf_counter() - start)
                page.close()
        finally:
            chromium.close()
    loads = health_at[1:]  # the first load also compiles the app
    value = statistics.median(loads)
    return Figure(
        f"S4 Partitions tab in Chromium, {size} libraries ({partitions} partitions)",
        value,
        " s",
        "<= 2 s at 100k",
        value <= 2.0 if judged else None,
        f"navigation to health response (min {min(loads):.2f}, max {max(loads):.2f}, 5 loads); "
        f"to network idle {statistics.median(quiet_at[1:]):.2f} s; load average "
        f"{Path('/proc/loadavg').read_text().split()[0]}",
    )


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale_profiles")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--smoke", action="store_true")
    group.add_argument("--scale", action="store_true")
    parser.add_argument("--ui", nargs="*", type=int, help="S4 only, at these library counts")
    parser.add_argument("--browser", action="store_true", help="S4 also in Chromium")
    parser.add_argument(
        "--per-library",
        action="store_true",
        help="S4 with the former mapping, one partition key per library (the before figure)",
    )
    args = parser.parse_args()
    if args.ui is not None:
        with server_url() as admin_url:
            for size in args.ui or [1_000, 10_000, 100_000]:
                for figure in partitions_tab(admin_url, size, args.browser, args.per_library):
                    print(figure.line(), flush=True)
        return 0
    mode = _LocalMode("smoke" if args.smoke else "scale" if args.scale else "default")
    with server_url() as admin_url:
        for figure in run(admin_url, mode):
            print(figure.line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
