"""Error translation: a statement's failure is told from a lost session by SQLSTATE."""

from __future__ import annotations

import threading

import pytest

from inventory_pipeline.db import (
    Connection,
    DatabaseError,
    DatabaseUnavailable,
    connect,
    execute,
    fetch_one,
    transaction,
)


def test_a_deadlock_is_the_statement_s_error_not_a_lost_database(
    conn: Connection, db_url: str
) -> None:
    """A deadlock victim's session survives: callers must be able to fail that one
    statement's work alone instead of treating the database as gone."""
    execute(conn, "CREATE TABLE pair (id int PRIMARY KEY)")
    execute(conn, "INSERT INTO pair VALUES (1), (2)")
    first_locked, second_locked = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def lock(order: tuple[int, int], mine: threading.Event, theirs: threading.Event) -> None:
        with connect(db_url) as c:
            try:
                with transaction(c):
                    execute(c, "SELECT 1 FROM pair WHERE id = %s FOR UPDATE", (order[0],))
                    mine.set()
                    theirs.wait(10)
                    execute(c, "SELECT 1 FROM pair WHERE id = %s FOR UPDATE", (order[1],))
            except DatabaseError as exc:
                errors.append(exc)
                assert fetch_one(c, "SELECT 1 AS alive") == {"alive": 1}

    threads = [
        threading.Thread(target=lock, args=((1, 2), first_locked, second_locked)),
        threading.Thread(target=lock, args=((2, 1), second_locked, first_locked)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    [error] = errors
    assert isinstance(error, DatabaseError) and not isinstance(error, DatabaseUnavailable)
    assert getattr(error, "sqlstate", None) == "40P01"


def test_a_statement_timeout_is_the_statement_s_error(conn: Connection) -> None:
    execute(conn, "SET statement_timeout = '50ms'")
    with pytest.raises(DatabaseError) as raised:
        execute(conn, "SELECT pg_sleep(1)")
    assert not isinstance(raised.value, DatabaseUnavailable)
    assert raised.value.sqlstate == "57014"


def test_a_terminated_session_is_unavailable(conn: Connection, db_url: str) -> None:
    row = fetch_one(conn, "SELECT pg_backend_pid() AS pid")
    assert row is not None
    with connect(db_url) as other:
        execute(other, "SELECT pg_terminate_backend(%s)", (row["pid"],))
    with pytest.raises(DatabaseUnavailable):
        execute(conn, "SELECT 1")


def test_an_exhausted_lock_table_is_the_statement_s_error(conn: Connection) -> None:
    """53200 (out of shared memory: the lock table is full) fails the statement that
    needed one lock too many; the session and the database are fine."""
    with pytest.raises(DatabaseError) as raised:
        execute(
            conn,
            "DO $$ BEGIN RAISE EXCEPTION 'out of shared memory' USING ERRCODE = '53200'; END $$",
        )
    assert not isinstance(raised.value, DatabaseUnavailable)
    assert raised.value.sqlstate == "53200"
    assert fetch_one(conn, "SELECT 1 AS alive") == {"alive": 1}
