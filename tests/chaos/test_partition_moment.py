"""A cut timed to a stats claim strikes while the host still holds it: the claim's holder
is frozen first, and the moment is caught only if the claim is still its own (in its
phase, a second of lease left) once what it sent has landed; otherwise the holder goes
on and the look continues (chaos/partition.py)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import pytest

from chaos import partition
from inventory_pipeline.db import Connection
from inventory_pipeline.stats import service as stats
from inventory_pipeline.stats.models import StatsClaim
from tests import stats_factories as sf

D = date(2026, 3, 10)


@pytest.fixture
def holder() -> Iterator[int]:
    """A process standing in for a host's stats worker."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()


def state(pid: int) -> str:
    """The process's scheduler state: T when stopped."""
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))


def claim_as(conn: Connection, pid: int) -> StatsClaim:
    sf.exercise(conn, "squat")
    sf.save(conn, uuid.uuid4(), D, sf.sets(("squat", 100, 5)))
    claim = stats.claim(conn, f"chaos-{pid}")
    assert claim is not None
    return claim


def test_the_holder_of_a_claim_is_frozen_until_the_fault_is_in_place(
    conn: Connection, holder: int
) -> None:
    claim_as(conn, holder)
    moment, frozen = partition._await_moment(conn, "computing", [holder])
    assert (moment, frozen) == ("computing, between them", holder)
    assert state(holder) == "T"
    partition._thaw(frozen)
    assert state(holder) != "T"


def test_a_claim_about_to_lapse_is_not_caught_and_its_holder_goes_on(
    conn: Connection, holder: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another host could take it before the cut begins: nothing would be held."""
    monkeypatch.setattr(partition, "MOMENT_LOOK_SECONDS", 1.5)
    claim = claim_as(conn, holder)
    sf.set_run(conn, claim.run_id, claim.lease_token, "lease_until = now() + interval '0.5s'")
    moment, frozen = partition._await_moment(conn, "computing", [holder])
    assert (moment, frozen) == ("no claim computing caught in 2 s", None)
    assert state(holder) != "T"
