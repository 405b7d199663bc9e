"""Lapsed leases are recorded as the database takes the work back (leases/schema.sql):
for each kind of lease, the holder whose lease ran out, when, and who took the work; a
holder that finishes in time, or whose late write the fence refuses, records nothing.
`inventory-pipeline status` lists them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import date

import pytest

from inventory_pipeline import cli
from inventory_pipeline.cli import lease_lines
from inventory_pipeline.credentials import service as credentials
from inventory_pipeline.db import Connection, execute, fetch_all
from inventory_pipeline.leases import service as leases
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.profiles.models import Claim, RefreshPolicy
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.recovery.policy import RetryPolicy
from inventory_pipeline.stats import service as stats
from inventory_pipeline.stats.models import StatsClaim
from tests import factories as f
from tests import stats_factories as sf
from tests.conftest import TMDB_TEST_KEY

POLICY = RefreshPolicy()
D = date(2026, 3, 10)


@pytest.fixture
def client(standin: StandIn) -> Iterator[TmdbClient]:
    with TmdbClient(standin.url, timeout_seconds=2.0) as c:
        yield c


@pytest.fixture
def user(conn: Connection) -> uuid.UUID:
    sf.exercise(conn, "squat")
    return uuid.uuid4()


def lapsed(conn: Connection) -> list[tuple[str, str | None, str | None, str]]:
    rows = fetch_all(conn, "SELECT kind, holder, taken_by, outcome FROM lapsed_leases ORDER BY id")
    return [(r["kind"], r["holder"], r["taken_by"], r["outcome"]) for r in rows]


def claimed_request(conn: Connection) -> tuple[int, Claim]:
    """A library with items, its refresh planned and claimed: (library, claim)."""
    lib = f.library(conn)
    f.items(conn, lib, 3)
    profiles.plan(conn, POLICY)
    [claim] = profiles.claim(conn, POLICY).claims
    return lib, claim


def lapsed_stats_claim(conn: Connection, user: uuid.UUID) -> StatsClaim:
    """A save's stats run claimed by worker-a:11, whose lease then ran out."""
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    dead = stats.claim(conn, "worker-a:11")
    assert dead is not None
    sf.expire_run(conn, dead.run_id, dead.lease_token)
    return dead


def test_a_profile_request_whose_lease_ran_out_is_recorded_back_in_the_queue(
    conn: Connection,
) -> None:
    _lib, old = claimed_request(conn)
    execute(conn, "UPDATE profile_refresh_requests SET lease_expires_at = now() - interval '1s'")
    assert profiles.plan(conn, POLICY).expired == 1
    assert lapsed(conn) == [
        ("profile request", f"token {str(old.lease_token)[:8]}", None, "requeued")
    ]
    execute(conn, "UPDATE profile_refresh_requests SET available_at = now()")
    [new] = profiles.claim(conn, POLICY).claims
    assert profiles.process(conn, old, POLICY).outcome == "lost"  # the fence: nothing more
    assert profiles.process(conn, new, POLICY).outcome == "published"
    assert len(lapsed(conn)) == 1


def test_a_profile_request_whose_lease_ran_out_on_its_last_attempt_is_recorded_failed(
    conn: Connection,
) -> None:
    """The expiry failed it for good: the line says so, not "back in the queue"."""
    lib, dead = claimed_request(conn)
    execute(
        conn,
        "UPDATE profile_refresh_requests"
        " SET lease_expires_at = now() - interval '1s', max_attempts = attempts",
    )
    assert profiles.plan(conn, POLICY).expired == 1
    assert lapsed(conn) == [
        ("profile request", f"token {str(dead.lease_token)[:8]}", None, "failed")
    ]
    [line] = lease_lines(leases.overview(conn))[1:]
    assert (
        f"profile request {dead.request_id} for library {lib}: lease of token"
        f" {str(dead.lease_token)[:8]} ran out"
    ) in line
    assert line.endswith(", failed for good (it was the last attempt)")


def broken(columns: object, rows: object) -> dict[str, object]:
    raise ValueError("generation blew up")


