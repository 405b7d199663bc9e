"""The shared admission limiter across processes, counted by the server."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from inventory_pipeline.db import Connection, fetch_one
from inventory_pipeline.provider import admission
from inventory_pipeline.provider.standin import StandIn
from tests.conftest import TMDB_TEST_KEY

WORKER = textwrap.dedent(
    """
    import sys
    from inventory_pipeline.db import connect
    from inventory_pipeline.provider import admission
    from inventory_pipeline.provider.tmdb import TmdbClient

    url, base, key, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    # A wide margin, so what is measured is the limiter's rule across processes and not
    # this machine's jitter between an admission and its request's arrival (a loaded CI
    # machine delayed requests past the default 5 % margin: 22 arrivals in one second).
    admission.HEADROOM = admission.WINDOW_HEADROOM = 1.2
    with connect(url) as conn, TmdbClient(base) as client:
        for i in range(count):
            admission.acquire(conn)
            client.fetch("movie", 100 + i, key)
    """
)


def test_rate_never_exceeded_across_four_processes(
    conn: Connection, db_url: str, standin: StandIn
) -> None:
    rate = 20
    admission.set_rate(conn, rate)
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, db_url, standin.url, TMDB_TEST_KEY, "15"])
        for _ in range(4)
    ]
    for p in procs:
        assert p.wait(timeout=60) == 0
    per_second = standin.state.per_second()
    assert sum(per_second.values()) == 60
    assert max(per_second.values()) <= rate


def test_reservation_holds_no_lock(conn: Connection, db_url: str) -> None:
    admission.set_rate(conn, 5)
    admission.acquire(conn)
    row = fetch_one(
        conn,
        "SELECT count(*) AS n FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
        " WHERE c.relname = 'provider_admission' AND l.granted AND l.pid <> pg_backend_pid()",
    )
    assert row is not None and row["n"] == 0


LATE_WORKER = textwrap.dedent(
    """
    import sys
    import time
    from inventory_pipeline.db import connect
    from inventory_pipeline.provider import admission
    from inventory_pipeline.provider.tmdb import TmdbClient

    url, base, key, count, late = sys.argv[1:4] + [int(sys.argv[4]), sys.argv[5] == "late"]
    # A wide margin, so what is measured is the limiter's rule and not this machine's
    # jitter between an admission and its request's arrival.
    admission.HEADROOM = admission.WINDOW_HEADROOM = 1.2
    real_sleep = time.sleep
    sleeps = [0]

    def descheduled(seconds):
        real_sleep(seconds)
        sleeps[0] += 1
        if late and sleeps[0] == 3:  # woken half a second after its slot
            real_sleep(0.5)

    time.sleep = descheduled
    with connect(url) as conn, TmdbClient(base) as client:
        for i in range(count):
            admission.acquire(conn)
            client.fetch("movie", 100 + i, key)
    """
)


def busiest_second(arrivals: list[float]) -> int:
    """The most arrivals in any sliding window (t - 1 s, t]."""
    ordered = sorted(arrivals)
    first, most = 0, 0
    for last, t in enumerate(ordered):
        while ordered[first] <= t - 1.0:
            first += 1
        most = max(most, last - first + 1)
    return most


def test_late_caller_does_not_push_a_sliding_second_over_the_rate(
    conn: Connection, db_url: str, standin: StandIn
) -> None:
    """A caller that wakes long after its slot (descheduled) is admitted only when the
    last window has room: no sliding second holds more than the rate, whichever process
    was late."""
    rate = 5
    admission.set_rate(conn, rate)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LATE_WORKER, db_url, standin.url, TMDB_TEST_KEY, "8", role]
        )
        for role in ("late", "on-time", "on-time")
    ]
    for p in procs:
        assert p.wait(timeout=60) == 0
    arrivals = list(standin.state.arrivals)
    assert len(arrivals) == 24
    assert busiest_second(arrivals) <= rate
