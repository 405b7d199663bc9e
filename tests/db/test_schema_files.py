"""A capability's schema file says what the migrations build. A database built from the
file alone and a migrated one hold the same objects of that capability: tables with
their columns, constraints, indexes, triggers, policies and grants, domains, functions
down to their bodies and settings, and the rows the capability starts from. A change
made to either without the other fails here."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from importlib import resources
from typing import Any

import pytest

from inventory_pipeline.db import Connection, connect, fetch_all
from inventory_pipeline.db.connection import (
    create_database,
    drop_database,
    execute_script,
    url_with_database,
)

# The schema files in the order a fresh database takes them: a capability's file may use
# the objects of the files before it (the recovery triggers sit on the inventory's items,
# the lapsed-lease triggers on every capability's leases).
SCHEMA_FILES = (
    "inventory_pipeline.profiles",
    "inventory_pipeline.recovery",
    "inventory_pipeline.credentials",
    "inventory_pipeline.revalidation",
    "inventory_pipeline.stats",
    "inventory_pipeline.leases",
)
# The migrator's own ledger, which no schema file describes.
LEDGER = "schema_migrations"

ACL = """
SELECT coalesce(r.rolname, 'PUBLIC') AS grantee, a.privilege_type
FROM aclexplode(%(acl)s::aclitem[]) AS a
LEFT JOIN pg_roles r ON r.oid = a.grantee
WHERE a.grantee <> %(owner)s::oid
ORDER BY 1, 2
"""


def _acl(conn: Connection, acl: Any, owner: int) -> list[tuple[str, str]]:
    rows = fetch_all(conn, ACL, {"acl": acl, "owner": owner})
    return [(r["grantee"], r["privilege_type"]) for r in rows]


def _rows(conn: Connection, table: str) -> list[Any]:
    """A table's rows without the columns that record when or by chance they were
    written (timestamps, generated uuids): the rows a fresh database starts from."""
    columns = [
        r["attname"]
        for r in fetch_all(
            conn,
            "SELECT a.attname FROM pg_attribute a LEFT JOIN pg_attrdef d"
            "  ON d.adrelid = a.attrelid AND d.adnum = a.attnum"
            " WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped"
            " AND a.atttypid NOT IN ('timestamptz'::regtype, 'timestamptz[]'::regtype)"
            " AND coalesce(pg_get_expr(d.adbin, d.adrelid), '') !~ 'gen_random_uuid'"
            " ORDER BY a.attnum",
            (table,),
        )
    ]
    # Identifiers from the catalog, quoted by format(): no value reaches the text.
    query = fetch_all(
        conn,
        "SELECT format('SELECT %%s FROM %%I ORDER BY 1', string_agg(format('%%I', c), ', '),"
        " %s::text) AS q FROM unnest(%s::text[]) AS c",
        (table, columns),
    )[0]["q"]
    return [tuple(r.values()) for r in fetch_all(conn, query)] if columns else []


def catalog(conn: Connection) -> dict[str, Any]:
    """Every object of the schema, described so that two databases compare equal when
    they hold the same definitions."""
    described: dict[str, Any] = {"tables": {}, "functions": {}, "domains": {}, "rows": {}}
    for domain in fetch_all(
        conn,
        "SELECT t.typname, format_type(t.typbasetype, t.typtypmod) AS base, t.typnotnull,"
        " ARRAY(SELECT pg_get_constraintdef(k.oid) FROM pg_constraint k"
        "       WHERE k.contypid = t.oid ORDER BY 1) AS checks"
        " FROM pg_type t WHERE t.typnamespace = 'public'::regnamespace AND t.typtype = 'd'",
    ):
        described["domains"][domain["typname"]] = domain
    for table in fetch_all(
        conn,
        "SELECT c.oid, c.relname, c.relkind, c.relrowsecurity, c.relowner, c.relacl,"
        " CASE WHEN c.relkind = 'v' THEN pg_get_viewdef(c.oid) END AS view"
        " FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace"
        " AND c.relkind IN ('r', 'v', 'm', 'p', 'c') AND c.relname <> %s",
        (LEDGER,),
    ):
        oid = table["oid"]
        described["tables"][table["relname"]] = {
            "kind": table["relkind"],
            "view": table["view"],
            "row_security": table["relrowsecurity"],
            "columns": fetch_all(
                conn,
                "SELECT a.attname, format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull,"
                " a.attidentity, pg_get_expr(d.adbin, d.adrelid) AS default_value"
                " FROM pg_attribute a LEFT JOIN pg_attrdef d"
                "   ON d.adrelid = a.attrelid AND d.adnum = a.attnum"
                " WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped"
                " ORDER BY a.attnum",
                (oid,),
            ),
            "constraints": fetch_all(
                conn,
                "SELECT conname, pg_get_constraintdef(oid) AS definition FROM pg_constraint"
                " WHERE conrelid = %s ORDER BY 1",
                (oid,),
            ),
            "indexes": fetch_all(
                conn,
                "SELECT pg_get_indexdef(indexrelid) AS definition FROM pg_index"
                " WHERE indrelid = %s ORDER BY 1",
                (oid,),
            ),
            "triggers": fetch_all(
                conn,
                "SELECT pg_get_triggerdef(oid) AS definition, tgenabled FROM pg_trigger"
                " WHERE tgrelid = %s AND NOT tgisinternal ORDER BY 1",
                (oid,),
            ),
            "policies": fetch_all(
                conn,
                "SELECT policyname, permissive, roles, cmd, qual, with_check FROM pg_policies"
                " WHERE schemaname = 'public' AND tablename = %s ORDER BY 1",
                (table["relname"],),
            ),
            "grants": _acl(conn, table["relacl"], table["relowner"]),
            "rows": _rows(conn, table["relname"]) if table["relkind"] == "r" else [],
        }
    for function in fetch_all(
        conn,
        "SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')' AS sig,"
        " pg_get_function_result(p.oid) AS result, l.lanname, p.provolatile, p.prosecdef,"
        " p.proisstrict, p.proconfig, p.prosrc, p.proowner,"
        " coalesce(p.proacl, acldefault('f', p.proowner)) AS acl"
        " FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang"
        " WHERE p.pronamespace = 'public'::regnamespace",
    ):
        acl, owner = function.pop("acl"), function.pop("proowner")
        function["grants"] = _acl(conn, acl, owner)
        described["functions"][function.pop("sig")] = function
    schema = fetch_all(
        conn,
        "SELECT nspacl, nspowner FROM pg_namespace WHERE nspname = 'public'",
    )[0]
    described["schema_grants"] = _acl(conn, schema["nspacl"], schema["nspowner"])
    return described


def _schema_file(package: str) -> str:
    return resources.files(package).joinpath("schema.sql").read_text("utf-8")


@pytest.fixture
def built_from_files(server_url: str) -> Iterator[Connection]:
    """A database made from the schema files alone, in their order."""
    name = f"inventory_schema_{uuid.uuid4().hex[:12]}"
    with connect(server_url) as admin:
        create_database(admin, name)
    try:
        with connect(url_with_database(server_url, name)) as fresh:
            for package in SCHEMA_FILES:
                execute_script(fresh, _schema_file(package))
            yield fresh
    finally:
        with connect(server_url) as admin:
            drop_database(admin, name)


def _assert_same(from_files: dict[str, Any], migrated: dict[str, Any]) -> None:
    assert from_files["schema_grants"] == migrated["schema_grants"]
    for kind in ("domains", "tables", "functions"):
        assert sorted(from_files[kind]) == sorted(migrated[kind]), f"{kind} differ"
        for key, definition in migrated[kind].items():
            assert from_files[kind][key] == definition, f"{kind} {key} differs"


def test_the_schema_files_describe_what_the_migrations_build(
    conn: Connection, built_from_files: Connection
) -> None:
    migrated = catalog(conn)
    _assert_same(catalog(built_from_files), migrated)
    assert migrated["tables"] and migrated["functions"] and migrated["domains"]
    assert migrated["tables"]["provider_settings"]["rows"] == [("tmdb", None, False, None)]


def test_each_object_is_defined_in_one_schema_file(conn: Connection) -> None:
    """A reader finds every table, view, type and function in exactly one file: the one of
    the capability that owns it."""
    described = catalog(conn)
    names = [*described["tables"], *described["domains"]] + [
        signature.split("(")[0] for signature in described["functions"]
    ]
    texts = {package: _schema_file(package) for package in SCHEMA_FILES}
    for name in names:
        pattern = rf"^CREATE (TABLE|VIEW|TYPE|DOMAIN|FUNCTION) {name}\b"
        defined_in = [p for p, text in texts.items() if re.search(pattern, text, re.M)]
        assert len(defined_in) == 1, f"{name} is defined in {defined_in or 'no schema file'}"


def test_an_object_left_out_of_the_schema_files_is_caught(
    conn: Connection, built_from_files: Connection
) -> None:
    """The check can fail: a function, an index, a starting row a migration would add,
    absent from the files."""
    from_files = catalog(built_from_files)
    _assert_same(from_files, catalog(conn))
    for change, undo in (
        (
            "CREATE FUNCTION stats_forgotten() RETURNS integer LANGUAGE sql AS 'SELECT 1'",
            "DROP FUNCTION stats_forgotten()",
        ),
        (
            "CREATE INDEX libraries_forgotten ON libraries (name)",
            "DROP INDEX libraries_forgotten",
        ),
        (
            "INSERT INTO revalidation_budget (bucket) VALUES ('forgotten')",
            "DELETE FROM revalidation_budget WHERE bucket = 'forgotten'",
        ),
        (
            "ALTER TABLE credential_wakeups ALTER COLUMN probe_failures SET DEFAULT 1",
            "ALTER TABLE credential_wakeups ALTER COLUMN probe_failures SET DEFAULT 0",
        ),
        (
            "GRANT SELECT ON libraries TO inventory_app",
            "REVOKE SELECT ON libraries FROM inventory_app",
        ),
    ):
        execute_script(conn, change)
        with pytest.raises(AssertionError):
            _assert_same(from_files, catalog(conn))
        execute_script(conn, undo)
        _assert_same(from_files, catalog(conn))
