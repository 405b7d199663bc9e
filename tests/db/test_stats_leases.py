"""The active-lease cap holds under concurrent claims, a run waiting out its retry time
holds no slot, and the status function counts active leases as the claim does."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import date

import pytest

from inventory_pipeline.db import Connection, connect, execute, fetch_one, transaction
from inventory_pipeline.stats import processors, service
from inventory_pipeline.stats import repository as stats_repository
from inventory_pipeline.stats.models import StatsClaim
from tests import stats_factories as sf

D = date(2026, 3, 10)


def users_with_work(conn: Connection, count: int) -> list[uuid.UUID]:
    sf.exercise(conn, "squat")
    users = [uuid.uuid4() for _ in range(count)]
    for u in users:
        sf.save(conn, u, D, sf.sets(("squat", 100, 5)))
    return users


def live_runs(conn: Connection) -> int:
    row = fetch_one(
        conn,
        "SELECT count(*) AS n FROM user_stats_projection_runs"
        " WHERE phase IN ('claimed', 'computed') AND lease_until > now()",
    )
    assert row is not None
    return int(row["n"])


def waiting_backends(conn: Connection, pids: list[int]) -> int:
    row = fetch_one(
        conn,
        "SELECT count(*) AS n FROM pg_stat_activity"
        " WHERE pid = ANY(%s) AND wait_event_type = 'Lock'",
        (pids,),
    )
    assert row is not None
    return int(row["n"])


def test_two_concurrent_claims_never_pass_the_cap(conn: Connection, db_url: str) -> None:
    """Cap 2 with one live lease: two drains claim at once on their own connections.
    Both would read 1 live lease; only one may start."""
    users_with_work(conn, 3)
    assert service.claim(conn, "first") is not None
    results: list[StatsClaim | BaseException | None] = []
    with (
        connect(db_url) as gate,
        connect(db_url) as one,
        connect(db_url) as two,
    ):
        pids = [
            fetch_one(c, "SELECT pg_backend_pid() AS pid")["pid"]  # type: ignore[index]
            for c in (one, two)
        ]

        def claim_on(c: Connection, name: str) -> None:
            try:
                results.append(service.claim(c, name))
            except BaseException as exc:  # reported by the assertion below
                results.append(exc)

        threads = [
            threading.Thread(target=claim_on, args=(c, n)) for c, n in ((one, "one"), (two, "two"))
        ]
        with transaction(gate):
            # Writes of new runs wait here, after each claim has counted the live leases.
            execute(gate, "LOCK TABLE user_stats_projection_runs IN SHARE MODE")
            for t in threads:
                t.start()
            for _ in range(500):
                if waiting_backends(conn, pids) == 2:
                    break
                time.sleep(0.01)
        for t in threads:
            t.join(timeout=30)
    assert live_runs(conn) == 2
    assert sorted(type(r).__name__ for r in results) == ["NoneType", "StatsClaim"]


def backing_off(conn: Connection, db_url: str, claimed: StatsClaim) -> None:
    """A failed attempt (statement timeout) that waits an hour before its retry."""
    execute(
        conn,
        "UPDATE stats_projection_worker_settings SET compute_budget_ms = 300,"
        " retry_backoff_seconds = 3600",
    )
    with connect(db_url) as blocker, blocker.transaction():
        execute(blocker, "LOCK TABLE stats_output_exercise IN EXCLUSIVE MODE")
        assert service.compute(conn, claimed).status == "retry_pending"
    execute(conn, "UPDATE stats_projection_worker_settings SET compute_budget_ms = 60000")


def test_runs_in_backoff_hold_no_slot(conn: Connection, db_url: str) -> None:
    """Two accounts waiting out a retry under cap 2 do not stop a third user, and the
    status function calls them backing off, not active."""
    first, second, third = users_with_work(conn, 3)
    for _ in range(2):
        claimed = service.claim(conn, "w")
        assert claimed is not None
        backing_off(conn, db_url, claimed)
    status = processors.worker_status(conn)
    assert (status["active_leases"], status["backing_off"]) == (0, 2)
    taken = service.claim(conn, "w")
    assert taken is not None and taken.user_id == third
    assert processors.work_waiting(conn).free_slots == 1
    status = processors.worker_status(conn)
    assert (status["active_leases"], status["backing_off"]) == (1, 2)
    assert processors.process_claim(conn, taken).outcome == "published"
    assert sf.versions(conn, third) == (1, 1)
    assert sf.versions(conn, first) == (1, 0) and sf.versions(conn, second) == (1, 0)


def test_status_and_claim_agree_on_active(conn: Connection) -> None:
    users_with_work(conn, 3)
    for name in ("a", "b"):
        assert service.claim(conn, name) is not None
    assert processors.worker_status(conn)["active_leases"] == 2
    assert processors.work_waiting(conn).free_slots == 0
    assert processors.work_waiting(conn).claimable == 0
    assert service.claim(conn, "c") is None


def test_a_resumed_run_respects_the_cap(conn: Connection, db_url: str) -> None:
    """A run whose retry time came is resumed only into a free slot, and is active
    again once resumed."""
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
    resumed = service.claim(conn, "w")
    assert resumed is not None and resumed.run_id == claimed.run_id
    assert processors.worker_status(conn)["active_leases"] == 3


def test_a_claim_waits_for_a_slot_at_most_its_budget(conn: Connection, db_url: str) -> None:
    """Other claims are taking every free lease slot (a scoped processor's claim stays
    uncommitted through its compute): the worker's claim waits for one for at most its
    budget, the scoped processor not at all, and neither fails."""
    [user] = users_with_work(conn, 1)
    execute(conn, "UPDATE stats_projection_worker_settings SET claim_budget_ms = 300")
    with connect(db_url) as holder, holder.transaction():
        sf.hold_lease_slots(holder)
        started = time.monotonic()
        assert service.claim(conn, "w") is None
        assert time.monotonic() - started >= 0.3
        assert processors.process_user(conn, user, "app").outcome == "idle"
    assert [j["status"] for j in sf.jobs(conn, user)] == ["pending"]
    assert service.claim(conn, "w") is not None


def test_claims_filling_different_slots_do_not_wait_for_each_other(
    conn: Connection, db_url: str
) -> None:
    """A claim holding one lease slot uncommitted (a scoped processor's claim through its
    compute) does not hold up a claim that can fill another: under cap 2 the worker
    claims the second slot at once; a third claim can only wait for the slot the scoped
    claim is filling, and gives up after its budget."""
    first, second, _ = users_with_work(conn, 3)
    execute(conn, "UPDATE stats_projection_worker_settings SET claim_budget_ms = 300")
    with connect(db_url) as scoped, scoped.transaction():
        held = service.claim(scoped, "app", first, wait=False)
        assert held is not None
        started = time.monotonic()
        taken = service.claim(conn, "w")
        assert taken is not None and taken.user_id == second
        assert time.monotonic() - started < 0.3  # it never waited for the scoped claim
        assert service.claim(conn, "w") is None
    assert live_runs(conn) == 2


def test_a_lowered_cap_holds_though_a_lease_keeps_a_slot_above_it(
    conn: Connection, db_url: str
) -> None:
    """Cap 3 lowered to 2 while a lease holds slot 3: two claims made at once, each able
    to lock a free slot of the new cap, start one lease between them, not two."""
    users_with_work(conn, 3)
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 3")
    first = service.claim(conn, "first")
    assert first is not None
    execute(
        conn, "UPDATE user_stats_projection_runs SET lease_slot = 3 WHERE id = %s", (first.run_id,)
    )
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 2")
    with connect(db_url) as one, connect(db_url) as two:
        with one.transaction(), two.transaction():
            taken = [service.claim(c, name, wait=False) for c, name in ((one, "one"), (two, "two"))]
    assert sorted(type(t).__name__ for t in taken) == ["NoneType", "StatsClaim"]
    assert live_runs(conn) == 2


def test_a_claim_leaves_the_slot_of_a_live_lease_unlocked(conn: Connection, db_url: str) -> None:
    """A scoped claim held uncommitted through its compute locks only the slot it fills:
    when the worker's lease in the other slot ends, the worker claims that slot again at
    once instead of waiting out its budget."""
    first, second, third = users_with_work(conn, 3)
    execute(conn, "UPDATE stats_projection_worker_settings SET claim_budget_ms = 300")
    leased = service.claim(conn, "w", first)
    assert leased is not None
    with connect(db_url) as scoped, scoped.transaction():
        assert service.claim(scoped, "app", second, wait=False) is not None
        assert service.compute(conn, leased).status == "computed"
        assert service.publish(conn, leased).status == "published"
        started = time.monotonic()
        again = service.claim(conn, "w", third)
        assert again is not None
        assert time.monotonic() - started < 0.3  # no wait for a lock the scoped claim kept


def test_a_claim_chosen_as_a_deadlock_victim_does_not_fail_the_worker(
    conn: Connection, db_url: str
) -> None:
    """Claims run side by side and a claim's start locks rows of more than one table (the
    job, then the user's owed range): a claim the server ends as a deadlock victim rolled
    back whole and is made again instead of failing the worker; the job is claimed, by
    that call or (when it still found the job locked) by the next."""
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
                if waiting_backends(other, [pid]) == 1:
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
    assert first is None or isinstance(first, StatsClaim)
    claimed = first or service.claim(conn, "w")
    assert claimed is not None and claimed.user_id == user


def test_a_claim_that_fails_an_exhausted_job_starts_no_other_user_in_its_transaction(
    conn: Connection,
) -> None:
    """A transaction carries one owner: the oldest job is past the attempt cap, so the
    claim fails it (its range owed) in a transaction of its own, and the next user's job
    starts in another."""
    exhausted, other = users_with_work(conn, 2)
    execute(
        conn,
        "UPDATE user_exercise_stats_refresh_jobs SET attempts = max_attempts"
        " FROM stats_projection_worker_settings WHERE user_id = %s",
        (exhausted,),
    )
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
    assert (
        fetch_one(
            conn, "SELECT 1 AS owed FROM user_stats_owed_ranges WHERE user_id = %s", (exhausted,)
        )
        is not None
    )


LAPSE = "lease_until = now() - interval '1s'"


def lapsed_beside_a_scoped_claim(
    conn: Connection, lapsing: uuid.UUID, other: uuid.UUID, batched: bool, lapse: str = LAPSE
) -> tuple[StatsClaim, StatsClaim]:
    """Cap 1: a worker's lease (after its first batch, if `batched`) holds no slot any
    more (`lapse`: it ran out, or its run waited out a retry time) and a claim scoped to
    another user fills the one slot (a scoped claim does not take the run back). The
    run's compute answers without renewing its lease beside that one, which would make
    two active leases under cap 1."""
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 1")
    lapsed = service.claim(conn, "w", lapsing)
    assert lapsed is not None
    if batched:
        assert service.compute(conn, lapsed).status == "batch_pending"
    sf.set_run(conn, lapsed.run_id, lapsed.lease_token, lapse)
    scoped = service.claim(conn, "app", other)
    assert scoped is not None
    before = run_row(conn, lapsed.run_id)
    refused = service.compute(conn, lapsed)
    assert (refused.status, refused.reason) == ("failed", "lease lapsed and no slot is free")
    assert run_row(conn, lapsed.run_id) == before  # nothing written
    assert processors.worker_status(conn)["active_leases"] == 1
    assert processors.process_claim(conn, lapsed).outcome == "deferred"  # not a failure
    assert processors.process_claim(conn, scoped).outcome == "published"
    return lapsed, scoped


def run_row(conn: Connection, run_id: int) -> dict[str, object]:
    row = fetch_one(
        conn,
        "SELECT phase, attempts, lease_until, lease_slot, retry_not_before, payload"
        " FROM user_stats_projection_runs WHERE id = %s",
        (run_id,),
    )
    assert row is not None
    return dict(row)


def test_a_lapsed_lease_is_renewed_only_into_a_free_slot(conn: Connection) -> None:
    """Once the slot is free again, the lapsed run renews its lease and computes."""
    lapsed, _ = lapsed_beside_a_scoped_claim(conn, *users_with_work(conn, 2), batched=False)
    assert service.compute(conn, lapsed).status == "computed"
    assert live_runs(conn) == 1
    assert service.publish(conn, lapsed).status == "published"


def test_a_lapsed_run_in_batches_is_renewed_only_into_a_free_slot(conn: Connection) -> None:
    """The same for a run computed in batches: its next batch renews the lease only
    once the slot is free."""
    big = uuid.uuid4()
    sf.history(conn, big, sessions=60, exercises=120)
    lapsed, _ = lapsed_beside_a_scoped_claim(conn, big, *users_with_work(conn, 1), batched=True)
    assert processors.process_claim(conn, lapsed).outcome == "published"


def test_a_run_past_its_retry_time_is_renewed_only_into_a_free_slot(conn: Connection) -> None:
    """A run waiting out a retry time holds no slot; once the time has passed, its
    compute does not make it active beside the lease a scoped claim took meanwhile, and
    renews it once the slot is free."""
    retry_passed = "retry_not_before = now() - interval '1 s'"
    waited, _ = lapsed_beside_a_scoped_claim(
        conn, *users_with_work(conn, 2), batched=False, lapse=retry_passed
    )
    assert service.compute(conn, waited).status == "computed"
    assert processors.worker_status(conn)["active_leases"] == 1


def test_two_lapsed_leases_renewed_at_once_do_not_pass_a_lowered_cap(
    conn: Connection, db_url: str
) -> None:
    """Cap 3 with three leases, two of them lapsed; the cap is lowered to 2 while the
    third keeps slot 3. The two lapsed runs' computes, in transactions open side by
    side, renew one lease between them, not two (three active under cap 2)."""
    users = users_with_work(conn, 3)
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 3")
    claims = [service.claim(conn, "w", u) for u in users]
    assert all(c is not None for c in claims)
    lapsed = [c for c in claims[:2] if c is not None]
    for c in lapsed:
        sf.expire_run(conn, c.run_id, c.lease_token)
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 2")
    with connect(db_url) as one, connect(db_url) as two:
        with one.transaction(), two.transaction():
            pairs = zip((one, two), lapsed, strict=True)
            answers = [service.compute(c, claim) for c, claim in pairs]
    assert sorted(a.status for a in answers) == ["computed", "failed"]
    assert processors.worker_status(conn)["active_leases"] == 2


def test_a_renewal_leaves_the_slots_of_live_leases_unlocked(conn: Connection, db_url: str) -> None:
    """A lapsed run renewing its lease, its compute uncommitted, locks only the slot it
    takes: when a live lease in another slot ends, a claim takes that slot at once."""
    first, second, third, fourth = users_with_work(conn, 4)
    execute(
        conn,
        "UPDATE stats_projection_worker_settings SET active_lease_cap = 3, claim_budget_ms = 300",
    )
    live = service.claim(conn, "w", first)
    lapsed = service.claim(conn, "w", second)
    assert live is not None and lapsed is not None
    sf.expire_run(conn, lapsed.run_id, lapsed.lease_token)
    assert service.claim(conn, "app", third) is not None  # fills the lapsed run's slot
    with connect(db_url) as renewing, renewing.transaction():
        assert service.compute(renewing, lapsed).status == "computed"  # into slot 3
        assert processors.process_claim(conn, live).outcome == "published"
        started = time.monotonic()
        again = service.claim(conn, "w", fourth)
        assert again is not None
        assert time.monotonic() - started < 0.3  # no wait for a lock the renewal kept


def test_a_compute_running_as_its_lease_lapses_keeps_its_slot(
    conn: Connection, db_url: str
) -> None:
    """Cap 1: a compute starts a second before its lease lapses and commits after. A
    claim made meanwhile, after the lapse, does not fill the run's slot (the compute
    renewing its lease would make two active leases under cap 1)."""
    first, second = users_with_work(conn, 2)
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 1")
    ending = service.claim(conn, "w", first)
    assert ending is not None
    in_a_second = "lease_until = clock_timestamp() + interval '1 s'"
    sf.set_run(conn, ending.run_id, ending.lease_token, in_a_second)
    with connect(db_url) as computing, computing.transaction():
        assert service.compute(computing, ending).status == "computed"
        time.sleep(1.2)  # the lease, as the run row still says, has lapsed
        assert service.claim(conn, "app", second, wait=False) is None
    assert processors.worker_status(conn)["active_leases"] == 1


@pytest.mark.parametrize("lowered", [False, True], ids=["in-its-slot", "above-a-lowered-cap"])
def test_a_slow_batch_whose_lease_lapses_does_not_pass_the_cap(
    conn: Connection, db_url: str, monkeypatch: pytest.MonkeyPatch, lowered: bool
) -> None:
    """Cap 1: a batch's transaction is several statements sent by the worker, so its
    lease may lapse while it runs however far its end was when it started (here the
    worker stalls inside the batch). A claim made after the lapse fills the slot; the
    batch then does not commit its lease's renewal beside that one, whether its lease
    held slot 1 or a slot above a cap lowered to 1 (two active leases under cap 1)."""
    big, other = uuid.uuid4(), users_with_work(conn, 1)[0]
    sf.history(conn, big, sessions=60, exercises=120)
    execute(conn, "UPDATE stats_projection_worker_settings SET compute_budget_ms = 500")
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 2")
    if lowered:  # the batched run holds slot 2
        first = service.claim(conn, "w", users_with_work(conn, 1)[0])
        assert first is not None
    batched = service.claim(conn, "w", big)
    assert batched is not None
    assert service.compute(conn, batched).status == "batch_pending"
    if lowered:
        assert processors.process_claim(conn, first).outcome == "published"
    assert run_row(conn, batched.run_id)["lease_slot"] == (2 if lowered else 1)
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 1")
    # Beyond the compute budget and the second of margin a single call needs.
    in_three_seconds = "lease_until = clock_timestamp() + interval '3 s'"
    sf.set_run(conn, batched.run_id, batched.lease_token, in_three_seconds)
    before = run_row(conn, batched.run_id)
    claimed: list[StatsClaim | None] = []
    real = stats_repository.compute_exercises

    def stalled(*args: object, **kwargs: object) -> None:
        time.sleep(3.3)  # the lease, as the run row says to everyone else, has lapsed
        claimed.append(service.claim(conn, "app", other, wait=False))
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(stats_repository, "compute_exercises", stalled)
    with connect(db_url) as computing:
        answer = service.compute(computing, batched)
    monkeypatch.undo()
    assert processors.worker_status(conn)["active_leases"] == 1
    assert claimed[0] is not None  # the lapsed lease held no slot
    assert (answer.status, answer.reason) == ("failed", "lease lapsed and no slot is free")
    assert run_row(conn, batched.run_id) == before  # the batch was undone
    assert processors.process_claim(conn, claimed[0]).outcome == "published"
    assert processors.process_claim(conn, batched).outcome == "published"


def test_a_batch_whose_commit_waits_past_its_lease_keeps_its_slot(
    conn: Connection, db_url: str
) -> None:
    """Cap 1: a batch run in the caller's own transaction commits when the caller does,
    here after its lease (as the run row still says) has lapsed. A claim made meanwhile
    does not fill the run's slot (the batch renewing its lease would make two active
    leases under cap 1)."""
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
        assert service.claim(conn, "app", other, wait=False) is None
    assert processors.worker_status(conn)["active_leases"] == 1
    assert processors.process_claim(conn, batched).outcome == "published"


def test_a_batch_keeps_its_lease_under_a_lowered_cap(conn: Connection) -> None:
    """A lowered cap is passed until the leases above it end: a run's next batch keeps
    its active lease though the cap no longer counts it in."""
    big, other = uuid.uuid4(), users_with_work(conn, 1)[0]
    sf.history(conn, big, sessions=60, exercises=120)
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 2")
    batched = service.claim(conn, "w", big)
    assert batched is not None
    assert service.claim(conn, "app", other) is not None
    assert service.compute(conn, batched).status == "batch_pending"
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 1")
    assert service.compute(conn, batched).status == "batch_pending"
    assert processors.worker_status(conn)["active_leases"] == 2
