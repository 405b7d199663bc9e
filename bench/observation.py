"""Provider observation against the loopback TMDb stand-in at the limiter's default
rate: the sustained rate as a share of the limit, and the busiest one-second window
(which must never exceed the limit), both from the arrival times the server records.

"Never above the rate" is judged on a sliding window: the most arrivals within any one
second starting at an arrival, not per calendar second (which can split a burst in two).

The claim's cost as due items grow (`claim_cost`, scale S5): the real claim statement
(a batch of 32, as one observer run claims) against 10k, 100k and 1M due items, per
claimed item, with each batch then completed (its due time moved past the run, its lease
cleared) as an observation would; and the statement's EXPLAIN (ANALYZE, BUFFERS) at each
size, rolled back.
"""

from __future__ import annotations

import re
import statistics
import time

from bench.common import Figure, Mode, over_runs, plot, scratch_database, timed
from inventory_pipeline.db import connect, execute, fetch_all
from inventory_pipeline.db.connection import execute_script
from inventory_pipeline.provider import admission
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import repository, service
from inventory_pipeline.recovery.models import ProviderSettings
from inventory_pipeline.recovery.policy import RetryPolicy

ITEMS = """
INSERT INTO media_servers (id, name, kind) VALUES (1, 'bench', 'plex');
INSERT INTO libraries (id, server_id, name, media_kind) VALUES (1, 1, 'movies', 'movie');
"""
FILL = """
INSERT INTO media_server_items (library_id, title, provider, provider_kind, provider_id)
SELECT 1, 'Title ' || g, 'tmdb', 'movie', g::text FROM generate_series(1, %(items)s) g
"""
KEY = "bench-key"
S5_SIZES = (10_000, 100_000, 1_000_000)
CLAIM_BATCH = 32  # what one observer run claims at a time (8 workers x 4)
CLAIM_LIBRARIES = """
INSERT INTO media_servers (id, name, kind) VALUES (1, 'bench', 'plex');
INSERT INTO libraries (id, server_id, name, media_kind)
SELECT g, 1, 'movies ' || g, 'movie' FROM generate_series(1, 10) g;
"""
# Items spread over ten libraries; every `every`-th one is due now, the others were
# observed and are due again in 30 days.
CLAIM_FILL = """
INSERT INTO media_server_items (library_id, title, provider, provider_kind, provider_id,
                                observation_due_at)
SELECT 1 + g %% 10, 'Title ' || g, 'tmdb', 'movie', g::text,
       CASE WHEN g %% %(every)s = 0 THEN now() ELSE now() + interval '30 days' END
FROM generate_series(%(first)s::bigint, %(last)s::bigint) g
"""
# What a completed observation does to the claim's index: the next due time moves past
# the run and the lease is cleared.
CLAIM_DONE = """
UPDATE media_server_items
SET observation_due_at = now() + interval '30 days',
    observation_lease_token = NULL,
    observation_lease_expires_at = NULL
WHERE id = ANY (%(ids)s)
"""


def observe(admin_url: str, items: int, rate: float) -> tuple[list[float], float]:
    """One observation of `items` items at `rate`: sorted arrival times, wall seconds."""
    with scratch_database(admin_url) as url, connect(url) as conn, StandIn(api_key=KEY) as standin:
        execute_script(conn, ITEMS)
        execute(conn, FILL, {"items": items})
        service.save_provider_settings(conn, ProviderSettings(KEY, True, None))
        admission.set_rate(conn, rate)
        with TmdbClient(standin.url) as client:
            elapsed = timed(
                lambda: service.observe(
                    lambda: connect(url), client, RetryPolicy(), max_items=items, workers=8
                )
            )
        arrivals = sorted(standin.state.arrivals)
    return arrivals, elapsed


def trailing_counts(arrivals: list[float], width: float = 1.0) -> list[tuple[float, float]]:
    """(seconds since the first arrival, arrivals in the window of `width` ending there)
    at every arrival: the curve whose maximum `busiest_window` returns."""
    points, first = [], 0
    for last, t in enumerate(arrivals):
        while arrivals[first] <= t - width:
            first += 1
        points.append((t - arrivals[0], float(last - first + 1)))
    return points


def busiest_window(arrivals: list[float], width: float = 1.0) -> int:
    """The most arrivals in any window (t - width, t] of one `width`, over every window
    ending at an arrival (the maximum over all windows is reached at one of those)."""
    return int(max((n for _, n in trailing_counts(arrivals, width)), default=0))


