"""Every state transition of verified credential wakeups (docs/credentials.md).

claim probe (settings share lock -> wakeup row, one-minute lease) -> probe the fixed
configuration endpoint with no transaction open -> complete (same configuration,
generation and unexpired lease) -> release bounded batches of authentication cases
(settings share lock -> wakeup row -> item rows with SKIP LOCKED), each with a
per-item generation receipt. Ordinary observation then does the real work; only a
successful observation resolves a case.
"""

from __future__ import annotations

import random
from uuid import uuid4

from inventory_pipeline.credentials import repository
from inventory_pipeline.credentials.models import (
    ProbeClaim,
    ProbeNotSent,
    ProbeOutcome,
    ProbeResult,
    ReleaseResult,
    WakeupStatus,
)
from inventory_pipeline.db import Connection, transaction
from inventory_pipeline.provider import admission
from inventory_pipeline.provider.models import Failure
from inventory_pipeline.provider.parsing import is_configuration
from inventory_pipeline.provider.tmdb import TmdbClient, classify
from inventory_pipeline.recovery.policy import equal_jitter

PROBE_LEASE_SECONDS = 60
PROBE_DEADLINE_SECONDS = 5.0
# The longest wait for an admission: well inside the lease, so the probe is sent, read
# and completed while the lease holds.
PROBE_ADMISSION_SECONDS = 20.0
PROBE_BODY_LIMIT = 64 * 1024
PROBE_PATH = "/3/configuration"
BACKOFF_MIN_SECONDS = 15 * 60
BACKOFF_MAX_SECONDS = 6 * 3600
RETRY_AFTER_CAP_SECONDS = 30 * 24 * 3600
RELEASE_LIMIT = 100
RELEASE_SCAN = 1000
RELEASE_SPACING_SECONDS = 60


def probe_client(base_url: str) -> TmdbClient:
    """The probe's client: a five-second deadline and a 64 KiB decoded-body limit."""
    return TmdbClient(
        base_url, timeout_seconds=PROBE_DEADLINE_SECONDS, max_body_bytes=PROBE_BODY_LIMIT
    )


def status(
    conn: Connection, release_spacing_seconds: int = RELEASE_SPACING_SECONDS
) -> WakeupStatus | None:
    return repository.status(conn, release_spacing_seconds)


# The failed-probe backoff as (start, cap) seconds: 15 minutes to six hours
# (docs/credentials.md#backoff).
# Callers other than the product's job (the convergence harness) pass shorter clocks.
BACKOFF = (BACKOFF_MIN_SECONDS, BACKOFF_MAX_SECONDS)


def backoff_seconds(
    failures: int, rng: random.Random | None = None, bounds: tuple[int, int] = BACKOFF
) -> int:
    """Backoff after a failed probe, `failures` being the earlier failures of this
    generation: equal jitter between the start and the cap (`bounds`), the window
    doubling per failure, never under the start or over the cap."""
    start, cap = bounds
    return equal_jitter(start, cap, failures + 1, rng)


def claim_probe(conn: Connection, lease_seconds: int = PROBE_LEASE_SECONDS) -> ProbeClaim | None:
    """Take the one-minute probe lease for the current generation, if a probe is due."""
    with transaction(conn):
        repository.set_lock_timeout(conn)
        settings = repository.lock_settings(conn)
        if settings is None or not settings["active"] or not settings["api_key"]:
            return None
        repository.lock_wakeup(conn, RELEASE_SPACING_SECONDS)
        token = uuid4()
        row = repository.claim_probe(conn, token, settings["generation"], lease_seconds)
        if row is None:
            return None
        return ProbeClaim(
            lease_token=token,
            generation=settings["generation"],
            api_key=settings["api_key"],
            language=settings["language"],
            probe_failures=int(row["probe_failures"]),
        )


