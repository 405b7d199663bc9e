"""Runs the named statements of `queries.sql`."""

from __future__ import annotations

from typing import Any

from inventory_pipeline.db import Connection, Row, execute, fetch_all, fetch_one
from inventory_pipeline.db.queries import load_queries
from inventory_pipeline.stats.models import WorkerSettings

QUERIES = load_queries("inventory_pipeline.stats")


def one(conn: Connection, name: str, params: dict[str, Any] | None = None) -> Row | None:
    return fetch_one(conn, QUERIES[name], params)


def many(conn: Connection, name: str, params: dict[str, Any] | None = None) -> list[Row]:
    return fetch_all(conn, QUERIES[name], params)


def run(conn: Connection, name: str, params: dict[str, Any] | None = None) -> int:
    return execute(conn, QUERIES[name], params)


def arm_stage(conn: Connection, stage: str, lease_token: str) -> WorkerSettings:
    row = one(conn, "arm_stage", {"stage": stage, "lease_token": lease_token})
    assert row is not None
    return WorkerSettings(**{k: v for k, v in row.items() if k not in ("budget_ms", "lease_token")})
