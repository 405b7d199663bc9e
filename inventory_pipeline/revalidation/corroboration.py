"""The corroboration rules (docs/identity-revalidation.md#corroboration): all must hold,
else no proposal. Plain functions of the evidence; no I/O."""

from __future__ import annotations

import re
import unicodedata
from datetime import date

from inventory_pipeline.provider.models import Candidate, Observation, ProviderKind
from inventory_pipeline.revalidation.models import Checks, RevalidationClaim

# A leading article is dropped before comparing (English, French, Spanish, German,
# Italian); "l'" is the elided French and Italian one. A title that is only an article
# keeps it.
ARTICLES = frozenset(
    {
        "the",
        "a",
        "an",
        "le",
        "la",
        "les",
        "el",
        "los",
        "las",
        "der",
        "die",
        "das",
        "il",
        "lo",
        "gli",
    }
)
_ELIDED = re.compile(r"^l'(?=\w)")
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u02bc": "'", "`": "'"})
_SEPARATORS = re.compile(r"[\W_]+")
YEAR_TOLERANCE = 1


def normalize_title(title: str) -> str:
    """A title as compared: accents removed (NFKD, combining marks dropped), case folded,
    "&" read as "and", apostrophes dropped, other punctuation and spacing as one space,
    one leading article dropped."""
    text = unicodedata.normalize("NFKD", title)
    text = "".join(c for c in text if not unicodedata.combining(c))
    text = text.casefold().translate(_APOSTROPHES).replace("&", " and ").strip()
    text = _ELIDED.sub("", text).replace("'", "")
    words = _SEPARATORS.sub(" ", text).split()
    if len(words) > 1 and words[0] in ARTICLES:
        words = words[1:]
    return " ".join(words)


def title_matches(source: str, *candidates: str | None) -> bool:
    """The source title equals one of the candidate's titles after normalization (an
    empty normalization matches nothing)."""
    wanted = normalize_title(source)
    return bool(wanted) and any(c is not None and normalize_title(c) == wanted for c in candidates)


def year_matches(source_year: int | None, released: date | None) -> bool:
    """The candidate's year is the item's year, give or take one; unknown is no match."""
    if source_year is None or released is None:
        return False
    return abs(released.year - source_year) <= YEAR_TOLERANCE


def candidates_of(
    kind: ProviderKind, old_tmdb_id: int, found: tuple[Candidate, ...]
) -> tuple[Candidate, ...]:
    """The candidates a lookup names: results of the item's kind with another TMDb id."""
    return tuple(c for c in found if c.kind == kind and c.tmdb_id != old_tmdb_id)


def corroborate(
    claim: RevalidationClaim,
    candidates: tuple[Candidate, ...],
    details: Observation | None,
) -> Checks:
    """Every rule that can be evaluated: one candidate, its details (None: the candidate
    itself is gone) naming the same external id, its title or original title equal to
    the item's source title, its year the item's year give or take one."""
    if len(candidates) != 1:
        return Checks(candidates=len(candidates))
    [candidate] = candidates
    if details is None:
        return Checks(candidates=1, candidate_tmdb_id=candidate.tmdb_id, round_trip=False)
    source, external_id = claim.external
    return Checks(
        candidates=1,
        candidate_tmdb_id=candidate.tmdb_id,
        round_trip=details.external_id(source) == external_id,
        title_match=title_matches(claim.source_title, details.title, details.original_title),
        year_match=year_matches(claim.source_year, details.release_date),
        candidate_title=details.title,
        candidate_original_title=details.original_title,
        candidate_year=details.release_date.year if details.release_date else None,
    )