def probe(
    conn: Connection, claim: ProbeClaim, client: TmdbClient
) -> tuple[ProbeOutcome, int | None] | ProbeNotSent:
    """Check the key against the fixed configuration endpoint, outside any transaction.
    Provider text is discarded: only an outcome and a bounded Retry-After remain. A
    throttling answer pauses admission for every process. When admission is paused
    (another process's 429 since the claim), no admission comes within
    PROBE_ADMISSION_SECONDS, or the lease ran out meanwhile, the probe is not sent at
    all (`give_back_probe`): nothing was verified, so nothing is a failed verification;
    it waits for the pause alone."""
    try:
        admission.acquire(conn, timeout_seconds=PROBE_ADMISSION_SECONDS)
    except admission.AdmissionPaused:
        return ProbeNotSent(claim.generation, "admission is paused by the provider's throttling")
    except admission.AdmissionTimeout:
        return ProbeNotSent(claim.generation, "no admission in time")
    if not repository.probe_lease_held(conn, claim.lease_token):
        return ProbeNotSent(claim.generation, "its lease ran out while waiting for admission")
    answer = client.get(
        PROBE_PATH,
        claim.api_key,
        limit=PROBE_BODY_LIMIT,
        retry_after_cap_seconds=RETRY_AFTER_CAP_SECONDS,
    )
    if isinstance(answer, Failure):
        return _outcome(answer), None
    status_code, raw, retry_after = answer
    if status_code == 200:
        return ("verified" if is_configuration(raw) else "invalid_response"), None
    failure = classify(status_code, raw, retry_after)
    if failure.pauses_admission:
        admission.pause(conn, retry_after)
    outcome = _outcome(failure)
    return outcome, retry_after


def give_back_probe(conn: Connection, claim: ProbeClaim) -> None:
    """A probe that was never sent gives its lease back: no outcome, no backoff."""
    repository.give_back_probe(conn, claim.lease_token)


def _outcome(failure: Failure) -> ProbeOutcome:
    if failure.category in ("auth", "throttled", "transient", "invalid_response"):
        return failure.category
    return "invalid_response"  # a fixed endpoint answering 404 is not a missing identity


def complete_probe(
    conn: Connection,
    claim: ProbeClaim,
    outcome: ProbeOutcome,
    retry_after_seconds: int | None,
    rng: random.Random | None = None,
    backoff: tuple[int, int] = BACKOFF,
) -> ProbeResult:
    retry_after = (
        None if retry_after_seconds is None else min(retry_after_seconds, RETRY_AFTER_CAP_SECONDS)
    )
    with transaction(conn):
        repository.set_lock_timeout(conn)
        row = repository.complete_probe(
            conn,
            claim.lease_token,
            claim.generation,
            outcome,
            backoff_seconds(claim.probe_failures, rng, backoff),
            retry_after,
        )
    return ProbeResult(claim.generation, outcome, bool(row and row["current"]), retry_after)


def verify(
    conn: Connection, client: TmdbClient, lease_seconds: int = PROBE_LEASE_SECONDS
) -> ProbeResult | ProbeNotSent | None:
    """Claim, probe and complete once; None when no probe is due. Nothing is claimed
    while the provider's throttling pauses admission: the probe waits without earning a
    backoff."""
    if admission.paused_seconds(conn) > 0:
        return None
    claim = claim_probe(conn, lease_seconds)
    if claim is None:
        return None
    probed = probe(conn, claim, client)
    if isinstance(probed, ProbeNotSent):
        give_back_probe(conn, claim)
        return probed
    outcome, retry_after = probed
    return complete_probe(conn, claim, outcome, retry_after)


def release(
    conn: Connection,
    limit: int = RELEASE_LIMIT,
    spacing_seconds: int = RELEASE_SPACING_SECONDS,
) -> ReleaseResult | None:
    """One bounded release batch of the verified generation; None when not due. At
    most `limit` cases per batch, at least `spacing_seconds` after the previous one."""
    with transaction(conn):
        repository.set_lock_timeout(conn)
        settings = repository.lock_settings(conn)
        wakeup = repository.lock_wakeup(conn, spacing_seconds)
        if settings is None or wakeup is None or not settings["active"]:
            return None
        generation = settings["generation"]
        if wakeup["verified_generation"] != generation:
            return None
        if not wakeup["release_allowed"]:
            return None  # at least a minute between batches for this configuration
        row = repository.release_batch(
            conn,
            generation,
            wakeup["verified_at"],
            int(wakeup["release_cursor"]),
            limit,
            RELEASE_SCAN,
        )
        released, scanned = int(row["released"]), int(row["scanned"])
        if released == limit:
            cursor = int(row["last_released"])
        elif scanned == RELEASE_SCAN:
            cursor = int(row["last_scanned"])
        else:
            cursor = 0  # reached the end: wrap to revisit locked or blocked rows
        repository.record_release(conn, cursor, released)
    return ReleaseResult(generation, released, scanned, cursor, cursor == 0)
