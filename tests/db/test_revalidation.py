"""Revalidation of unresolved 404s on real PostgreSQL and real loopback HTTP: evidence,
eligibility, each corroboration rule failing alone, faults, the hourly budget, and the
operator's gate (nothing applied without approval; an approval observed under the new
id resolves the case as replaced)."""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from inventory_pipeline.db import Connection, DatabaseError, execute, fetch_all, fetch_one
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.profiles.models import RefreshPolicy
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.recovery.models import Replacement
from inventory_pipeline.revalidation import repository, service
from inventory_pipeline.revalidation.models import ProposalRefused
from tests import factories as f
from tests import revalidation_cases as rc
from tests.conftest import TMDB_TEST_KEY
from tests.provider.test_faults import FAULTS as OBSERVATION_FAULTS
from tests.roles import acting_as, writer_role


@pytest.fixture
def movies(conn: Connection) -> int:
    f.provider_key(conn, TMDB_TEST_KEY)
    return f.library(conn)


@pytest.fixture
def shows(conn: Connection) -> int:
    f.provider_key(conn, TMDB_TEST_KEY)
    return f.library(conn, name="Shows", media_kind="tv")


def test_every_observation_keeps_the_external_ids_and_nothing_else(
    conn: Connection, movies: int, shows: int, client: TmdbClient, standin: StandIn
) -> None:
    movie = rc.item(conn, movies, 603)
    show = rc.item(conn, shows, 1399, kind="tv")
    rc.observe(conn, client)
    rows = {
        r["item_id"]: r
        for r in fetch_all(conn, "SELECT item_id, imdb_id, tvdb_id FROM provider_observations")
    }
    assert (rows[movie]["imdb_id"], rows[movie]["tvdb_id"]) == ("tt0000603", None)
    assert (rows[show]["imdb_id"], rows[show]["tvdb_id"]) == ("tt5000001399", 900001399)
    # A show's external ids come appended to its one details request.
    assert sorted(rc.requested(standin)) == ["/3/movie/603", "/3/tv/1399"]
    columns = {
        r["column_name"]
        for r in fetch_all(
            conn,
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_name = 'provider_observations'",
        )
    }
    assert not {"facebook_id", "instagram_id", "external_ids", "body"} & columns


