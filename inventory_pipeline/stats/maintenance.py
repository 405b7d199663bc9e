"""Bounded stats maintenance (seed 001 D10): PR overview rollover, catalog
invalidation, the backfill scanner and history retention. Each discovers work and
enqueues a new generation; the worker publishes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from inventory_pipeline.db import Connection, DatabaseError, transaction
from inventory_pipeline.stats import repository as repo

ROLLOVER_PAGE = 10
ROLLOVER_PAGE_MAX = 25
CATALOG_USER_PAGE = 100
RETENTION_DAYS = 7
RETENTION_BATCH = 5000


@dataclass(frozen=True)
class RolloverResult:
    requested: int
    failed: int


def _request(conn: Connection, user_id: UUID, event_type: str, reason: str, from_date: Any) -> None:
    repo.one(
        conn,
        "request_generation",
        {
            "user_id": user_id,
            "event_type": event_type,
            "from_date": from_date,
            "reason": reason,
            "source_ref": event_type,
        },
    )


def rollover(conn: Connection, limit: int = ROLLOVER_PAGE) -> RolloverResult:
    """One page of users whose three-day window is due: each gets a new generation
    (from the current database date); failures keep an attempt count and next retry."""
    limit = max(1, min(limit, ROLLOVER_PAGE_MAX))
    requested = failed = 0
    with transaction(conn):
        repo.run(conn, "set_lock_timeout")
        for row in repo.many(conn, "rollover_page", {"limit": limit}):
            user_id = row["user_id"]
            try:
                with transaction(conn):
                    today = repo.one(conn, "stats_today")
                    _request(
                        conn,
                        user_id,
                        "pr_overview_rollover",
                        "PR overview rollover",
                        today["today"] if today else None,
                    )
                    repo.run(conn, "rollover_requested", {"user_id": user_id})
                requested += 1
            except DatabaseError as exc:
                failed += 1
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                repo.run(conn, "rollover_failed", {"user_id": user_id, "error": first[:200]})
    return RolloverResult(requested, failed)


def rollover_overview(conn: Connection) -> dict[str, Any]:
    row = repo.one(conn, "rollover_overview")
    return {} if row is None else dict(row)


def process_catalog(conn: Connection, page: int = CATALOG_USER_PAGE) -> int:
    """Answer catalog change tokens: a personal change requests only its owner; a global
    change pages through users. A running global pass is never restarted: changes that
    arrive meanwhile leave a follow-up pass for the latest token."""
    requested = 0
    with transaction(conn):
        repo.run(conn, "set_lock_timeout")
        for scope in repo.many(conn, "catalog_scopes", {"limit": 10}):
            if scope["scope"] != "global":
                _request(conn, UUID(scope["scope"]), "catalog_changed", "catalog changed", None)
                repo.run(
                    conn, "personal_scope_done", {"scope": scope["scope"], "token": scope["token"]}
                )
                requested += 1
                continue
            pass_token = scope["pass_token"] if scope["pass_token"] is not None else scope["token"]
            users = repo.many(conn, "users_after", {"cursor": scope["cursor"], "limit": page})
            for user in users:
                _request(conn, user["user_id"], "catalog_changed", "catalog changed", None)
            requested += len(users)
            done = len(users) < page
            repo.run(
                conn,
                "global_pass_progress",
                {
                    "pass_token": pass_token,
                    "done": done,
                    "cursor": None if done else users[-1]["user_id"],
                },
            )
    return requested


def scan(conn: Connection, limit: int = 500) -> list[tuple[UUID, str]]:
    """The hourly backfill scanner: stale users merged into the queue as
    `scheduled_stats_backfill` with a full-history range."""
    with transaction(conn):
        stale = repo.many(conn, "stale_users", {"limit": limit})
        for row in stale:
            _request(
                conn, row["user_id"], "scheduled_stats_backfill", f"backfill: {row['signal']}", None
            )
    return [(r["user_id"], r["signal"]) for r in stale]


def prune(
    conn: Connection, days: int = RETENTION_DAYS, batch: int = RETENTION_BATCH
) -> dict[str, int]:
    """Delete finished history older than `days`, at most `batch` rows per statement."""
    params = {"days": days, "limit": batch}
    return {
        "jobs": repo.run(conn, "prune_jobs", params),
        "runs": repo.run(conn, "prune_runs", params),
        "catalog_changes": repo.run(conn, "prune_catalog_log", params),
    }
