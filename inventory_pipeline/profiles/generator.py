"""Profile generation from the items' projection (`inventory_observation_of`), with its
coverage contract.

Per trait the distribution plus its coverage
(contributors / item count). A trait is published only where coverage >= 0.5 and at
least five items contribute; otherwise it is recorded as insufficient, never guessed
(docs/profiles.md#coverage-contract).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

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


def _top_shares(values: pd.Series, contributors: int) -> dict[str, float]:
    """Shares of the ten largest values (ties by name), the rest as "other"."""
    counts = values.value_counts()
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))
    shares = {str(k): _round(v / contributors) for k, v in ordered[:TOP_VALUES]}
    rest = sum(v for _, v in ordered[TOP_VALUES:])
    if rest:
        shares["other"] = _round(rest / contributors)
    return shares


def _genres(frame: pd.DataFrame, item_count: int) -> dict[str, Any]:
    exploded = frame["genres"].explode().dropna()
    exploded = exploded[exploded != ""]
    # An item carrying a genre twice counts once.
    pairs = exploded.reset_index().drop_duplicates()
    contributors = int(pairs["index"].nunique())
    published: dict[str, Any] = {}
    if contributors:
        counts = pairs["genres"].value_counts()
        ordered = sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))
        published = {"share": {str(k): _round(v / contributors) for k, v in ordered}}
    return _trait(contributors, item_count, published)


def _rating(frame: pd.DataFrame, item_count: int) -> dict[str, Any]:
    ratings = frame["rating"].dropna().to_numpy(dtype=float)
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


def _categorical(series: pd.Series, item_count: int) -> dict[str, Any]:
    values = series.dropna()
    contributors = len(values)
    published = {"share": _top_shares(values, contributors)} if contributors else {}
    return _trait(contributors, item_count, published)


def _identity(frame: pd.DataFrame, item_count: int) -> dict[str, Any]:
    typed = frame.dropna(subset=["provider", "provider_kind"])
    keys = typed["provider"].astype(str) + ":" + typed["provider_kind"].astype(str)
    contributors = len(keys)
    published: dict[str, Any] = {}
    if contributors:
        counts = keys.value_counts()
        ordered = sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))
        published = {"share": {str(k): _round(v / contributors) for k, v in ordered}}
    return _trait(contributors, item_count, published)


def frame_from_rows(columns: tuple[str, ...], rows: tuple[tuple[Any, ...], ...]) -> pd.DataFrame:
    return pd.DataFrame.from_records(list(rows), columns=list(columns))


def generate_profile(frame: pd.DataFrame) -> dict[str, Any]:
    """The profile JSON of one library; an empty frame has no profile (caller deletes)."""
    item_count = len(frame)
    if item_count == 0:
        raise ValueError("an empty library has no profile")
    frame = frame.reset_index(drop=True)
    return {
        "genres": _genres(frame, item_count),
        "rating": _rating(frame, item_count),
        "primary_studio": _categorical(frame["primary_studio"], item_count),
        "original_language": _categorical(frame["original_language"], item_count),
        "identity": _identity(frame, item_count),
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
    return list(genres["share"].items())[:limit]
