"""The harness's replacement checks each catch the divergence they exist for: a
corroborated merge left unproposed, a proposal no merge corroborates, an observation
under another id without approval, an approval never observed; and they stay quiet on
a run the product got right."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from chaos import replacements
from inventory_pipeline.db import Connection, execute
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.revalidation import service
from tests import factories as f
from tests import revalidation_cases as rc
from tests.conftest import TMDB_TEST_KEY


@pytest.fixture
def audited(conn: Connection) -> Connection:
    execute(conn, (Path(replacements.__file__).with_name("audit.sql")).read_text())
    f.provider_key(conn, TMDB_TEST_KEY)
    return conn


def merge_one(
    conn: Connection, standin: StandIn, variant: str, monkeypatch: pytest.MonkeyPatch
) -> str:
    monkeypatch.setattr(replacements, "MERGE_VARIANTS", ((variant, 1),))
    return replacements.merge(conn, standin, random.Random(1), set())


def test_each_check_catches_its_divergence(
    audited: Connection,
    client: TmdbClient,
    standin: StandIn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    conn = audited
    movies = f.library(conn)
    item = rc.item(conn, movies, 603, title="Heat", year=1995)
    rc.observe(conn, client)
    assert merge_one(conn, standin, "corroborated", monkeypatch) == "corroborated"
    # The merge made the item due: two observations find 404, the case is eligible.
    rc.observe(conn, client)
    rc.make_due(conn, item)
    rc.observe(conn, client)
    assert replacements.outstanding(conn)["corroborated merges not proposed"] == 1
    [unproposed] = replacements.checks(conn)
    assert unproposed.startswith(
        f"item {item}: corroborated merge into TMDb 101206 not proposed (no proposal;"
        " item: case not_found x2, due in "
    )
    assert "lease none; revalidation: due in " in unproposed
    assert unproposed.endswith(", outcome none, faults 0)")
    [result] = rc.revalidate(conn, client).results
    assert result.outcome == "proposed" and replacements.checks(conn) == []
    assert replacements.outstanding(conn)["proposals awaiting review"] == 1

    # A proposal no merge corroborates.
    other = rc.item(conn, movies, 777, title="Ronin", year=1998)
    execute(
        conn,
        "INSERT INTO replacement_proposals (item_id, case_id, source_generation, provider_kind,"
        " old_tmdb_id, candidate_tmdb_id, external_source, external_id, source_title,"
        " source_year, candidate_title, candidate_year, checked_at)"
        " VALUES (%s, gen_random_uuid(), 1, 'movie', 777, 778, 'imdb_id', 'tt0000777',"
        " 'Ronin', 1998, 'Ronin', 1998, now())",
        (other,),
    )
    [bogus] = replacements.checks(conn)
    assert "proposed without a corroborated merge" in bogus and "777 -> 778" in bogus
    execute(conn, "DELETE FROM replacement_proposals WHERE old_tmdb_id = 777")

    # An observation under another id without an approval naming it.
    rc.observe(conn, client)  # Ronin observed under its own id: no divergence
    execute(conn, "UPDATE provider_observations SET tmdb_id = 9 WHERE item_id = %s", (other,))
    [applied] = replacements.checks(conn)
    assert applied.startswith(f"item {other}: observed under TMDb 9 (its own id 777)")
    execute(conn, "DELETE FROM chaos_observation_writes WHERE item_id = %s", (other,))

    # An approval not yet observed, then observed: the case resolves as replaced.
    replacements.review(conn, random.Random(0), approve_share=1.0)
    assert replacements.checks(conn) == [
        f"proposal {result.proposal_id}: approved, item {item} not observed under TMDb 101206"
        " (observed 603)"
    ]
    assert replacements.outstanding(conn)["approved replacements not observed"] == 1
    rc.observe(conn, client)
    assert replacements.checks(conn) == []
    assert not any(replacements.outstanding(conn).values())
    summary = replacements.summary(conn)
    assert summary["merges"] == {"corroborated": 1} and summary["replaced"] == 1


@pytest.mark.parametrize("variant", ["round_trip", "ambiguous", "title", "year"])
def test_a_merge_that_must_not_be_proposed_is_not_expected(
    audited: Connection,
    client: TmdbClient,
    standin: StandIn,
    monkeypatch: pytest.MonkeyPatch,
    variant: str,
) -> None:
    conn = audited
    item = rc.item(conn, f.library(conn), 603, title="Heat", year=1995)
    rc.observe(conn, client)
    assert merge_one(conn, standin, variant, monkeypatch) == variant
    rc.observe(conn, client)
    rc.make_due(conn, item)
    rc.observe(conn, client)
    [result] = rc.revalidate(conn, client).results
    assert result.outcome == "no_proposal"
    assert replacements.checks(conn) == []
    assert not any(replacements.outstanding(conn).values())
    assert service.proposals(conn) == []


def test_records_merged_at_once_are_each_proposed_under_their_own_survivor(
    audited: Connection,
    client: TmdbClient,
    standin: StandIn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Movies 62 and 63 once both merged into 100063 (100062 is an id the stand-in does
    not know): the later merge replaced the earlier one's external ids at the survivor, so
    the first item's check found a broken round trip and was never proposed."""
    conn = audited
    movies = f.library(conn)
    first = rc.item(conn, movies, 62, title="Alien", year=1979)
    second = rc.item(conn, movies, 63, title="Aliens", year=1986)
    rc.observe(conn, client)
    monkeypatch.setattr(replacements, "MERGE_VARIANTS", (("corroborated", 1),))
    done: set[tuple[str, int]] = set()
    for _ in range(2):
        assert replacements.merge(conn, standin, random.Random(1), done) == "corroborated"
    assert done == {("movie", 62), ("movie", 63)}
    rc.observe(conn, client)
    rc.make_due(conn)
    rc.observe(conn, client)
    results = rc.revalidate(conn, client).results
    assert sorted(r.outcome for r in results) == ["proposed", "proposed"]
    assert replacements.checks(conn) == []
    assert {(p["item_id"], p["candidate_tmdb_id"]) for p in rc.proposals(conn)} == {
        (first, 100124),
        (second, 100126),
    }


def test_the_stand_in_refuses_a_second_record_into_one_survivor(standin: StandIn) -> None:
    standin.merge("movie", 62, 100063)
    standin.merge("movie", 62, 100063, year=1980)  # the same record again: its terms change
    with pytest.raises(ValueError, match="already carries merged record 62"):
        standin.merge("movie", 63, 100063)
    standin.merge("tv", 63, 100063)  # another kind's record of that id
    # Over HTTP, as a demo or another process merges: 409 with the reason, nothing changed.
    request = urllib.request.Request(
        f"{standin.url}/__standin/merge",
        data=json.dumps({"kind": "movie", "from": 64, "into": 100063}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 409
    assert "already carries merged record 62" in json.loads(refused.value.read())["error"]
    assert ("movie", 64) not in standin.state.merges
    # Record 62 merged again, into another survivor: 100063 is free for another record.
    standin.merge("movie", 62, 100065)
    standin.merge("movie", 63, 100063)
