"""Frozen values of the stats worker."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any, Literal
from uuid import UUID

# The compute responses (their meaning: `stats_compute_stage` in stats/schema.sql).
ComputeStatus = Literal["computed", "batch_pending", "retry_pending", "failed", "lost"]
BATCH_SIZE = 100  # the measured candidate boundary, not an unlimited safety guarantee
TRANSACTION_BOUNDARY = "transaction_boundary_required"


@dataclass(frozen=True)
class WorkerSettings:
    """The single settings row: stage budgets, lease, cap, attempts, backoff, pause."""

    claim_budget_ms: int
    compute_budget_ms: int
    publish_budget_ms: int
    lease_seconds: int
    active_lease_cap: int
    max_attempts: int
    retry_backoff_seconds: int
    paused: bool = False


@dataclass(frozen=True)
class StatsClaim:
    """A job under a run's lease: the token fences every later write. `exercise_ids`
    empty means every exercise, None no exercise (period stats only)."""

    run_id: int
    job_id: int
    user_id: UUID
    lease_token: UUID
    target_version: int
    base_applied_version: int
    from_date: date | None
    exercise_ids: tuple[str, ...] | None
    lock_owner: str  # the worker that claimed it: only it may give the run back


@dataclass(frozen=True)
class ExhaustedJob:
    """A claim's answer when the job it started was past the attempt cap: the claim
    failed it (its range is owed) and claimed nothing else, since a transaction carries
    one owner; the caller claims again."""

    job_id: int
    user_id: UUID


@dataclass(frozen=True)
class ComputeResult:
    status: ComputeStatus
    stage: str | None = None
    next_offset: int | None = None
    total_exercises: int | None = None
    reason: str | None = None
    retry_not_before: datetime | None = None
    # A transient error (a timeout, a cancel, a lock timeout, a deadlock) ended the call
    # and the run was given back: the status says how it stands now.
    interrupted: bool = False


@dataclass(frozen=True)
class GivenBack:
    """How a run stands once its worker gave it back after a transient error ended a
    stage call (`stats_give_back_run`): backing off (or due at once), failed for good
    (attempts spent, its range owed), or lost (the lease was no longer its worker's)."""

    status: Literal["retry_pending", "failed", "lost"]
    reason: str
    retry_not_before: datetime | None


@dataclass(frozen=True)
class PublishResult:
    # lost: no live lease under the claim's token (it lapsed, or another claim took the
    # job back); retry_pending and failed: an attempt failed (its output kept for the
    # retry, or the attempts spent and the range owed).
    status: Literal["published", "rejected", "lost", "retry_pending", "failed"]
    user_id: UUID
    generation: int
    applied_version: int | None = None
    reason: str | None = None
    retry_not_before: datetime | None = None
    interrupted: bool = False  # as ComputeResult's


@dataclass(frozen=True)
class ProcessResult:
    """What one claim came to: the last compute status, the batches it took and, when
    it got that far, the publication."""

    status: ComputeStatus
    batches: int
    publication: PublishResult | None = None
    reason: str | None = None  # why the compute stage failed, when it did
    interrupted: bool = False  # the compute stage's call ended by a transient error

    @property
    def outcome(
        self,
    ) -> Literal["published", "rejected", "deferred", "failed", "lost", "interrupted"]:
        """Published, rejected into a successor, deferred (a retry time or a pending
        batch: the work resumes later), failed (attempts spent, the range owed), lost
        (no live lease: the claim's recovery takes the run back) or interrupted (a
        transient error ended a stage call and the run was given back)."""
        publication = self.publication
        if self.interrupted or (publication is not None and publication.interrupted):
            return "interrupted"
        if publication is not None:
            if publication.status == "retry_pending":
                return "deferred"
            return publication.status
        if self.status in ("retry_pending", "batch_pending"):
            return "deferred"
        if self.status == "lost":
            return "lost"
        return "failed"


@dataclass(frozen=True)
class AccountResult:
    """What the one-owner door or the scoped processor did for one account."""

    user_id: UUID | None
    outcome: Literal["published", "deferred", "rejected", "failed", "idle", "worker_timed_out"]
    generation: int | None
    has_more: bool
    remaining_user_count: int
    batches: int = 0


@dataclass(frozen=True)
class WorkWaiting:
    """The drain policy's view: claimable work and how long the oldest of it has waited,
    free lease slots, the pause switch."""

    waiting: int
    free_slots: int
    paused: bool
    oldest_wait_seconds: float

    @property
    def claimable(self) -> int:
        """Work a drain started now would take (none while paused or at the cap)."""
        return 0 if self.paused or self.free_slots == 0 else self.waiting


@dataclass(frozen=True)
class DrainSummary:
    """What a drain did: the generations it published, and how many claims ended
    otherwise (deferred to a retry time or a later batch, rejected into a successor,
    failed with their range owed, lost to the claim's recovery, or interrupted: a
    timeout, a cancel, a lock timeout or a deadlock ended a stage call and the run was
    given back)."""

    published: tuple[tuple[UUID, int, int], ...]  # user, generation, batches
    deferred: int = 0
    rejected: int = 0
    failed: int = 0
    lost: int = 0
    interrupted: int = 0
    # user, outcome, reason: each claim that failed, was rejected, was interrupted, or
    # was deferred by a failed attempt, with the reason its stage gave
    failures: tuple[tuple[UUID, str, str], ...] = ()
    # Why a pass ended without an answer from the claim: its claims kept failing
    # (CLAIM_TRIES transient errors in a row), which is not "nothing to claim".
    claim_error: str | None = None

    @property
    def empty(self) -> bool:
        """Nothing to report: no claim ended, and no claim failed."""
        return not self.rounds and self.claim_error is None

    @property
    def rounds(self) -> int:
        return (
            len(self.published)
            + self.deferred
            + self.rejected
            + self.failed
            + self.lost
            + self.interrupted
        )

    def __add__(self, other: DrainSummary) -> DrainSummary:
        return DrainSummary(
            self.published + other.published,
            self.deferred + other.deferred,
            self.rejected + other.rejected,
            self.failed + other.failed,
            self.lost + other.lost,
            self.interrupted + other.interrupted,
            self.failures + other.failures,
            other.claim_error or self.claim_error,
        )

    def as_metadata(self) -> dict[str, Any]:
        return {
            "users": len({u for u, _, _ in self.published}),
            "generations": len(self.published),
            "batches": sum(b for _, _, b in self.published),
            "deferred": self.deferred,
            "rejected": self.rejected,
            "failed": self.failed,
            "lost": self.lost,
            "interrupted": self.interrupted,
            "rounds": self.rounds,
        }


@dataclass(frozen=True)
class RetryOutcome:
    """The runbook's retry: the failed job and the job that now carries its range."""

    job_id: int
    successor_id: int


@dataclass(frozen=True)
class PrExercise:
    """One exercise of a PR overview (kilograms, two decimals; None where no set counts)."""

    exercise_id: str
    best_e1rm_all_time: Decimal | None
    best_e1rm_30d: Decimal | None
    best_e1rm_30d_prior_year: Decimal | None
    heaviest_kg: Decimal | None


@dataclass(frozen=True)
class PrOverview:
    """A user's PR overview for one date: the applied generation's window. `stale` is
    true while a newer generation is requested or a range of the user's is owed, so the
    caller can say the figures are catching up, even when `exercises` is empty."""

    as_of: date
    generation: int
    stale: bool
    exercises: tuple[PrExercise, ...]
