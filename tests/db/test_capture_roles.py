"""Change capture covers every writer, whatever its role.

Other programs write media_server_items (and libraries) under roles granted rights on
those tables and nothing else. Every kind of write statement such a role can issue is
captured, advancing exactly the libraries its rows touch, once per statement; and the
owner's rights the capture runs with give the writer no other reach.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from inventory_pipeline.db import Connection, DatabaseError, execute, fetch_all, fetch_one
from tests import factories as f
from tests.roles import ITEM_RIGHTS, acting_as, writer_role


@pytest.fixture
def writer(db_url: str) -> Iterator[str]:
    with writer_role(db_url) as role:
        yield role


@pytest.fixture
def libs(conn: Connection) -> list[int]:
    """Four libraries on one server: three hold five items each, the last is empty."""
    server = f.server(conn)
    made = [f.library(conn, server, name=name) for name in ("a", "b", "c", "empty")]
    for lib in made[:3]:
        f.items(conn, lib, 5)
    return made


def advanced(conn: Connection, libraries: list[int], write: Callable[[], object]) -> list[int]:
    """How far each library's revision moved while `write` ran."""

    def revisions() -> list[int]:
        return [f.revision(conn, lib) for lib in libraries]

    before = revisions()
    write()
    return [after - b for after, b in zip(revisions(), before, strict=True)]


def item_ids(conn: Connection, library_id: int) -> list[int]:
    rows = fetch_all(
        conn, "SELECT id FROM media_server_items WHERE library_id = %s ORDER BY id", (library_id,)
    )
    return [int(r["id"]) for r in rows]


def server_version(conn: Connection) -> int:
    row = fetch_one(conn, "SELECT current_setting('server_version_num')::int AS v")
    assert row is not None
    return int(row["v"])


def observe(conn: Connection, item_id: int) -> None:
    """A stored observation of the item (as the observation worker would leave it)."""
    execute(
        conn,
        "INSERT INTO provider_observations (item_id, source_generation, provider_kind, tmdb_id,"
        " title, genres, companies, observed_at) VALUES (%s, 1, 'movie', 1, 't', '{}', '{}',"
        " now())",
        (item_id,),
    )


def observed(conn: Connection) -> set[int]:
    return {int(r["item_id"]) for r in fetch_all(conn, "SELECT item_id FROM provider_observations")}


def test_insert(conn: Connection, writer: str, libs: list[int]) -> None:
    a, b, _, _ = libs

    def write() -> None:
        with acting_as(conn, writer):
            execute(
                conn,
                "INSERT INTO media_server_items (library_id, title, rating)"
                " VALUES (%s, 'x', 5), (%s, 'y', 6), (%s, 'z', 7)",
                (a, a, b),
            )

    assert advanced(conn, libs, write) == [1, 1, 0, 0]


def test_update(conn: Connection, writer: str, libs: list[int]) -> None:
    a, b, c, empty = libs
    moved = item_ids(conn, b)[0]
    renamed = item_ids(conn, c)[0]

    def relevant() -> None:
        with acting_as(conn, writer):
            execute(
                conn,
                "UPDATE media_server_items SET rating = 9.25 WHERE library_id = %s",
                (a,),
            )

    def move() -> None:
        with acting_as(conn, writer):
            execute(
                conn,
                "UPDATE media_server_items SET library_id = %s WHERE id = %s",
                (empty, moved),
            )

    def unobserved_fields() -> None:
        # A new title is a source change (the item's generation moves) but not a field
        # of the profile's observation.
        with acting_as(conn, writer):
            execute(
                conn,
                "UPDATE media_server_items SET title = 'renamed', plot = 'p', synced_at = now()"
                " WHERE id = %s",
                (renamed,),
            )

    assert advanced(conn, libs, relevant) == [1, 0, 0, 0]
    assert advanced(conn, libs, move) == [0, 1, 0, 1]
    assert advanced(conn, libs, unobserved_fields) == [0, 0, 0, 0]
    assert f.item(conn, renamed)["source_generation"] == 2


