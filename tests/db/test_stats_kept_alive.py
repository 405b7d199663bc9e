"""A drain kept alive: it sleeps on LISTEN, the database notifies each statement that can
make stats work claimable, and the claim still decides. The drains run in threads on
connections of their own, against real PostgreSQL. A drain listens before its first
pass, so work saved before it listened is claimed by that pass, not missed."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import date

import pytest

from inventory_pipeline.db import (
    Connection,
    DatabaseUnavailable,
    connect,
    execute,
    wait_for_notify,
)
from inventory_pipeline.stats import rebuild, runbook, service
from inventory_pipeline.stats import repository as repo
from inventory_pipeline.stats.models import DrainSummary
from tests import stats_factories as sf

SESSION = date(2026, 3, 10)


class KeptAlive:
    """`keep_draining` in a thread; what it reported and how it ended."""

    def __init__(self, url: str, **limits: float) -> None:
        self.reports: list[DrainSummary] = []
        self.end: str | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(url, limits), daemon=True)
        self._thread.start()

    def _run(self, url: str, limits: dict[str, float]) -> None:
        try:
            with connect(url, application_name="kept-alive") as conn:
                self.end = service.keep_draining(
                    conn, "kept-alive", report=self.reports.append, **limits
                )
        except BaseException as exc:
            self.error = exc

    def join(self, timeout: float = 60) -> str:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the drain did not end"
        if self.error is not None:
            raise self.error
        assert self.end is not None
        return self.end

    @property
    def published(self) -> list[tuple[uuid.UUID, int, int]]:
        return [p for summary in self.reports for p in summary.published]


def until(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.05)


@pytest.fixture
def kept_alive(db_url: str) -> Iterator[Callable[..., KeptAlive]]:
    started: list[KeptAlive] = []

    def start(**limits: float) -> KeptAlive:
        drain = KeptAlive(db_url, **limits)
        started.append(drain)
        return drain

    yield start
    for drain in started:
        drain._thread.join(60)


def test_a_save_wakes_a_waiting_drain_which_publishes_it(
    conn: Connection, kept_alive: Callable[..., KeptAlive]
) -> None:
    """Nothing but the save's notification can wake it: its recheck is an hour away."""
    sf.exercise(conn, "squat")
    drain = kept_alive(idle_seconds=4, lifetime_seconds=120, recheck_seconds=3600)
    time.sleep(0.5)  # the drain found nothing and waits
    user = uuid.uuid4()
    sf.save(conn, user, SESSION, sf.sets(("squat", 100, 5)))
    until(lambda: sf.versions(conn, user) == (1, 1), timeout=15)
    second = uuid.uuid4()
    sf.save(conn, second, SESSION, sf.sets(("squat", 80, 5)))
    until(lambda: sf.versions(conn, second) == (1, 1), timeout=15)
    assert drain.join() == "idle"
    assert sorted(u for u, _, _ in drain.published) == sorted([user, second])


def test_a_merge_wakes_a_drain_whose_claim_passed_the_job_by(
    conn: Connection, db_url: str, kept_alive: Callable[..., KeptAlive]
) -> None:
    """A save merging into a pending job holds the job's row until it commits, and a
    claim passes a locked job by: the drain waits, and only the merge's own notification
    brings it back before the recheck (an hour away here)."""
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, SESSION, sf.sets(("squat", 100, 5)))
    with connect(db_url) as writer:
        with writer.transaction():
            sf.save(writer, user, SESSION, sf.sets(("squat", 110, 5)))  # merges, holds
            drain = kept_alive(idle_seconds=8, lifetime_seconds=120, recheck_seconds=3600)
            time.sleep(1.5)  # its first pass passed the held job by; it waits
            assert sf.versions(conn, user) == (1, 0)
        until(lambda: sf.versions(conn, user) == (2, 2), timeout=15)
    assert drain.join() == "idle"


