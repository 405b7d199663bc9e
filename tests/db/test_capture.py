"""Change capture: statement-level triggers on real DML."""

from __future__ import annotations

import pytest

from inventory_pipeline.db import Connection, DatabaseError, execute, fetch_all, transaction
from tests import factories as f


def test_insert_advances_each_library_once_per_statement(conn: Connection) -> None:
    a = f.library(conn, name="a")
    b = f.library(conn, name="b")
    assert f.revision(conn, a) == 0
    execute(
        conn,
        "INSERT INTO media_server_items (library_id, title) SELECT lib, 't' || g"
        " FROM unnest(%s::bigint[]) lib, generate_series(1, 50) g",
        ([a, b],),
    )
    assert (f.revision(conn, a), f.revision(conn, b)) == (1, 1)
    assert f.state(conn, a)["dirty_since"] is not None


def test_rollback_leaves_no_revision(conn: Connection) -> None:
    lib = f.library(conn)
    with pytest.raises(RuntimeError), transaction(conn):
        f.items(conn, lib, 5)
        raise RuntimeError("writer gave up")
    assert f.revision(conn, lib) == 0


def test_unchanged_sync_does_not_dirty(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 20)
    before = f.revision(conn, lib)
    execute(
        conn,
        "UPDATE media_server_items SET synced_at = now(), plot = 'new plot', title = title || '!',"
        " year = year + 1 WHERE library_id = %s",
        (lib,),
    )
    # Same values written again are not a change either.
    execute(
        conn,
        "UPDATE media_server_items SET rating = rating, genres = genres WHERE library_id = %s",
        (lib,),
    )
    assert f.revision(conn, lib) == before


@pytest.mark.parametrize(
    "assignment",
    [
        "rating = 9.9",
        "genres = ARRAY['Western']",
        "primary_studio = 'Aardman'",
        "original_language = 'it'",
        "provider_id = provider_id || '0'",
        "provider_kind = 'tv', provider_id = '77'",
        "provider = NULL, provider_kind = NULL, provider_id = NULL",
        "rating = NULL",
    ],
)
def test_relevant_update_advances_once(conn: Connection, assignment: str) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 10)
    before = f.revision(conn, lib)
    execute(conn, f"UPDATE media_server_items SET {assignment} WHERE library_id = %s", (lib,))
    assert f.revision(conn, lib) == before + 1


def test_move_dirties_both_libraries(conn: Connection) -> None:
    a = f.library(conn, name="a")
    b = f.library(conn, name="b")
    ids = f.items(conn, a, 3)
    ra, rb = f.revision(conn, a), f.revision(conn, b)
    execute(conn, "UPDATE media_server_items SET library_id = %s WHERE id = %s", (b, ids[0]))
    assert (f.revision(conn, a), f.revision(conn, b)) == (ra + 1, rb + 1)


def test_delete_and_truncate_advance(conn: Connection) -> None:
    a = f.library(conn, name="a")
    b = f.library(conn, name="b")
    empty = f.library(conn, name="empty")
    f.items(conn, a, 3)
    f.items(conn, b, 3)
    execute(conn, "DELETE FROM media_server_items WHERE library_id = %s", (a,))
    assert f.revision(conn, a) == 2
    execute(conn, "DELETE FROM media_server_items WHERE false")
    assert f.revision(conn, a) == 2
    execute(conn, "TRUNCATE media_server_items")
    assert (f.revision(conn, a), f.revision(conn, b), f.revision(conn, empty)) == (2, 2, 0)


def test_inactive_library_keeps_capturing(conn: Connection) -> None:
    lib = f.library(conn, active=False)
    f.items(conn, lib, 3)
    assert f.revision(conn, lib) == 1


def test_library_deletion_removes_state_by_foreign_key(conn: Connection) -> None:
    a = f.library(conn, name="a")
    b = f.library(conn, name="b")
    f.items(conn, a, 3)
    f.items(conn, b, 3)
    execute(conn, "DELETE FROM libraries WHERE id = %s", (a,))
    states = fetch_all(conn, "SELECT library_id FROM library_inventory_state ORDER BY 1")
    assert [s["library_id"] for s in states] == [b]
    assert f.revision(conn, b) == 1


def test_new_library_starts_clean(conn: Connection) -> None:
    lib = f.library(conn)
    assert f.state(conn, lib) == {"revision": 0, "acknowledged_revision": 0, "dirty_since": None}


def test_acknowledgement_cannot_pass_revision(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 1)
    with pytest.raises(DatabaseError, match="ack_not_ahead"):
        execute(
            conn,
            "UPDATE library_inventory_state SET acknowledged_revision = 5, dirty_since = NULL"
            " WHERE library_id = %s",
            (lib,),
        )


def test_multi_library_writers_do_not_deadlock(db_url: str) -> None:
    """Two statements touching the same libraries in opposite item order lock state rows
    in library-id order, so they serialize instead of deadlocking."""
    import threading

    from inventory_pipeline.db import connect

    with connect(db_url) as setup:
        libs = [f.library(setup, name=str(i)) for i in range(6)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def writer(order: list[int]) -> None:
        try:
            with connect(db_url) as c:
                for _ in range(20):
                    barrier.wait(timeout=10)
                    execute(
                        c,
                        "INSERT INTO media_server_items (library_id, title)"
                        " SELECT lib, 'x' FROM unnest(%s::bigint[]) WITH ORDINALITY AS u(lib, n)"
                        " ORDER BY n",
                        (order,),
                    )
        except BaseException as exc:  # pragma: no cover - asserted below
            errors.append(exc)

    threads = [
        threading.Thread(target=writer, args=(libs,)),
        threading.Thread(target=writer, args=(list(reversed(libs)),)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with connect(db_url) as check:
        assert {f.revision(check, lib) for lib in libs} == {40}