def test_an_update_that_changes_an_id_is_a_delete_and_an_insert(
    conn: Connection, writer: str, libs: list[int]
) -> None:
    """A re-keying UPDATE dirties the library the old row left and the one the new row
    joined, as a MERGE doing the same does; the item's observation goes with its old id,
    and the re-keyed row starts over as a new item (a new source generation, due now)."""
    a, b, c, _ = libs
    moved, kept = item_ids(conn, a)[0], item_ids(conn, c)[0]
    observe(conn, moved)
    before = fetch_one(
        conn, "SELECT source_generation FROM media_server_items WHERE id = %s", (moved,)
    )
    assert before is not None

    def write() -> None:
        with acting_as(conn, writer):
            execute(
                conn,
                "UPDATE media_server_items SET id = %s, library_id = %s WHERE id = %s",
                (moved + 100_000, b, moved),
            )

    assert advanced(conn, libs, write) == [1, 1, 0, 0]
    assert observed(conn) == set()
    row = fetch_one(
        conn,
        "SELECT source_generation, observation_due_at <= now() AS due"
        " FROM media_server_items WHERE id = %s",
        (moved + 100_000,),
    )
    assert row == {"source_generation": before["source_generation"] + 1, "due": True}

    def same_library() -> None:  # a new id in the same library, nothing else changed
        with acting_as(conn, writer):
            execute(
                conn, "UPDATE media_server_items SET id = %s WHERE id = %s", (kept + 100_000, kept)
            )

    assert advanced(conn, libs, same_library) == [0, 0, 1, 0]


def test_delete_forgets_observations(conn: Connection, writer: str, libs: list[int]) -> None:
    _, b, c, _ = libs
    gone, kept = item_ids(conn, b)[0], item_ids(conn, c)[0]
    observe(conn, gone)
    observe(conn, kept)

    def write() -> None:
        with acting_as(conn, writer):
            execute(conn, "DELETE FROM media_server_items WHERE id = %s", (gone,))

    assert advanced(conn, libs, write) == [0, 1, 0, 0]
    assert observed(conn) == {kept}


def test_truncate(conn: Connection, db_url: str, libs: list[int]) -> None:
    observe(conn, item_ids(conn, libs[0])[0])
    with writer_role(db_url, items=f"{ITEM_RIGHTS}, TRUNCATE") as truncater:

        def write() -> None:
            with acting_as(conn, truncater):
                execute(conn, "TRUNCATE media_server_items")

        # Every library that held items, and only those.
        assert advanced(conn, libs, write) == [1, 1, 1, 0]
    assert observed(conn) == set()


def test_upsert_counts_its_insert_and_its_update(
    conn: Connection, writer: str, libs: list[int]
) -> None:
    """INSERT ... ON CONFLICT DO UPDATE fires the insert capture for the rows it inserted
    and the update capture for the rows it updated: a library with both advances twice."""
    a, b, c, _ = libs
    a_item, b_item, c_item = item_ids(conn, a)[0], item_ids(conn, b)[0], item_ids(conn, c)[0]
    upsert = (
        "INSERT INTO media_server_items (id, library_id, title, rating) VALUES {}"
        " ON CONFLICT (id) DO UPDATE SET rating = EXCLUDED.rating, synced_at = now()"
    )

    def insert_a_update_b() -> None:
        with acting_as(conn, writer):
            execute(
                conn,
                upsert.format("(DEFAULT, %s, 'new', 1), (%s, %s, 't', 1.25)"),
                (a, b_item, b),
            )

    def insert_and_update_a() -> None:
        with acting_as(conn, writer):
            execute(
                conn,
                upsert.format("(DEFAULT, %s, 'new', 1), (%s, %s, 't', 2.25)"),
                (a, a_item, a),
            )

    def same_values() -> None:
        # The conflict path runs (synced_at changes) but no observed field does.
        with acting_as(conn, writer):
            execute(
                conn,
                upsert.format(
                    "(%s, %s, 't', (SELECT rating FROM media_server_items WHERE id = %s))"
                ),
                (c_item, c, c_item),
            )

    assert advanced(conn, libs, insert_a_update_b) == [1, 1, 0, 0]
    assert advanced(conn, libs, insert_and_update_a) == [2, 0, 0, 0]
    assert advanced(conn, libs, same_values) == [0, 0, 0, 0]


def test_merge(conn: Connection, writer: str, libs: list[int]) -> None:
    """MERGE fires the capture of each action kind it performs, each once per statement."""
    a, b, c, empty = libs
    a_item, b_item = item_ids(conn, a)[0], item_ids(conn, b)[0]
    observe(conn, b_item)
    merge = (
        "MERGE INTO media_server_items t"
        " USING (VALUES (%s::bigint, 'update'), (%s, 'delete'), (NULL, 'insert'))"
        "   AS s (id, action)"
        " ON t.id = s.id"
        " WHEN MATCHED AND s.action = 'update' THEN UPDATE SET rating = 0.25"
        " WHEN MATCHED AND s.action = 'delete' THEN DELETE"
        " WHEN NOT MATCHED THEN INSERT (library_id, title) VALUES (%s, 'merged')"
    )

    def write() -> None:
        with acting_as(conn, writer):
            execute(conn, merge, (a_item, b_item, empty))

    assert advanced(conn, libs, write) == [1, 1, 0, 1]
    assert b_item not in observed(conn)

    def insert_and_update_c() -> None:
        # One library inserted into and updated by one MERGE advances once per action.
        with acting_as(conn, writer):
            execute(
                conn,
                "MERGE INTO media_server_items t"
                " USING (VALUES (%s::bigint), (NULL)) AS s (id) ON t.id = s.id"
                " WHEN MATCHED THEN UPDATE SET rating = 0.75"
                " WHEN NOT MATCHED THEN INSERT (library_id, title) VALUES (%s, 'merged')",
                (item_ids(conn, c)[0], c),
            )

    assert advanced(conn, libs, insert_and_update_c) == [0, 0, 2, 0]


