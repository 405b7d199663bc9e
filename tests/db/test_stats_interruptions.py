"""A stage call that a statement timeout, a cancel, a lock timeout or a deadlock ends is
rolled back whole; its worker gives the run back at once, so no lease slot is held while
nobody works on it: the attempt is counted (57014, 55P03) or the run is due again at
once (40P01), the SQLSTATE is recorded, and the worker and its session go on."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import date
from typing import Any

import pytest

from inventory_pipeline.db import Connection, QueryCanceled, connect, execute, fetch_one
from inventory_pipeline.stats import service
from inventory_pipeline.stats.models import StatsClaim
from tests import stats_factories as sf

D = date(2026, 3, 10)


def users_with_work(conn: Connection, count: int) -> list[uuid.UUID]:
    sf.exercise(conn, "squat")
    users = [uuid.uuid4() for _ in range(count)]
    for user in users:
        sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    return users


def backend_pid(conn: Connection) -> int:
    row = fetch_one(conn, "SELECT pg_backend_pid() AS pid")
    assert row is not None
    return int(row["pid"])


def wait_for_lock_wait(conn: Connection, pid: int) -> None:
    for _ in range(1000):
        row = fetch_one(conn, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,))
        if row is not None and row["wait_event_type"] == "Lock":
            return
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never waited on a lock")


def run(conn: Connection, user: uuid.UUID) -> dict[str, Any]:
    row = fetch_one(
        conn,
        "SELECT r.id, r.phase, r.attempts, r.retry_not_before > now() AS backing_off,"
        " r.retry_not_before <= now() AS due, r.error, r.error_sqlstate,"
        " EXISTS (SELECT 1 FROM stats_lease_slots l WHERE l.run_id = r.id"
        "         AND l.lease_until > now()) AS holds_slot"
        " FROM user_stats_projection_runs r WHERE r.user_id = %s ORDER BY r.id DESC LIMIT 1",
        (user,),
    )
    assert row is not None
    return dict(row)


def published(conn: Connection, users: list[uuid.UUID]) -> list[bool]:
    return [sf.versions(conn, u)[1] > 0 for u in users]


@contextmanager
def in_thread(work: Callable[[], Any]) -> Iterator[list[Any]]:
    """Run `work` in a thread; the block's end waits for it. The list holds its result
    or the exception it raised."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(work())
        except BaseException as exc:  # judged by the caller
            out.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    try:
        yield out
    finally:
        thread.join(timeout=60)
        assert not thread.is_alive()


def test_a_publication_that_times_out_on_a_held_user_frees_its_slot_for_other_users(
    conn: Connection, db_url: str
) -> None:
    """Cap 2. An application transaction holds the state rows of users A and B (a save
    not yet committed) while their runs publish: each publication waits for its row,
    spends its budget and is given back as a failed attempt with its SQLSTATE, freeing
    its slot, and user C is published meanwhile. (Before, each timeout left its run
    holding a slot under a live lease for five minutes: two filled the cap and C was
    never claimed.)"""
    execute(conn, "UPDATE stats_projection_worker_settings SET publish_budget_ms = 300")
    a, b, c = users_with_work(conn, 3)
    with connect(db_url) as worker, connect(db_url) as app, app.transaction():
        execute(
            app,
            "SELECT 1 FROM user_stats_refresh_state WHERE user_id IN (%s, %s) FOR UPDATE",
            (a, b),
        )
        summary = service.drain(worker, "w")
        assert published(conn, [a, b, c]) == [False, False, True]
        assert summary.interrupted == 2 and len(summary.published) == 1
        reasons = [reason for _, outcome, reason in summary.failures if outcome == "interrupted"]
        assert len(reasons) == 2 and all("statement budget spent (57014)" in r for r in reasons)
        for user in (a, b):
            given = run(conn, user)
            assert given["phase"] == "computed" and given["backing_off"]
            assert given["attempts"] == 2 and given["error_sqlstate"] == "57014"
            assert not given["holds_slot"]
        assert fetch_one(worker, "SELECT 1 AS usable") == {"usable": 1}


