"""Typed access to the maintenance statements of `queries.sql`: rebuild passes, the PR
overview rollover, catalog invalidation, the backfill scanner and retention."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime
from typing import Any
from uuid import UUID

from inventory_pipeline.db import Connection, execute, fetch_all, fetch_one
from inventory_pipeline.db.queries import load_queries

QUERIES = load_queries("inventory_pipeline.stats")


@dataclass(frozen=True)
class RebuildStep:
    """One step of a rebuild pass: the user enqueued (None when the pass just finished)
    and the pass's running total."""

    user_id: UUID | None
    job_id: int | None
    requested: int
    finished: bool


@dataclass(frozen=True)
class UserVersions:
    requested_version: int
    applied_version: int


@dataclass(frozen=True)
class GlobalPass:
    """The global catalog scope while a pass is owed or running."""

    token: int
    pass_token: int | None
    cursor: UUID | None


@dataclass(frozen=True)
class ScanPage:
    cursor: UUID | None
    user_ids: tuple[UUID, ...]


# -- rebuild -------------------------------------------------------------------------


def rebuild_start(conn: Connection, user_ids: list[UUID] | None) -> int:
    row = fetch_one(conn, QUERIES["rebuild_start"], {"user_ids": user_ids})
    assert row is not None
    return int(row["id"])


def rebuild_step(conn: Connection, pass_id: int) -> RebuildStep | None:
    """None: the pass was already finished."""
    row = fetch_one(conn, QUERIES["rebuild_step"], {"pass_id": pass_id})
    if row is None:
        return None
    return RebuildStep(row["user_id"], row["job_id"], int(row["requested"]), row["finished"])


def rebuild_open_passes(conn: Connection, idle_seconds: int) -> list[int]:
    rows = fetch_all(conn, QUERIES["rebuild_open_passes"], {"idle_seconds": idle_seconds})
    return [int(r["id"]) for r in rows]


# -- shared --------------------------------------------------------------------------


def set_lock_timeout(conn: Connection) -> None:
    execute(conn, QUERIES["set_lock_timeout"])


def request_generation(
    conn: Connection, user_id: UUID, event_type: str, reason: str, from_date: date | None
) -> int:
    """A new generation for one user through the merge-enqueue; returns the job id."""
    row = fetch_one(
        conn,
        QUERIES["request_generation"],
        {
            "user_id": user_id,
            "event_type": event_type,
            "from_date": from_date,
            "reason": reason,
            "source_ref": event_type,
        },
    )
    assert row is not None
    return int(row["job_id"])


# -- rollover ------------------------------------------------------------------------


def request_rollover(
    conn: Connection, after: tuple[datetime, UUID] | None
) -> tuple[datetime, UUID, str] | None:
    """The next due user's rollover after `after`, in one call: (due time, user,
    outcome)."""
    row = fetch_one(
        conn,
        QUERIES["request_rollover"],
        {
            "after_due": None if after is None else after[0],
            "after_user": None if after is None else after[1],
        },
    )
    return None if row is None else (row["roll_due_at"], row["roll_user_id"], row["roll_outcome"])


def rollover_overview(conn: Connection) -> dict[str, Any]:
    row = fetch_one(conn, QUERIES["rollover_overview"])
    return {} if row is None else dict(row)


@dataclass(frozen=True)
class MaintenanceDue:
    """Work the rollover job would find now (all zero: a run would do nothing)."""

    rollover_users: int
    catalog_scopes: int
    abandoned_rebuilds: int

    @property
    def any(self) -> bool:
        return bool(self.rollover_users or self.catalog_scopes or self.abandoned_rebuilds)


def maintenance_due(conn: Connection, idle_seconds: int) -> MaintenanceDue:
    row = fetch_one(conn, QUERIES["maintenance_due"], {"idle_seconds": idle_seconds})
    assert row is not None  # an aggregate over constants always returns its row
    return MaintenanceDue(
        int(row["rollover_users"]), int(row["catalog_scopes"]), int(row["abandoned_rebuilds"])
    )


# -- catalog -------------------------------------------------------------------------


def catalog_next_personal(conn: Connection, skipped: list[str]) -> tuple[str, int] | None:
    row = fetch_one(conn, QUERIES["catalog_next_personal"], {"skipped": skipped})
    return None if row is None else (str(row["scope"]), int(row["token"]))


def personal_scope_done(conn: Connection, scope: str, token: int) -> None:
    execute(conn, QUERIES["personal_scope_done"], {"scope": scope, "token": token})


def catalog_global_pass(conn: Connection) -> GlobalPass | None:
    row = fetch_one(conn, QUERIES["catalog_global_pass"])
    if row is None:
        return None
    return GlobalPass(int(row["token"]), row["pass_token"], row["cursor"])


def user_after(conn: Connection, cursor: UUID | None) -> UUID | None:
    row = fetch_one(conn, QUERIES["users_after"], {"cursor": cursor})
    return None if row is None else row["user_id"]


def global_pass_progress(
    conn: Connection, pass_token: int, cursor: UUID | None, done: bool
) -> None:
    execute(
        conn,
        QUERIES["global_pass_progress"],
        {"pass_token": pass_token, "cursor": cursor, "done": done},
    )


# -- scanner -------------------------------------------------------------------------


def scan_page(conn: Connection, limit: int) -> ScanPage | None:
    """None: another scanner holds the cursor."""
    row = fetch_one(conn, QUERIES["scan_page"], {"limit": limit})
    if row is None:
        return None
    return ScanPage(row["cursor"], tuple(row["user_ids"]))


def scan_advance(conn: Connection, cursor: UUID | None) -> None:
    execute(conn, QUERIES["scan_advance"], {"cursor": cursor})


def stale_users(conn: Connection, user_ids: tuple[UUID, ...]) -> list[tuple[UUID, str]]:
    rows = fetch_all(conn, QUERIES["stale_users"], {"user_ids": list(user_ids)})
    return [(r["user_id"], str(r["signal"])) for r in rows]


# -- retention -----------------------------------------------------------------------


def prune_catalog_log(conn: Connection, days: int, limit: int) -> int:
    return execute(conn, QUERIES["prune_catalog_log"], {"days": days, "limit": limit})
