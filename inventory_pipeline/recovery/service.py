"""Every state transition of provider observation and recovery (seed 003).

claim (compare-and-set, fresh UUID, five-minute lease) -> admission -> provider I/O with
no transaction open -> one guarded completion statement -> warnings after commit.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from inventory_pipeline.db import Connection
from inventory_pipeline.provider import admission
from inventory_pipeline.provider.models import Failure, FetchResult, Observation
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import repository
from inventory_pipeline.recovery.models import (
    ItemClaim,
    ObservationResult,
    ObservationSummary,
    OverdueCase,
    ProviderSettings,
    Transition,
)
from inventory_pipeline.recovery.policy import RetryPolicy

LEASE_SECONDS = 300  # seed 003: a five-minute attempt lease


def due_items(conn: Connection) -> int:
    return repository.due_items(conn)


def provider_settings(conn: Connection) -> ProviderSettings:
    return repository.provider_settings(conn)


def save_provider_settings(conn: Connection, settings: ProviderSettings) -> None:
    repository.save_provider_settings(conn, settings)


def claim(conn: Connection, limit: int, lease_seconds: int = LEASE_SECONDS) -> list[ItemClaim]:
    return repository.claim_due(conn, limit, lease_seconds)


def fetch(
    conn: Connection, claim: ItemClaim, client: TmdbClient, settings: ProviderSettings
) -> FetchResult:
    """Provider I/O for one claim: admission first, no transaction or lock held."""
    tmdb_id = claim.tmdb_id
    if tmdb_id is None:
        return Failure("not_found")  # the typed identity cannot name a TMDb record
    key = settings.usable_key
    if key is None:
        return Failure("configuration")
    admission.acquire(conn)
    return client.fetch(claim.provider_kind, tmdb_id, key, settings.language)


def complete(
    conn: Connection,
    claim: ItemClaim,
    result: FetchResult,
    policy: RetryPolicy,
    rng: random.Random | None = None,
) -> ObservationResult:
    """Record the attempt in one guarded statement; a stale claim changes nothing."""
    if isinstance(result, Observation):
        row = repository.complete_observed(conn, claim, result, policy.refresh_seconds)
        if row is None:
            return ObservationResult(claim.item_id, "lost")
        return ObservationResult(
            claim.item_id,
            "observed",
            transition="resolved" if row["resolved"] else None,
            case_id=row["case_id"] if row["resolved"] else None,
            attempts=row["attempts"] if row["resolved"] else 0,
            next_attempt_at=row["observation_due_at"],
            previous_category=row["previous_category"] if row["resolved"] else None,
        )
    delay = policy.delay(result.category, claim.next_attempt, result.retry_after_seconds, rng)
    row = repository.complete_failed(conn, claim, result.category, delay)
    if row is None:
        return ObservationResult(claim.item_id, "lost", category=result.category)
    transition: Transition
    if row["opened"]:
        transition = "opened"
    elif row["previous_category"] != result.category:
        transition = "cause_changed"
    else:
        transition = "repeated"
    return ObservationResult(
        claim.item_id,
        "failed",
        category=result.category,
        transition=transition,
        case_id=row["case_id"],
        attempts=row["attempts"],
        next_attempt_at=row["observation_due_at"],
        previous_category=row["previous_category"],
    )


def observe_claim(
    conn: Connection,
    claim: ItemClaim,
    client: TmdbClient,
    settings: ProviderSettings,
    policy: RetryPolicy,
) -> ObservationResult:
    return complete(conn, claim, fetch(conn, claim, client, settings), policy)


def observe(
    connect: Callable[[], Connection],
    client: TmdbClient,
    policy: RetryPolicy,
    max_items: int = 2000,
    workers: int = 8,
) -> ObservationSummary:
    """Claim and observe due items in batches until none are due or `max_items` is
    reached. Each worker thread has its own connection; the run holds no lock or
    transaction across any HTTP request."""
    results: list[ObservationResult] = []
    local = threading.local()
    connections: list[Connection] = []
    lock = threading.Lock()

    def worker_conn() -> Connection:
        conn: Connection | None = getattr(local, "conn", None)
        if conn is None:
            conn = connect()
            local.conn = conn
            with lock:
                connections.append(conn)
        return conn

    try:
        with connect() as main, ThreadPoolExecutor(max_workers=workers) as pool:
            while len(results) < max_items:
                settings = repository.provider_settings(main)
                batch = claim(main, min(workers * 4, max_items - len(results)))
                if not batch:
                    break

                def run(c: ItemClaim, s: ProviderSettings = settings) -> ObservationResult:
                    return observe_claim(worker_conn(), c, client, s, policy)

                results.extend(pool.map(run, batch))
    finally:
        for conn in connections:
            conn.close()
    return ObservationSummary(tuple(results))


Level = Literal["warning", "info"]


def notice(result: ObservationResult) -> tuple[Level, str] | None:
    """The message an attempt deserves, if any (seed 003: a warning only on a new case
    or a changed cause; one informational transition on recovery). Allowlisted fields
    only: item id, case id, category, attempts, next attempt."""
    due = result.next_attempt_at.isoformat(timespec="seconds") if result.next_attempt_at else "-"
    case = str(result.case_id)[:8] if result.case_id else "-"
    if result.transition == "opened":
        return (
            "warning",
            f"item {result.item_id}: recovery case {case} opened ({result.category}); "
            f"next attempt {due}",
        )
    if result.transition == "cause_changed":
        return (
            "warning",
            f"item {result.item_id}: recovery case {case} cause changed "
            f"{result.previous_category} -> {result.category} after {result.attempts} "
            f"attempts; next attempt {due}",
        )
    if result.transition == "resolved":
        return (
            "info",
            f"item {result.item_id}: recovery case {case} resolved ({result.previous_category}, "
            f"{result.attempts} failed attempts)",
        )
    return None


def overdue_cases(conn: Connection, grace_seconds: int = 900) -> list[OverdueCase]:
    return repository.overdue_cases(conn, grace_seconds)


def case_overview(conn: Connection) -> dict[str, int]:
    return repository.case_overview(conn)


def notices(results: Sequence[ObservationResult]) -> list[tuple[Level, str]]:
    return [n for n in (notice(r) for r in results) if n is not None]