def test_a_corroborated_merge_is_proposed_and_nothing_is_applied_before_approval(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    item = rc.merged(conn, client, standin, movies, 603, 9603, title="Heat", year=1995)
    profiles.refresh(conn, RefreshPolicy())
    identity = f.profile(conn, movies)["profile"]["identity"]  # type: ignore[index]
    [result] = rc.revalidate(conn, client).results
    assert result.outcome == "proposed" and result.checks is not None
    assert result.checks.corroborated
    notice = service.notice(result)
    assert notice is not None and "replacement proposed" in notice[1]
    [proposal] = rc.proposals(conn, item)
    assert (
        proposal["state"] == "proposed"
        and proposal["case_id"] == rc.case(conn, item)["recovery_case_id"]
    )
    assert (proposal["old_tmdb_id"], proposal["candidate_tmdb_id"]) == (603, 9603)
    assert (proposal["external_source"], proposal["external_id"]) == ("imdb_id", "tt0000603")
    assert (proposal["source_title"], proposal["candidate_title"]) == ("Heat", "Heat")
    assert (proposal["source_year"], proposal["candidate_year"]) == (1995, 1995)
    checked = rc.revalidation(conn, item)
    assert checked is not None and checked["outcome"] == "proposed"
    assert all(checked[k] for k in ("single_candidate", "round_trip", "title_match", "year_match"))
    assert checked["checked_at"] is not None

    # Proposed is not applied: the next observation still asks for the old id.
    start = len(rc.requested(standin))
    rc.make_due(conn, item)
    [again] = rc.observe(conn, client)
    assert (again.outcome, again.category) == ("failed", "not_found")
    assert rc.requested(standin, start) == ["/3/movie/603"]
    assert service.replacements(conn) == []
    # Nor is a case re-checked while its proposal stands.
    assert service.due_revalidations(conn) == 0

    items_before = fetch_all(conn, "SELECT * FROM media_server_items ORDER BY id")
    [decided] = service.decide(conn, approve=[proposal["id"]], decided_by="alice")
    assert (decided.state, decided.candidate_tmdb_id) == ("approved", 9603)
    # Approval writes the proposal only: the items table is exactly as it was.
    assert fetch_all(conn, "SELECT * FROM media_server_items ORDER BY id") == items_before

    # The first observation after approval comes at once, under the new id.
    assert recovery.due_items(conn) == 1
    start = len(rc.requested(standin))
    [replaced] = rc.observe(conn, client)
    assert rc.requested(standin, start) == ["/3/movie/9603"]
    assert replaced.outcome == "observed" and replaced.transition == "resolved"
    assert replaced.replacement is not None and replaced.replacement.tmdb_id == 9603
    assert "replaced by TMDb 9603" in (recovery.notice(replaced) or ("", ""))[1]
    row = rc.case(conn, item)
    assert row["recovery_resolved_at"] is not None and row["provider_id"] == "603"
    [approved] = rc.proposals(conn, item)
    assert approved["state"] == "approved" and approved["decided_by"] == "alice"
    assert approved["replaced_at"] is not None
    observed = fetch_one(
        conn, "SELECT tmdb_id FROM provider_observations WHERE item_id = %s", (item,)
    )
    assert observed == {"tmdb_id": 9603}
    [published] = service.replacements(conn)
    assert (published["item_id"], published["provider_id"]) == (item, "603")
    assert published["replacement_provider_id"] == "9603"
    assert published["approved_by"] == "alice" and published["observed_at"] is not None
    # The profile's identity trait still counts the item's own typed identity.
    profiles.refresh(conn, RefreshPolicy())
    assert f.profile(conn, movies)["profile"]["identity"] == identity  # type: ignore[index]

    # Later rechecks keep the replacement while the source is the same.
    rc.make_due(conn, item)
    start = len(rc.requested(standin))
    rc.observe(conn, client)
    assert rc.requested(standin, start) == ["/3/movie/9603"]
    # The syncing program adopts it: a source change drops the override and the row.
    execute(conn, "UPDATE media_server_items SET provider_id = '9603' WHERE id = %s", (item,))
    assert service.replacements(conn) == []
    assert service.proposals(conn, ("superseded",))[0].id == proposal["id"]
    start = len(rc.requested(standin))
    rc.observe(conn, client)
    assert rc.requested(standin, start) == ["/3/movie/9603"]
    assert rc.case(conn, item)["observed_at"] is not None


def test_a_show_is_looked_up_by_its_tvdb_id(
    conn: Connection, shows: int, client: TmdbClient, standin: StandIn
) -> None:
    item = rc.merged(conn, client, standin, shows, 1399, 1400, kind="tv", title="Mad Men")
    start = len(rc.requested(standin))
    [result] = rc.revalidate(conn, client).results
    assert result.outcome == "proposed"
    assert rc.requested(standin, start) == ["/3/find/900001399", "/3/tv/1400"]
    [proposal] = rc.proposals(conn, item)
    assert (proposal["external_source"], proposal["external_id"]) == ("tvdb_id", "900001399")


@pytest.mark.parametrize(
    ("merge", "reason", "passed"),
    [
        pytest.param({"unmerged": True}, "no_candidate", set(), id="no-candidate"),
        pytest.param({"also": (("movie", 7777),)}, "ambiguous", set(), id="ambiguous"),
        pytest.param(
            {"round_trip": False},
            "round_trip",
            {"single_candidate", "title_match", "year_match"},
            id="round-trip",
        ),
        pytest.param(
            {"title": "Heat Wave", "original_title": "Calor"},
            "title",
            {"single_candidate", "round_trip", "year_match"},
            id="title",
        ),
        pytest.param(
            {"year": 1997}, "year", {"single_candidate", "round_trip", "title_match"}, id="year"
        ),
        pytest.param(
            {"year": None, "item_year": None},
            "year",
            {"single_candidate", "round_trip", "title_match"},
            id="no-year",
        ),
        pytest.param({"find": (("tv", 7777),)}, "no_candidate", set(), id="other-kind-only"),
        pytest.param({"find": (("movie", 603),)}, "no_candidate", set(), id="same-id-only"),
    ],
)
def test_each_rule_failing_alone_proposes_nothing(
    conn: Connection,
    movies: int,
    client: TmdbClient,
    standin: StandIn,
    merge: dict[str, object],
    reason: str,
    passed: set[str],
) -> None:
    """Every other rule holds; this one alone fails, and no proposal appears."""
    item_year = merge.pop("item_year", 1995)
    item = rc.item(conn, movies, 603, title="Heat", year=item_year)  # type: ignore[arg-type]
    rc.observe(conn, client)
    found = merge.pop("find", None)
    if merge.pop("unmerged", False) or found is not None:
        standin.set_available("movie", 603, False)  # gone, no merge
        if found is not None:
            standin.set_find("imdb_id", "tt0000603", found)  # type: ignore[arg-type]
    else:
        merge.setdefault("title", "Heat")
        merge.setdefault("year", 1995)
        standin.merge("movie", 603, 9603, **merge)  # type: ignore[arg-type]
    rc.fail_twice(conn, client, item)
    [result] = rc.revalidate(conn, client).results
    assert result.outcome == "no_proposal"
    assert result.checks is not None and result.checks.reason == reason
    assert rc.proposals(conn) == []
    record = rc.revalidation(conn, item)
    assert record is not None and (record["outcome"], record["reason"]) == ("no_proposal", reason)
    rules = ("single_candidate", "round_trip", "title_match", "year_match")
    assert {r for r in rules if record[r]} == passed
    notice = service.notice(result)
    assert notice is not None and f"({reason};" in notice[1] and "keeps its backoff" in notice[1]
    # The case keeps its ordinary backoff, and an operator sees why.
    assert rc.case(conn, item)["observation_due_at"] > datetime.now(UTC) + timedelta(hours=23)
    [unproposed] = service.overview(conn).unproposed
    assert (unproposed.item_id, unproposed.reason) == (item, reason)
    # Never a tight loop: nothing is due until the case's next failure queues it again.
    assert service.due_revalidations(conn) == 0
    assert rc.revalidate(conn, client).results == ()
    rc.make_due(conn, item)
    rc.observe(conn, client)
    assert service.due_revalidations(conn) == 1


def test_a_candidate_of_the_other_kind_beside_the_one_is_no_ambiguity(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    rc.merged(conn, client, standin, movies, 603, 9603, survivor={"also": (("tv", 55),)})
    [result] = rc.revalidate(conn, client).results
    assert result.outcome == "proposed"


def test_an_original_title_and_a_year_one_off_corroborate(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    """Normalization: case, accents, punctuation and a leading article; the original
    title counts as much as the title; the year may be one off."""
    rc.merged(
        conn,
        client,
        standin,
        movies,
        603,
        9603,
        title="Le Fabuleux Destin d'Amélie Poulain!",
        year=2001,
        survivor={
            "title": "Amelie",
            "original_title": "fabuleux destin d\u2019amelie poulain",
            "year": 2002,
        },
    )
    [result] = rc.revalidate(conn, client).results
    assert result.outcome == "proposed", result


@pytest.mark.parametrize(
    "setup",
    ["never_observed", "one_failure", "transient", "no_external_id", "other_kind_library"],
)
def test_only_eligible_cases_are_revalidated(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn, setup: str
) -> None:
    """Open not_found cases of two or more failures, with external ids of a successful
    observation of the same source, in a library of their kind; nothing else."""
    item = rc.item(conn, movies, 603)
    if setup == "never_observed":
        standin.set_available("movie", 603, False)
        rc.observe(conn, client)
        rc.fail_twice(conn, client, item)
    else:
        if setup == "no_external_id":
            standin.set_fault("body", ids=[603])
            standin.state.fault.body = (  # type: ignore[union-attr]
                '{"id": 603, "title": "Heat", "imdb_id": ""}'
            )
        rc.observe(conn, client)
        standin.clear_fault()
        standin.merge("movie", 603, 9603, title="Heat", year=1995)
        if setup == "transient":
            standin.set_fault("status", status=503)
        rc.make_due(conn, item)
        rc.observe(conn, client)
        if setup != "one_failure":
            rc.make_due(conn, item)
            rc.observe(conn, client)
        if setup == "other_kind_library":
            execute(conn, "UPDATE libraries SET media_kind = 'tv' WHERE id = %s", (movies,))
    standin.clear_fault()
    assert service.due_revalidations(conn) == 0
    start = len(rc.requested(standin))
    assert rc.revalidate(conn, client).results == ()
    assert rc.requested(standin, start) == []
    assert rc.proposals(conn) == []


# Every fault the observation suite throws, and a 200 without the fields a lookup needs.
FAULTS = [*OBSERVATION_FAULTS, ("missing", {}, "invalid_response")]


# On the candidate's details (the observation's own request, whose faults the observation
# suite covers), a fault of each kind and the 404 that is evidence.
DETAILS_FAULTS = [f for f in FAULTS if f[0] in ("status", "throttle", "garbage", "slow")]


@pytest.mark.parametrize(
    ("step", "fault", "options", "category"),
    [("find", *f) for f in FAULTS] + [("details", *f) for f in DETAILS_FAULTS],
)
def test_each_fault_is_one_request_and_one_bounded_retry(
    conn: Connection,
    movies: int,
    client: TmdbClient,
    standin: StandIn,
    caplog: pytest.LogCaptureFixture,
    fault: str,
    options: dict[str, object],
    category: str,
    step: str,
) -> None:
    """The observation suite's faults, on the lookup or on the candidate's details: a
    fault (never a proposal, never a no-proposal), the request sent once, the retry
    after the retry policy's delay, the key in no text."""
    caplog.set_level(logging.DEBUG)
    item = rc.merged(conn, client, standin, movies, 603, 9603)
    # Aimed at the lookup (by the merged record's id) or at the candidate's details.
    standin.set_fault(fault, ids=[603 if step == "find" else 9603], **options)
    start = len(rc.requested(standin))
    [result] = rc.revalidate(conn, client).results
    standin.clear_fault()
    asked = rc.requested(standin, start)
    expected = ["/3/find/tt0000603"] + (["/3/movie/9603"] if step == "details" else [])
    if (step, category) == ("details", "not_found"):
        # A candidate whose details are gone is evidence: its round trip is broken.
        assert result.outcome == "no_proposal" and result.checks is not None
        assert result.checks.reason == "round_trip"
    else:
        assert (result.outcome, result.category) == ("fault", category), result
        record = rc.revalidation(conn, item)
        assert record is not None and record["outcome"] is None
        assert (record["faults"], record["last_fault"]) == (1, category)
        wait = (record["due_at"] - datetime.now(UTC)).total_seconds()
        assert rc.POLICY.base(category) - 5 <= wait <= rc.POLICY.cap_seconds  # type: ignore[arg-type]
        if options.get("retry_after") == "7200":
            assert wait >= 7200 - 5  # a valid Retry-After only lengthens the delay
        if category == "throttled":
            assert recovery.admission_paused_seconds(conn) > 0
    assert asked == expected
    assert rc.proposals(conn) == []
    assert service.due_revalidations(conn) == 0  # no retry loop
    message = service.notice(result)
    assert message is not None and TMDB_TEST_KEY not in message[1]
    assert TMDB_TEST_KEY not in caplog.text
    assert f.tables_containing(conn, TMDB_TEST_KEY) == []


def test_a_throttled_lookup_pauses_admission_and_gives_the_rest_back(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    items = [rc.merged(conn, client, standin, movies, 600 + n, 9600 + n) for n in range(3)]
    standin.set_fault("throttle", retry_after="30")
    start = len(rc.requested(standin))
    summary = rc.revalidate(conn, client)
    # The first lookup is throttled; the claims after it are never sent.
    assert [r.outcome for r in summary.results][:1] == ["fault"]
    assert set(r.outcome for r in summary.results[1:]) <= {"deferred"}
    assert len(rc.requested(standin, start)) == 1
    assert recovery.admission_paused_seconds(conn) > 25
    deferred = [r.item_id for r in summary.results if r.outcome == "deferred"]
    for item in deferred:
        record = rc.revalidation(conn, item)
        assert record is not None and record["faults"] == 0 and record["lease_token"] is None
    assert len(items) == 3


def test_the_hourly_budget_bounds_every_claimer_together(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    for n in range(5):
        rc.merged(conn, client, standin, movies, 600 + n, 9600 + n)
    assert service.due_revalidations(conn) == 5
    assert service.budget_left(conn, 2) == 2
    assert len(rc.revalidate(conn, client, per_hour=2).results) == 2
    assert service.budget_left(conn, 2) == 0
    assert rc.revalidate(conn, client, per_hour=2).results == ()
    assert service.claim(conn, 4, per_hour=2) == ([], 0)
    # A larger setting leaves room at once; an hour later the old claims no longer count.
    assert service.budget_left(conn, 3) == 1
    execute(
        conn,
        "UPDATE revalidation_budget SET recent_claims ="
        " ARRAY(SELECT t - interval '61 minutes' FROM unnest(recent_claims) t)",
    )
    assert service.budget_left(conn, 2) == 2
    assert len(rc.revalidate(conn, client, per_hour=60).results) == 3
    assert len(rc.proposals(conn)) == 5


def test_decisions_are_all_or_nothing_with_one_clear_refusal(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    first = rc.merged(conn, client, standin, movies, 601, 9601)
    second = rc.merged(conn, client, standin, movies, 602, 9602)
    rc.revalidate(conn, client)
    one, two = (rc.proposals(conn, i)[0]["id"] for i in (first, second))
    before = rc.proposals(conn)
    refusals: list[tuple[dict[str, object], str]] = [
        ({"approve": [one, 999999]}, "proposal 999999 does not exist"),
        ({"approve": [one], "reject": [one]}, f"proposal {one} is named twice"),
        ({}, "name at least one proposal"),
        ({"approve": [0]}, "positive whole numbers"),
        ({"approve": [one], "decided_by": " "}, "operator's name"),
        ({"approve": [one], "decided_by": "x" * 65}, "operator's name"),
        ({"approve": [one], "decided_by": "bob\x1b[2J"}, "operator's name"),
    ]
    for kwargs, message in refusals:
        kwargs.setdefault("decided_by", "alice")
        with pytest.raises(ProposalRefused, match=message.replace("(", r"\(")) as refused:
            service.decide(conn, **kwargs)  # type: ignore[arg-type]
        assert "\n" not in str(refused.value)
        assert rc.proposals(conn) == before
    service.decide(conn, approve=[one], reject=[two], decided_by="alice")
    states = {p["item_id"]: p["state"] for p in rc.proposals(conn)}
    assert states == {first: "approved", second: "rejected"}
    with pytest.raises(ProposalRefused, match=f"proposal {one} is already approved"):
        service.decide(conn, reject=[one], decided_by="alice")
    with pytest.raises(ProposalRefused, match=f"proposal {two} is already rejected"):
        service.decide(conn, approve=[two], decided_by="alice")
    # A rejected case keeps its id: the next observation asks for the old one.
    start = len(rc.requested(standin))
    rc.make_due(conn, second)
    rc.observe(conn, client)
    assert "/3/movie/602" in rc.requested(standin, start)
    assert "/3/movie/9602" not in rc.requested(standin, start)
    # And it is not proposed again for the same case.
    assert service.due_revalidations(conn) == 0


def test_a_case_ending_before_a_decision_supersedes_its_proposal(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    """TMDb restores the old id before anyone decided: the case resolves by itself and
    its proposal can no longer be approved."""
    item = rc.merged(conn, client, standin, movies, 603, 9603)
    rc.revalidate(conn, client)
    [proposal] = rc.proposals(conn, item)
    standin.clear_merges()
    rc.make_due(conn, item)
    [back] = rc.observe(conn, client)
    assert back.transition == "resolved" and back.replacement is None
    with pytest.raises(ProposalRefused, match="superseded"):
        service.decide(conn, approve=[proposal["id"]], decided_by="alice")
    assert service.sweep(conn)[0] == 1
    [stored] = rc.proposals(conn, item)
    assert stored["state"] == "superseded" and stored["superseded_at"] is not None


def test_records_of_ended_cases_are_forgotten(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    moved = rc.merged(conn, client, standin, movies, 601, 9601)
    deleted = rc.merged(conn, client, standin, movies, 602, 9602)
    execute(conn, "UPDATE media_server_items SET title = 'Heat 2' WHERE id = %s", (moved,))
    execute(conn, "DELETE FROM media_server_items WHERE id = %s", (deleted,))
    assert service.due_revalidations(conn) == 0
    # The deleted item's record went with it; the moved one is walked and forgotten.
    claims, walked = service.claim(conn, 10, per_hour=60)
    assert (claims, walked) == ([], 1)  # no budget spent
    assert fetch_all(conn, "SELECT * FROM identity_revalidations") == []
    assert service.budget_left(conn, 60) == 60


@pytest.mark.parametrize("removal", ["delete", "truncate", "library", "rekey"])
def test_a_deleted_items_replacement_never_reaches_an_item_reusing_its_id(
    conn: Connection,
    db_url: str,
    movies: int,
    client: TmdbClient,
    standin: StandIn,
    removal: str,
) -> None:
    """Another program deletes an item with an approved, observed replacement (a row,
    a TRUNCATE, its library) and inserts another film under the same id, at the same
    source generation: the new item is observed under its own TMDb id, nothing is
    published for it, and the old proposal stands superseded."""
    other = f.library(conn, name="Films")
    item = rc.merged(conn, client, standin, movies, 603, 9603)
    rejected = rc.merged(conn, client, standin, movies, 604, 9604)
    results = rc.revalidate(conn, client).results
    approve, reject = (r.proposal_id for r in sorted(results, key=lambda r: r.item_id))
    assert approve is not None and reject is not None
    service.decide(conn, approve=[approve], reject=[reject], decided_by="alice")
    rc.observe(conn, client)
    assert [r["item_id"] for r in service.replacements(conn)] == [item]
    generation = rc.case(conn, item)["source_generation"]
    rights = "SELECT, INSERT, UPDATE, DELETE, TRUNCATE"
    with writer_role(db_url, items=rights, libraries="SELECT, DELETE") as role:
        with acting_as(conn, role):
            if removal == "delete":
                gone = [item, rejected]
                execute(conn, "DELETE FROM media_server_items WHERE id = ANY (%s)", (gone,))
            elif removal == "truncate":
                execute(conn, "TRUNCATE media_server_items")
            elif removal == "rekey":  # both rows under new ids: a delete and an insert
                execute(
                    conn,
                    "UPDATE media_server_items SET id = id + 100000 WHERE id = ANY (%s)",
                    ([item, rejected],),
                )
            else:
                execute(conn, "DELETE FROM libraries WHERE id = %s", (movies,))
            for reused, tmdb_id in ((item, 348), (rejected, 349)):
                execute(
                    conn,
                    "INSERT INTO media_server_items (id, library_id, title, year, provider,"
                    " provider_kind, provider_id)"
                    " VALUES (%s, %s, 'Alien', 1979, 'tmdb', 'movie', %s)",
                    (reused, other, str(tmdb_id)),
                )
    assert rc.case(conn, item)["source_generation"] == generation  # the old (id, generation)
    assert service.replacements(conn) == []
    assert service.proposals(conn, ("proposed", "approved", "rejected")) == []
    assert {p["state"] for p in rc.proposals(conn)} == {"superseded"}
    assert fetch_all(conn, "SELECT * FROM identity_revalidations") == []
    start = len(rc.requested(standin))
    rc.observe(conn, client)
    # Re-keyed rows are new items too: observed under their own ids, not the replacement.
    kept = ["/3/movie/603", "/3/movie/604"] if removal == "rekey" else []
    assert sorted(rc.requested(standin, start)) == ["/3/movie/348", "/3/movie/349", *kept]


def test_a_case_set_aside_after_a_fault_is_queued_again_by_its_next_failure(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    """A check faults; when its wait is over the case is not eligible (its library is
    off) and the record is set aside with the fault on it. The case's next not_found
    failure, the library on again, queues it again and the check proposes."""
    item = rc.merged(conn, client, standin, movies, 603, 9603)
    standin.set_fault("status", ids=[603], status=503)
    [faulted] = rc.revalidate(conn, client).results
    standin.clear_fault()
    assert (faulted.outcome, faulted.category) == ("fault", "transient")
    execute(conn, "UPDATE libraries SET active = false WHERE id = %s", (movies,))
    # The test clock: the fault's wait is over.
    execute(conn, "UPDATE identity_revalidations SET due_at = now() WHERE item_id = %s", (item,))
    assert rc.revalidate(conn, client).results == ()
    record = rc.revalidation(conn, item)
    assert record is not None and record["due_at"] is None and record["faults"] == 1
    execute(conn, "UPDATE libraries SET active = true WHERE id = %s", (movies,))
    rc.make_due(conn, item)
    [failed] = rc.observe(conn, client)
    assert (failed.outcome, failed.category) == ("failed", "not_found")
    assert service.due_revalidations(conn) == 1
    [again] = rc.revalidate(conn, client).results
    assert again.outcome == "proposed"


def test_the_claim_walks_the_due_index_and_costs_the_same_per_case(conn: Connection) -> None:
    """The claim reads the due index in its order and stops after its batch: with
    thousands of records set aside (no due time) and few due, no sort and no
    scan of the waiting ones."""
    library = f.library(conn)
    execute(
        conn,
        "INSERT INTO identity_revalidations (case_id, item_id, source_generation, due_at)"
        " SELECT gen_random_uuid(), g, 1, CASE WHEN g % 100 = 0 THEN now() - interval '1 hour'"
        "   END FROM generate_series(1, 20000) g",
    )
    execute(conn, "ANALYZE identity_revalidations")
    assert library
    with conn.transaction(force_rollback=True):
        plan = "\n".join(
            r["QUERY PLAN"]
            for r in fetch_all(
                conn,
                "EXPLAIN " + repository.QUERIES["claim_revalidations"],
                {"limit": 4, "lease_seconds": 300},
            )
        )
    assert "Index Scan using identity_revalidations_due" in plan, plan
    assert "Seq Scan on identity_revalidations" not in plan, plan


def test_an_observation_under_an_id_no_approval_names_is_never_saved(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    """The completion itself enforces the gate: a claim that carried a replacement no
    approved proposal of the item's source names (a proposal awaiting a decision, a
    rejected one, or none) stores nothing and resolves nothing."""
    item = rc.merged(conn, client, standin, movies, 603, 9603)
    [result] = rc.revalidate(conn, client).results
    assert result.proposal_id is not None
    for proposal_id in (result.proposal_id, 424242):
        rc.make_due(conn, item)
        [claim] = recovery.claim(conn, 1)
        assert claim.replacement is None  # awaiting a decision: the claim asks for 603
        forged = replace(claim, replacement=Replacement(proposal_id, 9603))
        fetched = recovery.fetch(conn, forged, client, recovery.provider_settings(conn))
        assert getattr(fetched, "tmdb_id", None) == 9603  # TMDb answered for the candidate
        assert recovery.complete(conn, forged, fetched, rc.POLICY).outcome == "lost"
        assert fetch_one(conn, "SELECT 1 FROM provider_observations WHERE tmdb_id = 9603") is None
        assert rc.case(conn, item)["recovery_resolved_at"] is None
        execute(
            conn,
            "UPDATE media_server_items SET observation_lease_token = NULL,"
            " observation_lease_expires_at = NULL WHERE id = %s",
            (item,),
        )


def test_the_demo_shows_three_proposals_and_two_cases_without_one(conn: Connection) -> None:
    """`dev --demo`: the first observation run and revalidation run propose the three
    corroborated merges and record why the ambiguous lookup and the survivor of another
    year proposed nothing."""
    from inventory_pipeline.cli import DEMO_KEY
    from inventory_pipeline.demo import DEMO_MERGES, apply_merges, load_demo

    load_demo(conn)
    f.provider_key(conn, DEMO_KEY)
    with StandIn(api_key=DEMO_KEY, missing_every=17) as standin, TmdbClient(standin.url) as demo:
        apply_merges(standin)
        execute(
            conn,
            "UPDATE media_server_items SET observation_due_at = now() + interval '1 day'"
            " WHERE recovery_case_id IS NULL",
        )  # only the demo's merged items are due
        rc.observe(conn, demo)
        assert service.due_revalidations(conn) == len(DEMO_MERGES)
        summary = rc.revalidate(conn, demo)
    assert summary.count("proposed") == 3 and summary.reasons == {"ambiguous": 1, "year": 1}
    view = service.overview(conn)
    assert sorted(p.source_title for p in view.live) == ["Heat", "Mad Men", "The Matrix"]
    assert {p.library for p in view.live} == {"Films", "Series"}


def test_the_demo_shows_real_ages_in_two_partitions(conn: Connection) -> None:
    """Its merged items' history happened at the load, not a made-up day before (the UI
    showed "oldest not_found 1,440 min" two minutes after a fresh start); its libraries
    fill more than one profile partition (ranges of ten ids)."""
    from inventory_pipeline.demo import DEMO_MERGES, load_demo

    before = fetch_one(conn, "SELECT clock_timestamp() AS at")
    assert before is not None
    load_demo(conn)
    [oldest] = fetch_all(
        conn,
        "SELECT count(*) AS cases, min(least(i.observed_at, i.last_attempt_at,"
        " i.recovery_first_failed_at, i.recovery_last_failed_at, o.observed_at)) AS at"
        " FROM media_server_items i JOIN provider_observations o ON o.item_id = i.id"
        " WHERE i.recovery_case_id IS NOT NULL",
    )
    assert oldest["cases"] == len(DEMO_MERGES)
    assert oldest["at"] >= before["at"]
    ranges = fetch_all(conn, "SELECT DISTINCT id / 10 AS low FROM libraries")
    assert len(ranges) >= 2


def test_the_syncing_program_adopts_a_replacement_with_its_own_rights(
    conn: Connection, db_url: str, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    """The program that owns the typed identity reads the published replacements with
    SELECT on the view alone, adopts one by writing the new id under its own table
    rights, and the row leaves the view: the proposal is superseded, the item observed
    under its own (new) id."""
    item = rc.merged(conn, client, standin, movies, 603, 9603)
    [result] = rc.revalidate(conn, client).results
    assert result.proposal_id is not None
    service.decide(conn, approve=[result.proposal_id], decided_by="alice")
    rc.observe(conn, client)
    with writer_role(db_url) as role:
        execute(conn, f"GRANT SELECT ON identity_replacements TO {role}")
        with acting_as(conn, role):
            [row] = fetch_all(conn, "SELECT * FROM identity_replacements")
            assert (row["item_id"], row["replacement_provider_id"]) == (item, "9603")
        with pytest.raises(DatabaseError, match="permission denied"), acting_as(conn, role):
            fetch_all(conn, "SELECT * FROM replacement_proposals")
        with acting_as(conn, role):
            execute(
                conn,
                "UPDATE media_server_items SET provider_id = %s WHERE id = %s",
                (row["replacement_provider_id"], row["item_id"]),
            )
            assert fetch_all(conn, "SELECT * FROM identity_replacements") == []
    assert service.proposals(conn, ("superseded",))[0].id == result.proposal_id
    start = len(rc.requested(standin))
    [adopted] = rc.observe(conn, client)
    assert adopted.outcome == "observed" and rc.requested(standin, start) == ["/3/movie/9603"]
