"""Each check of the harness catches the divergence it exists for: errors judged by
SQLSTATE, the progress bounds, the event-complete audit, credential wakeups, the
independent profile oracle, and attempts burned on leases nobody worked under."""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from chaos import invariants, oracle
from chaos.config import (
    ACK_RATE_WINDOW_SECONDS,
    ADMISSION_MARGIN,
    ADMISSION_RATE,
    DIRTY_DRAIN_MARGIN,
    KILL_CHANCE,
    MAX_DIRTY_SECONDS,
    MAX_RECLAIM_SHARE,
    MAX_STORM_REQUESTS,
    MAX_TERMINAL_FAILURES,
    MAX_UNPLANNED_EXITS,
    MAX_WORKER_ERRORS_PER_MINUTE,
    PAUSE_CHANCE,
    RETRY_POLICY,
    WAKEUP_RELEASE_LIMIT,
)
from chaos.run import (
    Report,
    admission_rate,
    best_ack_rate,
    bounds,
    dirty_bound,
    dirty_since,
    drawn,
    judge_errors,
    unexercised,
)
from chaos.worker import declare, error_line
from inventory_pipeline.credentials import service as credentials
from inventory_pipeline.db import Connection, DatabaseError, connect, execute, fetch_one
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.profiles.generator import generate_profile
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.recovery import repository as recovery_repository
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.stats import service as stats_service
from tests import factories as f
from tests import stats_factories as sf
from tests.conftest import TMDB_TEST_KEY
from tests.db.test_interleavings import POLICY, process_all


def _audited(conn: Connection) -> None:
    execute(conn, (Path(invariants.__file__).with_name("audit.sql")).read_text())


# -- errors by SQLSTATE ----------------------------------------------------------------


def test_product_errors_carry_their_sqlstate(conn: Connection) -> None:
    lib = f.library(conn)
    with pytest.raises(DatabaseError) as caught:
        execute(
            conn,
            "INSERT INTO libraries (id, server_id, name, media_kind) SELECT id,"
            " server_id, name, media_kind FROM libraries WHERE id = %s",
            (lib,),
        )
    assert caught.value.sqlstate == "23505"
    assert error_line("refresher", caught.value).startswith("refresher: UniqueViolation [23505]: ")


def test_worker_errors_are_judged_by_sqlstate(db_url: str) -> None:
    """A deadlock, a constraint violation or a crash fails the run even if it converged;
    a lock timeout, a terminated session, a lost connection or no admission slot does
    not."""
    with connect(db_url) as a, connect(db_url) as b:
        with pytest.raises(DatabaseError) as lost:
            execute(b, "SELECT pg_terminate_backend(%s)", (a.info.backend_pid,))
            execute(a, "SELECT 1")
    assert lost.value.sqlstate == "57P01"
    lines = Counter(
        [
            error_line("planner", lost.value),
            "refresher: LockNotAvailable [55P03]: canceling statement due to lock timeout",
            "stats: DatabaseError [57014]: canceling statement due to statement timeout",
            "prober: DatabaseUnavailable [25P03]: terminating connection due to idle-in-tra",
            "planner: DatabaseUnavailable: cannot connect to postgresql://x: refused",
            "observer: AdmissionTimeout: no tmdb admission within 60 s",
            "planner: DatabaseError [40P01]: deadlock detected",
            "refresher: DatabaseError [23505]: duplicate key value violates unique constraint",
            "stats: DatabaseError [42883]: function f() does not exist",
            "observer: ValueError: invalid literal for int() with base 10: '²'",
            "planner: DatabaseError: a message without a code",
            "stats: DatabaseError [LEASE]: stats projection run 7 is leased to another worker",
            "observer: UnhandledException: item 3: invalid_response recorded from KeyError",
            "Traceback (most recent call last):",
        ]
    )
    assert judge_errors(lines) == [
        "deadlock in a worker: planner: DatabaseError [40P01]: deadlock detected",
        "worker error: refresher: DatabaseError [23505]: duplicate key value violates unique"
        " constraint",
        "worker error: stats: DatabaseError [42883]: function f() does not exist",
        "worker error: observer: ValueError: invalid literal for int() with base 10: '²'",
        "worker error: planner: DatabaseError: a message without a code",
        "worker error: stats: DatabaseError [LEASE]: stats projection run 7 is leased to another"
        " worker",
        "worker error: observer: UnhandledException: item 3: invalid_response recorded from"
        " KeyError",
        "worker error: Traceback (most recent call last):",
    ]


