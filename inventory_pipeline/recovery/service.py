"""Every state transition of provider observation and recovery (docs/provider-recovery.md).

claim (compare-and-set, fresh UUID, five-minute lease) -> admission -> provider I/O with
no transaction open -> one guarded completion statement -> warnings after commit.
A throttling answer pauses admission for the whole fleet; a claim admission refuses is
given back unsent.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import replace
from typing import Literal, TypeVar
from uuid import UUID

from inventory_pipeline.db import (
    TRANSIENT,
    Connection,
    DatabaseError,
    DatabaseUnavailable,
    connect,
)
from inventory_pipeline.provider import admission
from inventory_pipeline.provider.models import Failure, FetchResult, Observation
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import repository
from inventory_pipeline.recovery.models import (
    CaseAge,
    Deferred,
    ItemClaim,
    ObservationResult,
    ObservationSummary,
    OpenCase,
    Overdue,
    ProviderSettings,
    Transition,
)
from inventory_pipeline.recovery.policy import RetryPolicy
from inventory_pipeline.settings import TmdbSettings

LEASE_SECONDS = 300  # a five-minute attempt lease (docs/provider-recovery.md#claim-and-lease)
# A completion the database could not take for a transient reason is tried this often,
# pausing 0.2 s, then 0.4 s: no request is sent again.
COMPLETION_TRIES = 3
COMPLETION_PAUSE_SECONDS = 0.2
OBSERVER = "inventory_pipeline.observer"  # application_name of a run's sessions
Level = Literal["warning", "info"]
Answer = TypeVar("Answer")


def due_items(conn: Connection) -> int:
    return repository.due_items(conn)


def provider_settings(conn: Connection) -> ProviderSettings:
    return repository.provider_settings(conn)


def save_provider_settings(conn: Connection, settings: ProviderSettings) -> None:
    repository.save_provider_settings(conn, settings)


def claim(conn: Connection, limit: int, lease_seconds: int = LEASE_SECONDS) -> list[ItemClaim]:
    """Up to `limit` items: approved replacements awaiting their first observation first
    (docs/identity-revalidation.md#replacement), then items due by their clocks."""
    claims = repository.claim_replacements(conn, limit, lease_seconds)
    if len(claims) < limit:
        claims += repository.claim_due(conn, limit - len(claims), lease_seconds)
    return claims


def admission_paused_seconds(conn: Connection) -> float:
    """How long the provider's throttling keeps admission paused (0: it is not)."""
    return admission.paused_seconds(conn)


def fetch(
    conn: Connection, claim: ItemClaim, client: TmdbClient, settings: ProviderSettings
) -> FetchResult | Deferred:
    """Provider I/O for one claim: admission first, no transaction or lock held. The id
    requested is the claim's approved replacement, else its own typed identity. An
    identity that names no TMDb record is a missing identity and is never sent. A
    throttling answer pauses admission for every process; a claim admission refuses
    comes back Deferred, unsent."""
    tmdb_id = claim.tmdb_id
    if tmdb_id is None:
        return Failure("not_found", cause="no TMDb id")
    key = settings.usable_key
    if key is None:
        return Failure("configuration", cause="no active key")
    return admitted(
        conn, lambda: client.fetch(claim.provider_kind, tmdb_id, key, settings.language)
    )


def admitted(conn: Connection, send: Callable[[], Answer]) -> Answer | Deferred:
    """One request through the shared admission limiter, with no transaction or lock
    held: Deferred (unsent) while admission is paused or has no slot in time; an answer
    that is provider-wide evidence (`Failure.pauses_admission`: a 429, or a 503 with
    Retry-After) pauses admission for every process."""
    try:
        admission.acquire(conn)
    except admission.AdmissionPaused as paused:
        return Deferred(paused.seconds)
    except admission.AdmissionTimeout:
        return Deferred(0.0)
    result = send()
    if isinstance(result, Failure) and result.pauses_admission:
        admission.pause(conn, result.retry_after_seconds)
    return result


def complete(
    conn: Connection,
    claim: ItemClaim,
    result: FetchResult | Deferred,
    policy: RetryPolicy,
    rng: random.Random | None = None,
    generation: UUID | None = None,
) -> ObservationResult:
    """Record the attempt in one guarded statement; a stale claim changes nothing. A
    deferred claim goes back without an attempt. A failure records `generation`, the
    credential generation of the key the request was sent with."""
    if isinstance(result, Deferred):
        released = repository.release_claim(conn, claim)
        return ObservationResult(claim.item_id, "deferred" if released else "lost")
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
            replacement=claim.replacement if row["replaced"] else None,
        )
    delay = policy.delay(
        result.category, claim.attempt_under(result.category), result.retry_after_seconds, rng
    )
    row = repository.complete_failed(conn, claim, result.category, delay, generation)
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
        cause=result.cause,
    )


