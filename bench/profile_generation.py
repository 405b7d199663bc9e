"""Profile generation against a bare read of the same projection.

Baseline: read the library's projection (the profile reader's own query) into row
tuples. Measured: the worker's whole generation (snapshot read with revision, every
trait). One library of N varied items (ratings with gaps, zero to four
genres with repeats and blanks, studios and languages with gaps, a few untyped items);
goal <= 3x at 100k items and, under `--scale` (S3), at 1M items, where the run's peak
RSS must stay <= 2 GiB: a generation and a bare read each run alone in a fresh process
whose own peak RSS (VmHWM) is reported, next to the same process's RSS before the
read (interpreter, numpy, a connection).
"""

from __future__ import annotations

import multiprocessing
import resource
import statistics

from bench.common import Figure, Mode, median, over_runs, plot, scratch_database, timed
from inventory_pipeline.db import Connection, connect, execute
from inventory_pipeline.db.connection import execute_script
from inventory_pipeline.profiles import repository, service
from inventory_pipeline.profiles.generator import generate_profile

LIBRARY = """
INSERT INTO media_servers (id, name, kind) VALUES (1, 'bench', 'plex');
INSERT INTO libraries (id, server_id, name, media_kind) VALUES (1, 1, 'movies', 'movie');
"""
# One library of varied items, added in slices of 100k (the capture's transition tables
# stay bounded): every trait has gaps, ties and a long tail.
FILL = """
INSERT INTO media_server_items (library_id, title, provider, provider_kind, provider_id,
                                rating, genres, primary_studio, original_language)
SELECT 1, 'Title ' || g,
       CASE WHEN g %% 97 = 0 THEN NULL WHEN g %% 89 = 0 THEN 'imdb' ELSE 'tmdb' END,
       CASE WHEN g %% 97 = 0 THEN NULL WHEN g %% 3 = 0 THEN 'tv' ELSE 'movie' END,
       CASE WHEN g %% 97 = 0 THEN NULL ELSE g::text END,
       CASE WHEN g %% 7 = 0 THEN NULL ELSE (g * 37 %% 101) / 10.0 END,
       CASE WHEN g %% 11 = 0 THEN NULL
            ELSE (ARRAY['Drama', 'Comedy', 'Action', 'Thriller', 'Horror', 'Romance',
                        'Documentary', 'Animation', 'Family', 'Crime', 'Sci-Fi', 'War'])[
                     1:(g %% 5)] || CASE WHEN g %% 13 = 0 THEN ARRAY['Drama', ''] ELSE '{}' END
       END,
       CASE WHEN g %% 5 = 0 THEN NULL ELSE 'Studio ' || (g * 7919 %% 53) END,
       CASE WHEN g %% 17 = 0 THEN NULL ELSE (ARRAY['en', 'fr', 'de', 'ja', 'ko', 'es', 'it'])[
            1 + (g * 31 %% 7)] END
FROM generate_series(%(first)s::bigint, %(last)s::bigint) g
"""
SLICE = 100_000


def load(conn: Connection, loaded: int, size: int) -> None:
    """Grow library 1 from `loaded` to `size` items."""
    for first in range(loaded + 1, size + 1, SLICE):
        execute(conn, FILL, {"first": first, "last": min(first + SLICE - 1, size)})


def _high_water() -> int:
    """This process's peak RSS in bytes. /proc's VmHWM belongs to the process's own
    address space, so it starts afresh in a spawned child; `getrusage`'s ru_maxrss
    (the fallback off Linux) keeps the parent's RSS at the fork."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_rss(url: str, what: str, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """In a fresh process: RSS before and peak RSS after one bare read or generation."""
    with connect(url) as conn:
        before = _high_water()
        if what == "bare":
            _, rows = repository.read_snapshot(conn, 1)
            tuple(rows)
        else:
            library = service.read_snapshot(conn, 1)
            generate_profile(library.columns, library.rows)
        queue.put((before, _high_water()))


def peak_rss(url: str, what: str) -> tuple[int, int]:
    """(bytes before the read, peak bytes) of a fresh process doing `what` once."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_peak_rss, args=(url, what, queue))
    child.start()
    result = queue.get(timeout=1800)
    child.join()
    return result  # type: ignore[no-any-return]


def run(admin_url: str, mode: Mode) -> list[Figure]:
    smoke = mode.smoke
    sizes = mode.pick(smoke=(1_000, 5_000), default=(10_000, 100_000), scale=(100_000, 1_000_000))
    reps = 1 if smoke else 5
    figures = []
    curve: dict[str, list[tuple[float, float]]] = {"ratio": [], "peak GiB": []}
    with scratch_database(admin_url) as url, connect(url) as conn:
        execute_script(conn, LIBRARY)
        loaded = 0
        for size in sizes:
            load(conn, loaded, size)
            loaded = size
            execute(conn, "VACUUM ANALYZE")

            def bare() -> None:
                _, rows = repository.read_snapshot(conn, 1)
                tuple(rows)

            def generation() -> None:
                library = service.read_snapshot(conn, 1)
                generate_profile(library.columns, library.rows)

            bare()  # warm caches for both
            base, full = [], []
            for rep in range(reps):  # alternate which side goes first
                if rep % 2:
                    full.append(timed(generation))
                    base.append(timed(bare))
                else:
                    base.append(timed(bare))
                    full.append(timed(generation))
            ratios = [f / b for f, b in zip(full, base, strict=True)]
            label = f"{size // 1000}k" if size < 1_000_000 else f"{size // 1_000_000}M"
            figures.append(
                over_runs(
                    f"profile generation vs bare projection read ({label} items)",
                    ratios,
                    "x",
                    f"goal <= 3x; bare read {median(base) * 1000:.0f} ms, "
                    f"generation {median(full) * 1000:.0f} ms (medians)",
                    None if smoke or size < 100_000 else (lambda r: r <= 3),
                )
            )
            before, peak = peak_rss(url, "generation")
            _, bare_peak = peak_rss(url, "bare")
            gib = 1024**3
            figures.append(
                Figure(
                    f"profile generation peak RSS, one process ({label} items)",
                    peak / gib,
                    " GiB",
                    f"goal <= 2 GiB; bare read peak {bare_peak / gib:.2f} GiB, "
                    f"process before the read {before / gib:.2f} GiB",
                    None if smoke or size < 1_000_000 else peak <= 2 * gib,
                )
            )
            curve["ratio"].append((float(size), statistics.median(ratios)))
            curve["peak GiB"].append((float(size), peak / gib))
    plot(
        mode.plots / "profile-generation.png",
        "Profile generation of one library: ratio to a bare read, and peak RSS",
        "items in the library",
        "generation / bare read (x); peak RSS (GiB)",
        curve,
        log_x=True,
    )
    return figures