def test_a_holders_own_late_failure_report_is_not_a_lapse(conn: Connection) -> None:
    """Until the planner's expiry runs, a holder whose lease ran out still holds its
    token: its failure report is its own, not work taken back."""
    _lib, claim = claimed_request(conn)
    execute(conn, "UPDATE profile_refresh_requests SET lease_expires_at = now() - interval '1s'")
    assert profiles.process(conn, claim, POLICY, broken).outcome == "failed"
    assert profiles.plan(conn, POLICY).expired == 0
    assert lapsed(conn) == []


def test_a_request_finished_in_time_records_nothing(conn: Connection) -> None:
    _lib, claim = claimed_request(conn)
    assert profiles.process(conn, claim, POLICY).outcome == "published"
    assert profiles.plan(conn, POLICY).expired == 0
    assert lapsed(conn) == []


def test_a_stats_run_whose_lease_lapsed_is_recorded_with_its_holder(
    conn: Connection, user: uuid.UUID
) -> None:
    dead = lapsed_stats_claim(conn, user)
    assert len(stats.drain(conn, "worker-b:22").published) == 1
    assert lapsed(conn) == [("stats run", "worker-a:11", None, "restarted")]
    assert stats.compute(conn, dead).status == "lost"
    overview = leases.overview(conn)
    assert overview.lapsed == {"stats run": 1} and overview.expired["stats run"] == 0
    lines = lease_lines(overview)
    assert lines[0].startswith("lapsed leases        1 taken back in the last hour: stats run 1")
    assert f"stats run {dead.run_id} for user {user}: lease of worker-a:11 ran out" in lines[1]
    assert lines[1].endswith(", its job restarted under a new run")


def test_a_stats_run_whose_lease_lapsed_on_its_jobs_last_attempt_is_recorded_failed(
    conn: Connection, user: uuid.UUID
) -> None:
    """The claim that retires it counts one more attempt and fails the job for good."""
    lapsed_stats_claim(conn, user)
    execute(conn, "UPDATE stats_projection_worker_settings SET max_attempts = 1")
    assert stats.drain(conn, "worker-b:22").published == ()
    status = fetch_all(conn, "SELECT status FROM user_exercise_stats_refresh_jobs")
    assert [r["status"] for r in status] == ["failed"]
    assert lapsed(conn) == [("stats run", "worker-a:11", None, "failed")]
    [line] = lease_lines(leases.overview(conn))[1:]
    assert line.endswith(", failed for good (it was the last attempt)")


def lapsed_batch_claim(conn: Connection, user: uuid.UUID, owner: str) -> StatsClaim:
    """A large account's run claimed by `owner`, its first batch step committed, whose
    lease then ran out (a batch run is resumed under its own token, not retired)."""
    sf.history(conn, user, sessions=40, exercises=120)
    dead = stats.claim(conn, owner)
    assert dead is not None and stats.compute(conn, dead).status == "batch_pending"
    sf.expire_run(conn, dead.run_id, dead.lease_token)
    return dead


def test_a_batch_run_taken_back_by_its_own_holder_is_recorded(
    conn: Connection, user: uuid.UUID
) -> None:
    """The same worker, back from a stall, resumes its own lapsed batch run: the lapse
    (and the attempt it consumed) is recorded, taken by that worker."""
    dead = lapsed_batch_claim(conn, user, "worker-a:11")
    resumed = stats.claim(conn, "worker-a:11")
    assert resumed is not None and resumed.run_id == dead.run_id
    assert lapsed(conn) == [("stats run", "worker-a:11", "worker-a:11", "taken")]


def test_a_batch_run_that_lapsed_on_its_last_attempt_is_recorded_failed(
    conn: Connection, user: uuid.UUID
) -> None:
    """The claim that resumes it counts one more attempt, and its compute then fails the
    job for good: the line says so, not "taken by"."""
    lapsed_batch_claim(conn, user, "worker-a:11")
    execute(conn, "UPDATE stats_projection_worker_settings SET max_attempts = 1")
    assert stats.drain(conn, "worker-b:22").failed == 1
    status = fetch_all(conn, "SELECT status FROM user_exercise_stats_refresh_jobs")
    assert [r["status"] for r in status] == ["failed"]
    assert lapsed(conn) == [("stats run", "worker-a:11", None, "failed")]
    [line] = lease_lines(leases.overview(conn))[1:]
    assert line.endswith(", failed for good (it was the last attempt)")