def unstorable(columns: Any, rows: Any) -> dict[str, Any]:
    return {"mean": float("nan")}  # no JSON value: the database refuses it (22P02)


def broken(columns: Any, rows: Any) -> dict[str, Any]:
    raise ValueError("generation blew up")


def test_a_database_error_a_path_does_not_expect_is_seen_where_it_was_recorded(
    conn: Connection, db_url: str
) -> None:
    """A failed attempt that swallowed a database error is a divergence by its stored
    SQLSTATE; a generator's exception (no SQLSTATE) and a stats budget spent (57014,
    expected) are not."""
    _audited(conn)
    lib = f.library(conn)
    f.items(conn, lib, 3)
    profiles.plan(conn, POLICY)
    for generate in (broken, unstorable):
        execute(conn, "UPDATE profile_refresh_requests SET available_at = now()")
        [claim] = profiles.claim(conn, POLICY).claims
        assert profiles.process(conn, claim, POLICY, generate).outcome == "failed"
    user = uuid.uuid4()
    sf.exercise(conn, "squat")
    sf.save(conn, user, date(2026, 3, 2), sf.sets(("squat", 100, 5)))
    claimed = stats_service.claim(conn, "test")
    assert claimed is not None
    execute(conn, "UPDATE stats_projection_worker_settings SET compute_budget_ms = 300")
    with connect(db_url) as blocker, blocker.transaction():
        execute(blocker, "LOCK TABLE stats_output_exercise IN EXCLUSIVE MODE")
        assert stats_service.compute(conn, claimed).status == "retry_pending"
    assert invariants.recorded_errors(conn) == [
        "profile refresh attempt recorded a database error it does not expect: SQLSTATE 22P02"
        " x1 (DatabaseError: invalid input syntax for type json)"
    ]
    assert invariants.recorded_errors(conn, {"profile refresh attempt": frozenset({"22P02"})}) == [
        "stats run recorded a database error it does not expect: SQLSTATE 57014 x1"
        " (compute: statement budget spent (57014))"
    ]


# -- faults exercised --------------------------------------------------------------------


def test_a_run_that_injected_no_fault_of_a_kind_fails() -> None:
    """Each enabled fault must fire at least once; the restart only where the server
    can be restarted."""
    report = Report(seed=1, seconds=10)
    report.kills["refresher"] = 2
    report.terminations["stats"] = 1
    report.claim_kills["SIGKILL in a transaction"] = 1
    report.squeezes = 1
    report.cancels["compute"] = 1
    assert unexercised(report, restartable=True) == [
        "fault not exercised: pause",
        "fault not exercised: throttle storm",
        "fault not exercised: publication lock wait",
        "fault not exercised: interrupted observation",
        "fault not exercised: compressed answer",
        "fault not exercised: decompression bomb",
        "fault not exercised: server restart",
    ]
    report.pauses["observer"] = 1
    report.storms = [3]
    report.lock_waits["timed out"] = 1
    report.interrupted, report.compressed, report.bombs = 1, 2, 3
    assert unexercised(report, restartable=False) == []
    assert unexercised(report, restartable=True) == ["fault not exercised: server restart"]


def test_each_drawn_fault_has_its_share_of_a_roll() -> None:
    assert [drawn(x) for x in (0.0, KILL_CHANCE, KILL_CHANCE + PAUSE_CHANCE, 0.99)] == [
        "kill",
        "pause",
        "termination",
        None,
    ]


# -- bounds on progress ------------------------------------------------------------------


def test_each_progress_bound_fails_a_livelock() -> None:
    calm = Report(seed=1, seconds=60.0)
    calm.audit = {"profile_claims": 100, "profile_reclaims": 10, "profile_terminal_failures": 1}
    calm.storms = [2]
    assert bounds(calm) == []
    stuck = Report(seed=1, seconds=60.0)
    stuck.dirty_seconds = MAX_DIRTY_SECONDS + 1
    stuck.exits = Counter({"observer": MAX_UNPLANNED_EXITS + 1})
    stuck.worker_errors = Counter({"planner: LockNotAvailable [55P03]: x": 10_000})
    stuck.audit = {
        "profile_claims": 100,
        "profile_reclaims": int(100 * MAX_RECLAIM_SHARE) + 1,
        "profile_terminal_failures": MAX_TERMINAL_FAILURES + 1,
    }
    stuck.storms = [MAX_STORM_REQUESTS + 1]
    found = bounds(stuck)
    assert len(found) == 6, found
    assert MAX_WORKER_ERRORS_PER_MINUTE < 10_000


