"""Frozen values of revalidation and replacement proposals
(docs/identity-revalidation.md)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal
from uuid import UUID

from inventory_pipeline.provider.models import Category, ExternalSource, ProviderKind

# The first corroboration rule a check failed on (docs/identity-revalidation.md#corroboration).
Reason = Literal["no_candidate", "ambiguous", "round_trip", "title", "year"]
REASONS: tuple[Reason, ...] = ("no_candidate", "ambiguous", "round_trip", "title", "year")
ProposalState = Literal["proposed", "approved", "rejected", "superseded"]
PROPOSAL_STATES: tuple[ProposalState, ...] = ("proposed", "approved", "rejected", "superseded")
Outcome = Literal["proposed", "no_proposal", "fault", "lost", "deferred", "error"]


class ProposalRefused(ValueError):
    """A decision the proposals do not allow (an unknown id, a proposal already decided
    or superseded, a bad operator name): nothing was decided."""


@dataclass(frozen=True)
class RevalidationClaim:
    """One case under a revalidation lease, bound to its source generation, with the
    evidence of the item's last successful observation of that source."""

    case_id: UUID
    item_id: int
    source_generation: int
    lease_token: UUID
    provider_kind: ProviderKind
    source_title: str
    source_year: int | None
    old_tmdb_id: int
    imdb_id: str | None
    tvdb_id: int | None
    faults: int

    @property
    def external(self) -> tuple[ExternalSource, str]:
        """The external id to look up: a show's TVDB id when it has one, else the IMDb
        id (a claim is only made with one of them)."""
        if self.provider_kind == "tv" and self.tvdb_id is not None:
            return "tvdb_id", str(self.tvdb_id)
        if self.imdb_id is None:
            raise ValueError("a revalidation claim needs an external id")
        return "imdb_id", self.imdb_id


@dataclass(frozen=True)
class Checks:
    """Which corroboration rules passed (None: not evaluated, because an earlier one
    left nothing to evaluate), with the candidate's evidence."""

    candidates: int  # results of the same kind with another TMDb id
    candidate_tmdb_id: int | None = None
    round_trip: bool | None = None
    title_match: bool | None = None
    year_match: bool | None = None
    candidate_title: str | None = None
    candidate_original_title: str | None = None
    candidate_year: int | None = None

    @property
    def single_candidate(self) -> bool:
        return self.candidates == 1

    @property
    def reason(self) -> Reason | None:
        """The first rule that failed; None when all held."""
        if self.candidates == 0:
            return "no_candidate"
        if self.candidates > 1:
            return "ambiguous"
        if not self.round_trip:
            return "round_trip"
        if not self.title_match:
            return "title"
        if not self.year_match:
            return "year"
        return None

    @property
    def corroborated(self) -> bool:
        return self.reason is None


@dataclass(frozen=True)
class RevalidationResult:
    """What one revalidation did. `error` is an exception's class name, never its text."""

    case_id: UUID
    item_id: int
    outcome: Outcome
    old_tmdb_id: int | None = None
    checks: Checks | None = None
    proposal_id: int | None = None
    category: Category | None = None
    cause: str | None = None
    next_attempt_at: datetime | None = None
    error: str | None = None
    external: tuple[ExternalSource, str] | None = None


@dataclass(frozen=True)
class RevalidationSummary:
    results: tuple[RevalidationResult, ...]

    def count(self, outcome: Outcome) -> int:
        return sum(r.outcome == outcome for r in self.results)

    @property
    def reasons(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.results:
            if r.outcome == "no_proposal" and r.checks is not None and r.checks.reason:
                counts[r.checks.reason] = counts.get(r.checks.reason, 0) + 1
        return counts


@dataclass(frozen=True)
class Proposal:
    """A proposal as an operator reviews it, its state as it stands now (a change of
    the item's source supersedes it)."""

    id: int
    item_id: int
    library_id: int | None
    library: str | None
    provider_kind: ProviderKind
    old_tmdb_id: int
    candidate_tmdb_id: int
    external_source: ExternalSource
    external_id: str
    source_title: str
    source_year: int
    candidate_title: str
    candidate_original_title: str | None
    candidate_year: int
    state: ProposalState
    proposed_at: datetime
    checked_at: datetime
    decided_by: str | None
    decided_at: datetime | None
    replaced_at: datetime | None
    age_seconds: int


@dataclass(frozen=True)
class NoProposal:
    """A case's last conclusive check that proposed nothing, and why."""

    item_id: int
    library_id: int
    library: str
    provider_kind: ProviderKind
    old_tmdb_id: int
    external_source: ExternalSource
    external_id: str
    reason: Reason
    candidates: int
    single_candidate: bool
    round_trip: bool | None
    title_match: bool | None
    year_match: bool | None
    checked_at: datetime

    @property
    def passed(self) -> tuple[str, ...]:
        """The rules that held, by name."""
        rules = (
            ("single candidate", self.single_candidate),
            ("round trip", self.round_trip),
            ("title", self.title_match),
            ("year", self.year_match),
        )
        return tuple(name for name, held in rules if held)


@dataclass(frozen=True)
class Decision:
    """One proposal an operator decided."""

    proposal_id: int
    item_id: int
    state: ProposalState
    old_tmdb_id: int
    candidate_tmdb_id: int


@dataclass(frozen=True)
class ProposalOverview:
    """The standing view: proposals by state, the latest live ones, the no-proposal
    records by reason and the latest of them, and cases waiting out a fault."""

    states: dict[str, int]
    live: tuple[Proposal, ...]
    reasons: dict[str, int]
    unproposed: tuple[NoProposal, ...]
    faulted: dict[str, int]
    due: int
