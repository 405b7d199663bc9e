"""Frozen values of the stats worker."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime
from typing import Any, Literal
from uuid import UUID

# The compute responses (their meaning: `stats_compute_stage` in stats/schema.sql).
ComputeStatus = Literal["computed", "batch_pending", "retry_pending", "failed", "lost"]
BATCH_SIZE = 100  # the measured candidate boundary, not an unlimited safety guarantee
TRANSACTION_BOUNDARY = "transaction_boundary_required"
# The reason a stage gives when its statement budget ran out (a failed attempt with
# backoff): what the scoped processor reports as worker_timed_out.
BUDGET_SPENT = "statement budget spent (57014)"


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


@dataclass(frozen=True)
class ProcessResult:
    """What one claim came to: the last compute status, the batches it took and, when
    it got that far, the publication."""

    status: ComputeStatus
    batches: int
    publication: PublishResult | None = None
    reason: str | None = None  # why the compute stage failed, when it did

    @property
    def outcome(self) -> Literal["published", "rejected", "deferred", "failed", "lost"]:
        """Published, rejected into a successor, deferred (a retry time or a pending
        batch: the work resumes later), failed (attempts spent, the range owed) or lost
        (no live lease: the claim's recovery takes the run back)."""
        publication = self.publication
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
    failed with their range owed, lost to the claim's recovery, or interrupted by a
    database error that left the run to its lease)."""

    published: tuple[tuple[UUID, int, int], ...]  # user, generation, batches
    deferred: int = 0
    rejected: int = 0
    failed: int = 0
    lost: int = 0
    interrupted: int = 0
    # user, outcome, reason: each claim that failed, was rejected, or was deferred by a
    # failed attempt, with the reason its stage gave
    failures: tuple[tuple[UUID, str, str], ...] = ()

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
