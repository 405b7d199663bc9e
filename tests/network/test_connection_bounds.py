"""A silent network (no FIN, no RST) ends a session on both ends within a bound.

Without keepalives and TCP_USER_TIMEOUT the kernel's defaults apply: a server sending
into a dead link retries for about 15 minutes with the transaction and its locks held,
and a client that sent a statement waits as long. The product's connections carry the
settings of `db.connection.KEEPALIVES`; these tests cut a client host off in the middle
of a statement and check each end gives up well inside that."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from chaos import netns
from inventory_pipeline.db import LockNotAvailable, connect, execute, fetch_one, transaction
from tests.network.conftest import Site

ROOT = Path(__file__).resolve().parents[2]
# Far above the product's bound (about 30 s) and far below the kernel's (about 15 min):
# a deadline for a correctness property, not a timing measured against a goal.
DEADLINE_SECONDS = 120
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def client(site: Site, host: netns.Host, mode: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "tests.network.client", mode, site.server.url()]
    return subprocess.Popen(
        site.network.command(host, argv),
        cwd=ROOT,
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def lock_is_free(url: str) -> bool:
    with connect(url) as conn, transaction(conn):
        execute(conn, "SET LOCAL lock_timeout = '100ms'")
        try:
            fetch_one(conn, "SELECT id FROM held WHERE id = 1 FOR UPDATE")
        except LockNotAvailable:
            return False
    return True


def test_the_server_releases_a_cut_off_clients_locks_within_the_bound(site: Site) -> None:
    local = site.server.local_url()
    with connect(local) as conn:
        execute(conn, "CREATE TABLE held (id int PRIMARY KEY)")
        execute(conn, "INSERT INTO held VALUES (1)")
    host = site.network.add_host("worker")
    holder = client(site, host, "hold")
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        site.network.cut(host)  # during its 3 s pause, before the server sends the rows
        assert not lock_is_free(local)
        # The server, blocked sending into the silent link, gives up when nothing it sent
        # has been acknowledged for the connection's TCP user timeout; the rollback frees
        # the row.
        released = netns.wait_for(lambda: lock_is_free(local), DEADLINE_SECONDS, step=1.0)
        assert released is not None, f"row lock still held {DEADLINE_SECONDS} s after the cut"
        with connect(local) as conn:
            row = fetch_one(
                conn,
                "SELECT count(*) AS n FROM pg_stat_activity WHERE client_addr = %s",
                (host.address,),
            )
        assert row == {"n": 0}
    finally:
        holder.kill()
        holder.communicate()


def test_a_cut_off_client_fails_as_unreachable_within_the_bound(site: Site) -> None:
    host = site.network.add_host("worker")
    caller = client(site, host, "call")
    try:
        assert caller.stdin is not None and caller.stdout is not None
        assert caller.stdout.readline().strip() == "connected"
        site.network.cut(host)
        caller.stdin.write("go\n")
        caller.stdin.flush()
        try:
            caller.wait(timeout=DEADLINE_SECONDS)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"a statement sent into the cut link still waits after {DEADLINE_SECONDS} s"
            ) from None
        line = caller.stdout.readline()
        assert line.startswith("DatabaseUnavailable after"), line
    finally:
        caller.kill()
        caller.communicate()