def test_the_dirty_bound_follows_the_measured_acknowledgement_rate() -> None:
    """A slow machine (few acknowledgements a second for a large dirty set) earns a
    longer bound; a library starved while others are acknowledged fast does not."""
    slow = Report(seed=1, seconds=60.0)
    slow.dirty_seconds, slow.dirty_peak, slow.ack_rate = 213.0, 450, 2.0
    assert dirty_bound(slow) == DIRTY_DRAIN_MARGIN * 450 / 2.0 and bounds(slow) == []
    starved = Report(seed=1, seconds=60.0)
    starved.dirty_seconds, starved.dirty_peak, starved.ack_rate = 213.0, 450, 20.0
    assert dirty_bound(starved) == MAX_DIRTY_SECONDS
    assert bounds(starved) == [
        "an active library stayed dirty unacknowledged 213 s (bound 180 s: 450 dirty at most,"
        " acknowledged at up to 20.0/s)"
    ]


def test_a_dirty_library_waits_until_it_is_acknowledged() -> None:
    """The dirty clock of a library restarts when it is acknowledged, though a newer
    change keeps it dirty (observations landing on it one by one), or when it was clean;
    a library never acknowledged keeps its first moment."""
    since = dirty_since({}, {1: 3, 2: 5}, now=10.0)
    since = dirty_since(since, {1: 3, 2: 6}, now=20.0)  # 2 acknowledged, still dirty
    assert since == {1: (3, 10.0), 2: (6, 20.0)}
    since = dirty_since(since, {2: 6}, now=30.0)  # 1 clean
    since = dirty_since(since, {1: 3, 2: 6}, now=40.0)  # 1 dirty again
    assert since == {1: (3, 40.0), 2: (6, 20.0)}


def test_the_ack_rate_is_the_best_window_of_the_run(conn: Connection) -> None:
    _audited(conn)
    execute(
        conn,
        "INSERT INTO chaos_profile_acks (request_id, library_id, acked_at)"
        " SELECT n, n, now() + make_interval(secs => CASE WHEN n <= 60 THEN n / 10.0"
        " ELSE 100 + n END) FROM generate_series(1, 90) n",
    )
    assert best_ack_rate(conn) == 60 / ACK_RATE_WINDOW_SECONDS


# -- the event-complete audit -------------------------------------------------------------


def _claimed(conn: Connection, lib: int) -> Any:
    profiles.plan(conn, POLICY)
    [claim] = profiles.claim(conn, POLICY).claims
    return claim


def test_an_acknowledgement_not_from_a_running_claim_is_seen(conn: Connection) -> None:
    _audited(conn)
    lib = f.library(conn)
    f.items(conn, lib, 4)
    [planned] = profiles.plan(conn, POLICY).inventory
    execute(
        conn,
        "UPDATE profile_refresh_requests SET status = 'succeeded', finished_at = now()"
        " WHERE id = %s",
        (planned.request_id,),
    )
    assert invariants.no_lost_claim_acknowledged(conn) == [
        f"request {planned.request_id}: acknowledged by token ? (from pending, not a running claim)"
    ]


def test_a_second_acknowledgement_of_one_request_is_seen(conn: Connection) -> None:
    _audited(conn)
    lib = f.library(conn)
    f.items(conn, lib, 4)
    claim = _claimed(conn, lib)
    declare(conn, claim.lease_token)
    assert profiles.process(conn, claim, POLICY).outcome == "published"
    # A broken completion path: the request runs and succeeds again under the same token.
    execute(
        conn,
        "UPDATE profile_refresh_requests SET status = 'running', finished_at = NULL,"
        " lease_token = %s, lease_expires_at = now() + interval '1 minute' WHERE id = %s",
        (claim.lease_token, claim.request_id),
    )
    execute(
        conn,
        "UPDATE profile_refresh_requests SET status = 'succeeded', finished_at = now(),"
        " lease_token = NULL, lease_expires_at = NULL WHERE id = %s",
        (claim.request_id,),
    )
    assert f"request {claim.request_id}: acknowledged 2 times" in (
        invariants.no_lost_claim_acknowledged(conn)
    )


