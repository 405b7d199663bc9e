"""Runs the named statements of `queries.sql` and turns rows into frozen values."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from inventory_pipeline.db import Connection, Row, execute, fetch_all, fetch_one, transaction
from inventory_pipeline.db.queries import load_queries
from inventory_pipeline.provider.models import Observation
from inventory_pipeline.recovery.models import (
    CaseAge,
    ItemClaim,
    OpenCase,
    Overdue,
    OverdueCase,
    ProviderSettings,
    Replacement,
)

QUERIES = load_queries("inventory_pipeline.recovery")


def provider_settings(conn: Connection) -> ProviderSettings:
    row = fetch_one(conn, QUERIES["provider_settings"])
    if row is None:
        return ProviderSettings(None, False, None)
    return ProviderSettings(
        row["api_key"], row["active"], row["language"], row["credential_generation"]
    )


def save_provider_settings(conn: Connection, settings: ProviderSettings) -> None:
    execute(
        conn,
        QUERIES["save_provider_settings"],
        {"api_key": settings.api_key, "active": settings.active, "language": settings.language},
    )


def due_items(conn: Connection) -> int:
    row = fetch_one(conn, QUERIES["due_items"])
    return 0 if row is None else int(row["due"])


def _claims(rows: list[Row]) -> list[ItemClaim]:
    return [
        ItemClaim(
            item_id=r["id"],
            title=r["title"],
            provider_kind=r["provider_kind"],
            provider_id=r["provider_id"],
            source_generation=r["source_generation"],
            lease_token=r["observation_lease_token"],
            open_case=r["recovery_case_id"] is not None and r["recovery_resolved_at"] is None,
            recovery_category=r["recovery_category"],
            recovery_cause_attempts=r["recovery_cause_attempts"],
            replacement=None
            if r["proposal_id"] is None
            else Replacement(r["proposal_id"], r["replacement_tmdb_id"]),
        )
        for r in sorted(rows, key=lambda r: r["id"])
    ]


def claim_due(conn: Connection, limit: int, lease_seconds: int) -> list[ItemClaim]:
    params = {"limit": limit, "lease_seconds": lease_seconds}
    return _claims(fetch_all(conn, QUERIES["claim_due"], params))


def claim_replacements(conn: Connection, limit: int, lease_seconds: int) -> list[ItemClaim]:
    params = {"limit": limit, "lease_seconds": lease_seconds}
    return _claims(fetch_all(conn, QUERIES["claim_replacements"], params))


def _guard(claim: ItemClaim) -> dict[str, Any]:
    return {
        "item_id": claim.item_id,
        "lease_token": claim.lease_token,
        "source_generation": claim.source_generation,
        "proposal_id": None if claim.replacement is None else claim.replacement.proposal_id,
    }


def complete_observed(
    conn: Connection, claim: ItemClaim, observation: Observation, recheck_seconds: int
) -> Row | None:
    """Save an observation in one transaction: the library's state first, then the item
    (docs/provider-recovery.md#lock-order). None: the claim is stale, or the item or its
    library is gone."""
    with transaction(conn):
        execute(conn, QUERIES["completion_lock_timeout"])
        execute(conn, QUERIES["ensure_observed_library_state"], {"item_id": claim.item_id})
        library = fetch_one(conn, QUERIES["lock_observed_library"], {"item_id": claim.item_id})
        if library is None:
            return None
        return fetch_one(
            conn,
            QUERIES["complete_observed"],
            {
                **_guard(claim),
                "library_id": library["library_id"],
                "recheck_seconds": recheck_seconds,
                "provider_kind": observation.kind,
                "tmdb_id": observation.tmdb_id,
                "title": observation.title,
                "genres": list(observation.genres),
                "vote_average": observation.vote_average,
                "vote_count": observation.vote_count,
                "original_language": observation.original_language,
                "companies": list(observation.companies),
                "release_date": observation.release_date,
                "status": observation.status,
                "imdb_id": observation.imdb_id,
                "tvdb_id": observation.tvdb_id,
            },
        )


def complete_failed(
    conn: Connection,
    claim: ItemClaim,
    category: str,
    delay_seconds: int,
    generation: UUID | None,
) -> Row | None:
    params = {"category": category, "delay_seconds": delay_seconds}
    return fetch_one(
        conn,
        QUERIES["complete_failed"],
        {**_guard(claim), **params, "credential_generation": generation},
    )


def release_claim(conn: Connection, claim: ItemClaim) -> bool:
    return fetch_one(conn, QUERIES["release_claim"], _guard(claim)) is not None


def give_back_interrupted(
    conn: Connection, claim: ItemClaim, delay_seconds: float
) -> datetime | None:
    """The claim's item given back; when it is due again (None: the claim was lost)."""
    params = {**_guard(claim), "delay_seconds": delay_seconds}
    row = fetch_one(conn, QUERIES["give_back_interrupted"], params)
    return None if row is None else row["observation_due_at"]


def overdue_cases(conn: Connection, grace_seconds: int, limit: int = 20) -> Overdue:
    rows = fetch_all(
        conn, QUERIES["overdue_cases"], {"grace_seconds": grace_seconds, "limit": limit}
    )
    inactive = fetch_one(conn, QUERIES["inactive_open_cases"])
    return Overdue(
        tuple(OverdueCase(r["id"], r["recovery_category"], r["observation_due_at"]) for r in rows),
        int(rows[0]["total"]) if rows else 0,
        0 if inactive is None else int(inactive["waiting"]),
    )


def case_overview(conn: Connection) -> dict[str, int]:
    return {r["category"]: int(r["open_cases"]) for r in fetch_all(conn, QUERIES["case_overview"])}


def oldest_open_cases(conn: Connection, limit: int) -> list[OpenCase]:
    return [
        OpenCase(
            item_id=r["item_id"],
            title=r["title"],
            library=r["library"],
            provider_kind=r["provider_kind"],
            provider_id=r["provider_id"],
            category=r["category"],
            attempts=r["attempts"],
            first_failed_at=r["first_failed_at"],
            next_attempt_at=r["next_attempt_at"],
        )
        for r in fetch_all(conn, QUERIES["oldest_open_cases"], {"limit": limit})
    ]


def case_ages(conn: Connection) -> list[CaseAge]:
    return [
        CaseAge(
            r["category"],
            int(r["open_cases"]),
            int(r["oldest_age_seconds"] or 0),
            int(r["due_now"]),
        )
        for r in fetch_all(conn, QUERIES["case_ages"])
    ]
