"""Runs the named statements of `queries.sql` and turns rows into frozen values."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

from inventory_pipeline.db import (
    Connection,
    Row,
    execute,
    fetch_all,
    fetch_one,
    fetch_tuples,
    jsonb,
    savepoint,
)
from inventory_pipeline.db.queries import load_queries
from inventory_pipeline.profiles.models import (
    BACKFILL_REASON,
    INVENTORY_REASON,
    INVENTORY_SOURCE,
    LEARNING_REASON,
    LEARNING_SOURCE,
    NATIVE_REASON,
    NATIVE_SOURCE,
    BackfillRequest,
    Claim,
    DirtyPosition,
    LibraryLabel,
    LibrarySetFingerprint,
    PlannedRequest,
    PlannerPass,
    ProfileStatus,
    QueueOverview,
    RefreshPolicy,
    StalledLibrary,
    StoredProfile,
)

QUERIES = load_queries("inventory_pipeline.profiles")


def _claim(row: Row) -> Claim:
    return Claim(
        request_id=row["id"],
        library_id=row["library_id"],
        kind=row["kind"],
        inventory_revision=row["inventory_revision"],
        attempt=row["attempts"],
        lease_token=row["lease_token"],
        lease_expires_at=row["lease_expires_at"],
    )


def expire_leases(conn: Connection, policy: RefreshPolicy, limit: int = 1000) -> int:
    rows = fetch_all(
        conn,
        QUERIES["expire_leases"],
        {"retry_seconds": policy.retry_seconds, "limit": limit},
    )
    return len(rows)


def plan_inventory_requests(
    conn: Connection, policy: RefreshPolicy, limit: int, after: DirtyPosition | None = None
) -> PlannerPass:
    rows = fetch_all(
        conn,
        QUERIES["plan_inventory_requests"],
        {
            "limit": limit,
            "circuit_probe_seconds": policy.circuit_probe_seconds,
            "source": INVENTORY_SOURCE,
            "reason": INVENTORY_REASON,
            "after_since": "-infinity" if after is None else after.dirty_since,
            "after_id": 0 if after is None else after.library_id,
        },
    )
    first = rows[0]
    last = (
        None
        if first["last_id"] is None
        else DirtyPosition(first["last_since"], int(first["last_id"]))
    )
    requests = tuple(
        PlannedRequest(r["id"], r["library_id"], "inventory_change", r["inventory_revision"])
        for r in rows
        if r["id"] is not None
    )
    return PlannerPass(requests, int(first["candidates"]), last)


def plan_native_requests(
    conn: Connection, policy: RefreshPolicy, limit: int
) -> list[PlannedRequest]:
    rows = fetch_all(
        conn,
        QUERIES["plan_native_requests"],
        {
            "limit": limit,
            "circuit_probe_seconds": policy.circuit_probe_seconds,
            "native_max_age_seconds": policy.native_max_age_seconds,
            "source": NATIVE_SOURCE,
            "reason": NATIVE_REASON,
        },
    )
    return [PlannedRequest(r["id"], r["library_id"], "native", None) for r in rows]


def request_learning_refresh(
    conn: Connection,
    library_id: int,
    learning_id: int,
    classification_id: int,
    candidate_id: int | None,
) -> int | None:
    row = fetch_one(
        conn,
        QUERIES["request_learning_refresh"],
        {
            "library_id": library_id,
            "learning_id": learning_id,
            "classification_id": classification_id,
            "candidate_id": candidate_id,
            "source": LEARNING_SOURCE,
            "reason": LEARNING_REASON,
        },
    )
    return None if row is None else int(row["id"])


def lock_states(conn: Connection, library_ids: Sequence[int]) -> list[Row]:
    """Lock the libraries and their states for an analyst's backfill, inside the
    caller's transaction, in library-id order; a deleted library is not returned.

    A library another session holds (a deletion in flight, a writer's open transaction)
    is waited for, but never while this transaction holds another library: the attempt
    is rolled back to a savepoint, the busy library is waited for alone, and the attempt
    repeats. A deletion of several libraries in one statement locks them in its own
    order, so waiting while holding one could close a cycle with it.
    """
    ids = sorted(set(library_ids))
    while True:
        with savepoint(conn) as attempt:
            rows = fetch_all(conn, QUERIES["lock_states"], {"library_ids": ids})
            held = {r["library_id"] for r in rows}
            present = fetch_all(conn, QUERIES["present_states"], {"library_ids": ids})
            busy = [r["library_id"] for r in present if r["library_id"] not in held]
            if not busy:
                return rows
            attempt.rollback()
        with savepoint(conn) as wait:
            fetch_all(conn, QUERIES["wait_for_state"], {"library_id": busy[0]})
            wait.rollback()


def request_backfill(conn: Connection, library_ids: Sequence[int]) -> list[BackfillRequest]:
    rows = fetch_all(
        conn,
        QUERIES["request_backfill"],
        {
            "library_ids": list(library_ids),
            "source": INVENTORY_SOURCE,
            "reason": BACKFILL_REASON,
        },
    )
    return [BackfillRequest(r["id"], r["library_id"], r["enqueued"]) for r in rows]


def claim_requests(
    conn: Connection,
    lease_token: UUID,
    lease_seconds: int,
    limit: int,
    request_ids: Sequence[int] | None = None,
) -> list[Claim]:
    rows = fetch_all(
        conn,
        QUERIES["claim_requests"],
        {
            "lease_token": lease_token,
            "lease_seconds": lease_seconds,
            "limit": limit,
            "request_ids": None if request_ids is None else list(request_ids),
        },
    )
    return sorted((_claim(r) for r in rows), key=lambda c: c.library_id)


def count_claimable(conn: Connection, limit: int) -> int:
    row = fetch_one(conn, QUERIES["count_claimable"], {"limit": limit})
    return 0 if row is None else int(row["claimable"])


def count_dirty(conn: Connection, limit: int) -> int:
    row = fetch_one(conn, QUERIES["count_dirty"], {"limit": limit})
    return 0 if row is None else int(row["dirty"])


def read_revision(conn: Connection, library_id: int) -> int | None:
    row = fetch_one(conn, QUERIES["read_revision"], {"library_id": library_id})
    return None if row is None else int(row["revision"])


def read_snapshot(
    conn: Connection, library_id: int
) -> tuple[tuple[str, ...], list[tuple[Any, ...]]]:
    return fetch_tuples(conn, QUERIES["read_snapshot"], {"library_id": library_id})


def complete_claim(
    conn: Connection,
    claim: Claim,
    snapshot_revision: int,
    item_count: int,
    profile: dict[str, Any] | None,
    materialization_due: bool = False,
) -> Row | None:
    return fetch_one(
        conn,
        QUERIES["complete_claim"],
        {
            "materialization_due": materialization_due,
            "request_id": claim.request_id,
            "library_id": claim.library_id,
            "lease_token": claim.lease_token,
            "snapshot_revision": snapshot_revision,
            "item_count": item_count,
            "profile": jsonb(profile if profile is not None else {}),
        },
    )


def fail_claim(
    conn: Connection,
    claim: Claim,
    policy: RefreshPolicy,
    error: str,
    sqlstate: str | None,
    terminal: bool = False,
    spends_attempt: bool = True,
) -> Row | None:
    return fetch_one(
        conn,
        QUERIES["fail_claim"],
        {
            "request_id": claim.request_id,
            "lease_token": claim.lease_token,
            "retry_seconds": policy.retry_seconds,
            "error": error,
            "sqlstate": sqlstate,
            "terminal": terminal,
            "spends_attempt": spends_attempt,
        },
    )


def fold_changes(conn: Connection) -> int:
    row = fetch_one(conn, QUERIES["fold_changes"])
    return int(row["folded"]) if row is not None else 0


def materializations_due(conn: Connection, grace_seconds: float, limit: int) -> list[Row]:
    return fetch_all(
        conn, QUERIES["materializations_due"], {"grace_seconds": grace_seconds, "limit": limit}
    )


def materialized(conn: Connection, request_ids: Sequence[int]) -> None:
    execute(conn, QUERIES["materialized"], {"request_ids": list(request_ids)})


def request_outcomes(conn: Connection, request_ids: Sequence[int]) -> list[Row]:
    return fetch_all(conn, QUERIES["request_outcomes"], {"request_ids": list(request_ids)})


def compact_requests(conn: Connection, retention_days: int, limit: int) -> int:
    return execute(
        conn,
        QUERIES["compact_requests"],
        {"retention_days": retention_days, "limit": limit},
    )


def library_ids_after(conn: Connection, after_id: int) -> list[int]:
    rows = fetch_all(conn, QUERIES["library_ids_after"], {"after_id": after_id})
    return [int(r["id"]) for r in rows]


def library_ranges(conn: Connection, width: int) -> list[int]:
    rows = fetch_all(conn, QUERIES["library_ranges"], {"width": width})
    return [int(r["low"]) for r in rows]


def library_ids_in_ranges(conn: Connection, lows: Sequence[int], width: int) -> list[int]:
    rows = fetch_all(conn, QUERIES["library_ids_in_ranges"], {"lows": list(lows), "width": width})
    return [int(r["id"]) for r in rows]


def library_fingerprint(conn: Connection) -> LibrarySetFingerprint:
    row = fetch_one(conn, QUERIES["library_fingerprint"])
    assert row is not None  # an aggregate always returns one row
    return LibrarySetFingerprint(int(row["libraries"]), int(row["max_id"]), str(row["digest"]))


def profile_status(conn: Connection, library_ids: Sequence[int]) -> list[ProfileStatus]:
    rows = fetch_all(conn, QUERIES["profile_status"], {"library_ids": list(library_ids)})
    return [
        ProfileStatus(
            library_id=r["library_id"],
            label=_label(r),
            revision=r["revision"],
            acknowledged_revision=r["acknowledged_revision"],
            profile_revision=r["profile_revision"],
            item_count=r["item_count"],
            items=r["items"],
            dirty_seconds=r["dirty_seconds"],
            published_at=r["generated_at"],
            published_traits=tuple(r["published_traits"]),
            paused=r["paused"],
        )
        for r in rows
    ]


def _label(row: Row) -> LibraryLabel:
    return LibraryLabel(
        library_id=row["library_id"],
        name=row["name"],
        media_kind=row["media_kind"],
        server_name=row["server_name"],
        server_kind=row["server_kind"],
    )


def library_labels(conn: Connection, library_ids: Sequence[int]) -> list[LibraryLabel]:
    rows = fetch_all(conn, QUERIES["library_labels"], {"library_ids": list(library_ids)})
    return [_label(r) for r in rows]


def stored_profile(conn: Connection, library_id: int) -> StoredProfile | None:
    row = fetch_one(conn, QUERIES["stored_profile"], {"library_id": library_id})
    if row is None:
        return None
    return StoredProfile(
        library_id=row["library_id"],
        inventory_revision=row["inventory_revision"],
        item_count=row["item_count"],
        profile=row["profile"],
    )


def stalled_libraries(
    conn: Connection, stall_seconds: int, limit: int, after: tuple[datetime, int] | None
) -> list[StalledLibrary]:
    since, library_id = after if after is not None else (None, None)
    rows = fetch_all(
        conn,
        QUERIES["stalled_libraries"],
        {
            "stall_seconds": stall_seconds,
            "limit": limit,
            "after_since": since if since is not None else "-infinity",
            "after_id": library_id if library_id is not None else 0,
        },
    )
    return [
        StalledLibrary(
            library_id=r["library_id"],
            revision=r["revision"],
            acknowledged_revision=r["acknowledged_revision"],
            dirty_since=r["dirty_since"],
            stalled_seconds=r["stalled_seconds"],
        )
        for r in rows
    ]


def acknowledged_revisions(
    conn: Connection, library_ids: Sequence[int]
) -> dict[int, tuple[int, bool]]:
    rows = fetch_all(conn, QUERIES["acknowledged_revisions"], {"library_ids": list(library_ids)})
    return {int(r["library_id"]): (int(r["acknowledged_revision"]), r["paused"]) for r in rows}


def queue_overview(conn: Connection) -> QueueOverview:
    row = fetch_one(conn, QUERIES["queue_overview"])
    assert row is not None
    return QueueOverview(**row)


def mark_libraries_dirty(conn: Connection, after_library_id: int, limit: int) -> list[int]:
    rows = fetch_all(
        conn,
        QUERIES["mark_libraries_dirty"],
        {"after_library_id": after_library_id, "limit": limit},
    )
    return [int(r["library_id"]) for r in rows]
