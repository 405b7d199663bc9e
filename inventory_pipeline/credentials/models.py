"""Frozen values of verified credential wakeups (docs/credentials.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal
from uuid import UUID

ProbeOutcome = Literal["verified", "auth", "throttled", "transient", "invalid_response"]


def short(generation: UUID | None) -> str:
    """A generation as shown to people: its first eight hex digits."""
    return str(generation)[:8] if generation else "-"


@dataclass(frozen=True)
class WakeupStatus:
    generation: UUID
    usable: bool
    verified: bool
    auth_cases: int
    probe_allowed: bool
    release_allowed: bool
    eligible: bool
    throttled_until: datetime | None
    next_probe_at: datetime | None
    last_outcome: ProbeOutcome | None
    released_total: int

    @property
    def wants_probe(self) -> bool:
        return self.auth_cases > 0 and self.usable and not self.verified and self.probe_allowed

    @property
    def wants_release(self) -> bool:
        return self.auth_cases > 0 and self.verified and self.release_allowed and self.eligible


@dataclass(frozen=True)
class ProbeClaim:
    """The probe lease for one generation; the key never shows in a repr."""

    lease_token: UUID
    generation: UUID
    api_key: str = field(repr=False)
    language: str | None
    probe_failures: int


@dataclass(frozen=True)
class ProbeResult:
    generation: UUID
    outcome: ProbeOutcome
    accepted: bool  # False: the configuration, generation or lease moved on meanwhile
    retry_after_seconds: int | None = None


@dataclass(frozen=True)
class ProbeNotSent:
    """A claimed probe that was never sent: no admission came in time, or its lease ran
    out while it waited. Its lease is given back; no outcome is recorded and no backoff
    earned."""

    generation: UUID
    reason: str


@dataclass(frozen=True)
class ReleaseResult:
    generation: UUID
    released: int
    scanned: int
    cursor: int
    wrapped: bool
