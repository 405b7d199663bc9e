"""Frozen values of the stats worker."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import date, datetime
from typing import Any, Literal
from uuid import UUID

from inventory_pipeline.db import LockNotAvailable, QueryCanceled

# The compute responses (their meaning: stats/compute.py).
ComputeStatus = Literal["computed", "batch_pending", "retry_pending", "failed"]
BATCH_SIZE = 100  # the measured candidate boundary, not an unlimited safety guarantee
TRANSACTION_BOUNDARY = "transaction_boundary_required"
# A compute stage's answer for a run whose lease holds no slot (it lapsed, or the run
# waited out a retry time) while every slot of the cap is held: it writes nothing, and
# the run waits for a claim to take it back.
LAPSED_WITHOUT_SLOT = "lease lapsed and no slot is free"

# A stage's interruptions: its statement budget ran out or a lock was not available in
# time (or the statement was canceled); a failed attempt with backoff, not a bug.
INTERRUPTIONS = (QueryCanceled, LockNotAvailable)


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

    def budget_ms(self, stage: Literal["claim", "compute", "publish"]) -> int:
        """The statement budget a stage arms (each statement of the stage runs under it)."""
        budgets = {
            "claim": self.claim_budget_ms,
            "compute": self.compute_budget_ms,
            "publish": self.publish_budget_ms,
        }
        return budgets[stage]


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
class RunState:
    """A run as its stage locked it (held for the stage's transaction)."""

    phase: str
    lease_until: datetime  # as other transactions see it until this one commits
    expired: bool
    backing_off: bool
    retry_not_before: datetime | None
    attempts: int
    payload: dict[str, Any]
    xid: int


@dataclass(frozen=True)
class BatchCursor:
    """Where a batched compute stands, kept in the run's payload between transactions:
    the frozen exercise list, the next offset, the inputs it was prepared on (source
    revision and published base) and the transaction that last advanced it."""

    stage: Literal["batches", "finalize"]
    next_offset: int
    exercises: tuple[str, ...]
    source_revision: int
    base: int
    xid: int
    output_revision: int = 1
    retry_count: int = 0

    @property
    def total(self) -> int:
        return len(self.exercises)

    def next_chunk(self) -> tuple[str, ...]:
        return self.exercises[self.next_offset : self.next_offset + BATCH_SIZE]

    def advanced(self, done: int, xid: int) -> BatchCursor:
        offset = self.next_offset + done
        stage: Literal["batches", "finalize"] = "finalize" if offset >= self.total else "batches"
        return replace(self, next_offset=offset, stage=stage, xid=xid)

    def to_payload(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "next_offset": self.next_offset,
            "exercises": list(self.exercises),
            "total": self.total,
            "source_revision": self.source_revision,
            "base": self.base,
            "output_revision": self.output_revision,
            "retry_count": self.retry_count,
            "xid": self.xid,
        }

    @classmethod
    def from_payload(cls, raw: dict[str, Any]) -> BatchCursor:
        return cls(
            stage=raw["stage"],
            next_offset=int(raw["next_offset"]),
            exercises=tuple(raw["exercises"]),
            source_revision=int(raw["source_revision"]),
            base=int(raw["base"]),
            xid=int(raw["xid"]),
            output_revision=int(raw.get("output_revision", 1)),
            retry_count=int(raw.get("retry_count", 0)),
        )


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
    # lost: the run's lease was gone (expired, or another lease took the job).
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
    def outcome(self) -> Literal["published", "rejected", "deferred", "failed"]:
        """Published, rejected into a successor, deferred (a retry time, a pending batch,
        or a lapsed lease with no slot free: the work resumes later) or failed."""
        publication = self.publication
        if publication is not None and publication.status == "published":
            return "published"
        if publication is not None and publication.status == "rejected":
            return "rejected"
        if publication is not None and publication.status == "retry_pending":
            return "deferred"
        if publication is None and self.status in ("retry_pending", "batch_pending"):
            return "deferred"
        if publication is None and self.reason == LAPSED_WITHOUT_SLOT:
            return "deferred"
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
    """The drain policy's view: claimable work, free lease slots, the pause switch."""

    waiting: int
    free_slots: int
    paused: bool

    @property
    def claimable(self) -> int:
        """Work a drain started now would take (none while paused or at the cap)."""
        return 0 if self.paused or self.free_slots == 0 else self.waiting


@dataclass(frozen=True)
class DrainSummary:
    published: tuple[tuple[UUID, int, int], ...]  # user, generation, batches
    deferred: int
    rejected: int
    failed: int
    rounds: int
    passes: int = 1

    def then(self, other: DrainSummary) -> DrainSummary:
        return DrainSummary(
            self.published + other.published,
            self.deferred + other.deferred,
            self.rejected + other.rejected,
            self.failed + other.failed,
            self.rounds + other.rounds,
            self.passes + other.passes,
        )

    def as_metadata(self) -> dict[str, Any]:
        return {
            "users": len({u for u, _, _ in self.published}),
            "generations": len(self.published),
            "batches": sum(b for _, _, b in self.published),
            "deferred": self.deferred,
            "rejected": self.rejected,
            "failed": self.failed,
            "rounds": self.rounds,
            "passes": self.passes,
        }


@dataclass(frozen=True)
class RetryOutcome:
    """The runbook's retry: the failed job and the job that now carries its range."""

    job_id: int
    successor_id: int
