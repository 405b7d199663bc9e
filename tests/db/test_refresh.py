"""The profile planner, outbox and worker on real PostgreSQL."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from inventory_pipeline.db import Connection, DatabaseError, connect, execute, fetch_all, fetch_one
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.generator import generate_profile
from inventory_pipeline.profiles.models import Claim, Completion, RefreshPolicy
from tests import factories as f

POLICY = RefreshPolicy()


def refresh_all(conn: Connection, policy: RefreshPolicy = POLICY) -> list[Completion]:
    """A refresh run of the default budget: it plans for itself when nothing is queued."""
    return list(service.refresh(conn, policy).completions)


def test_dirty_library_is_refreshed_and_acknowledged(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 12)
    plan = service.plan(conn, POLICY)
    assert [(p.library_id, p.inventory_revision) for p in plan.inventory] == [(lib, 1)]
    [done] = service.refresh(conn, POLICY).completions
    assert done.outcome == "published"
    assert (done.acknowledged_revision, done.revision) == (1, 1)
    assert f.state(conn, lib) == {"revision": 1, "acknowledged_revision": 1, "dirty_since": None}
    stored = f.profile(conn, lib)
    assert stored is not None and stored["item_count"] == 12 and stored["inventory_revision"] == 1
    # The stored profile is exactly a from-scratch generation of the projection.
    library = service.read_snapshot(conn, lib)
    assert stored["profile"] == generate_profile(library.columns, library.rows)
    assert stored["profile"]["genres"]["status"] == "published"
    # Clean now: the next tick plans nothing.
    assert service.plan(conn, POLICY).planned == 0


def test_planner_takes_oldest_25_and_one_active_request_per_library(conn: Connection) -> None:
    srv = f.server(conn)
    libs = [f.library(conn, srv, name=str(i)) for i in range(30)]
    for lib in reversed(libs):  # the last library turns dirty first
        f.items(conn, lib, 1)
    one_pass = RefreshPolicy(planner_passes=1)
    first = service.plan(conn, one_pass)
    assert len(first.inventory) == 25
    assert {p.library_id for p in first.inventory} == set(libs[5:])
    second = service.plan(conn, one_pass)
    assert {p.library_id for p in second.inventory} == set(libs[:5])
    # Still dirty (not yet processed) but every library has its active request.
    f.items(conn, libs[0], 1)
    assert service.plan(conn, one_pass).planned == 0
    active = fetch_one(
        conn, "SELECT count(*) AS n FROM profile_refresh_requests WHERE status = 'pending'"
    )
    assert active is not None and active["n"] == 30


def test_concurrent_planners_never_duplicate(db_url: str) -> None:
    with connect(db_url) as setup:
        srv = f.server(setup)
        libs = [f.library(setup, srv, name=str(i)) for i in range(60)]
        for lib in libs:
            f.items(setup, lib, 1)
    planned: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def planner() -> None:
        with connect(db_url) as c:
            barrier.wait(timeout=10)
            for _ in range(5):
                result = service.plan(c, RefreshPolicy(planner_passes=1))
                with lock:
                    planned.extend(p.library_id for p in result.inventory)

    threads = [threading.Thread(target=planner) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(planned) == sorted(libs)


def test_existing_native_request_delays_but_cannot_acknowledge(conn: Connection) -> None:
    lib = f.library(conn)
    execute(conn, "INSERT INTO library_policies VALUES (%s, true, 'active')", (lib,))
    f.items(conn, lib, 6)
    # A native request already queued (e.g. by an earlier tick) blocks inventory work.
    execute(
        conn,
        "INSERT INTO profile_refresh_requests (library_id, kind, source, reason)"
        " VALUES (%s, 'native', 'native_policy', 'profile_age')",
        (lib,),
    )
    assert service.plan(conn, POLICY).inventory == ()
    [done] = service.refresh(conn, POLICY, max_claims=1).completions
    assert done.kind == "native" and done.outcome == "published"
    assert f.state(conn, lib)["acknowledged_revision"] == 0
    # The next pass queues the still-dirty revision.
    assert [p.inventory_revision for p in service.plan(conn, POLICY).inventory] == [1]
    refresh_all(conn)
    assert f.state(conn, lib)["acknowledged_revision"] == 1


def test_mid_generation_change_keeps_larger_revision_pending(db_url: str) -> None:
    with connect(db_url) as conn:
        lib = f.library(conn)
        f.items(conn, lib, 8)
        service.plan(conn, POLICY)
        [claim] = service.claim(conn, POLICY).claims

        def generate_then_write(columns: Any, rows: Any) -> dict[str, Any]:
            with connect(db_url) as writer:  # another program commits during generation
                execute(
                    writer, "UPDATE media_server_items SET rating = 1 WHERE library_id = %s", (lib,)
                )
            return generate_profile(columns, rows)

        done = service.process(conn, claim, POLICY, generate_then_write)
        assert done.outcome == "published"
        assert (done.claimed_revision, done.acknowledged_revision) == (1, 1)
        assert f.state(conn, lib)["dirty_since"] is not None
        assert f.revision(conn, lib) == 2
        [replan] = service.plan(conn, POLICY).inventory
        assert replan.inventory_revision == 2
        refresh_all(conn)
        assert f.state(conn, lib)["acknowledged_revision"] == 2


def test_lost_claim_acknowledges_nothing(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    service.plan(conn, POLICY)
    [old] = service.claim(conn, POLICY).claims
    # The lease runs out; recovery hands the request to a new claim.
    execute(conn, "UPDATE profile_refresh_requests SET lease_expires_at = now() - interval '1s'")
    assert service.plan(conn, POLICY).expired == 1
    execute(conn, "UPDATE profile_refresh_requests SET available_at = now()")
    [new] = service.claim(conn, POLICY).claims
    assert new.request_id == old.request_id and new.lease_token != old.lease_token
    late = service.process(conn, old, POLICY)
    assert late.outcome == "lost"
    assert f.state(conn, lib)["acknowledged_revision"] == 0
    assert f.profile(conn, lib) is None
    assert service.process(conn, new, POLICY).outcome == "published"
    assert f.state(conn, lib)["acknowledged_revision"] == 1


def test_a_lost_claims_failure_leaves_the_live_claim_alone(conn: Connection) -> None:
    """A worker whose lease was taken over and whose generation then fails records
    nothing: the request stays the live claim's, which still publishes."""
    lib = f.library(conn)
    f.items(conn, lib, 6)
    service.plan(conn, POLICY)
    [old] = service.claim(conn, POLICY).claims
    execute(conn, "UPDATE profile_refresh_requests SET lease_expires_at = now() - interval '1s'")
    assert service.plan(conn, POLICY).expired == 1
    execute(conn, "UPDATE profile_refresh_requests SET available_at = now()")
    [new] = service.claim(conn, POLICY).claims
    assert new.request_id == old.request_id and new.lease_token != old.lease_token
    late = service.process(conn, old, POLICY, broken)
    assert late.outcome == "lost"
    [request] = f.requests(conn, lib)
    assert (request["status"], request["attempts"]) == ("running", 2)
    assert request["last_error"] == "lease_expired"  # the expiry's, not the late failure's
    assert service.process(conn, new, POLICY).outcome == "published"
    assert f.state(conn, lib)["acknowledged_revision"] == 1


