"""Runs the named statements of `queries.sql` and turns rows into frozen values."""

from __future__ import annotations

from uuid import UUID

from inventory_pipeline.credentials.models import ProbeOutcome, WakeupStatus
from inventory_pipeline.db import Connection, Row, execute, fetch_one
from inventory_pipeline.db.queries import load_queries

QUERIES = load_queries("inventory_pipeline.credentials")


def set_lock_timeout(conn: Connection) -> None:
    execute(conn, QUERIES["set_lock_timeout"])


def status(conn: Connection, release_spacing_seconds: int) -> WakeupStatus | None:
    row = fetch_one(conn, QUERIES["status"], {"release_spacing_seconds": release_spacing_seconds})
    if row is None:
        return None
    eligible = fetch_one(conn, QUERIES["eligible_exists"])
    return WakeupStatus(
        generation=row["generation"],
        usable=bool(row["usable"]),
        verified=bool(row["verified"]),
        auth_cases=int(row["auth_cases"]),
        probe_allowed=bool(row["probe_allowed"]),
        release_allowed=bool(row["release_allowed"]),
        eligible=bool(eligible and eligible["eligible"]),
        throttled_until=row["throttled_until"],
        next_probe_at=row["next_probe_at"],
        last_outcome=row["last_outcome"],
        released_total=int(row["released_total"]),
    )


def lock_settings(conn: Connection) -> Row | None:
    return fetch_one(conn, QUERIES["lock_settings"])


def lock_wakeup(conn: Connection, release_spacing_seconds: int) -> Row | None:
    return fetch_one(
        conn, QUERIES["lock_wakeup"], {"release_spacing_seconds": release_spacing_seconds}
    )


def claim_probe(
    conn: Connection, lease_token: UUID, generation: UUID, lease_seconds: int
) -> Row | None:
    return fetch_one(
        conn,
        QUERIES["claim_probe"],
        {"lease_token": lease_token, "generation": generation, "lease_seconds": lease_seconds},
    )


def complete_probe(
    conn: Connection,
    lease_token: UUID,
    generation: UUID,
    outcome: ProbeOutcome,
    backoff_seconds: int,
    retry_after_seconds: int | None,
) -> Row | None:
    return fetch_one(
        conn,
        QUERIES["complete_probe"],
        {
            "lease_token": lease_token,
            "generation": generation,
            "outcome": outcome,
            "backoff_seconds": backoff_seconds,
            "retry_after_seconds": retry_after_seconds,
        },
    )


def release_batch(
    conn: Connection, generation: UUID, verified_at: object, cursor: int, limit: int, scan: int
) -> Row:
    row = fetch_one(
        conn,
        QUERIES["release_batch"],
        {
            "generation": generation,
            "verified_at": verified_at,
            "cursor": cursor,
            "limit": limit,
            "scan": scan,
        },
    )
    assert row is not None
    return row


def record_release(conn: Connection, cursor: int, released: int) -> None:
    execute(conn, QUERIES["record_release"], {"cursor": cursor, "released": released})


def probe_lease_held(conn: Connection, lease_token: UUID) -> bool:
    row = fetch_one(conn, QUERIES["probe_lease_held"], {"lease_token": lease_token})
    return bool(row and row["held"])


def give_back_probe(conn: Connection, lease_token: UUID) -> None:
    execute(conn, QUERIES["give_back_probe"], {"lease_token": lease_token})
