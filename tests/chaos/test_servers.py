"""The harness stops every server it starts, restarted or not."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from chaos.servers import EmbeddedChaosServer


def postmaster(pgdata: Path) -> int:
    """The running postmaster, from its pid file (the wheel keeps the one it started)."""
    return int((pgdata / "postmaster.pid").read_text().split()[0])


def running(pid: int) -> bool:
    """A dead postmaster may stay a zombie: its parent (init here) need not reap it."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("restarted", [False, True], ids=["as-started", "after-a-restart"])
def test_an_embedded_server_is_stopped_with_the_harness(restarted: bool) -> None:
    """A restart (pg_ctl) replaces the postmaster the embedded wheel started, and once
    that one is gone the wheel stops nothing; stopping the harness's server stops the
    postmaster running then, and its folder goes."""
    server = EmbeddedChaosServer()
    pgdata = server.folder / "pgdata"
    try:
        if restarted:
            first = postmaster(pgdata)
            server.restart()
            deadline = time.monotonic() + 30  # init reaps it within seconds here
            while psutil.pid_exists(first) and time.monotonic() < deadline:
                time.sleep(0.1)
        last = postmaster(pgdata)
        assert running(last)
    finally:
        server.stop()
    left = running(last)
    if left:
        psutil.Process(last).terminate()  # stop what the harness left running
    assert not left
    assert not server.folder.exists()