def test_merge_not_matched_by_source(conn: Connection, writer: str, libs: list[int]) -> None:
    """PostgreSQL 17 added WHEN NOT MATCHED BY SOURCE: a sync that deletes what the
    source no longer lists, in the same statement."""
    if server_version(conn) < 170000:
        pytest.skip("WHEN NOT MATCHED BY SOURCE needs PostgreSQL 17")
    a, b, _, _ = libs
    listed = item_ids(conn, b)[:2]

    def write() -> None:
        with acting_as(conn, writer):
            execute(
                conn,
                "MERGE INTO media_server_items t"
                " USING (SELECT unnest(%s::bigint[]) AS id) s ON t.id = s.id"
                " WHEN MATCHED THEN UPDATE SET synced_at = now()"
                " WHEN NOT MATCHED BY SOURCE AND t.library_id = %s THEN DELETE",
                (listed, b),
            )

    assert advanced(conn, libs, write) == [0, 1, 0, 0]
    assert item_ids(conn, b) == listed
    assert len(item_ids(conn, a)) == 5


def test_copy(conn: Connection, writer: str, libs: list[int]) -> None:
    a, _, c, _ = libs

    def write() -> None:
        with (
            acting_as(conn, writer),
            conn.cursor() as cur,
            cur.copy("COPY media_server_items (library_id, title, rating) FROM STDIN") as copy,
        ):
            for n in range(20):
                copy.write_row((a if n % 2 else c, f"copied {n}", n / 4))

    assert advanced(conn, libs, write) == [1, 0, 1, 0]


def test_library_writer(conn: Connection, db_url: str, libs: list[int]) -> None:
    """A role that may also create and delete libraries: new libraries get their state
    row, deleted ones take items, state and observations with them."""
    a, b, c, _ = libs
    observe(conn, item_ids(conn, a)[0])
    kept = item_ids(conn, c)[0]
    observe(conn, kept)
    with writer_role(db_url, libraries="SELECT, INSERT, DELETE") as curator:
        server = f.server(conn, name="other")
        with acting_as(conn, curator):
            row = fetch_one(
                conn,
                "INSERT INTO libraries (server_id, name, media_kind) VALUES (%s, 'new', 'tv')"
                " RETURNING id",
                (server,),
            )
            assert row is not None
            execute(conn, "DELETE FROM libraries WHERE id = %s", (a,))
    assert f.state(conn, int(row["id"])) == {
        "revision": 0,
        "acknowledged_revision": 0,
        "dirty_since": None,
    }
    states = fetch_all(conn, "SELECT library_id FROM library_inventory_state ORDER BY 1")
    assert a not in {s["library_id"] for s in states}
    assert observed(conn) == {kept}
    assert f.revision(conn, b) == 1


# The tables other programs write: every trigger function they fire is checked.
WRITER_TABLES = ("media_server_items", "libraries")


def test_every_trigger_on_writer_tables_runs_as_owner_with_a_pinned_path(
    conn: Connection,
) -> None:
    rows = fetch_all(
        conn,
        "SELECT DISTINCT p.proname, p.prosecdef, p.proconfig"
        " FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid"
        " WHERE t.tgrelid = ANY (%s::regclass[]) AND NOT t.tgisinternal ORDER BY 1",
        (list(WRITER_TABLES),),
    )
    assert {r["proname"] for r in rows} >= {
        "advance_source_generation",
        "capture_inventory_delete",
        "capture_inventory_insert",
        "capture_inventory_truncate",
        "capture_inventory_update",
        "create_inventory_state",
        "forget_all_observations",
        "forget_deleted_observations",
    }
    for r in rows:
        assert r["prosecdef"], r["proname"]
        assert "search_path=public, pg_temp" in (r["proconfig"] or []), r["proname"]
    # The projection stays an invoker function without SET clauses: only such a SQL
    # function is inlined into the update capture's comparison.
    projection = fetch_one(
        conn,
        "SELECT prosecdef, proconfig FROM pg_proc"
        " WHERE oid = 'inventory_observation_of(media_server_items)'::regprocedure",
    )
    assert projection == {"prosecdef": False, "proconfig": None}


