"""The shared admission limiter: a rate shared by every process and machine through one
PostgreSQL row (default 40 requests/s, acquired before each request, never
held during I/O).

`acquire` reserves the next slot in one autocommit statement and sleeps until it; a
reservation too far ahead is not taken, so a stalled caller cannot hoard slots. At its
slot it takes the admission in a second statement that records it and refuses while the
last window already holds the rate: a caller that slept past its slot (descheduled on a
loaded machine) waits for room instead of landing on top of the next slots, so no
sliding window admits more than the rate, across every process.

A throttling answer (429) pauses the row for everyone: while paused, `acquire` refuses
at once (AdmissionPaused), so callers give their work back instead of queueing it behind
the pause, and the requests that still reach the provider are those already admitted.
"""

from __future__ import annotations

import time

from inventory_pipeline.db import Connection, execute, fetch_one
from inventory_pipeline.db.queries import load_queries
from inventory_pipeline.provider.retry_after import MAX_RETRY_AFTER_SECONDS

QUERIES = load_queries("inventory_pipeline.provider", "admission.sql")
BUCKET = "tmdb"
DEFAULT_RATE = 40.0
# Slots are spaced 2 % wider than 1/rate. The admission window is 5 % longer than one
# second: it admits at most the rate, so a request's arrival at the provider may trail
# its admission by up to 50 ms (a thread descheduled on a loaded machine) and no sliding
# second of arrivals still holds more than the rate.
HEADROOM = 1.02
WINDOW_HEADROOM = 1.05
HORIZON_SECONDS = 1.0
# A caller refused by a full window (or a concurrent admission) asks again after at least
# this long.
MIN_ADMIT_RETRY_SECONDS = 0.001

# A 429 without a usable Retry-After pauses for 10 s: TMDb counts its limit per second
# (around 50 requests/s), so ten windows pass; each further throttled pause within
# PAUSE_MEMORY_SECONDS of the last doubles it, up to 15 minutes, so a provider that
# keeps refusing sees at most the requests in flight once per pause.
DEFAULT_PAUSE_SECONDS = 10
MAX_DEFAULT_PAUSE_SECONDS = 15 * 60
PAUSE_MEMORY_SECONDS = 15 * 60
# A Retry-After is the provider's own evidence and decides the pause (bounded as
# Retry-After always is, at seven days); under a second it still pauses a second, so a
# storm of "Retry-After: 0" cannot turn into a storm of requests.
MIN_PAUSE_SECONDS = 1


class AdmissionTimeout(Exception):
    """No admission slot within the time allowed."""


class AdmissionPaused(AdmissionTimeout):
    """Admission is paused: the provider throttled us."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"admission paused for {seconds:.0f} s: the provider throttled us")
        self.seconds = seconds


def set_rate(conn: Connection, requests_per_second: float, bucket: str = BUCKET) -> None:
    execute(
        conn,
        QUERIES["set_rate"],
        {"bucket": bucket, "requests_per_second": requests_per_second},
    )


def acquire(conn: Connection, bucket: str = BUCKET, timeout_seconds: float = 60.0) -> float:
    """Wait for an admission; returns the seconds waited. Raises AdmissionPaused at once
    while the bucket is paused, AdmissionTimeout when no admission comes in time."""
    started = time.monotonic()
    while True:
        row = fetch_one(
            conn,
            QUERIES["reserve"],
            {"bucket": bucket, "headroom": HEADROOM, "horizon": HORIZON_SECONDS},
        )
        if row is not None and row["wait_seconds"] is not None:
            wait = float(row["wait_seconds"])
            if wait > 0:
                time.sleep(wait)
            return _admit(conn, bucket, started, timeout_seconds)
        if row is not None and row["paused_seconds"] > 0:
            raise AdmissionPaused(float(row["paused_seconds"]))
        if time.monotonic() - started > timeout_seconds:
            raise AdmissionTimeout(f"no {bucket} admission within {timeout_seconds:.0f} s")
        time.sleep(HORIZON_SECONDS / 2)


def _admit(conn: Connection, bucket: str, started: float, timeout_seconds: float) -> float:
    """Take the reserved admission as soon as the window has room for it."""
    while True:
        row = fetch_one(conn, QUERIES["admit"], {"bucket": bucket, "headroom": WINDOW_HEADROOM})
        if row is not None and row["admitted"]:
            return time.monotonic() - started
        if row is not None and row["paused_seconds"] > 0:
            raise AdmissionPaused(float(row["paused_seconds"]))
        if time.monotonic() - started > timeout_seconds:
            raise AdmissionTimeout(f"no {bucket} admission within {timeout_seconds:.0f} s")
        wait = 0.0 if row is None else float(row["wait_seconds"])
        time.sleep(max(wait, MIN_ADMIT_RETRY_SECONDS))


def pause(conn: Connection, retry_after_seconds: int | None = None, bucket: str = BUCKET) -> float:
    """Record a throttling answer: pause admission for every process. A Retry-After
    decides the length; without one the default pause applies, doubling on repeated
    throttling. Answers to requests sent before a running pause began are not new
    evidence: they can lengthen it with a Retry-After and count nothing. A pause is
    never shortened. Returns the seconds now paused."""
    seconds = None
    if retry_after_seconds is not None:
        seconds = min(max(retry_after_seconds, MIN_PAUSE_SECONDS), MAX_RETRY_AFTER_SECONDS)
    row = fetch_one(
        conn,
        QUERIES["pause"],
        {
            "bucket": bucket,
            "retry_after_seconds": seconds,
            "default_seconds": DEFAULT_PAUSE_SECONDS,
            "max_default_seconds": MAX_DEFAULT_PAUSE_SECONDS,
            "memory_seconds": PAUSE_MEMORY_SECONDS,
        },
    )
    return 0.0 if row is None else float(row["paused_seconds"])


def paused_seconds(conn: Connection, bucket: str = BUCKET) -> float:
    """How long admission stays paused (0 when it is not)."""
    row = fetch_one(conn, QUERIES["paused"], {"bucket": bucket})
    return 0.0 if row is None else float(row["paused_seconds"])