def test_an_interrupted_observation_given_back_due_at_once_is_seen(conn: Connection) -> None:
    """The observers report the claims they gave back interrupted; a give-back that left
    its item due at once (the defect: the run sends it again at once) is a divergence,
    one due the harness's delay later is not, and both are counted."""
    _audited(conn)
    f.provider_key(conn, TMDB_TEST_KEY)
    lib = f.library(conn)
    items = [f.tmdb_item(conn, lib, tmdb_id) for tmdb_id in (11, 12)]
    for item, delay in zip(items, (0, RETRY_POLICY.interrupted_seconds), strict=True):
        [claim] = recovery.claim(conn, 1)
        assert claim.item_id == item
        assert recovery_repository.give_back_interrupted(conn, claim, delay) is not None
        execute(
            conn,
            "INSERT INTO chaos_interruptions (item_id, lease_token, replacement)"
            " VALUES (%s, %s, false)",
            (item, claim.lease_token),
        )
    out, given_back = invariants.interruptions(conn)
    assert given_back == 2
    assert len(out) == 1 and out[0].startswith(f"item {items[0]}: an interrupted observation")


def test_events_are_timed_by_the_clock_not_transaction_start(conn: Connection, db_url: str) -> None:
    """A worker whose transaction began while its lease was live acknowledges after the
    lease ran out. By transaction start time (the clock the guards use) the write looks
    live; by the event clock it is not."""
    _audited(conn)
    lib = f.library(conn)
    f.items(conn, lib, 4)
    claim = _claimed(conn, lib)
    execute(
        conn,
        "UPDATE profile_refresh_requests SET lease_expires_at = clock_timestamp()"
        " + interval '0.5 second' WHERE id = %s",
        (claim.request_id,),
    )
    with connect(db_url) as late:
        execute(late, "BEGIN")
        execute(late, "SELECT 1")  # its now() is fixed here, the lease still live
        time.sleep(0.8)
        declare(late, claim.lease_token)
        execute(
            late,
            "UPDATE profile_refresh_requests SET status = 'succeeded', finished_at = now(),"
            " lease_token = NULL, lease_expires_at = NULL WHERE id = %s",
            (claim.request_id,),
        )
        execute(late, "COMMIT")
    assert invariants.no_lost_claim_acknowledged(conn) == [
        f"request {claim.request_id}: acknowledged by token {claim.lease_token} (lease expired)"
    ]


def test_a_profile_revision_going_back_is_seen(conn: Connection) -> None:
    _audited(conn)
    lib = f.library(conn)
    f.items(conn, lib, 4)
    process_all(conn)
    f.items(conn, lib, 2, seed=5)
    process_all(conn)
    assert invariants.no_lost_claim_acknowledged(conn) == []
    execute(
        conn, "UPDATE library_profiles SET inventory_revision = 1 WHERE library_id = %s", (lib,)
    )
    assert invariants.no_lost_claim_acknowledged(conn) == [
        f"library {lib}: profile of revision 1 written after one of revision 2 (UPDATE)"
    ]


# -- attempts burned on leases nobody worked under ---------------------------------------


def _lapsed_claim(db_url: str, conn: Connection, actor: str) -> Any:
    """A claim taken by a session named `actor` that nobody works on: its lease runs
    out and the planner recovers it, spending the attempt."""
    lib = f.library(conn)
    f.items(conn, lib, 4)
    profiles.plan(conn, POLICY)
    with connect(db_url, application_name=actor) as claimer:
        [claim] = profiles.claim(claimer, POLICY).claims
    execute(
        conn,
        "UPDATE profile_refresh_requests SET lease_expires_at = clock_timestamp() WHERE id = %s",
        (claim.request_id,),
    )
    assert profiles.plan(conn, POLICY).expired == 1
    return claim


