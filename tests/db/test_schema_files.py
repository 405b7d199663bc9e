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

# What each schema file owns, by name: a new object of the capability named like its
# others is caught even when the schema file forgot it.
CAPABILITIES = {
    "inventory_pipeline.stats": {
        "relations": r"^(stats_|training_|user_|exercise|catalog_invalidation|pr_overview)",
        "functions": (
            r"^(stats_|bump_stats|delete_manual_pr|delete_training_session|enqueue_user_exercise"
            r"|estimated_one_rep_max|get_pr_overview|log_exercise_change|record_catalog_token"
            r"|request_stats_refresh|save_manual_pr|save_training_session)"
        ),
        "domains": r"^stats_",
        # Starting rows, without the columns that record when they were written.
        "rows": {
            "stats_projection_worker_settings": "SELECT * FROM stats_projection_worker_settings",
            "stats_lease_slots": (
                "SELECT slot, run_id, lease_until::text FROM stats_lease_slots ORDER BY slot"
            ),
            "pr_overview_projection_control": (
                "SELECT id, catalog_epoch FROM pr_overview_projection_control"
            ),
            "stats_scan_cursor": "SELECT id, cursor, laps FROM stats_scan_cursor",
            "stats_refresh_event_types": "SELECT * FROM stats_refresh_event_types ORDER BY id",
            "catalog_invalidation_tokens": "SELECT * FROM catalog_invalidation_tokens",
        },
    },
}

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


def catalog(conn: Connection, owned: dict[str, Any]) -> dict[str, Any]:
    """Every object of the capability, described so two databases compare equal when
    they hold the same definitions."""
    described: dict[str, Any] = {"tables": {}, "functions": {}, "domains": {}, "rows": {}}
    for domain in fetch_all(
        conn,
        "SELECT t.typname, format_type(t.typbasetype, t.typtypmod) AS base, t.typnotnull,"
        " ARRAY(SELECT pg_get_constraintdef(k.oid) FROM pg_constraint k"
        "       WHERE k.contypid = t.oid ORDER BY 1) AS checks"
        " FROM pg_type t WHERE t.typnamespace = 'public'::regnamespace AND t.typtype = 'd'"
        " AND t.typname ~ %s",
        (owned["domains"],),
    ):
        described["domains"][domain["typname"]] = domain
    for table in fetch_all(
        conn,
        "SELECT c.oid, c.relname, c.relkind, c.relrowsecurity, c.relowner, c.relacl"
        " FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace"
        " AND c.relkind IN ('r', 'v', 'm', 'p') AND c.relname ~ %s",
        (owned["relations"],),
    ):
        oid = table["oid"]
        described["tables"][table["relname"]] = {
            "kind": table["relkind"],
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
                "SELECT pg_get_triggerdef(oid) AS definition FROM pg_trigger"
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
        }
    for function in fetch_all(
        conn,
        "SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')' AS sig,"
        " pg_get_function_result(p.oid) AS result, l.lanname, p.provolatile, p.prosecdef,"
        " p.proisstrict, p.proconfig, p.prosrc, p.proowner,"
        " coalesce(p.proacl, acldefault('f', p.proowner)) AS acl"
        " FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang"
        " WHERE p.pronamespace = 'public'::regnamespace AND p.proname ~ %s",
        (owned["functions"],),
    ):
        acl, owner = function.pop("acl"), function.pop("proowner")
        function["grants"] = _acl(conn, acl, owner)
        described["functions"][function.pop("sig")] = function
    for table, query in owned["rows"].items():
        described["rows"][table] = fetch_all(conn, query)
    return described


@pytest.fixture
def built_from_file(server_url: str) -> Iterator[tuple[str, str]]:
    """Per capability, a database made from its schema file alone."""
    name = f"inventory_schema_{uuid.uuid4().hex[:12]}"
    with connect(server_url) as admin:
        create_database(admin, name)
    try:
        yield name, url_with_database(server_url, name)
    finally:
        with connect(server_url) as admin:
            drop_database(admin, name)


@pytest.mark.parametrize("package", sorted(CAPABILITIES))
def test_the_schema_file_describes_what_the_migrations_build(
    conn: Connection, built_from_file: tuple[str, str], package: str
) -> None:
    owned = CAPABILITIES[package]
    text = resources.files(package).joinpath("schema.sql").read_text("utf-8")
    _, url = built_from_file
    with connect(url) as fresh:
        execute_script(fresh, text)
        from_file = catalog(fresh, owned)
    migrated = catalog(conn, owned)
    for kind in ("domains", "tables", "functions", "rows"):
        assert sorted(from_file[kind]) == sorted(migrated[kind]), f"{kind} differ"
        for key, definition in migrated[kind].items():
            assert from_file[kind][key] == definition, f"{kind} {key} differs"
    assert migrated["tables"] and migrated["functions"]


def test_an_object_left_out_of_the_schema_file_is_caught(
    conn: Connection, built_from_file: tuple[str, str]
) -> None:
    """The check can fail: a function a migration would add, absent from the file."""
    owned = CAPABILITIES["inventory_pipeline.stats"]
    text = resources.files("inventory_pipeline.stats").joinpath("schema.sql").read_text("utf-8")
    _, url = built_from_file
    with connect(url) as fresh:
        execute_script(fresh, text)
        from_file = catalog(fresh, owned)
    execute_script(
        conn, "CREATE FUNCTION stats_forgotten() RETURNS integer LANGUAGE sql AS 'SELECT 1'"
    )
    assert sorted(catalog(conn, owned)["functions"]) != sorted(from_file["functions"])
    assert re.search(r"stats_forgotten", " ".join(catalog(conn, owned)["functions"]))