def test_a_lock_timeout_in_a_publication_is_a_failed_attempt(conn: Connection, db_url: str) -> None:
    """An operator's lock_timeout on the worker's role ends the publication's wait with
    55P03: a failed attempt with its SQLSTATE, the slot free."""
    (user,) = users_with_work(conn, 1)
    with connect(db_url) as worker, connect(db_url) as app, app.transaction():
        execute(worker, "SET lock_timeout = '200ms'")
        claimed = service.claim(worker, "w")
        assert claimed is not None and service.compute(worker, claimed).status == "computed"
        execute(
            app, "SELECT 1 FROM user_stats_refresh_state WHERE user_id = %s FOR UPDATE", (user,)
        )
        publication = service.publish(worker, claimed)
    assert publication.status == "retry_pending" and publication.interrupted
    assert publication.reason == "publish: lock wait timed out (55P03)"
    given = run(conn, user)
    assert given["error_sqlstate"] == "55P03" and given["attempts"] == 2
    assert not given["holds_slot"]


def test_a_deadlocked_publication_is_due_again_at_once(conn: Connection, db_url: str) -> None:
    """A publication chosen as a deadlock's victim is given back due at once, with no
    attempt counted; the next claim resumes it and publishes."""
    (user,) = users_with_work(conn, 1)
    with connect(db_url) as worker, connect(db_url) as other:
        claimed = service.claim(worker, "w")
        assert claimed is not None and service.compute(worker, claimed).status == "computed"
        pid = backend_pid(worker)
        with other.transaction():
            # The other transaction waits longest before it looks for a deadlock, so the
            # publication (waiting first) is the victim.
            execute(other, "SET LOCAL deadlock_timeout = '10s'")
            execute(
                other,
                "SELECT 1 FROM user_stats_refresh_state WHERE user_id = %s FOR UPDATE",
                (user,),
            )
            with in_thread(lambda: service.publish(worker, claimed)) as out:
                wait_for_lock_wait(conn, pid)
                # The publication holds the user's worker lock while it waits for the row.
                execute(other, "SELECT pg_advisory_xact_lock(stats_user_lock(%s))", (user,))
        (publication,) = out
        assert publication.status == "retry_pending" and publication.interrupted
        assert publication.reason == "publish: deadlock (40P01)"
        given = run(conn, user)
        assert given["due"] and given["attempts"] == 1 and given["error_sqlstate"] == "40P01"
        assert not given["holds_slot"]
        assert len(service.drain(worker, "w").published) == 1
    assert published(conn, [user]) == [True]


# Each statement of each stage, and what a session holds to keep it waiting there: the
# arming statement reads the settings row's table, the claim locks lease slots, the
# compute reads the training log, the publication takes the user's state row.
HOLD_ARM = "LOCK TABLE stats_projection_worker_settings IN ACCESS EXCLUSIVE MODE"
HOLD_CALL = {
    "claim": "LOCK TABLE stats_lease_slots IN ACCESS EXCLUSIVE MODE",
    "compute": "LOCK TABLE training_sets IN ACCESS EXCLUSIVE MODE",
    "publish": "SELECT 1 FROM user_stats_refresh_state FOR UPDATE",
}