def test_an_attempt_spent_before_work_began_is_seen(conn: Connection, db_url: str) -> None:
    _audited(conn)
    queued = _lapsed_claim(db_url, conn, "inventory_pipeline.dagster")
    worked = _lapsed_claim(db_url, conn, "chaos.refresher.42")  # a fault the harness made
    found = invariants.no_attempt_burned_unworked(conn)
    assert len(found) == 1 and found[0].startswith(
        f"request {queued.request_id}: attempt 1 spent on a lease that expired before work"
        " began (claimed by inventory_pipeline.dagster,"
    )
    assert str(worked.request_id) not in found[0]
    # A server restart inside the lease explains it: its holder was killed.
    execute(
        conn,
        "INSERT INTO chaos_faults (kind, started_at, ended_at)"
        " VALUES ('restart', now() - interval '1 minute', now())",
    )
    assert invariants.no_attempt_burned_unworked(conn) == []


# -- credential wakeups --------------------------------------------------------------------


def _verified(conn: Connection, standin: StandIn, cases: int) -> list[int]:
    lib = f.library(conn, media_kind="movie")
    ids = f.auth_cases(conn, lib, cases)
    f.provider_key(conn, TMDB_TEST_KEY)
    with credentials.probe_client(standin.url) as client:
        claim = credentials.claim_probe(conn)
        assert claim is not None
        outcome, retry_after = credentials.probe(conn, claim, client)
        declare(conn, claim.lease_token)
        assert credentials.complete_probe(conn, claim, outcome, retry_after).accepted
    return ids


def test_wakeup_batches_over_the_limit_or_too_close_are_seen(
    conn: Connection, standin: StandIn
) -> None:
    _audited(conn)
    _verified(conn, standin, 260)
    first = credentials.release(conn, limit=WAKEUP_RELEASE_LIMIT, spacing_seconds=1)
    assert first is not None and first.released == WAKEUP_RELEASE_LIMIT
    assert invariants.wakeups(conn, WAKEUP_RELEASE_LIMIT, 1) == []
    # Spacing 0 lets the next batch run at once; a limit of 150 overfills it.
    second = credentials.release(conn, limit=150, spacing_seconds=0)
    assert second is not None and second.released == 150
    found = invariants.wakeups(conn, WAKEUP_RELEASE_LIMIT, 1)
    assert found[0] == f"release batch of 150 cases (limit {WAKEUP_RELEASE_LIMIT})"
    assert found[1].startswith("release batch ") and found[1].endswith(
        " s after the previous batch began (spacing 1 s)"
    )
    assert len(found) == 2


def test_a_second_receipt_and_a_verification_without_lease_are_seen(
    conn: Connection, standin: StandIn
) -> None:
    _audited(conn)
    ids = _verified(conn, standin, 3)
    released = credentials.release(conn)
    assert released is not None and released.released == 3
    assert invariants.wakeups(conn, WAKEUP_RELEASE_LIMIT, 60) == []
    # Replay without the receipt guard: the same item released twice for a generation.
    execute(
        conn,
        "UPDATE media_server_items SET recovery_wakeup_generation = NULL WHERE id = %s",
        (ids[0],),
    )
    execute(
        conn,
        "UPDATE media_server_items SET recovery_wakeup_generation = %s WHERE id = %s",
        (released.generation, ids[0]),
    )
    # A new key verified by a write that holds no probe lease.
    f.provider_key(conn, TMDB_TEST_KEY + "-new")
    execute(
        conn,
        "UPDATE credential_wakeups SET verified_generation = s.credential_generation,"
        " verified_at = now() FROM provider_settings s",
    )
    generation = fetch_one(conn, "SELECT credential_generation AS g FROM provider_settings")
    assert generation is not None
    found = invariants.wakeups(conn, WAKEUP_RELEASE_LIMIT, 60)
    assert found[0] == f"generation {str(generation['g'])[:8]}: verified without a probe lease"
    assert found[-1] == (
        f"item {ids[0]}: 2 release receipts for generation {str(released.generation)[:8]}"
    )
    # The replayed release is also a batch of its own, too soon after the first.
    assert len(found) == 3 and "after the previous batch began" in found[1]


def test_a_verification_after_the_probe_lease_expired_is_seen(
    conn: Connection, standin: StandIn
) -> None:
    _audited(conn)
    lib = f.library(conn, media_kind="movie")
    f.auth_cases(conn, lib, 2)
    f.provider_key(conn, TMDB_TEST_KEY)
    claim = credentials.claim_probe(conn, lease_seconds=60)
    assert claim is not None
    execute(conn, "UPDATE credential_wakeups SET probe_lease_expires_at = clock_timestamp()")
    declare(conn, claim.lease_token)
    # A completion whose lease check was lost: it verifies whatever the lease says.
    execute(
        conn,
        "UPDATE credential_wakeups SET verified_generation = probe_generation,"
        " verified_at = now(), probe_lease_token = NULL, probe_lease_expires_at = NULL,"
        " probe_generation = NULL",
    )
    assert invariants.wakeups(conn, WAKEUP_RELEASE_LIMIT, 60) == [
        f"generation {str(claim.generation)[:8]}: verified after the probe lease expired"
    ]