def test_expired_but_unclaimed_lease_cannot_complete(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    service.plan(conn, POLICY)
    [claim] = service.claim(conn, POLICY).claims
    execute(conn, "UPDATE profile_refresh_requests SET lease_expires_at = now() - interval '1s'")
    assert service.process(conn, claim, POLICY).outcome == "lost"
    assert f.state(conn, lib)["acknowledged_revision"] == 0


def test_a_completion_that_waited_for_its_library_past_its_lease_is_lost(
    conn: Connection, db_url: str
) -> None:
    """Another transaction holds the library's state row (a fold of a large burst, a
    backfill locking its libraries) while the worker's completion waits for it; the
    lease runs out meanwhile. The completion checks the lease when it holds the row,
    not when it began: it is lost."""
    lib = f.library(conn)
    f.items(conn, lib, 6)
    service.plan(conn, POLICY)
    [claim] = service.claim(conn, RefreshPolicy(lease_seconds=1)).claims
    outcome: list[str] = []
    with connect(db_url) as sync, connect(db_url) as worker:
        execute(sync, "BEGIN")
        execute(
            sync, "SELECT 1 FROM library_inventory_state WHERE library_id = %s FOR UPDATE", (lib,)
        )
        thread = threading.Thread(
            target=lambda: outcome.append(service.process(worker, claim, POLICY).outcome)
        )
        pid = fetch_one(worker, "SELECT pg_backend_pid() AS pid")
        assert pid is not None
        thread.start()
        while not fetch_one(
            conn,
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
            (pid["pid"],),
        ):
            time.sleep(0.02)
        execute(sync, "SELECT pg_sleep(1.5)")  # past the lease
        execute(sync, "COMMIT")
        thread.join()
    assert outcome == ["lost"]
    assert f.state(conn, lib)["acknowledged_revision"] == 0


def test_acknowledgement_never_moves_backwards(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    f.items(conn, lib, 6)
    refresh_all(conn)
    assert f.state(conn, lib)["acknowledged_revision"] == 2
    # A learning request finishing later leaves the acknowledgement alone; an
    # inventory request carrying an older revision (analyst backfill planned earlier)
    # cannot lower it either.
    execute(
        conn,
        "INSERT INTO profile_refresh_requests (library_id, kind, source, reason,"
        " inventory_revision) VALUES (%s, 'inventory_change', 'inventory_revision',"
        " 'inventory_changed', 1)",
        (lib,),
    )
    [done] = service.refresh(conn, POLICY).completions
    assert done.outcome == "published" and done.acknowledged_revision == 2


def test_empty_library_deletes_profile_and_is_acknowledged(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    refresh_all(conn)
    assert f.profile(conn, lib) is not None
    execute(conn, "DELETE FROM media_server_items WHERE library_id = %s", (lib,))
    [done] = refresh_all(conn)
    assert done.outcome == "removed" and done.item_count == 0
    assert f.profile(conn, lib) is None
    assert f.state(conn, lib) == {"revision": 2, "acknowledged_revision": 2, "dirty_since": None}


def test_young_profile_is_still_regenerated(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    refresh_all(conn)
    first = f.profile(conn, lib)
    execute(
        conn, "UPDATE media_server_items SET genres = ARRAY['Noir'] WHERE library_id = %s", (lib,)
    )
    [done] = refresh_all(conn)
    assert done.outcome == "published"
    second = f.profile(conn, lib)
    assert first is not None and second is not None
    assert second["profile"]["genres"]["share"] == {"Noir": 1.0}


def test_inactive_library_pauses_new_claims_but_running_work_finishes(conn: Connection) -> None:
    srv = f.server(conn)
    running = f.library(conn, srv, name="running")
    paused = f.library(conn, srv, name="paused", active=False)
    f.items(conn, running, 6)
    f.items(conn, paused, 6)
    plan = service.plan(conn, POLICY)
    assert [p.library_id for p in plan.inventory] == [running]
    batch = service.claim(conn, POLICY)
    execute(conn, "UPDATE libraries SET active = false WHERE id = %s", (running,))
    [done] = [service.process(conn, c, POLICY) for c in batch.claims]
    assert done.outcome == "published"
    # Changes while inactive are captured; nothing is planned or claimed until
    # reactivation.
    f.items(conn, running, 2)
    assert service.plan(conn, POLICY).planned == 0
    execute(conn, "UPDATE libraries SET active = true")
    assert {p.library_id for p in service.plan(conn, POLICY).inventory} == {running, paused}
    # A pending request of a library that turns inactive is not claimed either.
    execute(conn, "UPDATE libraries SET active = false WHERE id = %s", (paused,))
    assert [c.library_id for c in service.claim(conn, POLICY).claims] == [running]
    execute(conn, "UPDATE media_servers SET active = false")
    assert service.claim(conn, POLICY).claims == ()


def broken(columns: Any, rows: Any) -> dict[str, Any]:
    raise ValueError("generation blew up")


def test_three_attempts_then_two_hour_circuit_probe(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    service.plan(conn, POLICY)
    for attempt in (1, 2, 3):
        execute(conn, "UPDATE profile_refresh_requests SET available_at = now()")
        batch = service.claim(conn, POLICY)
        [done] = [service.process(conn, c, POLICY, broken) for c in batch.claims]
        assert done.outcome == "failed" and "generation blew up" in (done.error or "")
        [req] = f.requests(conn, lib)
        assert req["attempts"] == attempt
        assert req["status"] == ("failed" if attempt == 3 else "pending")
    assert req["available_at"] > req["created_at"]  # backoff, no immediate retry
    # Terminal: still dirty, but the circuit holds for two hours even with new inventory.
    f.items(conn, lib, 1)
    assert service.plan(conn, POLICY).planned == 0
    f.age_requests(conn, lib, 7201)
    [probe] = service.plan(conn, POLICY).inventory
    assert probe.inventory_revision == 2
    refresh_all(conn)
    assert f.state(conn, lib)["acknowledged_revision"] == 2
    # The failed record was kept (cooldown across restarts); both records remain.
    assert [r["status"] for r in f.requests(conn, lib)] == ["failed", "succeeded"]


def unstorable(columns: Any, rows: Any) -> dict[str, Any]:
    return {"mean": float("nan")}  # NaN is no JSON value: the database refuses it (22P02)


def test_a_failed_attempt_keeps_the_sqlstate_of_the_database_error_behind_it(
    conn: Connection,
) -> None:
    """A reader tells a database refusal from a generator's exception by the stored
    code, not by parsing the message; a later attempt's error replaces both."""
    lib = f.library(conn)
    f.items(conn, lib, 3)
    service.plan(conn, POLICY)
    [claim] = service.claim(conn, POLICY).claims
    assert service.process(conn, claim, POLICY, unstorable).outcome == "failed"
    [req] = f.requests(conn, lib)
    assert req["last_error_sqlstate"] == "22P02", req["last_error"]
    execute(conn, "UPDATE profile_refresh_requests SET available_at = now()")
    [claim] = service.claim(conn, POLICY).claims
    assert service.process(conn, claim, POLICY, broken).outcome == "failed"
    [req] = f.requests(conn, lib)
    assert (req["last_error"], req["last_error_sqlstate"]) == (
        "ValueError: generation blew up",
        None,
    )
    execute(conn, "UPDATE profile_refresh_requests SET available_at = now()")
    refresh_all(conn)
    [req] = f.requests(conn, lib)
    assert (req["status"], req["last_error"], req["last_error_sqlstate"]) == (
        "succeeded",
        None,
        None,
    )


def test_probe_after_terminal_failure_without_new_inventory(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    service.plan(conn, POLICY)
    for _ in range(3):
        execute(conn, "UPDATE profile_refresh_requests SET available_at = now()")
        service.refresh(conn, POLICY, generate=broken)
    f.age_requests(conn, lib, 3600)
    assert service.plan(conn, POLICY).planned == 0
    f.age_requests(conn, lib, 3601)
    assert [p.inventory_revision for p in service.plan(conn, POLICY).inventory] == [1]


def test_lease_expiry_on_last_attempt_fails_terminally(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    service.plan(conn, POLICY)
    for _ in range(3):
        execute(conn, "UPDATE profile_refresh_requests SET available_at = now()")
        assert len(service.claim(conn, POLICY).claims) == 1
        execute(conn, "UPDATE profile_refresh_requests SET lease_expires_at = now()")
        service.plan(conn, POLICY)  # recovers the expired lease (a killed run)
    [req] = f.requests(conn, lib)
    assert (req["status"], req["last_error"]) == ("failed", "lease_expired")


def test_native_discovery(conn: Connection) -> None:
    srv = f.server(conn)
    stocked = f.library(conn, srv, name="stocked")
    empty = f.library(conn, srv, name="empty")
    inactive_intent = f.library(conn, srv, name="inactive intent")
    for lib, intent in ((stocked, "active"), (empty, "active"), (inactive_intent, "inactive")):
        execute(conn, "INSERT INTO library_policies VALUES (%s, true, %s)", (lib, intent))
    f.items(conn, stocked, 6)
    f.items(conn, inactive_intent, 6)
    refresh_all(conn)  # inventory work first; profiles are young afterwards
    execute(conn, "UPDATE library_profiles SET generated_at = now() - interval '2 days'")
    plan = service.plan(conn, POLICY)
    assert [(p.library_id, p.kind) for p in plan.native] == [(stocked, "native")]


def test_request_kind_constraints(conn: Connection) -> None:
    lib = f.library(conn)
    learning = service.request_learning_refresh(conn, lib, learning_id=7, classification_id=3)
    assert learning is not None
    bad: list[tuple[str, str, str, int | None, int | None, int | None, int | None]] = [
        # inventory work carries no classification, candidate or learning ids
        ("inventory_change", "inventory_revision", "inventory_changed", 1, 5, None, None),
        ("inventory_change", "inventory_revision", "inventory_changed", 1, None, None, 5),
        # a positive revision, fixed source and reason
        ("inventory_change", "inventory_revision", "inventory_changed", 0, None, None, None),
        ("inventory_change", "somewhere", "inventory_changed", 1, None, None, None),
        # learning and native keep their own constraints and carry no revision
        ("learning", "learning", "learning_update", None, None, None, None),
        ("native", "native_policy", "profile_age", 1, None, None, None),
        ("native", "native_policy", "profile_age", None, None, None, 4),
    ]
    for values in bad:
        with pytest.raises(DatabaseError, match="violates check constraint"):
            execute(
                conn,
                "INSERT INTO profile_refresh_requests (kind, source, reason, inventory_revision,"
                " classification_id, candidate_id, learning_id, library_id)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                (*values, lib),
            )


def test_compaction_keeps_latest_per_library_and_active_work(conn: Connection) -> None:
    srv = f.server(conn)
    lib = f.library(conn, srv, name="busy")
    quiet = f.library(conn, srv, name="quiet")
    for _ in range(4):
        f.items(conn, lib, 1)
        refresh_all(conn)
    f.items(conn, quiet, 1)
    refresh_all(conn)
    f.items(conn, lib, 1)
    service.plan(conn, POLICY)  # one pending request stays active
    execute(
        conn,
        "UPDATE profile_refresh_requests SET finished_at = finished_at -"
        " interval '31 days' WHERE finished_at IS NOT NULL",
    )
    newer = f.requests(conn, lib)[2]
    execute(
        conn,
        "UPDATE profile_refresh_requests SET finished_at = now() WHERE id = %s",
        (newer["id"],),
    )
    deleted = service.compact(conn, RefreshPolicy(compaction_batch=1))
    assert deleted == 2  # the two oldest terminal records of the busy library
    left = fetch_all(conn, "SELECT library_id, status FROM profile_refresh_requests ORDER BY id")
    assert [(r["library_id"], r["status"]) for r in left] == [
        (lib, "succeeded"),
        (lib, "succeeded"),
        (quiet, "succeeded"),
        (lib, "pending"),
    ]


def test_backfill_goes_through_outbox_and_joins_active_request(conn: Connection) -> None:
    srv = f.server(conn)
    clean = f.library(conn, srv, name="clean")
    dirty = f.library(conn, srv, name="dirty")
    never = f.library(conn, srv, name="never stocked")
    inactive = f.library(conn, srv, name="inactive", active=False)
    f.items(conn, clean, 6)
    refresh_all(conn)
    f.items(conn, dirty, 6)
    f.items(conn, inactive, 6)
    service.plan(conn, POLICY)  # dirty already has a pending request: the backfill joins it
    results = service.backfill(conn, [clean, dirty, never, inactive], POLICY)
    assert [(r.library_id, r.status) for r in results] == [
        (clean, "refreshed"),
        (dirty, "refreshed"),
        (never, "never_stocked"),
        (inactive, "inactive"),
    ]
    assert len(f.requests(conn, dirty)) == 1
    reasons = [r["reason"] for r in f.requests(conn, clean)]
    assert reasons == ["inventory_changed", "analyst_backfill"]
    assert f.state(conn, dirty)["acknowledged_revision"] == 1


def test_library_deletion_removes_its_requests_and_profile(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    refresh_all(conn)
    f.items(conn, lib, 1)
    service.plan(conn, POLICY)
    assert len(f.requests(conn, lib)) == 2
    execute(conn, "DELETE FROM libraries WHERE id = %s", (lib,))
    assert f.requests(conn, lib) == []
    assert f.profile(conn, lib) is None
    assert service.plan(conn, POLICY).planned == 0


def test_failed_backfill_spends_no_attempt(conn: Connection) -> None:
    """The backfill tries once; its failure leaves the request to the automatic path
    with all of its attempts."""
    lib = f.library(conn)
    f.items(conn, lib, 6)
    [result] = service.backfill(conn, [lib], POLICY, generate=broken)
    assert result.status == "failed" and "generation blew up" in (result.error or "")
    [request] = f.requests(conn, lib)
    assert (request["status"], request["attempts"]) == ("pending", 0)


@pytest.mark.parametrize("joined", ["older revision", "learning"])
def test_a_backfill_that_joins_a_request_ends_with_its_revision_acknowledged(
    conn: Connection, joined: str
) -> None:
    """The active request a backfill joins may carry an older revision, or be of another
    kind (which acknowledges nothing): the backfill reports its library refreshed only
    once the revision it found is acknowledged, queueing a request of its own after the
    joined one."""
    lib = f.library(conn)
    f.items(conn, lib, 6)
    if joined == "older revision":
        service.plan(conn, POLICY)  # pending at revision 1
    else:
        service.request_learning_refresh(conn, lib, learning_id=1, classification_id=9)
    f.items(conn, lib, 6)  # revision 2, behind the active request
    [result] = service.backfill(conn, [lib], POLICY)
    assert result.status == "refreshed"
    assert f.state(conn, lib)["acknowledged_revision"] == f.revision(conn, lib) == 2
    assert result.completion is not None and result.completion.acknowledged_revision == 2
    stored = f.profile(conn, lib)
    assert stored is not None and stored["item_count"] == 12


def test_a_backfill_never_spends_the_last_attempt_of_the_request_it_joins(
    conn: Connection,
) -> None:
    """A request in backoff after two failed attempts is joined by a backfill whose own
    attempt fails: the analyst sees the failure, and the request goes back as it was
    (two attempts spent, its backoff kept), its circuit still closed."""
    lib = f.library(conn)
    f.items(conn, lib, 6)
    service.plan(conn, POLICY)
    for _ in range(2):
        execute(conn, "UPDATE profile_refresh_requests SET available_at = now()")
        [claim] = service.claim(conn, POLICY).claims
        assert service.process(conn, claim, POLICY, generate=broken).outcome == "failed"
    [before] = f.requests(conn, lib)
    assert (before["status"], before["attempts"]) == ("pending", 2)
    [result] = service.backfill(conn, [lib], POLICY, generate=broken)
    assert result.status == "failed" and "generation blew up" in (result.error or "")
    [after] = f.requests(conn, lib)
    assert (after["status"], after["attempts"]) == ("pending", 2)
    assert after["available_at"] == before["available_at"]
    assert after["last_error"] is not None and "generation blew up" in after["last_error"]
    # The automatic path still has its last attempt.
    execute(conn, "UPDATE profile_refresh_requests SET available_at = now()")
    assert [c.outcome for c in refresh_all(conn)] == ["published"]


def test_compaction_deletes_only_inventory_change_history(conn: Connection) -> None:
    """Learning and native records belong to their flows: compaction never deletes them."""
    lib = f.library(conn)
    f.items(conn, lib, 1)
    refresh_all(conn)
    for learning_id in (1, 2):
        service.request_learning_refresh(conn, lib, learning_id, classification_id=9)
        execute(
            conn,
            "UPDATE profile_refresh_requests SET status = 'succeeded', finished_at = now()"
            " WHERE kind = 'learning' AND status = 'pending'",
        )
    f.items(conn, lib, 1)
    refresh_all(conn)
    f.items(conn, lib, 1)
    refresh_all(conn)
    execute(conn, "UPDATE profile_refresh_requests SET finished_at = now() - interval '31 days'")
    assert service.compact(conn, POLICY) == 2  # the two older inventory_change records
    left = fetch_all(conn, "SELECT kind FROM profile_refresh_requests ORDER BY id")
    assert [r["kind"] for r in left] == ["learning", "learning", "inventory_change"]


def test_request_ahead_of_the_revision_fails_alone(conn: Connection) -> None:
    """A hand-inserted request whose revision the library never reached fails with a
    clear error; the rest of the run goes on and nothing is acknowledged beyond."""
    srv = f.server(conn)
    bogus, good = f.library(conn, srv, name="bogus"), f.library(conn, srv, name="good")
    f.items(conn, bogus, 6)
    f.items(conn, good, 6)
    execute(
        conn,
        "INSERT INTO profile_refresh_requests (library_id, kind, source, reason,"
        " inventory_revision) VALUES (%s, 'inventory_change', 'inventory_revision',"
        " 'inventory_changed', 99)",
        (bogus,),
    )
    done = {c.library_id: c for c in refresh_all(conn)}
    assert done[good].outcome == "published"
    assert done[bogus].outcome == "failed"
    assert "revision 99 is ahead of the library's revision 1" in (done[bogus].error or "")
    [req] = f.requests(conn, bogus)
    assert (req["status"], req["attempts"]) == ("failed", 1)
    assert f.state(conn, bogus)["acknowledged_revision"] == 0
    assert f.profile(conn, bogus) is None


def test_runs_and_backfills_hold_a_lease_only_on_work_begun(conn: Connection, db_url: str) -> None:
    """While one library is generated, the others of the same run or backfill are not
    leased: a slow library cannot make the rest wait out their leases."""
    srv = f.server(conn)
    libs = [f.library(conn, srv, name=str(i)) for i in range(4)]
    for lib in libs:
        f.items(conn, lib, 6)
    leased: list[int] = []

    def watching(columns: Any, rows: Any) -> dict[str, Any]:
        with connect(db_url) as other:
            row = fetch_one(
                other, "SELECT count(*) AS n FROM profile_refresh_requests WHERE status = 'running'"
            )
        assert row is not None
        leased.append(int(row["n"]))
        return generate_profile(columns, rows)

    service.plan(conn, POLICY)
    assert [c.outcome for c in service.refresh(conn, POLICY, generate=watching).completions] == [
        "published"
    ] * 4
    assert leased == [1, 1, 1, 1]
    for lib in libs:
        f.items(conn, lib, 1)
    leased.clear()
    results = service.backfill(conn, libs, POLICY, generate=watching)
    assert [r.status for r in results] == ["refreshed"] * 4
    assert leased == [1, 1, 1, 1]


def test_backfill_of_a_library_deleted_midway_ends_at_once(conn: Connection, db_url: str) -> None:
    """A library deleted after the backfill enqueued it takes its request along: the
    backfill reports it deleted instead of waiting for a request that no longer exists."""
    srv = f.server(conn)
    first, doomed = f.library(conn, srv, name="first"), f.library(conn, srv, name="doomed")
    f.items(conn, first, 6)
    f.items(conn, doomed, 6)

    def deleting(columns: Any, rows: Any) -> dict[str, Any]:
        with connect(db_url) as other:
            execute(other, "DELETE FROM libraries WHERE id = %s", (doomed,))
        return generate_profile(columns, rows)

    results = service.backfill(conn, [first, doomed], POLICY, wait_seconds=30, generate=deleting)
    assert [(r.library_id, r.status, r.error) for r in results] == [
        (first, "refreshed", None),
        (doomed, "failed", "library deleted"),
    ]


def test_a_run_plans_for_itself_until_its_budget_is_spent(conn: Connection) -> None:
    """Nothing queued: the run plans, drains what that queued, plans again while work
    remains, and stops at its claim budget; each claim is announced before its work."""
    srv = f.server(conn)
    libs = [f.library(conn, srv, name=str(i)) for i in range(30)]
    for lib in libs:
        f.items(conn, lib, 3)
    one_pass = RefreshPolicy(planner_passes=1)  # 25 libraries per plan
    announced: list[int] = []

    def announce(claim: Claim) -> None:
        # The claim has committed: its request is running under the announced token.
        [req] = [r for r in f.requests(conn, claim.library_id) if r["status"] == "running"]
        assert req["lease_token"] == claim.lease_token
        announced.append(claim.library_id)

    seen: list[Completion] = []
    run = service.refresh(conn, one_pass, 28, on_claim=announce, on_completion=seen.append)
    assert [p.planned for p in run.plans] == [25, 5]
    assert run.planned == 30
    assert len(run.completions) == 28 and list(run.completions) == seen
    assert announced == [c.library_id for c in run.completions]
    assert run.outcomes == {"published": 28, "removed": 0, "lost": 0, "failed": 0}
    # The rest of the queue: taken without planning, then one plan that queues nothing.
    rest = service.refresh(conn, one_pass)
    assert (len(rest.completions), [p.planned for p in rest.plans]) == (2, [0])
    assert all(f.state(conn, lib)["dirty_since"] is None for lib in libs)


def test_a_run_without_replanning_stops_at_the_first_empty_claim(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 3)
    run = service.refresh(conn, POLICY, replan=False)
    assert (run.plans, run.completions) == ((), ())
    assert f.requests(conn, lib) == []
    service.plan(conn, POLICY)
    [done] = service.refresh(conn, POLICY, replan=False).completions
    assert done.outcome == "published"
