"""The profile generator and its coverage contract (no database)."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest

from inventory_pipeline.profiles.generator import COLUMNS, generate_profile, top_genres


def profile_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The profile of items given as partial rows (missing fields are NULL)."""
    return generate_profile(COLUMNS, [tuple(r.get(c) for c in COLUMNS) for r in rows])


def test_published_traits_with_shares_rounded() -> None:
    rows = [
        {
            "genres": ["Drama", "Comedy"],
            "rating": 1.0,
            "primary_studio": "A24",
            "original_language": "en",
            "provider": "tmdb",
            "provider_kind": "movie",
        },
        {
            "genres": ["Drama", "Drama"],
            "rating": 2.0,
            "primary_studio": "A24",
            "original_language": "en",
            "provider": "tmdb",
            "provider_kind": "movie",
        },
        {
            "genres": ["Horror"],
            "rating": 3.0,
            "primary_studio": "Toho",
            "original_language": "ja",
            "provider": "tmdb",
            "provider_kind": "tv",
        },
        {
            "genres": ["Drama"],
            "rating": 4.0,
            "primary_studio": "A24",
            "original_language": "en",
            "provider": "tmdb",
            "provider_kind": "movie",
        },
        {
            "genres": ["Comedy"],
            "rating": 10.0,
            "primary_studio": "Pixar",
            "original_language": "fr",
            "provider": "tmdb",
            "provider_kind": "movie",
        },
        {"genres": [], "rating": None, "primary_studio": None, "original_language": None},
    ]
    profile = profile_of(rows)
    genres = profile["genres"]
    assert genres["status"] == "published"
    assert (genres["contributors"], genres["coverage"]) == (5, 0.8333)
    # An item carrying a genre twice counts once.
    assert genres["share"] == {"Drama": 0.6, "Comedy": 0.4, "Horror": 0.2}
    rating = profile["rating"]
    expected = np.percentile([1, 2, 3, 4, 10], [10, 50, 90])
    assert rating["mean"] == 4.0 and rating["median"] == 3.0
    assert (rating["p10"], rating["p90"]) == (round(expected[0], 4), round(expected[2], 4))
    assert profile["primary_studio"]["share"] == {"A24": 0.6, "Pixar": 0.2, "Toho": 0.2}
    assert profile["identity"]["share"] == {"tmdb:movie": 0.8, "tmdb:tv": 0.2}


def test_insufficient_below_five_contributors_or_half_coverage() -> None:
    four = [{"genres": ["Drama"], "rating": 5.0} for _ in range(4)]
    profile = profile_of(four)
    assert profile["genres"] == {"status": "insufficient", "coverage": 1.0, "contributors": 4}
    assert "share" not in profile["genres"]
    # Ten items, five with a rating: coverage exactly 0.5 is published...
    half = [{"rating": 5.0} for _ in range(5)] + [{} for _ in range(5)]
    assert profile_of(half)["rating"]["status"] == "published"
    # ...one fewer is not, however many items there are.
    below = [{"rating": 5.0} for _ in range(5)] + [{} for _ in range(6)]
    result = profile_of(below)["rating"]
    assert result == {"status": "insufficient", "coverage": 0.4545, "contributors": 5}


def test_top_ten_then_the_rest_apart() -> None:
    rows = [{"original_language": f"l{i:02d}"} for i in range(12) for _ in range(12 - i)]
    trait = profile_of(rows)["original_language"]
    assert list(trait["share"]) == [f"l{i:02d}" for i in range(10)]
    total = sum(12 - i for i in range(12))
    assert trait["rest_share"] == round((2 + 1) / total, 4)


def test_a_value_named_like_the_rest_is_a_value() -> None:
    """A studio called "other" holding half the items keeps its share; the eleven
    smaller studios' rest is reported apart, and the shares with the rest sum to one."""
    rows = [{"primary_studio": "other"} for _ in range(20)]
    rows += [{"primary_studio": f"s{i:02d}"} for i in range(12) for _ in range(2 if i < 8 else 1)]
    trait = profile_of(rows)["primary_studio"]
    assert trait["share"]["other"] == 0.5
    assert trait["rest_share"] == round(3 / 40, 4)
    assert sum(trait["share"].values()) + trait["rest_share"] == pytest.approx(1.0, abs=1e-3)


def test_a_multi_dimensional_genres_array_counts_its_names() -> None:
    """text[] accepts arrays of any dimension: each item counts the distinct names its
    array holds, whatever its shape; NULL elements and blank names are none."""
    rows = [{"genres": [["Drama", "Comedy"], ["War", None]]} for _ in range(4)]
    rows += [{"genres": [[["Drama"]], [[""]]]}, {"genres": [[None, "  "]]}]
    trait = profile_of(rows)["genres"]
    assert trait["contributors"] == 5
    assert trait["share"] == {"Drama": 1.0, "Comedy": 0.8, "War": 0.8}


@pytest.mark.parametrize("trait", ["primary_studio", "original_language"])
def test_a_blank_name_is_no_value_in_every_trait(trait: str) -> None:
    rows = [{trait: "A24"} for _ in range(5)] + [{trait: ""}, {trait: " \t"}]
    profile = profile_of(rows)
    assert profile[trait]["contributors"] == 5 and profile[trait]["share"] == {"A24": 1.0}
    assert profile_of([{"genres": ["", " "]}] * 6)["genres"]["contributors"] == 0


def test_top_genres_are_largest_first_whatever_order_the_keys_come_in() -> None:
    """A stored profile comes back from jsonb with its keys shortest first."""
    stored = json.loads(json.dumps({"genres": {"status": "published", "share": {}}}))
    stored["genres"]["share"] = {"War": 0.0417, "Drama": 1.0, "Comedy": 0.5}
    assert top_genres(stored, 2) == [("Drama", 1.0), ("Comedy", 0.5)]


def test_ties_are_ordered_by_name() -> None:
    rows = [{"primary_studio": s} for s in ["b", "a", "c", "a", "b", "c"]]
    assert list(profile_of(rows)["primary_studio"]["share"]) == ["a", "b", "c"]


def test_empty_library_has_no_profile() -> None:
    with pytest.raises(ValueError):
        profile_of([])


def test_top_genres_only_when_published() -> None:
    rows = [{"genres": ["Drama"]} for _ in range(5)]
    assert top_genres(profile_of(rows)) == [("Drama", 1.0)]
    assert top_genres(profile_of(rows[:4])) == []


def test_the_profile_does_not_depend_on_the_order_items_are_read() -> None:
    """The reader has no ORDER BY: the same inventory read in another order is the same
    profile, even where a mean falls on a rounding boundary (32 ratings of one decimal
    average to five decimals ending in 5, and float summation order moves the last bit)."""
    rng = random.Random(7)
    for _ in range(200):
        rows = [(None, None, rng.randint(0, 100) / 10, ["Drama"], "A24", "en") for _ in range(32)]
        profiles = set()
        for _ in range(10):
            rng.shuffle(rows)
            profile = generate_profile(COLUMNS, tuple(rows))
            profiles.add(json.dumps(profile, sort_keys=True))
        assert len(profiles) == 1
