"""Provider observation against the loopback TMDb stand-in at the limiter's default
rate: sustained observation rate as a share of the limit, counted per second by the
server, and the busiest second (which must never exceed the limit)."""

from __future__ import annotations

import statistics

from bench.common import Figure, Mode, scratch_database, timed
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


def run(admin_url: str, mode: Mode) -> list[Figure]:
    smoke = mode.smoke
    rate = admission.DEFAULT_RATE
    items = 60 if smoke else 1200  # 30 s at the default rate
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
        per_second = standin.state.per_second()
    seconds = sorted(per_second)
    full = [per_second[s] for s in seconds[1:-1]] or list(per_second.values())
    sustained = statistics.mean(full)
    busiest = max(per_second.values())
    return [
        Figure(
            f"observation sustained rate vs limiter ({items} items, limit {rate:.0f}/s)",
            sustained / rate * 100,
            " %",
            f"goal >= 90 %; {sustained:.1f} req/s over {elapsed:.1f} s",
            None if smoke else sustained / rate >= 0.9,
        ),
        Figure(
            "observation busiest second vs limiter",
            busiest / rate * 100,
            " %",
            f"goal <= 100 %; {busiest} requests",
            busiest <= rate,
        ),
    ]