# -- the independent oracle ------------------------------------------------------------------


def test_oracle_agrees_with_the_generator_on_random_libraries() -> None:
    columns = (
        "provider",
        "provider_kind",
        "rating",
        "genres",
        "primary_studio",
        "original_language",
    )
    for seed in range(300):
        rng = random.Random(seed)
        rows = f.item_values(rng, rng.randint(1, 30))
        for row in rows:
            if rng.random() < 0.3:
                row["rating"] = None
            else:
                row["rating"] = Decimal(str(round(rng.uniform(0, 10), rng.choice((1, 2)))))
            if rng.random() < 0.3:
                row["genres"] = rng.choice((None, [], ["Drama", "Drama", ""]))
            if rng.random() < 0.3:
                row["primary_studio"] = rng.choice((None, f"S{rng.randint(1, 15)}"))
            if rng.random() < 0.2:
                row["provider"] = row["provider_kind"] = row["provider_id"] = None
        raw = [{c: row[c] for c in columns} for row in rows]
        items = tuple(
            tuple(float(r[c]) if c == "rating" and r[c] is not None else r[c] for c in columns)
            for r in raw
        )
        assert (
            list(oracle.differences(oracle.expected_profile(raw), generate_profile(columns, items)))
            == []
        ), seed


def test_oracle_sees_what_the_products_own_recomputation_cannot(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generator bug shared by the worker and the product's recomputation passes the
    recomputation check; the oracle, which shares no code with them, catches it."""
    lib = f.library(conn)
    f.items(conn, lib, 12)
    process_all(conn)
    assert oracle.check(conn) == []

    def broken(columns: Any, rows: Any) -> dict[str, Any]:
        profile = generate_profile(columns, rows)
        profile["genres"]["contributors"] += 1
        return profile

    monkeypatch.setattr(invariants, "generate_profile", broken)
    f.items(conn, lib, 1, seed=8)
    profiles.plan(conn, POLICY)
    profiles.refresh(conn, POLICY, generate=broken)
    assert invariants.profiles_converged(conn) == []
    assert oracle.check(conn) == [
        f"library {lib}: oracle: genres.contributors: expected 13, stored 14"
    ]


def test_oracle_sees_an_item_count_and_a_missing_profile(conn: Connection) -> None:
    lib = f.library(conn)
    other = f.library(conn, name="Shows", media_kind="tv")
    f.items(conn, lib, 6)
    f.items(conn, other, 6)
    process_all(conn)
    execute(conn, "UPDATE library_profiles SET item_count = 7 WHERE library_id = %s", (lib,))
    execute(conn, "DELETE FROM library_profiles WHERE library_id = %s", (other,))
    assert oracle.check(conn) == [
        f"library {lib}: oracle: item_count: expected 6, stored 7",
        f"library {other}: oracle: 6 items, no profile stored",
    ]


def test_an_authentication_case_nobody_may_wake_is_not_stuck(conn: Connection) -> None:
    """A day's cooldown is stuck where a verified key would release the case, and
    legitimate where it would not (the item moved to a library of another kind)."""
    movies = f.library(conn, media_kind="movie")
    shows = f.library(conn, name="Shows", media_kind="tv")
    [waiting, moved] = f.auth_cases(conn, movies, 2)
    execute(conn, "UPDATE media_server_items SET library_id = %s WHERE id = %s", (shows, moved))
    assert invariants.nothing_stuck(conn) == [f"item {waiting}: open auth case without a due retry"]
    assert invariants.outstanding(conn)["observable open cases"] == 1


def test_a_stats_publication_begun_after_its_lease_is_seen(conn: Connection) -> None:
    _audited(conn)
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, date(2026, 3, 10), sf.sets(("squat", 100, 5)))
    claim = stats_service.claim(conn, "test")
    assert claim is not None
    declare(conn, claim.lease_token)
    assert stats_service.compute(conn, claim).status == "computed"
    assert stats_service.publish(conn, claim).status == "published"
    assert invariants.no_lost_claim_acknowledged(conn) == []
    sf.save(conn, user, date(2026, 3, 11), sf.sets(("squat", 110, 5)))
    late = stats_service.claim(conn, "test")
    assert late is not None
    declare(conn, late.lease_token)
    assert stats_service.compute(conn, late).status == "computed"
    sf.expire_run(conn, late.run_id, late.lease_token)
    # A publication whose lease check was lost: it publishes whatever the lease says.
    with conn.transaction():
        execute(
            conn,
            "SELECT set_config('inventory.stats_lease_token', %s, true)",
            (str(late.lease_token),),
        )
        execute(
            conn,
            "UPDATE user_stats_projection_runs SET phase = 'published' WHERE id = %s",
            (late.run_id,),
        )
    assert invariants.no_lost_claim_acknowledged(conn) == [
        f"stats run {late.run_id}: published by its worker after the lease ended (process None)"
    ]


def test_a_dead_workers_observation_lease_is_outstanding_a_live_one_is_not(
    conn: Connection,
) -> None:
    lib = f.library(conn)
    live, dead = (f.tmdb_item(conn, lib, n) for n in (3, 4))
    execute(
        conn,
        "UPDATE media_server_items SET observation_lease_token = gen_random_uuid(),"
        " observation_lease_expires_at = now() + CASE WHEN id = %s THEN interval '1 minute'"
        " ELSE interval '-1 second' END WHERE id IN (%s, %s)",
        (live, live, dead),
    )
    assert invariants.outstanding(conn)["expired observation leases"] == 1


# -- invariants that had no check --------------------------------------------------------


def test_leases_beyond_the_cap_are_seen_and_a_lowered_cap_lets_earlier_ones_run_out(
    conn: Connection,
) -> None:
    _audited(conn)
    sf.exercise(conn, "squat")
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 2")
    users = [uuid.uuid4() for _ in range(4)]
    for user in users:
        sf.save(conn, user, date(2026, 3, 10), sf.sets(("squat", 100, 5)))
    assert stats_service.claim(conn, "a") and stats_service.claim(conn, "b")
    assert stats_service.claim(conn, "c") is None  # the cap holds
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 1")
    assert invariants.stats_leases(conn) == []  # two earlier leases run out: no divergence
    time.sleep(1.1)  # past the second within which a claim may have read the older cap
    # A deliberate defect: the claim takes any free slot, not only those within the cap.
    cap = "WHERE l.slot <= st.active_lease_cap AND l.lease_until <= now()"
    row = fetch_one(conn, "SELECT pg_get_functiondef('stats_claim_stage'::regproc) AS d")
    assert row is not None and row["d"].count(cap) == 1
    execute(conn, row["d"].replace(cap, "WHERE l.lease_until <= now()"))
    execute(conn, "INSERT INTO stats_lease_slots (slot) VALUES (3), (4)")
    assert stats_service.claim(conn, "c") and stats_service.claim(conn, "d")
    [found] = invariants.stats_leases(conn)
    assert found.endswith(
        "granted a lease with 4 active (2 granted before the cap last changed), cap 1"
    ), found


def test_a_stats_step_past_the_lease_or_without_its_token_is_seen(conn: Connection) -> None:
    _audited(conn)
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, date(2026, 3, 10), sf.sets(("squat", 100, 5)))
    claim = stats_service.claim(conn, "test")
    assert claim is not None
    assert stats_service.compute(conn, claim).status == "computed"
    assert invariants.stats_leases(conn) == []
    sf.expire_run(conn, claim.run_id, claim.lease_token)
    # Deliberate defects: a session without the token changes the run (its lease lapsed,
    # so the fence lets it); the holder publishes past its lease.
    execute(
        conn, "UPDATE user_stats_projection_runs SET payload = '{}' WHERE id = %s", (claim.run_id,)
    )
    sf.set_run(conn, claim.run_id, claim.lease_token, "phase = 'published'")
    assert invariants.stats_leases(conn) == [
        f"stats run {claim.run_id}: step to computed by a session without its lease token",
        f"stats run {claim.run_id}: step to published after its lease ended",
    ]


def test_a_release_of_the_wrong_case_or_with_the_wrong_jitter_is_seen(
    conn: Connection, standin: StandIn
) -> None:
    _audited(conn)
    [case, other] = _verified(conn, standin, 2)
    released = credentials.release(conn, limit=WAKEUP_RELEASE_LIMIT, spacing_seconds=0)
    assert released is not None and released.released == 2
    assert invariants.release_rules(conn) == []
    shows = f.library(conn, media_kind="tv")
    [wrong_kind] = f.auth_cases(conn, shows, 1)
    execute(
        conn, "UPDATE media_server_items SET provider_kind = 'movie' WHERE id = %s", (wrong_kind,)
    )
    plain = f.tmdb_item(conn, shows, 7)
    generation = fetch_one(conn, "SELECT verified_generation AS g FROM credential_wakeups")
    assert generation is not None
    # Deliberate defects: a release past the rules.
    for item, due in ((wrong_kind, "30 s"), (plain, "30 s"), (case, "2 hours")):
        execute(
            conn,
            "UPDATE media_server_items SET recovery_wakeup_generation = gen_random_uuid(),"
            " observation_due_at = now() + %s::interval WHERE id = %s",
            (due, item),
        )
    assert invariants.release_rules(conn) == [
        f"item {wrong_kind}: released in a library of another media kind",
        f"item {plain}: released without an open authentication case",
        f"item {case}: released due after 7200.0 s",
    ]
    assert other


def test_a_claim_at_an_inactive_library_is_seen(conn: Connection) -> None:
    _audited(conn)
    lib = f.library(conn)
    f.items(conn, lib, 3)
    profiles.plan(conn, POLICY)
    execute(conn, "UPDATE libraries SET active = false WHERE id = %s", (lib,))
    assert profiles.claim(conn, POLICY).claims == ()  # the product waits
    # A deliberate defect: a claim that does not ask whether the library is active.
    execute(
        conn,
        "UPDATE profile_refresh_requests SET status = 'running', attempts = attempts + 1,"
        " lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 minute'"
        " WHERE library_id = %s",
        (lib,),
    )
    [request] = f.requests(conn, lib)
    assert invariants.inactive_claims(conn, margin_seconds=0) == [
        f"request {request['id']}: claimed by inventory_pipeline while library {lib} was inactive"
    ]


def test_more_arrivals_in_a_second_than_the_admission_rate_allows_are_seen() -> None:
    limit = int(ADMISSION_RATE * ADMISSION_MARGIN)
    assert admission_rate(Counter({100: limit, 101: 3})) == []
    assert admission_rate(Counter({100: limit + 1})) == [
        f"{limit + 1} requests reached the provider in one second"
        f" (admission rate {ADMISSION_RATE}/s)"
    ]


def test_an_activity_change_is_timed_as_it_commits(conn: Connection, db_url: str) -> None:
    """A deactivation whose transaction runs on is not in force before its commit: a
    claim meanwhile read the library active."""
    _audited(conn)
    lib = f.library(conn)
    with connect(db_url) as other:
        with other.transaction():
            execute(other, "UPDATE libraries SET active = false WHERE id = %s", (lib,))
            time.sleep(0.3)
            before_commit = fetch_one(other, "SELECT clock_timestamp() AS t")
    row = fetch_one(conn, "SELECT at FROM chaos_activity WHERE id = %s", (lib,))
    assert before_commit is not None and row is not None and row["at"] >= before_commit["t"]


def test_a_claim_a_reactivation_raced_is_not_a_divergence(conn: Connection) -> None:
    """Inactive before the claiming statement began, active again before its write: the
    statement may have read it active."""
    _audited(conn)
    execute(
        conn,
        "INSERT INTO chaos_activity (kind, id, active, at) VALUES"
        " ('library', 7, false, now() - interval '10 s'),"
        " ('library', 7, true, now() - interval '2 s')",
    )
    claim = (
        "INSERT INTO chaos_profile_claims (request_id, library_id, lease_token, attempt,"
        " lease_expires_at, server_id, statement_at, claimed_at) VALUES (%s, 7,"
        " gen_random_uuid(), 1, now(), 1, now() - %s::interval, now() - %s::interval)"
    )
    execute(conn, claim, (1, "3 s", "1 s"))  # the reactivation inside: raced
    execute(conn, claim, (2, "5 s", "4 s"))  # inactive throughout: a divergence
    assert invariants.inactive_claims(conn) == [
        "request 2: claimed by inventory_pipeline while library 7 was inactive"
    ]
