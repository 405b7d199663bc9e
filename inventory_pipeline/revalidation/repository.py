"""Runs the named statements of `queries.sql` and turns rows into frozen values."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from inventory_pipeline.db import Connection, Row, execute, fetch_all, fetch_one
from inventory_pipeline.db.queries import load_queries
from inventory_pipeline.revalidation.models import (
    Checks,
    Decision,
    NoProposal,
    Proposal,
    ProposalState,
    RevalidationClaim,
)

QUERIES = load_queries("inventory_pipeline.revalidation")


def due_revalidations(conn: Connection) -> int:
    row = fetch_one(conn, QUERIES["due_revalidations"])
    return 0 if row is None else int(row["due"])


def budget_left(conn: Connection, per_hour: int) -> int:
    row = fetch_one(conn, QUERIES["budget_left"], {"per_hour": per_hour})
    return 0 if row is None else int(row["allowed"])


def take_budget(conn: Connection, per_hour: int) -> int:
    """In the caller's transaction: the budget left, its row locked to the commit."""
    row = fetch_one(conn, QUERIES["take_budget"], {"per_hour": per_hour})
    return 0 if row is None else int(row["allowed"])


def spend_budget(conn: Connection, spent: int) -> None:
    execute(conn, QUERIES["spend_budget"], {"spent": spent})


def claim_revalidations(
    conn: Connection, limit: int, lease_seconds: int
) -> tuple[list[RevalidationClaim], int]:
    """The claims made and how many records the walk settled in all."""
    rows = fetch_all(
        conn, QUERIES["claim_revalidations"], {"limit": limit, "lease_seconds": lease_seconds}
    )
    claims = [
        RevalidationClaim(
            case_id=r["case_id"],
            item_id=r["item_id"],
            source_generation=r["source_generation"],
            lease_token=r["lease_token"],
            provider_kind=r["provider_kind"],
            source_title=r["title"],
            source_year=r["year"],
            old_tmdb_id=r["old_tmdb_id"],
            imdb_id=r["imdb_id"],
            tvdb_id=r["tvdb_id"],
            faults=r["faults"],
        )
        for r in rows
        if r["verdict"] == "due"
    ]
    return claims, len(rows)


def _guard(claim: RevalidationClaim) -> dict[str, Any]:
    return {
        "case_id": claim.case_id,
        "item_id": claim.item_id,
        "lease_token": claim.lease_token,
        "source_generation": claim.source_generation,
    }


def complete_revalidation(
    conn: Connection, claim: RevalidationClaim, checks: Checks
) -> tuple[bool, int | None]:
    """Whether the check was recorded (False: the claim was lost), and the proposal
    written for it, if any."""
    source, external_id = claim.external
    row = fetch_one(
        conn,
        QUERIES["complete_revalidation"],
        {
            **_guard(claim),
            "outcome": "proposed" if checks.corroborated else "no_proposal",
            "reason": checks.reason,
            "provider_kind": claim.provider_kind,
            "external_source": source,
            "external_id": external_id,
            "old_tmdb_id": claim.old_tmdb_id,
            "candidates": checks.candidates,
            "candidate_tmdb_id": checks.candidate_tmdb_id,
            "single_candidate": checks.single_candidate,
            "round_trip": checks.round_trip,
            "title_match": checks.title_match,
            "year_match": checks.year_match,
            "candidate_title": checks.candidate_title,
            "candidate_original_title": checks.candidate_original_title,
            "candidate_year": checks.candidate_year,
        },
    )
    if row is None:
        return False, None
    return bool(row["recorded"]), row["proposal_id"]


def fault_revalidation(
    conn: Connection, claim: RevalidationClaim, category: str, delay_seconds: int
) -> datetime | None:
    row = fetch_one(
        conn,
        QUERIES["fault_revalidation"],
        {**_guard(claim), "category": category, "delay_seconds": delay_seconds},
    )
    return None if row is None else row["due_at"]


def release_revalidation(conn: Connection, claim: RevalidationClaim) -> bool:
    return fetch_one(conn, QUERIES["release_revalidation"], _guard(claim)) is not None