def test_work_no_statement_announced_is_found_on_the_recheck(
    conn: Connection, kept_alive: Callable[..., KeptAlive]
) -> None:
    """A job enqueued without a notification (the trigger off, as for work that becomes
    claimable with time alone) is claimed at the next recheck."""
    sf.exercise(conn, "squat")
    execute(
        conn,
        "ALTER TABLE user_exercise_stats_refresh_jobs"
        " DISABLE TRIGGER user_exercise_stats_refresh_jobs_notify_enqueued",
    )
    drain = kept_alive(idle_seconds=3, lifetime_seconds=120, recheck_seconds=0.2)
    time.sleep(0.3)
    user = uuid.uuid4()
    sf.save(conn, user, SESSION, sf.sets(("squat", 100, 5)))
    until(lambda: sf.versions(conn, user) == (1, 1), timeout=10)
    assert drain.join() == "idle"


def test_an_idle_drain_ends_and_reports_what_it_did_once(
    conn: Connection, kept_alive: Callable[..., KeptAlive]
) -> None:
    sf.exercise(conn, "squat")
    users = [uuid.uuid4() for _ in range(3)]
    for user in users:
        sf.save(conn, user, SESSION, sf.sets(("squat", 100, 5)))
    drain = kept_alive(idle_seconds=1, lifetime_seconds=120)
    assert drain.join() == "idle"
    # One report: the publications came within the report interval of each other.
    assert len(drain.reports) == 1
    assert sorted(u for u, _, _ in drain.published) == sorted(users)


def test_a_drain_ends_at_its_lifetime_though_work_keeps_coming(
    conn: Connection, kept_alive: Callable[..., KeptAlive]
) -> None:
    sf.exercise(conn, "squat")
    drain = kept_alive(idle_seconds=60, lifetime_seconds=2, report_seconds=0.5)
    deadline = time.monotonic() + 30
    while drain._thread.is_alive() and time.monotonic() < deadline:
        sf.save(conn, uuid.uuid4(), SESSION, sf.sets(("squat", 100, 5)))
        time.sleep(0.1)
    assert drain.join() == "lifetime"
    # Reported as it went, not only at the end.
    assert len(drain.reports) >= 2 and drain.published


def test_pausing_the_worker_ends_a_waiting_drain_at_once(
    conn: Connection, kept_alive: Callable[..., KeptAlive]
) -> None:
    """The pause is a settings change: it notifies, the drain's pass claims nothing and
    finds the worker paused. Work saved meanwhile stays pending for after the resume."""
    sf.exercise(conn, "squat")
    drain = kept_alive(idle_seconds=600, lifetime_seconds=600, recheck_seconds=3600)
    time.sleep(0.5)
    runbook.pause(conn)
    assert drain.join(timeout=30) == "paused"
    user = uuid.uuid4()
    sf.save(conn, user, SESSION, sf.sets(("squat", 100, 5)))
    assert kept_alive(idle_seconds=600, lifetime_seconds=600).join(timeout=30) == "paused"
    assert sf.versions(conn, user) == (1, 0)
    runbook.resume(conn)
    assert kept_alive(idle_seconds=0.5, lifetime_seconds=600).join() == "idle"
    assert sf.versions(conn, user) == (1, 1)


def test_the_database_notifies_each_statement_that_can_make_work_claimable(
    conn: Connection, db_url: str
) -> None:
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    with connect(db_url) as listener:
        repo.listen_for_work(listener)

        def notified() -> bool:
            return wait_for_notify(listener, 2)

        def quiet() -> bool:
            return not wait_for_notify(listener, 0.2)

        saved = sf.save(conn, user, SESSION, sf.sets(("squat", 100, 5)))
        assert notified(), "a save"
        assert quiet(), "one wakeup answers for all notifications waiting"
        # The live job ending frees its lease slot (and its user's successor).
        claimed = service.claim(conn, "test")
        assert claimed is not None
        assert quiet(), "a claim makes nothing claimable"
        sf.save(conn, user, SESSION, sf.sets(("squat", 110, 5)))  # a successor
        assert notified()
        assert service.process(conn, claimed).outcome == "published"
        assert notified(), "a job ending with a successor, which becomes claimable"
        assert len(service.drain(conn, "test").published) == 1  # the successor
        # A job ending with none frees only a lease slot, which a drain waiting for one
        # finds at its recheck: no commit takes the notify queue's lock for it.
        assert quiet(), "a job ending with no successor"
        sf.save(conn, user, SESSION, sf.sets(("squat", 120, 5)))
        assert notified()
        sf.save(conn, user, SESSION, sf.sets(("squat", 130, 5)))
        assert notified(), "a merge into a pending job"
        service.drain(conn, "test")
        assert quiet()
        sf.delete(conn, user, saved["session_id"])
        assert notified(), "a delete"
        service.drain(conn, "test")
        assert quiet()
        rebuild.request_rebuild(conn, [user])
        assert notified(), "a rebuild request"
        runbook.pause(conn)
        assert notified(), "a settings change"
        runbook.resume(conn)
        assert notified(), "the pause lifted"
        # A write rolled back notifies nothing.
        with pytest.raises(RuntimeError), conn.transaction():
            sf.save(conn, uuid.uuid4(), SESSION, sf.sets(("squat", 100, 5)))
            raise RuntimeError("rolled back")
        assert quiet()


