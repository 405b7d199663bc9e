"""Test factories: rows with sensible defaults, written through plain SQL like any
other program writing the data contract would."""

from __future__ import annotations

import random
from typing import Any

from inventory_pipeline.db import Connection, execute, fetch_all, fetch_one, jsonb

GENRES = ("Drama", "Comedy", "Action", "Thriller", "Documentary", "Animation", "Horror")
STUDIOS = ("A24", "Pixar", "Ghibli", "Warner", "Universal", "Toho", "Gaumont")
LANGUAGES = ("en", "fr", "ja", "ko", "de", "es")


def server(conn: Connection, name: str = "home", active: bool = True) -> int:
    row = fetch_one(
        conn,
        "INSERT INTO media_servers (name, kind, active) VALUES (%s, 'plex', %s) RETURNING id",
        (name, active),
    )
    assert row is not None
    return int(row["id"])


def library(
    conn: Connection,
    server_id: int | None = None,
    name: str = "Movies",
    media_kind: str = "movie",
    active: bool = True,
) -> int:
    if server_id is None:
        server_id = server(conn)
    row = fetch_one(
        conn,
        "INSERT INTO libraries (server_id, name, media_kind, active) VALUES (%s, %s, %s, %s)"
        " RETURNING id",
        (server_id, name, media_kind, active),
    )
    assert row is not None
    return int(row["id"])