def give_back_interrupted(conn: Connection, claim: RevalidationClaim, delay_seconds: float) -> bool:
    params = {**_guard(claim), "delay_seconds": delay_seconds}
    return fetch_one(conn, QUERIES["give_back_interrupted_revalidation"], params) is not None


def supersede_proposals(conn: Connection, limit: int) -> int:
    return len(fetch_all(conn, QUERIES["supersede_proposals"], {"limit": limit}))


def forget_revalidations(conn: Connection, limit: int) -> int:
    return len(fetch_all(conn, QUERIES["forget_revalidations"], {"limit": limit}))


def prune_proposals(conn: Connection, retention_days: int, limit: int) -> int:
    rows = fetch_all(
        conn, QUERIES["prune_proposals"], {"retention_days": retention_days, "limit": limit}
    )
    return len(rows)


def _proposal(r: Row) -> Proposal:
    return Proposal(
        id=r["id"],
        item_id=r["item_id"],
        library_id=r["library_id"],
        library=r["library"],
        provider_kind=r["provider_kind"],
        old_tmdb_id=r["old_tmdb_id"],
        candidate_tmdb_id=r["candidate_tmdb_id"],
        external_source=r["external_source"],
        external_id=r["external_id"],
        source_title=r["source_title"],
        source_year=r["source_year"],
        candidate_title=r["candidate_title"],
        candidate_original_title=r["candidate_original_title"],
        candidate_year=r["candidate_year"],
        state=r["state"],
        proposed_at=r["proposed_at"],
        checked_at=r["checked_at"],
        decided_by=r["decided_by"],
        decided_at=r["decided_at"],
        replaced_at=r["replaced_at"],
        age_seconds=int(r["age_seconds"]),
    )


def proposals(
    conn: Connection, states: tuple[ProposalState, ...], stored: tuple[str, ...], limit: int
) -> list[Proposal]:
    rows = fetch_all(
        conn,
        QUERIES["proposals"],
        {"states": list(states), "stored": list(stored), "limit": limit},
    )
    return [_proposal(r) for r in rows]


def proposal_states(conn: Connection) -> dict[str, int]:
    return {r["state"]: int(r["n"]) for r in fetch_all(conn, QUERIES["proposal_states"])}


def unproposed(conn: Connection, limit: int) -> list[NoProposal]:
    return [
        NoProposal(
            item_id=r["item_id"],
            library_id=r["library_id"],
            library=r["library"],
            provider_kind=r["provider_kind"],
            old_tmdb_id=r["old_tmdb_id"],
            external_source=r["external_source"],
            external_id=r["external_id"],
            reason=r["reason"],
            candidates=r["candidates"],
            single_candidate=r["single_candidate"],
            round_trip=r["round_trip"],
            title_match=r["title_match"],
            year_match=r["year_match"],
            checked_at=r["checked_at"],
        )
        for r in fetch_all(conn, QUERIES["unproposed"], {"limit": limit})
    ]


def unproposed_reasons(conn: Connection) -> dict[str, int]:
    return {r["reason"]: int(r["n"]) for r in fetch_all(conn, QUERIES["unproposed_reasons"])}


def faulted(conn: Connection) -> dict[str, int]:
    return {r["category"]: int(r["n"]) for r in fetch_all(conn, QUERIES["faulted"])}


def lock_proposal_items(conn: Connection, ids: list[int]) -> None:
    fetch_all(conn, QUERIES["lock_proposal_items"], {"ids": ids})


def chosen_proposals(conn: Connection, ids: list[int]) -> dict[int, str]:
    return {
        int(r["id"]): r["state"] for r in fetch_all(conn, QUERIES["chosen_proposals"], {"ids": ids})
    }


def decide_proposals(
    conn: Connection, approve: list[int], reject: list[int], decided_by: str
) -> list[Decision]:
    rows = fetch_all(
        conn,
        QUERIES["decide_proposals"],
        {"approve": approve, "reject": reject, "decided_by": decided_by},
    )
    return [
        Decision(r["id"], r["item_id"], r["state"], r["old_tmdb_id"], r["candidate_tmdb_id"])
        for r in sorted(rows, key=lambda r: r["id"])
    ]


def replacements(conn: Connection) -> list[Row]:
    return fetch_all(conn, QUERIES["replacements"])
