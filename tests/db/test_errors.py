"""Error translation: a statement's failure is told from a lost session by SQLSTATE,
and each state callers branch on arrives as its own class, provoked here for real."""

from __future__ import annotations

import threading
import time

import pytest

from inventory_pipeline.db import (
    CheckViolation,
    Connection,
    DatabaseError,
    DatabaseUnavailable,
    DeadlockDetected,
    FeatureNotSupported,
    ForeignKeyViolation,
    IdleInTransactionTimeout,
    LockNotAvailable,
    NumericValueOutOfRange,
    ObjectNotInPrerequisiteState,
    QueryCanceled,
    SerializationFailure,
    UniqueViolation,
    connect,
    execute,
    fetch_one,
    transaction,
)
from inventory_pipeline.db.connection import ERROR_CLASSES


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
    assert isinstance(error, DeadlockDetected) and not isinstance(error, DatabaseUnavailable)
    assert error.sqlstate == "40P01"


def test_a_statement_timeout_is_the_statement_s_error(conn: Connection) -> None:
    """57014 arrives as QueryCanceled with how long the call ran: at least the budget."""
    execute(conn, "SET statement_timeout = '50ms'")
    with pytest.raises(QueryCanceled) as raised:
        execute(conn, "SELECT pg_sleep(1)")
    assert not isinstance(raised.value, DatabaseUnavailable)
    assert raised.value.sqlstate == "57014"
    assert raised.value.elapsed_ms is not None and raised.value.elapsed_ms >= 50
    assert fetch_one(conn, "SELECT 1 AS alive") == {"alive": 1}


def test_a_cancel_request_is_query_canceled_before_any_budget(
    conn: Connection, db_url: str
) -> None:
    """An operator's cancel has the same SQLSTATE; its elapsed time is what it ran."""
    pid = conn.info.backend_pid

    def cancel() -> None:
        time.sleep(0.2)
        with connect(db_url) as admin:
            execute(admin, "SELECT pg_cancel_backend(%s)", (pid,))

    canceller = threading.Thread(target=cancel)
    canceller.start()
    with pytest.raises(QueryCanceled) as raised:
        execute(conn, "SELECT pg_sleep(10)")
    canceller.join()
    assert raised.value.sqlstate == "57014"
    assert raised.value.elapsed_ms is not None and 150 <= raised.value.elapsed_ms < 10_000


def test_a_lock_timeout_is_lock_not_available(conn: Connection, db_url: str) -> None:
    execute(conn, "CREATE TABLE held (id int PRIMARY KEY)")
    execute(conn, "INSERT INTO held VALUES (1)")
    with connect(db_url) as holder, holder.transaction():
        execute(holder, "SELECT 1 FROM held WHERE id = 1 FOR UPDATE")
        execute(conn, "SET lock_timeout = '50ms'")
        with pytest.raises(LockNotAvailable) as raised:
            execute(conn, "UPDATE held SET id = 2 WHERE id = 1")
    assert raised.value.sqlstate == "55P03"


def test_constraint_violations_have_their_classes(conn: Connection) -> None:
    execute(conn, "CREATE TABLE parent (id int PRIMARY KEY, size int CHECK (size > 0))")
    execute(conn, "CREATE TABLE child (parent_id int NOT NULL REFERENCES parent)")
    execute(conn, "INSERT INTO parent VALUES (1, 1)")
    with pytest.raises(UniqueViolation) as unique:
        execute(conn, "INSERT INTO parent VALUES (1, 1)")
    with pytest.raises(ForeignKeyViolation) as foreign:
        execute(conn, "INSERT INTO child VALUES (2)")
    with pytest.raises(CheckViolation) as check:
        execute(conn, "INSERT INTO parent VALUES (3, 0)")
    with pytest.raises(NumericValueOutOfRange) as numeric:
        execute(conn, "INSERT INTO parent VALUES (4, 2147483647 + 1)")
    assert [e.value.sqlstate for e in (unique, foreign, check, numeric)] == [
        "23505",
        "23503",
        "23514",
        "22003",
    ]


def test_a_concurrent_update_under_repeatable_read_is_a_serialization_failure(
    conn: Connection, db_url: str
) -> None:
    execute(conn, "CREATE TABLE counter (id int PRIMARY KEY, n int)")
    execute(conn, "INSERT INTO counter VALUES (1, 0)")
    with pytest.raises(SerializationFailure) as raised, transaction(conn):
        execute(conn, "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        execute(conn, "SELECT n FROM counter WHERE id = 1")  # takes the snapshot
        with connect(db_url) as other:
            execute(other, "UPDATE counter SET n = n + 1 WHERE id = 1")
        execute(conn, "UPDATE counter SET n = n + 1 WHERE id = 1")
    assert raised.value.sqlstate == "40001"


def test_an_object_not_ready_and_an_unsupported_form_have_their_classes(
    conn: Connection,
) -> None:
    execute(conn, "CREATE SEQUENCE fresh")
    with pytest.raises(ObjectNotInPrerequisiteState) as not_ready:
        execute(conn, "SELECT currval('fresh')")  # no nextval in this session yet
    with pytest.raises(FeatureNotSupported) as unsupported:
        execute(conn, "SELECT count(*) FROM pg_class FOR UPDATE")
    assert (not_ready.value.sqlstate, unsupported.value.sqlstate) == ("55000", "0A000")


def test_an_idle_in_transaction_timeout_is_a_lost_session(db_url: str) -> None:
    """The server ends a session idle inside a transaction (25P03): the class says so
    and it is an unavailable database for callers that only ask that."""
    with connect(db_url, idle_in_transaction_ms=100) as idle:
        with pytest.raises(IdleInTransactionTimeout) as raised, transaction(idle):
            execute(idle, "SELECT 1")
            time.sleep(0.5)
            execute(idle, "SELECT 1")
    assert isinstance(raised.value, DatabaseUnavailable)
    assert raised.value.sqlstate == "25P03"


def test_every_mapped_class_is_named_by_its_sqlstate() -> None:
    """One table maps SQLSTATE to class; each class's docstring names its SQLSTATE."""
    for sqlstate, cls in ERROR_CLASSES.items():
        assert issubclass(cls, DatabaseError) and f"({sqlstate})" in (cls.__doc__ or "")


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