INTERNAL_FUNCTIONS = (
    "advance_inventory_revisions(bigint[])",
    "advance_source_generation()",
    "capture_inventory_delete()",
    "capture_inventory_insert()",
    "capture_inventory_truncate()",
    "capture_inventory_update()",
    "create_inventory_state()",
    "forget_all_observations()",
    "forget_deleted_observations()",
    "inventory_observation_of(media_server_items)",
)


def test_writer_reaches_only_its_tables(conn: Connection, writer: str) -> None:
    executable = fetch_all(
        conn,
        "SELECT f FROM unnest(%s::text[]) AS f"
        " WHERE has_function_privilege(%s, f::regprocedure, 'EXECUTE')",
        (list(INTERNAL_FUNCTIONS), writer),
    )
    assert executable == []
    reachable = {
        r["t"]: r["p"]
        for r in fetch_all(
            conn,
            "SELECT c.relname AS t, array_agg(p.privilege ORDER BY p.privilege) AS p"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " CROSS JOIN unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE',"
            "   'REFERENCES', 'TRIGGER']) AS p(privilege)"
            " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'v', 'm', 'p')"
            " AND has_table_privilege(%s, c.oid, p.privilege)"
            " GROUP BY c.relname",
            (writer,),
        )
    }
    assert reachable == {
        "media_server_items": ["DELETE", "INSERT", "SELECT", "UPDATE"],
        "libraries": ["SELECT"],
        "media_servers": ["SELECT"],
    }
    # The pinned search_path names the schema: a writer that could create objects in it
    # could shadow the owner's (PostgreSQL 15 and later grant nobody CREATE on public).
    creatable = fetch_one(
        conn, "SELECT has_schema_privilege(%s, 'public', 'CREATE') AS c", (writer,)
    )
    assert creatable == {"c": False}


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT * FROM library_inventory_state",
        "UPDATE library_inventory_state SET revision = revision + 1",
        "SELECT * FROM provider_observations",
        "DELETE FROM provider_observations",
        "SELECT advance_inventory_revisions(ARRAY[1::bigint])",
        "SELECT capture_inventory_truncate()",
        # Attaching the owner's capture to a table of its own would let a writer advance
        # any library it names; EXECUTE is checked when a trigger is created.
        "CREATE TEMP TABLE forged (id bigint, library_id bigint) ON COMMIT DROP;"
        " CREATE TRIGGER forged AFTER INSERT ON forged REFERENCING NEW TABLE AS new_rows"
        " FOR EACH STATEMENT EXECUTE FUNCTION capture_inventory_insert()",
        "CREATE TEMP TABLE forged (library_id bigint) ON COMMIT DROP;"
        " CREATE TRIGGER forged BEFORE TRUNCATE ON forged"
        " FOR EACH STATEMENT EXECUTE FUNCTION forget_all_observations()",
    ],
)
def test_writer_is_refused(conn: Connection, writer: str, statement: str) -> None:
    with pytest.raises(DatabaseError, match="permission denied"), acting_as(conn, writer):
        execute(conn, statement)


def test_writer_session_cannot_redirect_the_owners_capture(
    conn: Connection, writer: str, libs: list[int]
) -> None:
    """Temporary tables named like the owner's, first on the writer's search_path, are
    not what the capture writes: its search_path is pinned."""
    a, b, _, _ = libs
    observe(conn, item_ids(conn, b)[0])

    def write() -> None:
        with acting_as(conn, writer):
            execute(
                conn,
                "CREATE TEMP TABLE library_inventory_state (library_id bigint PRIMARY KEY,"
                " revision bigint, acknowledged_revision bigint, dirty_since timestamptz,"
                " changed_at timestamptz) ON COMMIT DROP;"
                " CREATE TEMP TABLE libraries (LIKE public.libraries) ON COMMIT DROP;"
                " INSERT INTO libraries SELECT * FROM public.libraries;"
                " CREATE TEMP TABLE provider_observations (item_id bigint) ON COMMIT DROP",
            )
            execute(conn, "SET LOCAL search_path = pg_temp, public")
            execute(
                conn,
                "INSERT INTO public.media_server_items (library_id, title) VALUES (%s, 'x')",
                (a,),
            )
            execute(conn, "DELETE FROM public.media_server_items WHERE library_id = %s", (b,))
            shadow = fetch_one(conn, "SELECT count(*) AS n FROM pg_temp.library_inventory_state")
            assert shadow == {"n": 0}

    assert advanced(conn, libs, write) == [1, 1, 0, 0]
    assert observed(conn) == set()
