"""The deletion interleavings again, on a database whose foreign keys were created in
another order, as a dump and restore does (constraints by name): a library deletion
then cascades into its inventory state before its items, requests and profile. The
pipeline's lock order must not depend on the order of the cascades."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from inventory_pipeline.db import Connection, connect, execute, fetch_all
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from tests.db import test_deletion as base
from tests.db.test_deletion import (
    SCENARIOS,
    Control,
    Scenario,
    Session,
    deletion_during_pipeline,
    install_gates,
    pipeline_during_deletion,
)

# The fixtures of the interleaving tests, on this module's `shared_url`.
db_url = base.db_url
control = base.control
sessions = base.sessions

# Cascaded in this order: library_inventory_state's first, as a restore that creates
# constraints by name leaves it.
RESTORED = (
    "library_policies",
    "library_profiles",
    "media_server_items",
    "profile_refresh_requests",
)

CASCADE_ORDER = (
    "SELECT c.conrelid::regclass::text AS t FROM pg_trigger g"
    " JOIN pg_constraint c ON c.oid = g.tgconstraint"
    " JOIN pg_proc p ON p.oid = g.tgfoid"
    " WHERE g.tgrelid = 'libraries'::regclass AND p.proname = 'RI_FKey_cascade_del'"
    ' ORDER BY g.tgname COLLATE "C"'
)


def recreate_cascades(conn: Connection) -> None:
    """Create the cascades again in RESTORED's order, the state's first. The server fires
    a table's triggers in name order and the names carry OIDs, so where the OIDs cross
    a power of ten the order differs: then create them all again, further on."""
    for _ in range(3):
        for table in ("library_inventory_state", *RESTORED):
            execute(
                conn,
                f"ALTER TABLE {table} DROP CONSTRAINT {table}_library_id_fkey,"
                f" ADD CONSTRAINT {table}_library_id_fkey FOREIGN KEY (library_id)"
                " REFERENCES libraries (id) ON DELETE CASCADE",
            )
        if [r["t"] for r in fetch_all(conn, CASCADE_ORDER)] == [
            "library_inventory_state",
            *RESTORED,
        ]:
            return


@pytest.fixture(scope="module")
def shared_url(server_url: str, template_name: str) -> Iterator[str]:
    name = f"inventory_restored_{uuid.uuid4().hex[:12]}"
    with connect(server_url) as admin:
        create_database(admin, name, template=template_name)
    url = url_with_database(server_url, name)
    with connect(url) as conn:
        recreate_cascades(conn)
        install_gates(conn)
    yield url
    with connect(server_url) as admin:
        drop_database(admin, name)


def test_the_state_cascade_comes_first(conn: Connection) -> None:
    assert [r["t"] for r in fetch_all(conn, CASCADE_ORDER)] == [
        "library_inventory_state",
        *RESTORED,
    ]


@pytest.mark.parametrize("point", ["items", "requests", "state", "uncommitted"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_pipeline_at_every_point_of_a_restored_deletion(
    conn: Connection,
    control: Control,
    sessions: Callable[[str | None], Session],
    scenario: Scenario,
    point: str,
) -> None:
    pipeline_during_deletion(conn, control, sessions, scenario, point, "library")


@pytest.mark.parametrize(
    "scenario, point",
    [(s, g) for s in SCENARIOS for g in s.gates],
    ids=lambda v: v.name if isinstance(v, Scenario) else v,
)
def test_restored_deletion_at_every_point_of_the_pipeline(
    conn: Connection,
    control: Control,
    sessions: Callable[[str | None], Session],
    scenario: Scenario,
    point: str,
) -> None:
    deletion_during_pipeline(conn, control, sessions, scenario, point, "library")