def test_a_stats_run_published_in_time_records_nothing(conn: Connection, user: uuid.UUID) -> None:
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    assert len(stats.drain(conn, "worker-a:11").published) == 1
    assert lapsed(conn) == []


def test_an_observation_lease_taken_over_is_recorded(conn: Connection) -> None:
    f.provider_key(conn, TMDB_TEST_KEY)
    item = f.tmdb_item(conn, f.library(conn), 9)
    [dead] = recovery.claim(conn, 1)
    execute(
        conn,
        "UPDATE media_server_items SET observation_lease_expires_at = now() - interval '1s'"
        " WHERE id = %s",
        (item,),
    )
    assert leases.overview(conn).expired["observation"] == 1
    [fresh] = recovery.claim(conn, 1)
    assert lapsed(conn) == [
        (
            "observation",
            f"token {str(dead.lease_token)[:8]}",
            f"token {str(fresh.lease_token)[:8]}",
            "taken",
        )
    ]


def test_an_observation_completed_in_time_records_nothing(
    conn: Connection, client: TmdbClient
) -> None:
    f.provider_key(conn, TMDB_TEST_KEY)
    f.tmdb_item(conn, f.library(conn), 9)
    [claim] = recovery.claim(conn, 1)
    settings = recovery.provider_settings(conn)
    result = recovery.observe_claim(conn, claim, client, settings, RetryPolicy())
    assert result.outcome == "observed"
    assert lapsed(conn) == []


def test_a_credential_probe_lease_taken_over_is_recorded(conn: Connection) -> None:
    execute(conn, "UPDATE provider_settings SET api_key = %s, active = true", (TMDB_TEST_KEY,))
    f.auth_cases(conn, f.library(conn), 1)
    dead = credentials.claim_probe(conn)
    assert dead is not None
    execute(conn, "UPDATE credential_wakeups SET probe_lease_expires_at = now() - interval '1s'")
    live = credentials.claim_probe(conn)
    assert live is not None
    assert lapsed(conn) == [
        (
            "credential probe",
            f"token {str(dead.lease_token)[:8]}",
            f"token {str(live.lease_token)[:8]}",
            "taken",
        )
    ]
    assert not credentials.complete_probe(conn, dead, "verified", None).accepted
    assert len(lapsed(conn)) == 1


def test_the_ledger_keeps_a_week(conn: Connection, user: uuid.UUID) -> None:
    execute(
        conn,
        "INSERT INTO lapsed_leases (kind, work, holder, lapsed_at, taken_by, taken_at, outcome)"
        " VALUES ('stats run', 'run 1 of user x', 'old', now() - interval '8 days', NULL,"
        " now() - interval '8 days', 'restarted')",
    )
    lapsed_stats_claim(conn, user)
    stats.drain(conn, "worker-b:22")
    assert [holder for _, holder, _, _ in lapsed(conn)] == ["worker-a:11"]


def test_status_shows_whose_lease_lapsed_and_who_took_the_work(
    conn: Connection,
    db_url: str,
    user: uuid.UUID,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in ("INVENTORY_DAGSTER_STORAGE_URL", "DAGSTER_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("INVENTORY_DATABASE_URL", db_url)
    dead = lapsed_stats_claim(conn, user)
    assert cli.main(["status"]) == 0
    waiting = [x for x in capsys.readouterr().out.splitlines() if x.startswith("lapsed leases")]
    assert waiting == [
        "lapsed leases        0 taken back in the last hour: none;"
        " run out, not yet taken back: stats run 1"
    ]
    assert cli.main(["stats", "drain"]) == 0  # a second host's drain takes it
    out = capsys.readouterr().out.splitlines()
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, x in enumerate(out) if x.startswith("lapsed leases"))
    assert out[start] == (
        "lapsed leases        1 taken back in the last hour: stats run 1;"
        " run out, not yet taken back: none"
    )
    latest = out[start + 1]
    assert f"stats run {dead.run_id} for user {user}: lease of worker-a:11 ran out" in latest
