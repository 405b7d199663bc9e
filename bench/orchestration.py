"""A burst of dirty libraries through the real Dagster daemon: batched runs (this
project) against the same sensor with a claim batch of 1 (one run per library, the
shape a Dagster user's one-run-per-partition sensor would have).

Both modes run the same daemon, dagster.yaml and code; the baseline only sets the claim
batch to one library and lifts the cap on runs per tick. It is not a separately written
per-partition sensor. The figure is wall time from the commit of the burst to every
library acknowledged; the speed-up is paired within each repetition, and the
repetitions alternate which mode goes first.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from bench.common import Figure, Mode, over_runs, scratch_database
from inventory_pipeline.db import connect, execute, fetch_one
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.deployment import (
    DAEMON_COMMAND,
    dagster_storage_url,
    prepare_dagster_home,
    start_dagster,
    stop_dagster,
)
from inventory_pipeline.settings import Settings

BURST = """
INSERT INTO media_servers (id, name, kind) VALUES (1, 'bench', 'plex');
INSERT INTO libraries (id, server_id, name, media_kind)
SELECT g, 1, 'library ' || g, 'movie' FROM generate_series(1, %(libraries)s) g;
"""
ITEMS = """
INSERT INTO media_server_items (library_id, title, rating, genres, primary_studio,
                                original_language, provider, provider_kind, provider_id)
SELECT l, 'Title ' || g, (mod(g, 100)) / 10.0, ARRAY['Drama'], 'Studio ' || mod(g, 7), 'en',
       'tmdb', 'movie', (l * 1000 + g)::text
FROM generate_series(1, %(libraries)s) l, generate_series(1, 50) g
"""
PENDING = """
SELECT count(*) AS n FROM library_inventory_state WHERE acknowledged_revision < revision
"""


@contextlib.contextmanager
def daemon(admin_url: str, app_url: str, extra_env: dict[str, str]) -> Iterator[str]:
    """The real daemon (this repo's dagster.yaml) on `app_url`; yields the URL of its
    storage database, a scratch database dropped afterwards."""
    name = f"inventory_bench_dagster_{uuid.uuid4().hex[:8]}"
    with connect(admin_url) as admin:
        create_database(admin, name)
    try:
        with tempfile.TemporaryDirectory(prefix="inventory-bench-dagster-") as home:
            prepare_dagster_home(Settings.from_env({}), {"DAGSTER_HOME": home})
            env = dict(os.environ)
            env.update(
                {
                    "DAGSTER_HOME": home,
                    "INVENTORY_DATABASE_URL": app_url,
                    "INVENTORY_DAGSTER_STORAGE_URL": dagster_storage_url(
                        url_with_database(admin_url, name)
                    ),
                    **extra_env,
                }
            )
            log = Path(home) / "daemon.log"
            with log.open("wb") as out:
                proc = start_dagster(
                    [*DAEMON_COMMAND, "run", "-m", "inventory_pipeline.definitions"],
                    env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
                try:
                    yield url_with_database(admin_url, name)
                finally:
                    stop_dagster(proc, timeout=60)
    finally:  # also when interrupted: the storage database is ours to drop
        with connect(admin_url) as admin:
            drop_database(admin, name)


def burst(admin_url: str, libraries: int, extra_env: dict[str, str], limit: float) -> float:
    with scratch_database(admin_url) as url, connect(url) as conn:
        execute(conn, BURST.replace("%(libraries)s", str(int(libraries))))
        with daemon(admin_url, url, extra_env):
            time.sleep(8)  # let the daemon and its code server come up
            start = time.monotonic()
            execute(conn, ITEMS, {"libraries": libraries})
            while time.monotonic() - start < limit:
                execute(conn, "SELECT fold_inventory_changes()")
                row = fetch_one(conn, PENDING)
                if row is not None and row["n"] == 0:
                    return time.monotonic() - start
                time.sleep(0.25)
    raise RuntimeError(f"burst of {libraries} libraries not acknowledged within {limit:.0f} s")


def run(admin_url: str, mode: Mode) -> list[Figure]:
    libraries = mode.pick(smoke=10, default=500)
    # The baseline is a rate per library, one run each (about 6 s a library): three
    # libraries prove it runs.
    per_partition_libraries = mode.pick(smoke=3, default=30)
    reps = mode.pick(smoke=1, default=5)
    batched: list[float] = []
    single_per_library: list[float] = []
    for rep in range(reps):
        for mode_name in ("batched", "single") if rep % 2 == 0 else ("single", "batched"):
            if mode_name == "batched":
                batched.append(burst(admin_url, libraries, {}, limit=600))
            else:
                single = burst(
                    admin_url,
                    per_partition_libraries,
                    {"INVENTORY_RUN_CLAIMS": "1", "INVENTORY_MAX_RUNS_PER_TICK": "1000"},
                    limit=1200,
                )
                # Measured on fewer libraries (it is linear in runs) and extrapolated
                # per library, so the run stays bounded.
                single_per_library.append(single / per_partition_libraries)
    ratios = [s * libraries / b for s, b in zip(single_per_library, batched, strict=True)]
    return [
        over_runs(
            f"burst of {libraries} dirty libraries, batched runs",
            batched,
            " s",
            "wall time commit -> all acknowledged",
        ),
        over_runs(
            "baseline: the same sensor with a claim batch of 1, one run per library"
            f" ({per_partition_libraries} libraries measured)",
            single_per_library,
            " s/library",
            "baseline",
        ),
        over_runs(
            "batched speed-up over a claim batch of 1",
            ratios,
            "x",
            "goal >= 10x",
            None if mode.smoke else (lambda r: r >= 10),
        ),
    ]
