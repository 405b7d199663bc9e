"""The shared admission limiter: a rate shared by every process and machine through one
PostgreSQL row (issue 3: default 40 requests/s, acquired before each request, never
held during I/O).

`acquire` reserves the next slot in one autocommit statement and sleeps until it; a
reservation too far ahead is not taken, so a stalled caller cannot hoard slots.
"""

from __future__ import annotations

import time

from inventory_pipeline.db import Connection, execute, fetch_one
from inventory_pipeline.db.queries import load_queries

QUERIES = load_queries("inventory_pipeline.provider", "admission.sql")
BUCKET = "tmdb"
DEFAULT_RATE = 40.0
# Slots are spaced 2 % wider than 1/rate so request arrivals, which jitter by a few
# milliseconds after their slot, never exceed the rate in any one second.
HEADROOM = 1.02
HORIZON_SECONDS = 1.0


class AdmissionTimeout(Exception):
    """No admission slot within the time allowed."""


def set_rate(conn: Connection, requests_per_second: float, bucket: str = BUCKET) -> None:
    execute(
        conn,
        QUERIES["set_rate"],
        {"bucket": bucket, "requests_per_second": requests_per_second},
    )


def acquire(conn: Connection, bucket: str = BUCKET, timeout_seconds: float = 60.0) -> float:
    """Wait for an admission slot; returns the seconds waited."""
    started = time.monotonic()
    while True:
        row = fetch_one(
            conn,
            QUERIES["reserve"],
            {"bucket": bucket, "headroom": HEADROOM, "horizon": HORIZON_SECONDS},
        )
        if row is not None:
            wait = float(row["wait_seconds"])
            if wait > 0:
                time.sleep(wait)
            return time.monotonic() - started
        if time.monotonic() - started > timeout_seconds:
            raise AdmissionTimeout(f"no {bucket} admission within {timeout_seconds:.0f} s")
        time.sleep(HORIZON_SECONDS / 2)
