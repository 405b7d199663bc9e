"""Frozen values of provider observation and recovery (docs/provider-recovery.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal
from uuid import UUID

from inventory_pipeline.provider.models import Category, ProviderKind

Transition = Literal["opened", "cause_changed", "repeated", "resolved"]

TMDB_ID_MAX = 2**31 - 1  # TMDb's API reference types every movie/TV id as int32
# `[0-9]` in a str pattern is the ten ASCII digits only (`\d` would take any Unicode
# digit); fullmatch, because `$` would also match before a trailing newline.
_TMDB_ID = re.compile(r"[1-9][0-9]{0,9}")


def tmdb_id_of(provider_id: str) -> int | None:
    """The TMDb id a typed identity names, or None when it names none: ASCII digits, no
    sign, whitespace or leading zero, 1 to 2147483647. The same rule as the database's
    `tmdb_id_of(text)`; a test holds the two to identical answers. Never raises."""
    if not _TMDB_ID.fullmatch(provider_id):
        return None
    value = int(provider_id)
    return value if value <= TMDB_ID_MAX else None


@dataclass(frozen=True)
class ProviderSettings:
    """The key never shows in a repr, so it cannot leak through a log of this value."""

    api_key: str | None = field(repr=False)
    active: bool
    language: str | None
    # The credential generation of this key (a new one whenever the key or the active
    # flag changes): a failure records which key its request was sent with.
    generation: UUID | None = None

    @property
    def usable_key(self) -> str | None:
        return self.api_key if self.active and self.api_key else None


@dataclass(frozen=True)
class Replacement:
    """An operator's approved replacement: the proposal and the TMDb id it names."""

    proposal_id: int
    tmdb_id: int


@dataclass(frozen=True)
class ItemClaim:
    """One item under an observation lease, bound to its source snapshot, and the
    approved replacement of that source it is observed under, if any."""

    item_id: int
    title: str
    provider_kind: ProviderKind
    provider_id: str
    source_generation: int
    lease_token: UUID
    open_case: bool
    recovery_category: Category | None
    # Failures of the open case under its current cause (the backoff's exponent).
    recovery_cause_attempts: int
    replacement: Replacement | None = None

    @property
    def tmdb_id(self) -> int | None:
        """The TMDb id requested: an approved replacement's, else the one the typed
        identity names (None when it names none)."""
        if self.replacement is not None:
            return self.replacement.tmdb_id
        return tmdb_id_of(self.provider_id)

    def attempt_under(self, category: Category) -> int:
        """The number a failure of this cause now would be among the case's failures
        under that cause: each cause's backoff starts at its own start."""
        if self.open_case and self.recovery_category == category:
            return self.recovery_cause_attempts + 1
        return 1


@dataclass(frozen=True)
class Deferred:
    """The request was never sent: admission is paused because the provider throttled
    (or had no slot in time). The claim goes back without counting an attempt."""

    paused_seconds: float


# interrupted: a transient database error; the claim went back unrecorded (no attempt).
Outcome = Literal["observed", "failed", "lost", "deferred", "interrupted", "error"]


@dataclass(frozen=True)
class ObservationResult:
    """What one attempt did; warnings are emitted from this after commit. `error` is the
    class name of an exception the attempt raised (never its message, which could carry
    provider text); "error" as the outcome means nothing could be recorded."""

    item_id: int
    outcome: Outcome
    category: Category | None = None
    transition: Transition | None = None
    case_id: UUID | None = None
    attempts: int = 0
    next_attempt_at: datetime | None = None
    previous_category: Category | None = None
    error: str | None = None
    cause: str | None = None  # the provider's fixed cause label, e.g. "HTTP 5xx"
    # Observed under an approved replacement for the first time: the case (if open)
    # resolved as replaced.
    replacement: Replacement | None = None
    # How a person finds the item: its title and typed identity, bounded and escaped
    # (`item_label`); empty where the attempt's claim is not at hand.
    label: str = ""


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
            key = r.category if r.outcome == "failed" and r.category else r.outcome
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


@dataclass(frozen=True)
class Overdue:
    """The oldest overdue cases an observation may claim, how many there are in all,
    and how many open cases wait in inactive libraries (not overdue: nobody may claim
    them)."""

    oldest: tuple[OverdueCase, ...]
    total: int
    inactive: int


@dataclass(frozen=True)
class OpenCase:
    """An open recovery case as a person looks for it: the item's title, library and
    typed identity, its category, attempts, and when it failed first and is tried next."""

    item_id: int
    title: str
    library: str
    provider_kind: str | None
    provider_id: str | None
    category: Category
    attempts: int
    first_failed_at: datetime
    next_attempt_at: datetime | None


@dataclass(frozen=True)
class CaseAge:
    """Open recovery cases of one category, as the database holds them now: how many,
    how long the oldest has been failing, and how many are due for an attempt."""

    category: Category
    open_cases: int
    oldest_age_seconds: int
    due_now: int
