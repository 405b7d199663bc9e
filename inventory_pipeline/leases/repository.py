"""Runs the named statements of `queries.sql` and turns rows into frozen values."""

from __future__ import annotations

from inventory_pipeline.db import Connection, fetch_all, fetch_one
from inventory_pipeline.db.queries import load_queries
from inventory_pipeline.leases.models import LapsedLease

QUERIES = load_queries("inventory_pipeline.leases")


def lapsed_by_kind(conn: Connection, window_seconds: int) -> dict[str, int]:
    rows = fetch_all(conn, QUERIES["lapsed_by_kind"], {"window": window_seconds})
    return {r["kind"]: int(r["n"]) for r in rows}


def latest_lapsed(conn: Connection, window_seconds: int, limit: int) -> tuple[LapsedLease, ...]:
    rows = fetch_all(conn, QUERIES["latest_lapsed"], {"window": window_seconds, "limit": limit})
    return tuple(LapsedLease(**r) for r in rows)


def expired_now(conn: Connection) -> dict[str, int]:
    row = fetch_one(conn, QUERIES["expired_now"])
    return {kind: int(n) for kind, n in (row or {}).items()}
