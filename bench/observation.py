"""Provider observation against the loopback TMDb stand-in at the limiter's default
rate: the sustained rate as a share of the limit, and the busiest one-second window
(which must never exceed the limit), both from the arrival times the server records.

"Never above the rate" is judged on a sliding window: the most arrivals within any one
second starting at an arrival, not per calendar second (which can split a burst in two).
"""

from __future__ import annotations

from bench.common import Figure, Mode, over_runs, plot, scratch_database, timed
from inventory_pipeline.db import connect, execute
from inventory_pipeline.db.connection import execute_script
from inventory_pipeline.provider import admission
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service
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
    return [
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
