"""Each worker stage is one server-side call sent with its budget in one round trip: a
session that goes away during the call leaves a connection that fails cleanly."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import date

import pytest

from inventory_pipeline.db import (
    Connection,
    DatabaseUnavailable,
    connect,
    execute,
    fetch_one,
)
from inventory_pipeline.stats import service
from tests import stats_factories as sf

D = date(2026, 3, 10)
LEASE_SLOTS = "SELECT pg_advisory_xact_lock(hashtextextended('stats_lease_slots', 0))"


def wait_for_lock_wait(conn: Connection, pid: int) -> None:
    for _ in range(500):
        row = fetch_one(conn, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,))
        if row is not None and row["wait_event_type"] == "Lock":
            return
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never waited on a lock")


def test_a_session_ended_during_a_stage_call_leaves_a_cleanly_failing_connection(
    conn: Connection, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The claim waits for its turn at the lease slots when its session is terminated:
    the claim raises DatabaseUnavailable, nothing else is logged, and the connection's
    next use raises DatabaseUnavailable too (not a driver error about pipeline mode)."""
    sf.exercise(conn, "squat")
    sf.save(conn, uuid.uuid4(), D, sf.sets(("squat", 100, 5)))
    errors: list[BaseException] = []
    with connect(db_url) as worker, connect(db_url) as holder, holder.transaction():
        execute(holder, LEASE_SLOTS)
        row = fetch_one(worker, "SELECT pg_backend_pid() AS pid")
        assert row is not None
        pid = int(row["pid"])

        def claim() -> None:
            try:
                service.claim(worker, "w")
            except BaseException as exc:  # judged below
                errors.append(exc)

        with caplog.at_level(logging.WARNING, logger="psycopg"):
            thread = threading.Thread(target=claim)
            thread.start()
            wait_for_lock_wait(conn, pid)
            execute(conn, "SELECT pg_terminate_backend(%s)", (pid,))
            thread.join(timeout=30)
            assert not thread.is_alive()
            assert len(errors) == 1 and isinstance(errors[0], DatabaseUnavailable)
            with pytest.raises(DatabaseUnavailable):
                fetch_one(worker, "SELECT 1")
        assert [r.getMessage() for r in caplog.records if r.name.startswith("psycopg")] == []
