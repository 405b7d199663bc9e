"""Frozen values of provider observation (docs/provider-recovery.md).

Only these reach the rest of the program: a validated observation or a failure with an
allowlisted category and a bounded delay. No raw body, header, URL or key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date
from typing import Literal

ProviderKind = Literal["movie", "tv"]

# The allowlisted failure categories (docs/provider-recovery.md#categories).
Category = Literal[
    "not_found", "auth", "throttled", "transient", "invalid_response", "configuration"
]
CATEGORIES: tuple[Category, ...] = (
    "not_found",
    "auth",
    "throttled",
    "transient",
    "invalid_response",
    "configuration",
)


ExternalSource = Literal["imdb_id", "tvdb_id"]


@dataclass(frozen=True)
class Observation:
    """A validated TMDb movie or TV record. Its external ids (a movie's IMDb id; a show's
    IMDb and TVDB ids) are the evidence a later revalidation looks up
    (docs/identity-revalidation.md#evidence); the original title is read for that
    comparison and never stored."""

    tmdb_id: int
    kind: ProviderKind
    title: str
    genres: tuple[str, ...]
    vote_average: float | None
    vote_count: int | None
    original_language: str | None
    companies: tuple[str, ...]
    release_date: date | None
    status: str | None
    original_title: str | None = None
    imdb_id: str | None = None
    tvdb_id: int | None = None

    def external_id(self, source: ExternalSource) -> str | None:
        """The record's external id of that source, as text (None: it has none)."""
        if source == "imdb_id":
            return self.imdb_id
        return None if self.tvdb_id is None else str(self.tvdb_id)


@dataclass(frozen=True)
class Candidate:
    """One result of an external-id lookup (`/3/find`): a TMDb record of a kind, with the
    titles and date the lookup lists for it."""

    tmdb_id: int
    kind: ProviderKind
    title: str | None
    original_title: str | None
    release_date: date | None


@dataclass(frozen=True)
class FindAnswer:
    """The movie and TV results of an external-id lookup; other kinds are dropped."""

    candidates: tuple[Candidate, ...]

    def of_kind(self, kind: ProviderKind) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.kind == kind)


@dataclass(frozen=True)
class Failure:
    """An allowlisted category, for throttling the bounded Retry-After delay, and the
    cause as a fixed label ("HTTP 5xx", "HTTP 429", "timeout", ...): never a body, URL
    or exception message. The cause is an explanation, not part of the outcome: two
    failures of one category and delay compare equal."""

    category: Category
    retry_after_seconds: int | None = None
    cause: str | None = field(default=None, compare=False)

    @property
    def pauses_admission(self) -> bool:
        """Provider-wide evidence that TMDb wants every client to wait: a throttling
        answer (429, TMDb's code 25), or a 503 that says for how long (Retry-After: the
        service as a whole is unavailable, not this item). Any other 5xx is this
        request's transient failure alone."""
        return self.category == "throttled" or (
            self.cause == "HTTP 503" and self.retry_after_seconds is not None
        )


FetchResult = Observation | Failure