@pytest.mark.parametrize("statement", ["arm", "call"])
@pytest.mark.parametrize("stage", ["claim", "compute", "publish"])
def test_a_cancel_of_any_statement_of_any_stage_leaves_nothing_held(
    conn: Connection, db_url: str, stage: str, statement: str
) -> None:
    """An operator cancels the statement a stage call waits in. A claim is made again;
    a compute or publication is given back as a failed attempt (57014, a cancel: its
    budget was not spent) with its slot free. The worker's session stays usable and,
    under a cap of 1, its next claim takes another user's work."""
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 1")
    first, second = users_with_work(conn, 2)
    with connect(db_url) as worker, connect(db_url) as holder:
        claimed: StatsClaim | None = None
        if stage != "claim":
            claimed = service.claim(worker, "w")
            assert claimed is not None and claimed.user_id == first
            if stage == "publish":
                assert service.compute(worker, claimed).status == "computed"
        pid = backend_pid(worker)

        def call() -> Any:
            if stage == "claim":
                return service.claim(worker, "w")
            assert claimed is not None
            return getattr(service, stage)(worker, claimed)

        execute(holder, "BEGIN")
        execute(holder, HOLD_ARM if statement == "arm" else HOLD_CALL[stage])
        with in_thread(call) as out:
            wait_for_lock_wait(conn, pid)
            execute(conn, "SELECT pg_cancel_backend(%s)", (pid,))
            execute(holder, "COMMIT")  # let go before the call is waited for
        (answer,) = out
        assert not isinstance(answer, BaseException), answer
        if stage == "claim":
            assert isinstance(answer, StatsClaim) and answer.user_id == first
        else:
            assert answer.status == "retry_pending" and answer.interrupted
            assert answer.reason == f"{stage}: canceled (57014)"
            given = run(conn, first)
            assert given["backing_off"] and given["attempts"] == 2
            assert given["error_sqlstate"] == "57014" and not given["holds_slot"]
            summary = service.drain(worker, "w")
            assert [user for user, _, _ in summary.published] == [second]


def test_a_worker_whose_batch_run_was_resumed_elsewhere_gives_nothing_back(
    conn: Connection, db_url: str
) -> None:
    """A batch run keeps its lease token when a claim resumes it after its lease lapsed.
    The first worker, back from a stall, meets a cancel and gives back: it no longer
    holds the run, so nothing is written and the resuming worker's lease stays live."""
    user = uuid.uuid4()
    sf.history(conn, user, sessions=40, exercises=120)
    with connect(db_url) as stalled, connect(db_url) as other:
        first = service.claim(stalled, "stalled")
        assert first is not None and service.compute(stalled, first).status == "batch_pending"
        sf.expire_run(conn, first.run_id, first.lease_token)
        second = service.claim(other, "other")
        assert second is not None and second.lease_token == first.lease_token
        canceled = QueryCanceled("canceling statement due to user request", "57014")
        given = service.give_back(stalled, first, "compute", canceled)
        assert given.status == "lost"
        resumed = run(conn, user)
        assert resumed["holds_slot"] and resumed["backing_off"] is None
        assert resumed["error"] is None
        assert service.compute(other, second).status == "batch_pending"


def test_claims_that_keep_failing_are_not_nothing_to_claim(conn: Connection, db_url: str) -> None:
    """Every claim runs out of its budget (a session holds the lease slots' table): after
    five in a row the drain's pass ends saying so, rather than reading as nothing to
    claim; a drain kept alive does not end as idle meanwhile, and once the table is let
    go its next pass publishes."""
    execute(conn, "UPDATE stats_projection_worker_settings SET claim_budget_ms = 100")
    (user,) = users_with_work(conn, 1)
    with connect(db_url) as worker, connect(db_url) as holder:
        execute(holder, "BEGIN")
        execute(holder, "LOCK TABLE stats_lease_slots IN ACCESS EXCLUSIVE MODE")
        summary = service.drain(worker, "w")
        assert summary.rounds == 0 and summary.claim_error is not None
        assert summary.claim_error.startswith("5 claims in a row failed (57014)")
        reports: list[Any] = []

        def kept_alive() -> Any:
            return service.keep_draining(
                worker,
                "w",
                idle_seconds=0.5,
                lifetime_seconds=60,
                report=reports.append,
                report_seconds=0.1,
                recheck_seconds=0.2,
            )

        with in_thread(kept_alive) as out:
            time.sleep(1.5)  # three idle limits of failing claims
            execute(holder, "COMMIT")
            deadline = time.monotonic() + 30
            while sf.versions(conn, user) != (1, 1) and time.monotonic() < deadline:
                time.sleep(0.05)
        assert out == ["idle"]
        assert any(r.claim_error for r in reports)
        assert [u for r in reports for u, _, _ in r.published] == [user]