def observe_claim(
    conn: Connection,
    claim: ItemClaim,
    client: TmdbClient,
    settings: ProviderSettings,
    policy: RetryPolicy,
) -> ObservationResult:
    """One attempt, start to finish (docs/provider-recovery.md#database-errors). A
    database error is never a provider outcome: a transient one (deadlock, serialization,
    lock or statement timeout) is met by trying the completion again, without a second
    request, and when it persists the claim goes back unrecorded (`interrupted`: no
    attempt counted, no case); a lost session leaves the claim to its lease; any other
    one is raised. Any other exception is a defect in handling this item's answer: the
    attempt is recorded as an invalid_response (a day's backoff, a warning naming the
    exception class), so the item neither fails the run nor comes back first."""
    error: str | None = None
    try:
        result = fetch(conn, claim, client, settings)
    except TRANSIENT as exc:
        return give_back(conn, claim, exc, policy)
    except DatabaseError:
        raise
    except Exception as exc:
        result, error = Failure("invalid_response", cause="unhandled"), type(exc).__name__
    attempt = 1
    while True:
        try:
            recorded = complete(conn, claim, result, policy, generation=settings.generation)
        except TRANSIENT as exc:
            if attempt == COMPLETION_TRIES:
                return give_back(conn, claim, exc, policy)
            time.sleep(COMPLETION_PAUSE_SECONDS * attempt)
            attempt += 1
            continue
        return recorded if error is None else replace(recorded, error=error)


def first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def give_back(
    conn: Connection, claim: ItemClaim, exc: Exception, policy: RetryPolicy
) -> ObservationResult:
    """A claim a transient database error interrupted goes back unrecorded (no attempt,
    no case), due again `policy.interrupted_seconds` later; if even that fails, its lease
    ends it."""
    due = None
    try:
        due = repository.give_back_interrupted(conn, claim, policy.interrupted_seconds)
    except TRANSIENT:
        pass
    return ObservationResult(
        claim.item_id, "interrupted", next_attempt_at=due, error=type(exc).__name__
    )


def observe(
    connect: Callable[[], Connection],
    client: TmdbClient,
    policy: RetryPolicy,
    max_items: int = 2000,
    workers: int = 8,
    on_result: Callable[[ObservationResult], None] | None = None,
) -> ObservationSummary:
    """Claim and observe due items in batches until none are due, `max_items` is
    reached or admission is paused (unclaimed items stay due for the next run). Each
    worker thread has its own connection; the run holds no lock or transaction across
    any HTTP request. One item's exception ends that item alone, but a database error
    that is neither transient nor a lost session fails the run (raised with the item and
    its SQLSTATE once the batch in flight is done, no more claimed). `on_result` runs in
    the caller's thread as soon as each attempt's completion has committed, so a run
    that dies later has already reported every case it committed."""
    results: list[ObservationResult] = []
    failed: DatabaseError | None = None
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

    def forget_worker_conn() -> None:
        conn: Connection | None = getattr(local, "conn", None)
        local.conn = None
        if conn is not None:
            with lock:
                connections.remove(conn)
            conn.close()

    def run(c: ItemClaim, settings: ProviderSettings) -> ObservationResult:
        label = item_label(c.title, c.provider_kind, c.provider_id)
        try:
            result = observe_claim(worker_conn(), c, client, settings, policy)
        except DatabaseError as exc:
            if not isinstance(exc, DatabaseUnavailable):
                raise DatabaseError(
                    f"item {c.item_id}: {type(exc).__name__} (SQLSTATE {exc.sqlstate}): "
                    f"{first_line(exc)}",
                    exc.sqlstate,
                ) from exc
            forget_worker_conn()  # the next item of this thread opens a fresh session
            result = ObservationResult(c.item_id, "error", error=type(exc).__name__)
        except Exception as exc:
            result = ObservationResult(c.item_id, "error", error=type(exc).__name__)
        return replace(result, label=label)

    try:
        with connect() as main, ThreadPoolExecutor(max_workers=workers) as pool:
            while len(results) < max_items:
                if admission.paused_seconds(main) > 0:
                    break  # the provider throttled: take nothing until the pause ends
                settings = repository.provider_settings(main)
                batch = claim(main, min(workers * 4, max_items - len(results)))
                if not batch:
                    break
                futures = [pool.submit(run, c, settings) for c in batch]
                outcomes = set()
                for future in as_completed(futures):
                    try:
                        result = future.result()
                    except DatabaseError as exc:
                        failed = failed or exc  # reported once the batch is done
                        continue
                    results.append(result)
                    outcomes.add(result.outcome)
                    if on_result is not None:
                        on_result(result)
                if failed is not None:
                    raise failed
                if outcomes == {"error"}:
                    break  # nothing of the batch could be recorded: claim no more
    finally:
        for conn in connections:
            conn.close()
    return ObservationSummary(tuple(results))


