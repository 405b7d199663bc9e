"""Races of revalidation and the operator's gate, stepped through explicitly with two
connections: a source change during a revalidation, an approval racing a source
change, two revalidators on one case. The source generation fence wins every time: no
proposal for a changed source, no approval of one, no observation under a replacement
of another source."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from inventory_pipeline.db import Connection, DatabaseError, connect, execute, fetch_all, fetch_one
from inventory_pipeline.provider.models import Failure
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.recovery.models import Deferred
from inventory_pipeline.recovery.policy import RetryPolicy
from inventory_pipeline.revalidation import service
from inventory_pipeline.revalidation.models import ProposalRefused
from tests import factories as f
from tests import revalidation_cases as rc
from tests.conftest import TMDB_TEST_KEY

RETITLE = "UPDATE media_server_items SET title = %s WHERE id = %s"


@pytest.fixture
def movies(conn: Connection) -> int:
    f.provider_key(conn, TMDB_TEST_KEY)
    return f.library(conn)


@pytest.fixture
def eligible(conn: Connection, movies: int, client: TmdbClient, standin: StandIn) -> int:
    """An item whose TMDb id 603 was merged into 9603: its case is due for revalidation."""
    return rc.merged(conn, client, standin, movies, 603, 9603, title="Heat", year=1995)


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run `call` in a thread; its result or exception lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def waiting_on_a_lock(conn: Connection, application_name: str) -> bool:
    row = fetch_one(
        conn,
        "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = %s"
        " AND wait_event_type = 'Lock'",
        (application_name,),
    )
    return row is not None and row["n"] > 0


def wait_until_blocked(conn: Connection, application_name: str) -> None:
    deadline = time.monotonic() + 10
    while not waiting_on_a_lock(conn, application_name):
        assert time.monotonic() < deadline, f"{application_name} never waited on a lock"
        time.sleep(0.02)


def no_observation_under(conn: Connection, tmdb_id: int) -> bool:
    return not fetch_all(conn, "SELECT 1 FROM provider_observations WHERE tmdb_id = %s", (tmdb_id,))


# -- a source change during revalidation ---------------------------------------------


@pytest.mark.parametrize("back", [False, True], ids=["changed", "changed-and-back"])
def test_a_source_change_during_revalidation_proposes_nothing(
    conn: Connection, db_url: str, eligible: int, client: TmdbClient, back: bool
) -> None:
    [claim], _ = service.claim(conn, 1, rc.PER_HOUR)
    checks = service.lookup(conn, claim, client, recovery.provider_settings(conn))
    with connect(db_url) as writer:  # the source changes while the answers are in flight
        execute(writer, RETITLE, ("Heat (1995)", eligible))
        if back:
            execute(writer, RETITLE, ("Heat", eligible))
    late = service.complete(conn, claim, checks, rc.POLICY)
    assert late.outcome == "lost"
    assert rc.proposals(conn) == []
    # The record of the ended case is forgotten with the lost check.
    assert fetch_all(conn, "SELECT * FROM identity_revalidations") == []
    assert service.claim(conn, 1, rc.PER_HOUR) == ([], 0)


def test_a_completion_waits_for_a_source_change_in_flight_then_loses(
    conn: Connection, db_url: str, eligible: int, client: TmdbClient
) -> None:
    [claim], _ = service.claim(conn, 1, rc.PER_HOUR)
    checks = service.lookup(conn, claim, client, recovery.provider_settings(conn))
    with connect(db_url, application_name="revalidating") as completer:
        with connect(db_url) as writer, writer.transaction():
            execute(writer, RETITLE, ("Heat 2", eligible))  # the item row stays locked
            thread, out = in_thread(lambda: service.complete(completer, claim, checks, rc.POLICY))
            wait_until_blocked(conn, "revalidating")
        thread.join(timeout=10)
    [late] = out
    assert late.outcome == "lost"
    assert rc.proposals(conn) == []


def test_a_source_change_waits_for_the_completion_then_supersedes_its_proposal(
    conn: Connection, db_url: str, eligible: int, client: TmdbClient
) -> None:
    [claim], _ = service.claim(conn, 1, rc.PER_HOUR)
    checks = service.lookup(conn, claim, client, recovery.provider_settings(conn))
    with connect(db_url) as completer, connect(db_url, application_name="writer") as writer:
        with completer.transaction():
            done = service.complete(completer, claim, checks, rc.POLICY)
            assert done.outcome == "proposed"
            thread, out = in_thread(lambda: execute(writer, RETITLE, ("Heat 2", eligible)))
            wait_until_blocked(conn, "writer")  # the completion's share lock holds it
        thread.join(timeout=10)
    assert out == [1]
    [proposal] = service.proposals(conn, ("superseded",))
    assert proposal.id == done.proposal_id
    with pytest.raises(ProposalRefused, match="superseded"):
        service.decide(conn, approve=[proposal.id], decided_by="alice")


# -- an approval racing a source change --------------------------------------------------


def proposal_of(conn: Connection, client: TmdbClient) -> int:
    [result] = rc.revalidate(conn, client).results
    assert result.outcome == "proposed" and result.proposal_id is not None
    return result.proposal_id


def test_a_source_change_before_the_approval_refuses_it(
    conn: Connection, db_url: str, eligible: int, client: TmdbClient, standin: StandIn
) -> None:
    proposal = proposal_of(conn, client)
    execute(conn, RETITLE, ("Heat 2", eligible))
    with pytest.raises(ProposalRefused, match=f"proposal {proposal} is superseded"):
        service.decide(conn, approve=[proposal], decided_by="alice")
    assert rc.proposals(conn)[0]["state"] == "proposed"  # stored; it stands superseded
    assert service.proposals(conn) == []
    assert recovery.due_items(conn) == 1  # due for its new source, not for a replacement
    start = len(rc.requested(standin))
    rc.observe(conn, client)
    assert rc.requested(standin, start) == ["/3/movie/603"]
    assert no_observation_under(conn, 9603)


def test_an_approval_waits_for_a_source_change_in_flight_and_is_refused(
    conn: Connection, db_url: str, eligible: int, client: TmdbClient
) -> None:
    proposal = proposal_of(conn, client)
    with connect(db_url, application_name="approving") as operator:
        with connect(db_url) as writer, writer.transaction():
            execute(writer, RETITLE, ("Heat 2", eligible))
            thread, out = in_thread(
                lambda: service.decide(operator, approve=[proposal], decided_by="alice")
            )
            time.sleep(0.5)
            assert thread.is_alive()  # retrying the item's lock until the writer commits
        thread.join(timeout=10)
    [refused] = out
    assert isinstance(refused, ProposalRefused) and "superseded" in str(refused)
    assert rc.proposals(conn)[0]["decided_at"] is None


def two_proposals(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> tuple[int, int, list[int]]:
    first = rc.merged(conn, client, standin, movies, 603, 9603, title="Heat", year=1995)
    second = rc.merged(conn, client, standin, movies, 604, 9604, title="Ronin", year=1998)
    ids = [r.proposal_id for r in rc.revalidate(conn, client).results]
    assert len(ids) == 2 and None not in ids
    return first, second, ids  # type: ignore[return-value]


def test_a_decision_never_deadlocks_a_program_writing_its_items_in_another_order(
    conn: Connection, db_url: str, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    """A program holds the later item and then writes the earlier one while a decision
    names both: the decision never holds one item waiting for the other, so the
    program's transaction commits (were there a deadlock, its short deadlock_timeout
    would make it the victim) and the decision, retrying, sees both sources changed."""
    first, second, ids = two_proposals(conn, movies, client, standin)
    with connect(db_url) as operator, connect(db_url) as writer:
        execute(writer, "SET deadlock_timeout = '10ms'")
        with writer.transaction():
            execute(writer, RETITLE, ("Ronin 2", second))
            thread, out = in_thread(
                lambda: service.decide(operator, approve=ids, decided_by="alice")
            )
            time.sleep(0.5)
            execute(writer, RETITLE, ("Heat 2", first))
        thread.join(timeout=10)
    [refused] = out
    assert isinstance(refused, ProposalRefused) and "superseded" in str(refused)
    titles = fetch_all(conn, "SELECT title FROM media_server_items ORDER BY id")
    assert [t["title"] for t in titles] == ["Heat 2", "Ronin 2"]
    assert all(p["decided_at"] is None for p in rc.proposals(conn))


def test_a_decision_refuses_in_one_line_while_a_writer_holds_an_item(
    conn: Connection, db_url: str, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    """A writer holding an item past the decision's wait: the decision is refused in
    one line, nothing is decided, the writer commits, and the next decision goes
    through."""
    _, second, ids = two_proposals(conn, movies, client, standin)
    with connect(db_url) as writer, writer.transaction():
        execute(writer, "SELECT 1 FROM media_server_items WHERE id = %s FOR UPDATE", (second,))
        with pytest.raises(ProposalRefused, match="another transaction is writing") as refused:
            service.decide(conn, approve=ids, decided_by="alice", lock_seconds=0.2)
        assert "\n" not in str(refused.value)
    assert all(p["decided_at"] is None for p in rc.proposals(conn))
    decided = service.decide(conn, approve=ids, decided_by="alice")
    assert {d.state for d in decided} == {"approved"}


def test_a_source_change_waiting_on_an_approval_drops_the_override(
    conn: Connection, db_url: str, eligible: int, client: TmdbClient, standin: StandIn
) -> None:
    proposal = proposal_of(conn, client)
    with connect(db_url) as operator, connect(db_url, application_name="writer") as writer:
        with operator.transaction():
            service.decide(operator, approve=[proposal], decided_by="alice")
            thread, out = in_thread(lambda: execute(writer, RETITLE, ("Heat 2", eligible)))
            wait_until_blocked(conn, "writer")  # the approval's share lock holds it
        thread.join(timeout=10)
    assert out == [1]
    [stands] = service.proposals(conn, ("superseded",))
    assert stands.id == proposal and stands.decided_by == "alice"
    # The approval was for the old source: its override is never used.
    start = len(rc.requested(standin))
    rc.observe(conn, client)
    assert rc.requested(standin, start) == ["/3/movie/603"]
    assert no_observation_under(conn, 9603)
    assert service.replacements(conn) == []
    assert service.sweep(conn)[0] == 1
    assert rc.proposals(conn)[0]["state"] == "superseded"


def test_a_source_change_after_the_replacement_claim_loses_its_observation(
    conn: Connection, db_url: str, eligible: int, client: TmdbClient
) -> None:
    proposal = proposal_of(conn, client)
    service.decide(conn, approve=[proposal], decided_by="alice")
    [claim] = recovery.claim(conn, 1)
    assert claim.replacement is not None and claim.tmdb_id == 9603
    fetched = recovery.fetch(conn, claim, client, recovery.provider_settings(conn))
    execute(conn, RETITLE, ("Heat 2", eligible))
    assert recovery.complete(conn, claim, fetched, rc.POLICY).outcome == "lost"
    assert no_observation_under(conn, 9603)
    assert rc.proposals(conn)[0]["replaced_at"] is None
    assert service.replacements(conn) == []


# -- two revalidators on one case ---------------------------------------------------------


def test_two_revalidators_claiming_at_once_never_share_a_case(db_url: str, eligible: int) -> None:
    barrier = threading.Barrier(2)
    claimed: list[list[object]] = []

    def revalidator() -> list[object]:
        with connect(db_url) as c:
            barrier.wait(timeout=10)
            return list(service.claim(c, 4, rc.PER_HOUR)[0])

    threads = [in_thread(revalidator) for _ in range(2)]
    for thread, out in threads:
        thread.join(timeout=10)
        claimed.append(out[0])
    assert sorted(len(c) for c in claimed) == [0, 1]


@pytest.mark.parametrize("stale_first", [True, False], ids=["stale-first", "live-first"])
def test_a_revalidator_past_its_lease_loses_to_the_one_that_took_over(
    conn: Connection, db_url: str, eligible: int, client: TmdbClient, stale_first: bool
) -> None:
    settings = recovery.provider_settings(conn)
    [stale], _ = service.claim(conn, 1, rc.PER_HOUR)
    stale_checks = service.lookup(conn, stale, client, settings)
    execute(conn, "UPDATE identity_revalidations SET lease_expires_at = now() - interval '1 s'")
    with connect(db_url) as other:
        [live], _ = service.claim(other, 1, rc.PER_HOUR)
        assert live.lease_token != stale.lease_token
        live_checks = service.lookup(other, live, client, settings)
        if stale_first:
            assert service.complete(conn, stale, stale_checks, rc.POLICY).outcome == "lost"
            assert service.complete(other, live, live_checks, rc.POLICY).outcome == "proposed"
        else:
            assert service.complete(other, live, live_checks, rc.POLICY).outcome == "proposed"
            assert service.complete(conn, stale, stale_checks, rc.POLICY).outcome == "lost"
    # A stale completion, fault or release changes nothing either.
    assert service.complete(conn, stale, stale_checks, rc.POLICY).outcome == "lost"
    assert service.complete(conn, stale, Failure("transient"), rc.POLICY).outcome == "lost"
    assert service.complete(conn, stale, Deferred(1.0), rc.POLICY).outcome == "lost"
    [proposal] = rc.proposals(conn)
    record = rc.revalidation(conn, eligible)
    assert record is not None and record["lease_token"] is None and record["faults"] == 0
    assert proposal["state"] == "proposed"


def test_a_new_case_mid_revalidation_loses_the_old_cases_check(
    conn: Connection, eligible: int, client: TmdbClient, standin: StandIn
) -> None:
    """The old id answers again (its case resolves) and then fails anew: the check made
    for the old case records nothing on the new one."""
    [claim], _ = service.claim(conn, 1, rc.PER_HOUR)
    checks = service.lookup(conn, claim, client, recovery.provider_settings(conn))
    standin.clear_merges()
    rc.make_due(conn, eligible)
    rc.observe(conn, client)
    standin.set_available("movie", 603, False)
    rc.make_due(conn, eligible)
    rc.observe(conn, client)
    assert rc.case(conn, eligible)["recovery_case_id"] != claim.case_id
    assert service.complete(conn, claim, checks, rc.POLICY).outcome == "lost"
    assert rc.proposals(conn) == []


# -- a database error is never a provider outcome ----------------------------------------


def fail_next_revalidation_write(conn: Connection, sqlstate: str) -> None:
    """The next write of a revalidation record raises `sqlstate`, once (a sequence, not
    a table: the raise rolls its own transaction back)."""
    execute(conn, "CREATE SEQUENCE injected_failures")
    execute(
        conn,
        "CREATE FUNCTION fail_once() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN IF nextval('injected_failures') = 1 THEN"
        " RAISE EXCEPTION 'injected' USING ERRCODE = TG_ARGV[0]; END IF; RETURN NEW; END $$",
    )
    execute(
        conn,
        "CREATE TRIGGER fail_once BEFORE UPDATE ON identity_revalidations"
        f" FOR EACH ROW EXECUTE FUNCTION fail_once('{sqlstate}')",
    )


def test_a_transient_database_error_gives_the_case_back_without_a_fault(
    conn: Connection, eligible: int, client: TmdbClient
) -> None:
    """A deadlock at the completion is no invalid_response: the claim goes back with no
    fault counted, and is not sent again at once: it is due a minute later."""
    [claim], _ = service.claim(conn, 1, rc.PER_HOUR)
    fail_next_revalidation_write(conn, "40P01")
    settings = recovery.provider_settings(conn)
    result = service.revalidate_claim(conn, claim, client, settings, rc.POLICY)
    assert (result.outcome, result.error) == ("error", "DeadlockDetected")
    record = rc.revalidation(conn, eligible)
    assert record is not None and record["lease_token"] is None and record["faults"] == 0
    assert record["last_fault"] is None
    assert service.claim(conn, 1, rc.PER_HOUR)[0] == []  # no immediate retry
    wait = fetch_one(
        conn,
        "SELECT due_at - now() AS wait FROM identity_revalidations WHERE case_id = %s",
        (claim.case_id,),
    )
    assert wait is not None
    assert wait["wait"].total_seconds() > RetryPolicy().interrupted_seconds - 5


def test_any_other_database_error_is_raised_not_recorded(
    conn: Connection, eligible: int, client: TmdbClient
) -> None:
    """A refusal the run cannot explain (here an undefined column's 42703) fails the run
    with its SQLSTATE; the case keeps no fault and its claim is left to its lease."""
    [claim], _ = service.claim(conn, 1, rc.PER_HOUR)
    fail_next_revalidation_write(conn, "42703")
    settings = recovery.provider_settings(conn)
    with pytest.raises(DatabaseError) as raised:
        service.revalidate_claim(conn, claim, client, settings, rc.POLICY)
    assert raised.value.sqlstate == "42703"
    record = rc.revalidation(conn, eligible)
    assert record is not None and record["faults"] == 0
    assert record["lease_token"] == claim.lease_token