def run(admin_url: str, mode: Mode) -> list[Figure]:
    rate = admission.DEFAULT_RATE
    items = mode.pick(smoke=60, default=1200)  # 30 s at the default rate
    reps = mode.pick(smoke=1, default=5)
    sustained: list[float] = []
    busiest: list[float] = []
    spans: list[float] = []
    for _ in range(reps):
        arrivals, elapsed = observe(admin_url, items, rate)
        span = arrivals[-1] - arrivals[0]
        sustained.append((len(arrivals) - 1) / span / rate * 100)
        busiest.append(busiest_window(arrivals))
        spans.append(elapsed)
    top = max(busiest)
    plot(
        mode.plots / "observation-window.png",
        f"Provider requests in the trailing 1 s window (limit {rate:.0f}/s, last run)",
        "seconds since the first request",
        "requests in the trailing second",
        {
            "requests": trailing_counts(arrivals),
            "limit": [(0, rate), (arrivals[-1] - arrivals[0], rate)],
        },
    )
    figures = [
        over_runs(
            f"observation sustained rate vs limiter ({items} items, limit {rate:.0f}/s)",
            sustained,
            " %",
            "goal >= 90 %; arrivals over the span from first to last,"
            f" runs took {min(spans):.1f}-{max(spans):.1f} s",
            None if mode.smoke else (lambda r: r >= 90),
        ),
        Figure(
            f"observation busiest sliding 1 s window vs limiter (worst of {reps} runs)",
            top / rate * 100,
            " %",
            f"goal <= 100 %; {top:.0f} requests",
            top <= rate,
        ),
    ]
    sizes = mode.pick(smoke=(1_000, 5_000), default=(10_000, 100_000), scale=S5_SIZES)
    per_item, plans = claim_cost(admin_url, sizes, mode.pick(smoke=5, default=30))
    for size in sizes:
        print(f"-- claim_due at {size:,} due items: EXPLAIN (ANALYZE, BUFFERS)", flush=True)
        print(plans[size], flush=True)
        figures.append(
            over_runs(
                f"observation claim per claimed item ({size:,} due items, batch {CLAIM_BATCH})",
                per_item[size],
                " ms",
                "S5: flat as due items grow",
            )
        )
    total = mode.pick(smoke=5_000, default=100_000, scale=1_000_000)
    few, few_plans = claim_cost(admin_url, (total,), mode.pick(smoke=1, default=30), every=100)
    print(f"-- claim_due at {total:,} items, 1 in 100 due: EXPLAIN (ANALYZE, BUFFERS)")
    print(few_plans[total], flush=True)
    figures.append(
        over_runs(
            f"observation claim per claimed item ({total:,} items, {total // 100:,} due)",
            few[total],
            " ms",
            "S5: the steady state, most items observed",
        )
    )
    smallest, largest = sizes[0], sizes[-1]
    figures.append(
        Figure(
            f"observation claim per item, {largest:,} vs {smallest:,} due items",
            statistics.median(per_item[largest]) / statistics.median(per_item[smallest]),
            "x",
            "medians of the times above; noisy on a shared machine, not judged",
        )
    )
    cases = [(f"{n:,} due items", plans[n]) for n in sizes]
    cases.append((f"{total:,} items, {total // 100:,} due", few_plans[total]))
    for case, plan in cases:
        read, claimed = due_index_rows(plan), claimed_rows(plan)
        figures.append(
            Figure(
                f"observation claim: due-index rows read per claimed item ({case})",
                -1.0 if read is None or not claimed else read / claimed,
                "",
                "S5 goal: flat, index-driven (the due index read in order, stopping at the"
                " batch: 1.00 at every size; -1: the due index is not walked)",
                None if mode.smoke else read is not None and read == claimed,
            )
        )
    plot(
        mode.plots / "observation-claim-cost.png",
        f"Observation claim cost per claimed item (batch of {CLAIM_BATCH})",
        "due items",
        "ms per claimed item (median)",
        {"claim_due": [(float(n), statistics.median(per_item[n])) for n in sizes]},
        log_x=True,
    )
    return figures


def claim_cost(
    admin_url: str,
    sizes: tuple[int, ...],
    claims: int,
    analyze_all: bool = False,
    every: int = 1,
) -> tuple[dict[int, list[float]], dict[int, str]]:
    """Milliseconds per claimed item of `claims` batches at each size of due items (the
    table grows from one size to the next), and each size's EXPLAIN (ANALYZE, BUFFERS).

    Only the items are analyzed, as autovacuum leaves a small installation: ten
    libraries and one server are fewer changes than its threshold (50 rows), so those
    tables keep the planner's default estimates. `analyze_all` analyzes every table.
    With `every` > 1 only every `every`-th item is due (the steady state: most items
    observed and due again later)."""
    per_item: dict[int, list[float]] = {}
    plans: dict[int, str] = {}
    with scratch_database(admin_url) as url, connect(url) as conn:
        execute_script(conn, CLAIM_LIBRARIES)
        loaded = 0
        for size in sizes:
            for first in range(loaded + 1, size + 1, 100_000):
                execute(
                    conn,
                    CLAIM_FILL,
                    {"first": first, "last": min(first + 99_999, size), "every": every},
                )
            loaded = size
            execute(conn, "VACUUM ANALYZE" if analyze_all else "VACUUM ANALYZE media_server_items")
            times = []
            for _ in range(claims):
                start = time.perf_counter()
                batch = [c.item_id for c in service.claim(conn, CLAIM_BATCH)]
                seconds = time.perf_counter() - start
                if len(batch) != CLAIM_BATCH:
                    raise RuntimeError(f"claimed {len(batch)} of {CLAIM_BATCH} at {size} items")
                times.append(seconds * 1000 / CLAIM_BATCH)
                execute(conn, CLAIM_DONE, {"ids": batch})
            per_item[size] = times
            with conn.transaction(force_rollback=True):
                rows = fetch_all(
                    conn,
                    "EXPLAIN (ANALYZE, BUFFERS) " + repository.QUERIES["claim_due"],
                    {"limit": CLAIM_BATCH, "lease_seconds": 300},
                )
            plans[size] = "\n".join(r["QUERY PLAN"] for r in rows)
    return per_item, plans


def claimed_rows(plan: str) -> float:
    """Rows the claim's UPDATE returned (EXPLAIN ANALYZE)."""
    found = re.search(r"^Update on .*actual time=[\d.]+\.\.[\d.]+ rows=([\d.]+)", plan, re.M)
    return 0.0 if found is None else float(found.group(1))


def due_index_rows(plan: str) -> float | None:
    """Rows the claim's walk of the due index returned (EXPLAIN ANALYZE), or None when
    the plan does not walk it in order."""
    for line in plan.splitlines():
        if "Index Scan using media_server_items_observation_due" in line:
            found = re.search(r"actual time=[\d.]+\.\.[\d.]+ rows=([\d.]+)", line)
            return None if found is None else float(found.group(1))
    return None
