"""Claim: the first committed stage of the worker. One transaction records an attempt
and a lease (a fresh token), or resumes a run whose retry time has come under its own
token, within the cap of active leases."""

from __future__ import annotations

from collections.abc import Callable
from uuid import UUID

from inventory_pipeline.db import Connection, DeadlockDetected, UniqueViolation
from inventory_pipeline.stats import repository as repo
from inventory_pipeline.stats.models import ExhaustedJob, StatsClaim

# Server-side claims a call tries before giving up this round: each refusal by the
# one-live-job index means another claim started that user's job meanwhile, a deadlock
# victim rolled back whole, and a job found past the attempt cap was failed in a claim
# of its own.
CLAIM_TRIES = 5


def claim(
    conn: Connection,
    lock_owner: str,
    user_id: UUID | None = None,
    wait: bool = True,
    after_run: int | None = None,
    answered: Callable[[], StatsClaim | ExhaustedJob | None] | None = None,
) -> StatsClaim | None:
    """Claim work, oldest first: resume a run due to resume (same token and cursor),
    revive a dead worker's job under a new lease at once, or start the oldest pending
    job of a user with no live job. None while paused, at the cap of active leases (a
    run waiting out a retry does not hold a slot), when nothing is claimable, or when
    no lease slot came free within the claim budget (or at once, without `wait`). One
    server-side call; a start the one-live-job index refused (another claim won the user
    after this one's check) rolls that call back whole and the call is made again: its
    fresh snapshot sees the winner's job and passes that user by; so is a call the
    server ended as a deadlock victim, and one that failed a job past the attempt cap
    (a transaction carries one owner, so that claim took nothing else). With
    `after_run` (the caller's previous run), nothing is claimed while that run is still
    claimed or computed. `answered` gives the first call's answer when the caller made
    that call in a round trip of its own."""

    def call() -> StatsClaim | ExhaustedJob | None:
        return repo.claim_stage(conn, lock_owner, user_id, wait, after_run)

    ask = answered or call
    for _ in range(CLAIM_TRIES):
        try:
            answer = ask()
        except (UniqueViolation, DeadlockDetected):
            answer = None
        else:
            if not isinstance(answer, ExhaustedJob):
                return answer
        ask = call
    return None
