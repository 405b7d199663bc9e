"""Profile generation against a bare read of the same projection into pandas.

Baseline: read the library's projection (the profile reader's own query) into a
DataFrame. Measured: the worker's whole generation (snapshot read with revision,
DataFrame, every trait). Goal <= 3x at 100k items; the 10k figure shows how the cost
grows with size.
"""

from __future__ import annotations

from bench.common import Figure, Mode, median, over_runs, scratch_database, timed
from inventory_pipeline.db import connect, execute
from inventory_pipeline.db.connection import execute_script
from inventory_pipeline.db.queries import load_queries
from inventory_pipeline.profiles import repository, service
from inventory_pipeline.profiles.generator import frame_from_rows, generate_profile

Q = load_queries("bench", "variants.sql")


def run(admin_url: str, mode: Mode) -> list[Figure]:
    smoke = mode.smoke
    sizes = (1_000, 5_000) if smoke else (10_000, 100_000)
    reps = 1 if smoke else 5
    figures = []
    with scratch_database(admin_url) as url, connect(url) as conn:
        execute_script(conn, Q["setup_libraries"])
        for size in sizes:
            execute(conn, Q["truncate_items"])
            execute(conn, Q["sync_insert"], {"items": size * 10})  # ten libraries
            execute(conn, "VACUUM ANALYZE media_server_items")

            def bare() -> None:
                columns, rows = repository.read_observation(conn, 1)
                frame_from_rows(columns, tuple(rows))

            def generation() -> None:
                observation = service.observe(conn, 1)
                generate_profile(frame_from_rows(observation.columns, observation.rows))

            bare()  # warm caches for both
            base, full = [], []
            for rep in range(reps):  # alternate which side goes first
                if rep % 2:
                    full.append(timed(generation))
                    base.append(timed(bare))
                else:
                    base.append(timed(bare))
                    full.append(timed(generation))
            figures.append(
                over_runs(
                    f"profile generation vs bare projection read ({size // 1000}k items)",
                    [f / b for f, b in zip(full, base, strict=True)],
                    "x",
                    f"goal <= 3x; bare read {median(base) * 1000:.0f} ms, "
                    f"generation {median(full) * 1000:.0f} ms (medians)",
                    None if smoke or size < 100_000 else (lambda r: r <= 3),
                )
            )
    return figures
