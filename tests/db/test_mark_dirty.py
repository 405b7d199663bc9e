"""Writes that skip capture, and the one command that recovers from them.

A restore or replication apply that runs with `session_replication_role = replica` fires
no trigger: its writes advance no revision and new libraries get no state row.
`inventory-pipeline mark-dirty` (service.mark_all_dirty) marks every library dirty
afterwards, in bounded batches, and the planner takes it from there.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from inventory_pipeline.db import Connection, connect, execute, fetch_one, transaction
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.models import RefreshPolicy
from tests import factories as f
from tests.acceptance.test_cli import run
from tests.db.test_interleavings import process_all

POLICY = RefreshPolicy()


def replica_apply(conn: Connection, library_id: int, n: int) -> None:
    """Items written the way a restore or a logical replication apply writes them."""
    with transaction(conn):
        execute(conn, "SET LOCAL session_replication_role = replica")
        f.items(conn, library_id, n, seed=library_id)


def has_state(conn: Connection, library_id: int) -> bool:
    row = fetch_one(
        conn, "SELECT 1 AS one FROM library_inventory_state WHERE library_id = %s", (library_id,)
    )
    return row is not None


def test_replica_writes_are_not_captured_until_marked(conn: Connection) -> None:
    server = f.server(conn)
    clean = f.library(conn, server, name="clean")
    f.items(conn, clean, 6)
    process_all(conn)
    assert f.state(conn, clean)["dirty_since"] is None
    replica_apply(conn, clean, 6)
    with transaction(conn):
        execute(conn, "SET LOCAL session_replication_role = replica")
        row = fetch_one(
            conn,
            "INSERT INTO libraries (server_id, name, media_kind) VALUES (%s, 'restored', 'tv')"
            " RETURNING id",
            (server,),
        )
        assert row is not None
        restored = int(row["id"])
    replica_apply(conn, restored, 7)
    # Nothing was captured: the planner sees no work.
    assert f.state(conn, clean) == {"revision": 1, "acknowledged_revision": 1, "dirty_since": None}
    assert not has_state(conn, restored)
    assert service.plan(conn, POLICY).planned == 0

    assert service.mark_all_dirty(conn) == 2
    assert f.revision(conn, clean) == 2
    assert f.revision(conn, restored) == 1
    planned = service.plan(conn, POLICY).inventory
    assert sorted((p.library_id, p.inventory_revision) for p in planned) == [
        (clean, 2),
        (restored, 1),
    ]
    process_all(conn)
    assert {
        s.library_id: (s.acknowledged_revision, s.item_count)
        for s in service.profile_status(conn, [clean, restored])
    } == {
        clean: (2, 12),
        restored: (1, 7),
    }


def test_every_library_once_in_bounded_batches(conn: Connection) -> None:
    server = f.server(conn)
    libs = [f.library(conn, server, name=str(i), active=i != 3) for i in range(7)]
    for lib in libs[:4]:
        f.items(conn, lib, 2)
    before = [f.revision(conn, lib) for lib in libs]
    assert service.mark_all_dirty(conn, batch=3) == 7
    assert [f.revision(conn, lib) - b for lib, b in zip(libs, before, strict=True)] == [1] * 7
    assert all(f.state(conn, lib)["dirty_since"] is not None for lib in libs)
    assert service.mark_all_dirty(conn, batch=7) == 7  # an exact multiple ends too


def test_batches_commit_on_their_own(conn: Connection, db_url: str) -> None:
    """While a writer holds the last library, the batches before it are already
    committed and unlocked: no transaction locks every library."""
    server = f.server(conn)
    libs = [f.library(conn, server, name=str(i)) for i in range(5)]
    marked: list[int] = []
    with connect(db_url) as holder, connect(db_url) as probe:
        with transaction(holder):
            execute(
                holder,
                "SELECT 1 FROM library_inventory_state WHERE library_id = %s FOR UPDATE",
                (libs[-1],),
            )

            def mark() -> None:
                with connect(db_url) as worker_conn:
                    marked.append(service.mark_all_dirty(worker_conn, batch=2))

            worker = threading.Thread(target=mark)
            worker.start()
            for _ in range(400):
                if f.revision(probe, libs[3]) == 1:
                    break
                time.sleep(0.05)
            # The first two batches are visible and none of their rows is locked.
            assert [f.revision(probe, lib) for lib in libs] == [1, 1, 1, 1, 0]
            with transaction(probe):
                execute(probe, "SET LOCAL lock_timeout = '1s'")
                execute(
                    probe,
                    "SELECT 1 FROM library_inventory_state WHERE library_id = ANY (%s) FOR UPDATE",
                    (libs[:4],),
                )
        worker.join(timeout=30)
    assert marked == [5]
    assert f.revision(conn, libs[-1]) == 1


def test_lost_state_does_not_strand_a_stored_profile(conn: Connection) -> None:
    """A library whose state row is gone while its profile (at revision 5) is kept gets a
    revision above the profile's, so its next refresh can replace that profile."""
    lib = f.library(conn)
    f.items(conn, lib, 6)
    process_all(conn)
    execute(
        conn, "UPDATE library_profiles SET inventory_revision = 5 WHERE library_id = %s", (lib,)
    )
    execute(conn, "DELETE FROM library_inventory_state WHERE library_id = %s", (lib,))
    f.items(conn, lib, 6, seed=9)  # captured: a fresh state row at revision 1
    assert f.revision(conn, lib) == 1
    service.mark_all_dirty(conn)
    assert f.revision(conn, lib) == 6
    [done] = process_all(conn)
    assert done.outcome == "published"  # type: ignore[attr-defined]
    stored = f.profile(conn, lib)
    assert stored is not None and (stored["inventory_revision"], stored["item_count"]) == (6, 12)


def test_mark_dirty_command(db_url: str, tmp_path: Path) -> None:
    env = {"INVENTORY_DATABASE_URL": db_url, "INVENTORY_DATA_DIR": str(tmp_path)}
    with connect(db_url) as conn:
        libs = [f.library(conn, name=str(i)) for i in range(3)]
    result = run(["mark-dirty"], env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(
        "3 libraries marked dirty; the planner queues their refresh"
    )
    with connect(db_url) as conn:
        assert [f.revision(conn, lib) for lib in libs] == [1, 1, 1]
    refused = run(["mark-dirty"], {"INVENTORY_DATABASE_URL": "postgresql://u:pw@127.0.0.1:1/x"})
    assert refused.returncode == 1
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith("inventory-pipeline: error: cannot connect to postgresql://u:***@")
