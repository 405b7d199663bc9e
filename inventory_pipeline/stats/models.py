"""Frozen values of the stats worker (seed 001)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime
from typing import Any, Literal
from uuid import UUID

# seed 001 #1590: the compute responses.
ComputeStatus = Literal["computed", "batch_pending", "retry_pending", "failed"]
BATCH_SIZE = 100  # the measured candidate boundary, not an unlimited safety guarantee


@dataclass(frozen=True)
class WorkerSettings:
    claim_budget_ms: int
    compute_budget_ms: int
    publish_budget_ms: int
    lease_seconds: int
    active_lease_cap: int
    max_attempts: int
    retry_backoff_seconds: int


@dataclass(frozen=True)
class StatsClaim:
    """A job under a run's lease: the token fences every later write."""

    run_id: int
    job_id: int
    user_id: UUID
    lease_token: UUID
    target_version: int
    base_applied_version: int
    from_date: date | None
    exercise_ids: tuple[str, ...]


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
    status: Literal["published", "rejected", "lease_lost"]
    user_id: UUID
    generation: int
    applied_version: int | None = None
    reason: str | None = None


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
class DrainSummary:
    published: tuple[tuple[UUID, int, int], ...]  # user, generation, batches
    deferred: int
    rejected: int
    failed: int
    rounds: int

    def as_metadata(self) -> dict[str, Any]:
        return {
            "users": len({u for u, _, _ in self.published}),
            "generations": len(self.published),
            "batches": sum(b for _, _, b in self.published),
            "deferred": self.deferred,
            "rejected": self.rejected,
            "failed": self.failed,
            "rounds": self.rounds,
        }