def item_values(rng: random.Random, n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        kind = rng.choice(("movie", "tv"))
        out.append(
            {
                "title": f"Title {i}",
                "year": rng.randint(1950, 2025),
                "provider": "tmdb",
                "provider_kind": kind,
                "provider_id": str(rng.randint(1, 10**6)),
                "rating": round(rng.uniform(0, 10), 1),
                "genres": rng.sample(GENRES, rng.randint(1, 3)),
                "primary_studio": rng.choice(STUDIOS),
                "original_language": rng.choice(LANGUAGES),
                "plot": "A story.",
            }
        )
    return out


def insert_items(conn: Connection, library_id: int, rows: list[dict[str, Any]]) -> list[int]:
    """Insert item rows (as made by `item_values`) in one statement; returns their ids."""
    result = fetch_all(
        conn,
        "INSERT INTO media_server_items (library_id, title, year, provider, provider_kind,"
        " provider_id, rating, genres, primary_studio, original_language, plot)"
        " SELECT %s, x.title, x.year, x.provider, x.provider_kind, x.provider_id, x.rating,"
        " x.genres, x.primary_studio, x.original_language, x.plot"
        " FROM jsonb_to_recordset(%s) AS x(title text, year int, provider text,"
        " provider_kind text, provider_id text, rating numeric, genres text[],"
        " primary_studio text, original_language text, plot text)"
        " RETURNING id",
        (library_id, jsonb(rows)),
    )
    return [int(r["id"]) for r in result]


def items(
    conn: Connection, library_id: int, n: int = 10, seed: int = 1, **overrides: Any
) -> list[int]:
    """Insert n items in one statement; returns their ids."""
    rows = item_values(random.Random(seed), n)
    for row in rows:
        row.update(overrides)
    return insert_items(conn, library_id, rows)


def state(conn: Connection, library_id: int) -> dict[str, Any]:
    """The library's state once the captured changes are folded."""
    fetch_one(conn, "SELECT fold_inventory_changes()")
    row = fetch_one(
        conn,
        "SELECT revision, acknowledged_revision, dirty_since FROM library_inventory_state"
        " WHERE library_id = %s",
        (library_id,),
    )
    assert row is not None
    return row


def revision(conn: Connection, library_id: int) -> int:
    return int(state(conn, library_id)["revision"])


def requests(conn: Connection, library_id: int) -> list[dict[str, Any]]:
    return fetch_all(
        conn,
        "SELECT * FROM profile_refresh_requests WHERE library_id = %s ORDER BY id",
        (library_id,),
    )


def profile(conn: Connection, library_id: int) -> dict[str, Any] | None:
    return fetch_one(conn, "SELECT * FROM library_profiles WHERE library_id = %s", (library_id,))


def age_requests(conn: Connection, library_id: int, seconds: int) -> None:
    """Move a library's request history back in time (the tests' clock)."""
    execute(
        conn,
        "UPDATE profile_refresh_requests SET finished_at = finished_at - make_interval(secs => %s),"
        " created_at = created_at - make_interval(secs => %s),"
        " available_at = available_at - make_interval(secs => %s)"
        " WHERE library_id = %s",
        (seconds, seconds, seconds, library_id),
    )


def tmdb_item(
    conn: Connection, library_id: int, tmdb_id: int, kind: str = "movie", **fields: Any
) -> int:
    """One item with a typed TMDb identity."""
    row = fetch_one(
        conn,
        "INSERT INTO media_server_items (library_id, title, provider, provider_kind, provider_id,"
        " original_language) VALUES (%s, %s, 'tmdb', %s, %s, %s) RETURNING id",
        (
            library_id,
            fields.get("title", f"Item {tmdb_id}"),
            kind,
            str(tmdb_id),
            fields.get("original_language"),
        ),
    )
    assert row is not None
    return int(row["id"])


def item(conn: Connection, item_id: int) -> dict[str, Any]:
    row = fetch_one(conn, "SELECT * FROM media_server_items WHERE id = %s", (item_id,))
    assert row is not None
    return row


def provider_key(conn: Connection, key: str | None, active: bool = True) -> None:
    execute(
        conn,
        "UPDATE provider_settings SET api_key = %s, active = %s WHERE provider = 'tmdb'",
        (key, active and key is not None),
    )


def auth_cases(
    conn: Connection,
    library_id: int,
    count: int,
    first_tmdb_id: int = 1,
    failed_ago: str = "1 hour",
) -> list[int]:
    """Items whose last observation failed with `auth`, cooling down for a day."""
    ids = [tmdb_item(conn, library_id, first_tmdb_id + n) for n in range(count)]
    execute(
        conn,
        "UPDATE media_server_items SET recovery_case_id = gen_random_uuid(),"
        " recovery_provider = provider, recovery_provider_kind = provider_kind,"
        " recovery_provider_id = provider_id, recovery_category = 'auth', recovery_attempts = 2,"
        " recovery_first_failed_at = now() - %s::interval,"
        " recovery_last_failed_at = now() - %s::interval,"
        " observation_due_at = now() + interval '1 day', last_attempt_at = now() - %s::interval"
        " WHERE id = ANY(%s)",
        (failed_ago, failed_ago, failed_ago, ids),
    )
    return ids


def tables_containing(conn: Connection, needle: str) -> list[str]:
    """Tables (other than provider_settings, which holds the key by design) with any
    row whose text contains `needle`. A session-temporary function scans them, each
    table name quoted by format(%I), the needle bound."""
    execute(
        conn,
        """
        CREATE OR REPLACE FUNCTION pg_temp.tables_containing(needle text)
        RETURNS SETOF text LANGUAGE plpgsql AS $$
        DECLARE
            t text;
            found boolean;
        BEGIN
            FOR t IN SELECT c.relname FROM pg_class c
                     JOIN pg_namespace n ON n.oid = c.relnamespace
                     WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p')
                       AND c.relname <> 'provider_settings' ORDER BY 1 LOOP
                EXECUTE format(
                    'SELECT EXISTS (SELECT 1 FROM %I x WHERE strpos(x::text, $1) > 0)', t
                ) INTO found USING needle;
                IF found THEN
                    RETURN NEXT t;
                END IF;
            END LOOP;
        END $$
        """,
    )
    rows = fetch_all(conn, "SELECT pg_temp.tables_containing(%s) AS name", (needle,))
    return [str(r["name"]) for r in rows]
