"""Change capture beside other programs' transactions: a writer is never aborted because
the worker acknowledged its library, and two writers never wait for each other through
capture (docs/profiles.md#change-capture)."""

from __future__ import annotations

import threading

import pytest

from inventory_pipeline.db import Connection, DatabaseError, connect, execute, fetch_one
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.models import RefreshPolicy
from tests import factories as f

POLICY = RefreshPolicy()


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_writer_is_not_aborted_by_the_acknowledgement_of_its_library(
    conn: Connection, db_url: str, isolation: str
) -> None:
    """The sync reads the library, the worker acknowledges it, the sync writes: it
    commits, and its write is a new revision the planner queues."""
    lib = f.library(conn)
    f.items(conn, lib, 6)
    with connect(db_url) as sync:
        execute(sync, f"BEGIN ISOLATION LEVEL {isolation}")
        execute(sync, "SELECT count(*) FROM media_server_items WHERE library_id = %s", (lib,))
        [done] = service.refresh(conn, POLICY).completions
        assert done.outcome == "published"
        execute(
            sync,
            "INSERT INTO media_server_items (library_id, title, rating) VALUES (%s, 'new', 7)",
            (lib,),
        )
        execute(sync, "UPDATE media_server_items SET rating = 8 WHERE library_id = %s", (lib,))
        execute(sync, "COMMIT")
    assert f.state(conn, lib)["acknowledged_revision"] == 1
    assert f.revision(conn, lib) == 3
    [planned] = service.plan(conn, POLICY).inventory
    assert (planned.library_id, planned.inventory_revision) == (lib, 3)


def test_two_writers_in_opposite_library_orders_both_commit(conn: Connection, db_url: str) -> None:
    """Writer one changes library A then B, writer two B then A, each in its own
    statements and different items: without capture neither waits for the other, and
    capture must not make them (they deadlocked through the libraries' state rows)."""
    srv = f.server(conn)
    a, b = f.library(conn, srv, name="a"), f.library(conn, srv, name="b")
    a_items, b_items = f.items(conn, a, 2), f.items(conn, b, 2)
    before = (f.revision(conn, a), f.revision(conn, b))
    errors: list[DatabaseError] = []
    held = (threading.Event(), threading.Event())

    def write(first: int, second: int, mine: threading.Event, theirs: threading.Event) -> None:
        try:
            with connect(db_url) as writer:
                execute(writer, "SET lock_timeout = '5s'")
                execute(writer, "BEGIN")
                execute(writer, "UPDATE media_server_items SET rating = 3 WHERE id = %s", (first,))
                mine.set()
                assert theirs.wait(10)
                execute(writer, "UPDATE media_server_items SET rating = 4 WHERE id = %s", (second,))
                execute(writer, "COMMIT")
        except DatabaseError as exc:
            errors.append(exc)

    one = threading.Thread(target=write, args=(a_items[0], b_items[0], held[0], held[1]))
    one.start()
    write(b_items[1], a_items[1], held[1], held[0])
    one.join()
    assert errors == []
    assert (f.revision(conn, a), f.revision(conn, b)) == (before[0] + 2, before[1] + 2)
    row = fetch_one(conn, "SELECT count(*) AS n FROM library_inventory_changes")
    assert row is not None and row["n"] == 0  # folded


def test_the_check_counts_a_change_a_fold_passed_over(conn: Connection, db_url: str) -> None:
    """A fold skips a library whose state row another transaction holds (a completion):
    the check's statuses still count the library's change rows, so a change is never
    read as current."""
    lib = f.library(conn)
    f.items(conn, lib, 6)
    service.refresh(conn, POLICY)
    with connect(db_url) as holder:
        execute(holder, "BEGIN")
        execute(
            holder, "SELECT 1 FROM library_inventory_state WHERE library_id = %s FOR UPDATE", (lib,)
        )
        f.items(conn, lib, 1, seed=7)
        [status] = service.profile_status(conn, [lib])
        assert (status.revision, status.acknowledged_revision) == (2, 1)
        assert status.dirty_seconds is not None
        execute(holder, "ROLLBACK")
    assert f.revision(conn, lib) == 2
