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


@dataclass(frozen=True)
class Observation:
    """A validated TMDb movie or TV record."""

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


@dataclass(frozen=True)
class Failure:
    """An allowlisted category, for throttling the bounded Retry-After delay, and the
    cause as a fixed label ("HTTP 5xx", "HTTP 429", "timeout", ...): never a body, URL
    or exception message. The cause is an explanation, not part of the outcome: two
    failures of one category and delay compare equal."""

    category: Category
    retry_after_seconds: int | None = None
    cause: str | None = field(default=None, compare=False)


FetchResult = Observation | Failure