def observe_due(
    database_url: str,
    tmdb: TmdbSettings,
    on_notice: Callable[[Level, str], None],
    policy: RetryPolicy | None = None,
) -> ObservationSummary:
    """One observation run, as the CLI and the Dagster job both start it: set the
    admission rate (one limiter shared by every process, so the latest run's rate holds
    for all), open a TMDb client and `observe` up to `tmdb.max_items` due items with
    `tmdb.workers` sessions of their own to `database_url`. `on_notice` gets each
    attempt's message (`notice`) as soon as its completion has committed."""

    def connect_observer() -> Connection:
        return connect(database_url, application_name=OBSERVER)

    with connect_observer() as conn:
        admission.set_rate(conn, tmdb.rate)

    def report(result: ObservationResult) -> None:
        message = notice(result)
        if message is not None:
            on_notice(*message)

    with TmdbClient(tmdb.base_url) as client:
        return observe(
            connect_observer,
            client,
            RetryPolicy() if policy is None else policy,
            max_items=tmdb.max_items,
            workers=tmdb.workers,
            on_result=report,
        )


TITLE_CHARS = 60  # of an item's title in a warning
ID_CHARS = 20  # of a typed identity in a warning (longer ones are malformed anyway)


def bounded(text: str, limit: int) -> str:
    """One line of at most `limit` characters, quoted and escaped: inventory text is
    anyone's, so a warning never carries its control characters or its length."""
    flat = " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())
    if len(flat) > limit:
        flat = flat[: limit - 1] + "…"
    return json.dumps(flat, ensure_ascii=False)


def item_label(title: str, provider_kind: str | None, provider_id: str | None) -> str:
    """How a person finds an item in a warning: its title and typed identity, e.g.
    `"The Matrix" (tmdb movie "603")`."""
    kind = provider_kind if provider_kind in ("movie", "tv") else bounded(provider_kind or "", 8)
    identity = f"tmdb {kind} {bounded(provider_id or '', ID_CHARS)}"
    return f"{bounded(title, TITLE_CHARS)} ({identity})"


def oldest_open_cases(conn: Connection, limit: int = 20) -> list[OpenCase]:
    """The open cases failing longest, each with the item's title, library and identity."""
    return repository.oldest_open_cases(conn, limit)


def notice(result: ObservationResult) -> tuple[Level, str] | None:
    """The message an attempt deserves, if any (docs/provider-recovery.md#warnings: a
    warning only on a new case or a changed cause; one informational transition on
    recovery; a warning when an attempt could not be recorded at all). Allowlisted
    fields only: item id, the item's title and typed identity (bounded and escaped,
    `item_label`), case id, category, the provider's cause label ("HTTP 5xx",
    "timeout"), attempts, next attempt, an exception's class name."""
    item = f"item {result.item_id} {result.label}" if result.label else f"item {result.item_id}"
    due = result.next_attempt_at.isoformat(timespec="seconds") if result.next_attempt_at else "-"
    case = str(result.case_id)[:8] if result.case_id else "-"
    cause = f"{result.category}: {result.cause}" if result.cause else str(result.category)
    if result.error:
        cause = f"{cause}, after {result.error}"
    if result.outcome == "error":
        return (
            "warning",
            f"{item}: attempt not recorded ({result.error}); retried when its lease expires",
        )
    if result.outcome == "interrupted":
        return (
            "info",
            f"{item}: attempt not recorded ({result.error}); given back, next attempt {due}"
            if result.next_attempt_at
            else f"{item}: attempt not recorded ({result.error}); retried when its lease expires",
        )
    if result.transition == "opened":
        return (
            "warning",
            f"{item}: recovery case {case} opened ({cause}); next attempt {due}",
        )
    if result.transition == "cause_changed":
        return (
            "warning",
            f"{item}: recovery case {case} cause changed "
            f"{result.previous_category} -> {cause} after {result.attempts} "
            f"attempts; next attempt {due}",
        )
    if result.transition == "resolved":
        replaced = (
            f"; replaced by TMDb {result.replacement.tmdb_id} "
            f"(proposal {result.replacement.proposal_id})"
            if result.replacement
            else ""
        )
        return (
            "info",
            f"{item}: recovery case {case} resolved ({result.previous_category}, "
            f"{result.attempts} failed attempts){replaced}",
        )
    return None


def overdue_cases(conn: Connection, grace_seconds: int = 900) -> Overdue:
    return repository.overdue_cases(conn, grace_seconds)


def case_overview(conn: Connection) -> dict[str, int]:
    return repository.case_overview(conn)


def case_ages(conn: Connection) -> list[CaseAge]:
    """Open cases by category and age, read from the database (not from a run)."""
    return repository.case_ages(conn)
