"""Frozen values of provider observation and recovery (seed 003)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal
from uuid import UUID

from inventory_pipeline.provider.models import Category, ProviderKind

Transition = Literal["opened", "cause_changed", "repeated", "resolved"]


@dataclass(frozen=True)
class ProviderSettings:
    """The key never shows in a repr, so it cannot leak through a log of this value."""

    api_key: str | None = field(repr=False)
    active: bool
    language: str | None

    @property
    def usable_key(self) -> str | None:
        return self.api_key if self.active and self.api_key else None


@dataclass(frozen=True)
class ItemClaim:
    """One item under an observation lease, bound to its source snapshot."""

    item_id: int
    provider_kind: ProviderKind
    provider_id: str
    source_generation: int
    lease_token: UUID
    open_case: bool
    recovery_category: Category | None
    recovery_attempts: int

    @property
    def tmdb_id(self) -> int | None:
        """The numeric TMDb id, or None when the typed identity is unusable."""
        text = self.provider_id.strip()
        if not text.isdigit() or len(text) > 10:
            return None
        return int(text)

    @property
    def next_attempt(self) -> int:
        """The recovery attempt number a failure now would be."""
        return self.recovery_attempts + 1 if self.open_case else 1


@dataclass(frozen=True)
class ObservationResult:
    """What one attempt did; warnings are emitted from this after commit."""

    item_id: int
    outcome: Literal["observed", "failed", "lost"]
    category: Category | None = None
    transition: Transition | None = None
    case_id: UUID | None = None
    attempts: int = 0
    next_attempt_at: datetime | None = None
    previous_category: Category | None = None


@dataclass(frozen=True)
class ObservationSummary:
    results: tuple[ObservationResult, ...]

    @property
    def observed(self) -> int:
        return sum(r.outcome == "observed" for r in self.results)

    @property
    def by_category(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.results:
            key = "observed" if r.outcome == "observed" else (r.category or r.outcome)
            if r.outcome == "lost":
                key = "lost"
            counts[key] = counts.get(key, 0) + 1
        return counts

    @property
    def opened(self) -> int:
        return sum(r.transition == "opened" for r in self.results)

    @property
    def resolved(self) -> int:
        return sum(r.transition == "resolved" for r in self.results)


@dataclass(frozen=True)
class OverdueCase:
    item_id: int
    category: Category
    due_at: datetime
