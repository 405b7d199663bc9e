"""The corroboration rules and the parsing of their evidence, without a network: title
normalization, the year window, candidates, external ids and `/3/find` bodies."""

from __future__ import annotations

import json
import uuid
from datetime import date

import pytest

from inventory_pipeline.provider.models import Candidate, Observation
from inventory_pipeline.provider.parsing import (
    InvalidResponse,
    external_id_valid,
    parse_body,
    parse_find_body,
)
from inventory_pipeline.revalidation.corroboration import (
    candidates_of,
    corroborate,
    normalize_title,
    title_matches,
    year_matches,
)
from inventory_pipeline.revalidation.models import Checks, RevalidationClaim


@pytest.mark.parametrize(
    ("source", "candidate"),
    [
        ("The Matrix", "Matrix"),
        ("AMÉLIE", "amelie"),
        ("Le Fabuleux Destin d'Amélie Poulain", "fabuleux destin d\u2019amelie poulain"),
        ("L'Avventura", "Avventura"),
        ("Schindler's List", "Schindlers List"),
        ("Fast & Furious", "Fast and Furious"),
        ("Mission: Impossible", "Mission Impossible"),
        ("Se7en", "se7en"),
        ("  Heat  ", "Heat."),
        ("Das Boot", "Boot"),
        ("千と千尋の神隠し", "千と千尋の神隠し"),
    ],
)
def test_normalization_matches_what_differs_only_in_form(source: str, candidate: str) -> None:
    assert normalize_title(source) == normalize_title(candidate)
    assert title_matches(source, "Something else", candidate)


@pytest.mark.parametrize(
    ("source", "candidate"),
    [
        ("Heat", "Heat Wave"),
        ("The Thing", "Thing 2"),
        ("Alien", "Aliens"),
        ("The", "A"),  # a title that is only an article keeps it
        ("!!!", "???"),  # nothing left to compare matches nothing
    ],
)
def test_normalization_keeps_real_differences(source: str, candidate: str) -> None:
    assert not title_matches(source, candidate)


def test_a_missing_title_matches_nothing() -> None:
    assert not title_matches("Heat", None, None)


@pytest.mark.parametrize(
    ("year", "released", "matches"),
    [
        (1995, date(1995, 12, 15), True),
        (1995, date(1996, 1, 5), True),
        (1995, date(1994, 1, 5), True),
        (1995, date(1997, 1, 1), False),
        (None, date(1995, 1, 1), False),
        (1995, None, False),
    ],
)
def test_the_year_is_the_items_give_or_take_one(
    year: int | None, released: date | None, matches: bool
) -> None:
    assert year_matches(year, released) is matches


def claim(
    kind: str = "movie", imdb: str | None = "tt0113277", tvdb: int | None = None
) -> RevalidationClaim:
    return RevalidationClaim(
        case_id=uuid.uuid4(),
        item_id=1,
        source_generation=1,
        lease_token=uuid.uuid4(),
        provider_kind=kind,  # type: ignore[arg-type]
        source_title="Heat",
        source_year=1995,
        old_tmdb_id=949,
        imdb_id=imdb,
        tvdb_id=tvdb,
        faults=0,
    )


def details(tmdb_id: int = 950, imdb: str | None = "tt0113277", year: int = 1995) -> Observation:
    return Observation(
        tmdb_id, "movie", "Heat", (), None, None, None, (), date(year, 12, 15), None, None, imdb
    )


def candidate(tmdb_id: int, kind: str = "movie") -> Candidate:
    return Candidate(tmdb_id, kind, "Heat", None, None)  # type: ignore[arg-type]


def test_candidates_are_of_the_kind_with_another_id() -> None:
    found = (candidate(949), candidate(950), candidate(951, "tv"))
    assert candidates_of("movie", 949, found) == (candidate(950),)


def test_each_rule_is_recorded_and_the_first_failure_is_the_reason() -> None:
    assert corroborate(claim(), (), None) == Checks(candidates=0)
    assert corroborate(claim(), (), None).reason == "no_candidate"
    two = corroborate(claim(), (candidate(950), candidate(951)), None)
    assert (two.reason, two.round_trip) == ("ambiguous", None)
    gone = corroborate(claim(), (candidate(950),), None)
    assert (gone.reason, gone.round_trip, gone.title_match) == ("round_trip", False, None)
    other = corroborate(claim(), (candidate(950),), details(imdb="tt0000001", year=1990))
    assert (other.round_trip, other.title_match, other.year_match) == (False, True, False)
    assert other.reason == "round_trip"
    good = corroborate(claim(), (candidate(950),), details())
    assert good.corroborated and good.reason is None and good.candidate_year == 1995


def test_a_show_is_looked_up_by_its_tvdb_id_else_its_imdb_id() -> None:
    assert claim("tv", "tt5000001399", 77).external == ("tvdb_id", "77")
    assert claim("tv", "tt5000001399", None).external == ("imdb_id", "tt5000001399")
    assert claim("movie", "tt0113277", 77).external == ("imdb_id", "tt0113277")
    with pytest.raises(ValueError):
        _ = claim("movie", None, None).external


def test_external_ids_are_kept_only_when_well_formed() -> None:
    body = {"id": 949, "title": "Heat", "imdb_id": "tt0113277"}
    assert parse_body(json.dumps(body).encode(), "movie", 949).imdb_id == "tt0113277"
    for bad in ("", None, "nm0000199", "tt12", "tt01132770000000", 113277, " tt0113277"):
        odd = parse_body(json.dumps({**body, "imdb_id": bad}).encode(), "movie", 949)
        assert odd.imdb_id is None  # no evidence, never a failed observation
    show = {
        "id": 1399,
        "name": "Mad Men",
        "external_ids": {"imdb_id": "tt0804503", "tvdb_id": 80337},
    }
    parsed = parse_body(json.dumps(show).encode(), "tv", 1399)
    assert (parsed.imdb_id, parsed.tvdb_id) == ("tt0804503", 80337)
    for bad_tvdb in (0, -1, 2**31, True, "80337"):
        show["external_ids"] = {"tvdb_id": bad_tvdb}
        assert parse_body(json.dumps(show).encode(), "tv", 1399).tvdb_id is None
    assert external_id_valid("imdb_id", "tt0113277")
    assert not external_id_valid("imdb_id", "tt0113277/../../3/configuration")
    assert not external_id_valid("tvdb_id", "2147483648")
    assert not external_id_valid("tvdb_id", "٦٠٣")


def test_find_bodies() -> None:
    body = {
        "movie_results": [
            {"id": 950, "title": "Heat", "original_title": "Heat", "release_date": "1995-12-15"}
        ],
        "tv_results": [{"id": 7, "name": "Heat", "first_air_date": "not a date"}],
        "person_results": [{"id": 1}],
    }
    answer = parse_find_body(json.dumps(body).encode())
    assert [(c.kind, c.tmdb_id) for c in answer.candidates] == [("movie", 950), ("tv", 7)]
    assert answer.of_kind("tv")[0].release_date is None  # a bad date is no date
    assert answer.of_kind("movie")[0].release_date == date(1995, 12, 15)
    for bad in (
        b"[]",
        b"not json",
        json.dumps({"movie_results": []}).encode(),
        json.dumps({"movie_results": [{"title": "no id"}], "tv_results": []}).encode(),
        json.dumps({"movie_results": [{"id": 0}], "tv_results": []}).encode(),
        json.dumps({"movie_results": ["x"], "tv_results": []}).encode(),
    ):
        with pytest.raises(InvalidResponse):
            parse_find_body(bad)