def test_a_drain_reports_each_failed_attempt_with_its_reason(conn: Connection, db_url: str) -> None:
    """What an operator reads in the drain's log: the user, the outcome and the reason."""
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, SESSION, sf.sets(("squat", 100, 5)))
    execute(conn, "UPDATE stats_projection_worker_settings SET compute_budget_ms = 300")
    with connect(db_url) as blocker, blocker.transaction():
        execute(blocker, "LOCK TABLE stats_output_exercise IN EXCLUSIVE MODE")
        summary = service.drain(conn, "test")
    assert summary.interrupted == 1
    assert summary.failures == ((user, "interrupted", "compute: statement budget spent (57014)"),)


def test_a_long_pass_reports_as_it_goes(
    conn: Connection, kept_alive: Callable[..., KeptAlive]
) -> None:
    """A backlog is drained in passes cut at each report time, so what was published
    shows while the backlog lasts, not only once it is gone; a cut pass is no idle one,
    even for a drain that ends at the first pass finding nothing (idle 0, a launchpad
    drain)."""
    sf.exercise(conn, "squat")
    users = [uuid.uuid4() for _ in range(40)]
    for user in users:
        sf.save(conn, user, SESSION, sf.sets(("squat", 100, 5)))
    drain = kept_alive(idle_seconds=0, lifetime_seconds=120, report_seconds=0.05)
    assert drain.join() == "idle"
    assert len(drain.reports) >= 2
    assert sorted(u for u, _, _ in drain.published) == sorted(users)


def test_what_a_drain_did_is_reported_on_its_way_out_of_an_error(
    conn: Connection, kept_alive: Callable[..., KeptAlive]
) -> None:
    """Its session ends (a restart, a network fault): the drain raises, after reporting
    what it published since its last report."""
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, SESSION, sf.sets(("squat", 100, 5)))
    drain = kept_alive(idle_seconds=60, lifetime_seconds=120, report_seconds=3600)
    until(lambda: sf.versions(conn, user) == (1, 1))
    assert drain.reports == []
    execute(
        conn,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE application_name = 'kept-alive' AND datname = current_database()",
    )
    with pytest.raises(DatabaseUnavailable):
        drain.join()
    assert [u for u, _, _ in drain.published] == [user]


def test_a_successor_job_waits_from_when_the_job_before_it_ended(conn: Connection) -> None:
    """A save made while the user's job is live goes into a successor job, claimable only
    once that job ends: its wait, which tells the sensor whether the drain keeps up, is
    measured from then, not from when it was enqueued (before, a successor enqueued 40 s
    earlier read as 40 s behind the moment it became claimable)."""
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, SESSION, sf.sets(("squat", 100, 5)))
    claimed = service.claim(conn, "w")
    assert claimed is not None
    sf.save(conn, user, SESSION, sf.sets(("squat", 110, 5)))
    execute(
        conn, "UPDATE user_exercise_stats_refresh_jobs SET created_at = now() - interval '40 s'"
    )
    assert service.work_waiting(conn).waiting == 0
    assert service.process(conn, claimed).outcome == "published"
    work = service.work_waiting(conn)
    assert work.waiting == 1 and work.oldest_wait_seconds < 5
