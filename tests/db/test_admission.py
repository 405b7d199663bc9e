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
