"""Profile generation from the items' projection (`inventory_observation_of`), with its
coverage contract.

Per trait the distribution plus its coverage
(contributors / item count). A trait is published only where coverage >= 0.5 and at
least five items contribute; otherwise it is recorded as insufficient, never guessed
(docs/profiles.md#coverage-contract).

The projection arrives as plain row tuples and is counted with `Counter` over its
columns (numpy only for the rating percentiles): for the typical library of tens of
items a DataFrame's fixed cost per operation was 7-9 ms, 30 times the counting itself,
and at a million items the two take the same time (BENCHMARKS.md, S2 and S3).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

MIN_COVERAGE = 0.5
MIN_CONTRIBUTORS = 5
TOP_VALUES = 10
DECIMALS = 4

COLUMNS = (
    "provider",
    "provider_kind",
    "rating",
    "genres",
    "primary_studio",
    "original_language",
)


def _round(value: float) -> float:
    return round(float(value), DECIMALS)


def _trait(contributors: int, item_count: int, published: dict[str, Any]) -> dict[str, Any]:
    coverage = contributors / item_count if item_count else 0.0
    trait: dict[str, Any] = {"coverage": _round(coverage), "contributors": int(contributors)}
    if coverage >= MIN_COVERAGE and contributors >= MIN_CONTRIBUTORS:
        return {"status": "published", **trait, **published}
    return {"status": "insufficient", **trait}


def _ordered(counts: Counter[Any]) -> list[tuple[Any, int]]:
    """Values largest first, ties by name."""
    return sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))


def _shared(counts: Counter[Any], top: int | None, item_count: int) -> dict[str, Any]:
    """Shares of contributors, largest first (ties by name); with `top`, the `top` largest
    in `share` and what the others hold together in `rest_share`, a field of its own: a
    value may be named anything, "other" included."""
    contributors = sum(counts.values())
    published: dict[str, Any] = {}
    if contributors:
        ordered = _ordered(counts)
        kept = ordered if top is None else ordered[:top]
        published["share"] = {str(k): _round(v / contributors) for k, v in kept}
        rest = sum(v for _, v in ordered[len(kept) :])
        if rest:
            published["rest_share"] = _round(rest / contributors)
    return _trait(contributors, item_count, published)


def _is_name(value: Any) -> bool:
    """A name counts when it has a character other than whitespace: NULL, '' and '  '
    are no value, in every trait."""
    return isinstance(value, str) and value != "" and not value.isspace()


def _names(value: Any) -> list[str]:
    """The names an array holds, whatever its dimensions: text[] accepts
    '{{Drama,Comedy},{War,Crime}}' as well as '{Drama}' (NULL: none)."""
    if not isinstance(value, list):
        return [value] if _is_name(value) else []
    return [name for element in value for name in _names(element)]


def _genres(values: Sequence[Any], item_count: int) -> dict[str, Any]:
    """Every genre's share of the items carrying one; an item carrying a genre twice
    counts it once."""
    counts: Counter[str] = Counter()
    contributors = 0
    for genres in values:
        distinct = set(_names(genres))
        counts.update(distinct)
        contributors += bool(distinct)
    published: dict[str, Any] = {}
    if contributors:
        published["share"] = {k: _round(v / contributors) for k, v in _ordered(counts)}
    return _trait(contributors, item_count, published)


def _rating(values: Sequence[Any], item_count: int) -> dict[str, Any]:
    ratings = np.array([v for v in values if v is not None], dtype=float)
    ratings = ratings[~np.isnan(ratings)]  # a numeric 'NaN' is no rating
    contributors = len(ratings)
    published: dict[str, Any] = {}
    if contributors:
        p10, median, p90 = np.percentile(ratings, [10, 50, 90])  # linear interpolation
        published = {
            # fsum is exact, so the mean (and its rounding) does not depend on the order
            # the reader returned the items in; a float sum would move the last bit.
            "mean": _round(math.fsum(ratings) / contributors),
            "median": _round(median),
            "p10": _round(p10),
            "p90": _round(p90),
        }
    return _trait(contributors, item_count, published)


def _present(values: Sequence[Any]) -> Counter[str]:
    return Counter(v for v in values if _is_name(v))


def _identity(
    providers: Sequence[str | None], kinds: Sequence[str | None], item_count: int
) -> dict[str, Any]:
    keys: Counter[str] = Counter()
    for (provider, kind), n in Counter(zip(providers, kinds, strict=True)).items():
        if provider is not None and kind is not None:
            keys[f"{provider}:{kind}"] += n
    return _shared(keys, None, item_count)


def generate_profile(columns: Sequence[str], rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
    """The profile JSON of one library from its projection's rows (`columns` names their
    fields, which include COLUMNS); an empty library has no profile (caller deletes)."""
    item_count = len(rows)
    if item_count == 0:
        raise ValueError("an empty library has no profile")
    column = dict(zip(columns, zip(*rows, strict=True), strict=True))
    return {
        "genres": _genres(column["genres"], item_count),
        "rating": _rating(column["rating"], item_count),
        "primary_studio": _shared(_present(column["primary_studio"]), TOP_VALUES, item_count),
        "original_language": _shared(_present(column["original_language"]), TOP_VALUES, item_count),
        "identity": _identity(column["provider"], column["provider_kind"], item_count),
    }


def held_back_reason(trait: dict[str, Any]) -> str | None:
    """Why a trait of a generated profile is not published, per the coverage contract;
    None when it is published."""
    if trait.get("status") == "published":
        return None
    contributors = int(trait.get("contributors", 0))
    coverage = float(trait.get("coverage", 0.0))
    reasons = []
    if contributors < MIN_CONTRIBUTORS:
        noun = "item" if contributors == 1 else "items"
        reasons.append(f"{contributors} contributing {noun}, need {MIN_CONTRIBUTORS}")
    if coverage < MIN_COVERAGE:
        reasons.append(f"coverage {coverage:g}, need {MIN_COVERAGE:g}")
    return "insufficient: " + "; ".join(reasons or ["not published"])


def top_genres(profile: dict[str, Any], limit: int = 5) -> list[tuple[str, float]]:
    genres = profile.get("genres", {})
    if genres.get("status") != "published":
        return []
    # A stored profile's share comes back from jsonb with its keys shortest first.
    shares = [(str(k), float(v)) for k, v in genres["share"].items()]
    return sorted(shares, key=lambda kv: (-kv[1], kv[0]))[:limit]
