"""The active-lease cap: one row per slot, a claim takes a free one (its run holds no
active lease) without waiting, a stage renewing its lease locks its row, and a run
waiting out its retry time holds none. The status function counts active leases as the
claim does."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import date

import pytest

from inventory_pipeline.db import Connection, connect, execute, fetch_all, fetch_one, transaction
from inventory_pipeline.stats import service
from inventory_pipeline.stats.models import StatsClaim
from tests import stats_factories as sf

D = date(2026, 3, 10)


def users_with_work(conn: Connection, count: int) -> list[uuid.UUID]:
    sf.exercise(conn, "squat")
    users = [uuid.uuid4() for _ in range(count)]
    for u in users:
        sf.save(conn, u, D, sf.sets(("squat", 100, 5)))
    return users


def active_leases(conn: Connection) -> int:
    return int(service.worker_status(conn)["active_leases"])


def slots(conn: Connection) -> list[tuple[int, int | None]]:
    rows = fetch_all(conn, "SELECT slot, run_id FROM stats_lease_slots ORDER BY slot")
    return [(r["slot"], r["run_id"]) for r in rows]


def test_concurrent_claims_never_pass_the_cap(conn: Connection, db_url: str) -> None:
    """Cap 2: eight claims made at once on their own connections start two leases."""
    users_with_work(conn, 8)
    results: list[StatsClaim | BaseException | None] = []
    start = threading.Barrier(8)

    def claim_once(name: str) -> None:
        with connect(db_url) as own:
            start.wait()
            try:
                results.append(service.claim(own, name))
            except BaseException as exc:  # reported by the assertion below
                results.append(exc)

    threads = [threading.Thread(target=claim_once, args=(f"w{n}",)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    claimed = [r for r in results if isinstance(r, StatsClaim)]
    assert len(results) == 8 and all(r is None or isinstance(r, StatsClaim) for r in results)
    assert len(claimed) == 2 and active_leases(conn) == 2
    assert sorted(run for _, run in slots(conn)) == sorted(c.run_id for c in claimed)


def test_concurrent_drains_lose_no_claim_and_keep_the_cap(conn: Connection, db_url: str) -> None:
    """Cap 4, four drains at once over 200 users: every job is published and no claim is
    lost to another claim filling its slot. (A slot judged free from its run's state in
    the claim's snapshot was filled again after another claim had just committed its
    run there: the re-check after the row lock saw the slot's new row but not the new
    run, and the first run's compute then found its slot gone.)"""
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 4")
    users_with_work(conn, 200)
    summaries: list[object] = []
    peaks: list[int] = []
    running = threading.Event()
    running.set()

    def watch() -> None:
        with connect(db_url) as watcher:
            while running.is_set():
                peaks.append(active_leases(watcher))
                time.sleep(0.005)

    def drain(name: str) -> None:
        with connect(db_url) as own:
            summaries.append(service.drain(own, name))

    watcher = threading.Thread(target=watch)
    watcher.start()
    drains = [threading.Thread(target=drain, args=(f"w{n}",)) for n in range(4)]
    for t in drains:
        t.start()
    for t in drains:
        t.join(timeout=120)
    running.clear()
    watcher.join(timeout=10)
    assert sum(len(s.published) for s in summaries) == 200  # type: ignore[attr-defined]
    assert sum(s.lost + s.interrupted for s in summaries) == 0  # type: ignore[attr-defined]
    assert max(peaks) <= 4


def backing_off(conn: Connection, db_url: str, claimed: StatsClaim) -> None:
    """A failed attempt (statement timeout) that waits an hour before its retry."""
    execute(
        conn,
        "UPDATE stats_projection_worker_settings SET compute_budget_ms = 300,"
        " retry_backoff_seconds = 3600",
    )
    with connect(db_url) as blocker, blocker.transaction():
        execute(blocker, "LOCK TABLE training_sets IN ACCESS EXCLUSIVE MODE")
        assert service.compute(conn, claimed).status == "retry_pending"
    execute(conn, "UPDATE stats_projection_worker_settings SET compute_budget_ms = 60000")


def test_runs_in_backoff_hold_no_slot(conn: Connection, db_url: str) -> None:
    """Two accounts waiting out a retry under cap 2 do not stop a third user, and the
    status function calls them backing off, not active."""
    _, _, third = users_with_work(conn, 3)
    for _ in range(2):
        claimed = service.claim(conn, "w")
        assert claimed is not None
        backing_off(conn, db_url, claimed)
    status = service.worker_status(conn)
    assert (status["active_leases"], status["backing_off"]) == (0, 2)
    taken = service.claim(conn, "w")
    assert taken is not None and taken.user_id == third
    assert service.work_waiting(conn).free_slots == 1
    status = service.worker_status(conn)
    assert (status["active_leases"], status["backing_off"]) == (1, 2)
    assert service.process(conn, taken).outcome == "published"
    assert sf.versions(conn, third) == (1, 1)


def test_status_and_claim_agree_on_active(conn: Connection) -> None:
    users_with_work(conn, 3)
    for name in ("a", "b"):
        assert service.claim(conn, name) is not None
    assert active_leases(conn) == 2
    assert service.work_waiting(conn).free_slots == 0
    assert service.work_waiting(conn).claimable == 0
    assert service.claim(conn, "c") is None


def test_a_resumed_run_respects_the_cap(conn: Connection, db_url: str) -> None:
    """A run whose retry time came is resumed only into a free slot, and is active
    again once resumed; raising the cap adds a slot at once."""
    users_with_work(conn, 3)
    claimed = service.claim(conn, "w")
    assert claimed is not None
    backing_off(conn, db_url, claimed)
    for name in ("a", "b"):
        assert service.claim(conn, name) is not None
    execute(
        conn,
        "UPDATE user_stats_projection_runs SET retry_not_before = now() WHERE id = %s",
        (claimed.run_id,),
    )
    assert service.claim(conn, "w") is None  # two active: the due run waits for a slot
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 3")
    assert len(slots(conn)) == 3
    resumed = service.claim(conn, "w")
    assert resumed is not None and resumed.run_id == claimed.run_id
    assert active_leases(conn) == 3


def test_a_claim_never_waits_for_a_slot(conn: Connection, db_url: str) -> None:
    """Other claims are taking every free slot (a scoped processor's claim stays
    uncommitted through its compute): a claim takes nothing, at once, and the scoped
    processor reports idle; neither fails, and the work waits."""
    [user] = users_with_work(conn, 1)
    with connect(db_url) as holder, holder.transaction():
        sf.hold_lease_slots(holder)
        started = time.monotonic()
        assert service.claim(conn, "w") is None
        assert service.process_user(conn, user, "app").outcome == "idle"
        assert time.monotonic() - started < 1.0
    assert [j["status"] for j in sf.jobs(conn, user)] == ["pending"]
    assert service.claim(conn, "w") is not None


def test_claims_filling_different_slots_do_not_wait_for_each_other(
    conn: Connection, db_url: str
) -> None:
    """A claim holding one slot uncommitted (a scoped processor's claim through its
    compute) does not hold up a claim that can fill another: under cap 2 the worker
    claims the second slot at once, and a third claim finds none."""
    first, second, _ = users_with_work(conn, 3)
    with connect(db_url) as scoped, scoped.transaction():
        held = service.claim(scoped, "app", first)
        assert held is not None
        started = time.monotonic()
        taken = service.claim(conn, "w")
        assert taken is not None and taken.user_id == second
        assert service.claim(conn, "w") is None
        assert time.monotonic() - started < 1.0  # it never waited for the scoped claim
    assert active_leases(conn) == 2


def test_a_lowered_cap_stops_claims_above_it_and_lets_its_leases_finish(
    conn: Connection,
) -> None:
    """Cap 3 lowered to 2 while leases hold slots 1 to 3: no claim starts until two
    end; the lease in slot 3 finishes its work, and its slot is never filled again."""
    users_with_work(conn, 5)
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 3")
    leases = [service.claim(conn, f"w{n}") for n in range(3)]
    assert all(lease is not None for lease in leases)
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 2")
    assert len(slots(conn)) == 3  # held: it stays until its lease ends
    assert service.claim(conn, "w") is None
    third = leases[2]
    assert third is not None and service.process(conn, third).outcome == "published"
    assert service.claim(conn, "w") is None  # two active, the cap
    first = leases[0]
    assert first is not None and service.process(conn, first).outcome == "published"
    again = service.claim(conn, "w")
    assert again is not None and active_leases(conn) == 2
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 2")
    assert [slot for slot, _ in slots(conn)] == [1, 2]  # the free row above it went


def test_a_claim_leaves_the_slot_of_a_live_lease_unlocked(conn: Connection, db_url: str) -> None:
    """A scoped claim held uncommitted through its compute locks only the slot it fills:
    when the worker's lease in the other slot ends, the worker claims that slot again at
    once."""
    first, second, third = users_with_work(conn, 3)
    leased = service.claim(conn, "w", first)
    assert leased is not None
    with connect(db_url) as scoped, scoped.transaction():
        assert service.claim(scoped, "app", second) is not None
        assert service.process(conn, leased).outcome == "published"
        again = service.claim(conn, "w", third)
        assert again is not None


def test_a_claim_chosen_as_a_deadlock_victim_does_not_fail_the_worker(
    conn: Connection, db_url: str
) -> None:
    """A claim's start locks rows of more than one table (the job, then the user's owed
    range): a claim the server ends as a deadlock victim rolled back whole and is made
    again instead of failing the worker; the job is claimed, by that call or (when it
    still found the job locked) by the next."""
    [user] = users_with_work(conn, 1)
    execute(
        conn,
        "INSERT INTO user_stats_owed_ranges (user_id, from_date, exercise_ids)"
        " VALUES (%s, NULL, '{}')",
        (user,),
    )
    results: list[StatsClaim | BaseException | None] = []
    with connect(db_url) as other:
        pid = fetch_one(conn, "SELECT pg_backend_pid() AS pid")["pid"]  # type: ignore[index]
        with transaction(other):
            execute(other, "SET LOCAL deadlock_timeout = '30s'")  # the claim is the victim
            execute(
                other, "SELECT 1 FROM user_stats_owed_ranges WHERE user_id = %s FOR UPDATE", (user,)
            )

            def claim() -> None:
                try:
                    results.append(service.claim(conn, "w"))
                except BaseException as exc:  # reported by the assertion below
                    results.append(exc)

            thread = threading.Thread(target=claim)
            thread.start()
            for _ in range(500):  # the claim started the job and waits for the owed range
                row = fetch_one(
                    other,
                    "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                    (pid,),
                )
                if row is not None and row["wait_event_type"] == "Lock":
                    break
                time.sleep(0.01)
            execute(
                other,
                "UPDATE user_exercise_stats_refresh_jobs SET updated_at = updated_at"
                " WHERE user_id = %s",
                (user,),
            )
        thread.join(timeout=30)
    [first] = results
    # Made again at once, the claim finds the job still locked and passes the user by;
    # the next claim takes it.
    assert first is None or isinstance(first, StatsClaim)
    claimed = first or service.claim(conn, "w")
    assert claimed is not None and claimed.user_id == user


def test_a_claim_that_fails_an_exhausted_job_starts_no_other_user_in_its_transaction(
    conn: Connection,
) -> None:
    """A transaction carries one owner: the dead worker's job is past the attempt cap,
    so the claim fails it (its range owed) in a transaction of its own, and the next
    user's job starts in another."""
    exhausted, other = users_with_work(conn, 2)
    execute(conn, "UPDATE stats_projection_worker_settings SET max_attempts = 1")
    dead = service.claim(conn, "w", exhausted)
    assert dead is not None
    sf.expire_run(conn, dead.run_id, dead.lease_token)
    claimed = service.claim(conn, "w")
    assert claimed is not None and claimed.user_id == other
    [failed] = sf.jobs(conn, exhausted)
    assert failed["status"] == "failed"
    row = fetch_one(
        conn,
        "SELECT (SELECT xmin::text FROM user_exercise_stats_refresh_jobs WHERE user_id = %s)"
        " AS failed_in, (SELECT xmin::text FROM user_stats_projection_runs WHERE id = %s)"
        " AS started_in",
        (exhausted, claimed.run_id),
    )
    assert row is not None and row["failed_in"] != row["started_in"]
    owed = fetch_one(
        conn, "SELECT 1 AS owed FROM user_stats_owed_ranges WHERE user_id = %s", (exhausted,)
    )
    assert owed is not None


def run_row(conn: Connection, run_id: int) -> dict[str, object]:
    row = fetch_one(
        conn,
        "SELECT phase, attempts, lease_until, retry_not_before, payload"
        " FROM user_stats_projection_runs WHERE id = %s",
        (run_id,),
    )
    assert row is not None
    return dict(row)


@pytest.mark.parametrize(
    ("batched", "lapse"),
    [
        (False, "lease_until = now() - interval '1s'"),
        (True, "lease_until = now() - interval '1s'"),
        (False, "retry_not_before = now() - interval '1s'"),
    ],
    ids=["lapsed", "lapsed-in-batches", "past-its-retry-time"],
)
def test_a_lease_that_holds_no_slot_is_never_renewed_by_its_worker(
    conn: Connection, batched: bool, lapse: str
) -> None:
    """Cap 1: a worker's lease (after its first batch, when `batched`) holds no slot any
    more (it lapsed, or its run waited out a retry time) and a claim scoped to another
    user fills the one slot. The worker's next stage writes nothing and answers lost,
    which is no failure; the claim's recovery takes the run back later."""
    lapsing, other = users_with_work(conn, 2)
    if batched:
        sf.history(conn, lapsing, sessions=40, exercises=120)
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 1")
    lapsed = service.claim(conn, "w", lapsing)
    assert lapsed is not None
    if batched:
        assert service.compute(conn, lapsed).status == "batch_pending"
    sf.set_run(conn, lapsed.run_id, lapsed.lease_token, lapse)
    scoped = service.claim(conn, "app", other)
    assert scoped is not None
    before = run_row(conn, lapsed.run_id)
    answer = service.compute(conn, lapsed)
    assert answer.status == ("retry_pending" if "retry" in lapse else "lost")
    assert run_row(conn, lapsed.run_id) == before  # nothing written
    assert active_leases(conn) == 1
    assert service.process(conn, lapsed).outcome in ("lost", "deferred")  # not a failure
    assert service.process(conn, scoped).outcome == "published"
    assert len(service.drain(conn, "w").published) == 1  # the recovery: resumed or revived
    assert sf.versions(conn, lapsing)[0] == sf.versions(conn, lapsing)[1]


def test_a_compute_running_as_its_lease_lapses_keeps_its_slot(
    conn: Connection, db_url: str
) -> None:
    """Cap 1: a compute starts a second before its lease lapses and commits after. A
    claim made meanwhile, after the lapse, does not fill the run's slot: the compute
    locked it when it renewed the lease."""
    first, second = users_with_work(conn, 2)
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 1")
    ending = service.claim(conn, "w", first)
    assert ending is not None
    in_a_second = "lease_until = clock_timestamp() + interval '1 s'"
    sf.set_run(conn, ending.run_id, ending.lease_token, in_a_second)
    with connect(db_url) as computing, computing.transaction():
        assert service.compute(computing, ending).status == "computed"
        time.sleep(1.2)  # the lease, as the run row still says to others, has lapsed
        assert service.claim(conn, "app", second) is None
    assert active_leases(conn) == 1
    assert service.publish(conn, ending).status == "published"


def test_a_claim_that_took_a_lapsed_slot_first_makes_the_renewal_lose_it(
    conn: Connection, db_url: str
) -> None:
    """Cap 1: a worker's stage began just before its lease lapsed, and a claim made just
    after took the slot (uncommitted). The stage's renewal waits for that claim's lock,
    then finds the slot another run's and answers lost: two leases are never active
    under cap 1."""
    first, second = users_with_work(conn, 2)
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 1")
    lapsing = service.claim(conn, "w", first)
    assert lapsing is not None
    in_a_second = "lease_until = clock_timestamp() + interval '1 s'"
    sf.set_run(conn, lapsing.run_id, lapsing.lease_token, in_a_second)
    answers: list[str] = []
    with connect(db_url) as worker, connect(db_url) as claimer:
        execute(worker, "BEGIN")  # the stage's transaction starts while the lease is live
        time.sleep(1.1)
        with claimer.transaction():
            taken = service.claim(claimer, "app", second)
            assert taken is not None
            thread = threading.Thread(
                target=lambda: answers.append(service.compute(worker, lapsing).status)
            )
            thread.start()
            time.sleep(0.5)
            assert not answers  # waiting for the claim's lock on the slot
        thread.join(timeout=30)
        execute(worker, "COMMIT")
    assert answers == ["lost"]
    assert active_leases(conn) == 1


def test_a_batch_whose_commit_waits_past_its_lease_keeps_its_slot(
    conn: Connection, db_url: str
) -> None:
    """Cap 1: a batch run in the caller's own transaction commits when the caller does,
    here after its lease (as the run row still says) has lapsed. A claim made meanwhile
    does not fill the run's slot, whose row the batch's renewal locked."""
    big, other = uuid.uuid4(), users_with_work(conn, 1)[0]
    sf.history(conn, big, sessions=60, exercises=120)
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 1")
    batched = service.claim(conn, "w", big)
    assert batched is not None
    assert service.compute(conn, batched).status == "batch_pending"
    in_three_seconds = "lease_until = clock_timestamp() + interval '3 s'"
    sf.set_run(conn, batched.run_id, batched.lease_token, in_three_seconds)
    with connect(db_url) as computing, computing.transaction():
        assert service.compute(computing, batched).status == "batch_pending"
        time.sleep(3.3)
        assert service.claim(conn, "app", other) is None
    assert active_leases(conn) == 1
    assert service.process(conn, batched).outcome == "published"


def test_a_batch_keeps_its_lease_under_a_lowered_cap(conn: Connection) -> None:
    """A lowered cap is passed until the leases above it end: a run's next batch keeps
    its active lease though the cap no longer counts it in."""
    big, other = uuid.uuid4(), users_with_work(conn, 1)[0]
    sf.history(conn, big, sessions=60, exercises=120)
    batched = service.claim(conn, "w", big)
    assert batched is not None
    assert service.claim(conn, "app", other) is not None
    assert service.compute(conn, batched).status == "batch_pending"
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 1")
    assert service.compute(conn, batched).status == "batch_pending"
    assert active_leases(conn) == 2
