"""Fleet-wide throttling over real loopback HTTP: a 429 pauses the shared admission
limiter for every process; a run stops taking items, gives back the claims it has not
sent without counting an attempt, and the requests that reach the provider are bounded
by those already in flight, not by the batch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from inventory_pipeline.credentials import service as credentials
from inventory_pipeline.db import Connection, connect, execute, fetch_one
from inventory_pipeline.provider import admission
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service
from inventory_pipeline.recovery.policy import RetryPolicy
from tests import factories as f
from tests.conftest import TMDB_TEST_KEY

POLICY = RetryPolicy()
WORKERS = 8
ITEMS = 400


def pause_seconds(conn: Connection) -> float:
    row = fetch_one(
        conn,
        "SELECT GREATEST(0, EXTRACT(epoch FROM paused_until - clock_timestamp()))::float AS s"
        " FROM provider_admission WHERE bucket = 'tmdb'",
    )
    assert row is not None
    return float(row["s"] or 0)


def end_pause(conn: Connection) -> None:
    """The test clock: the pause has run out."""
    execute(
        conn,
        "UPDATE provider_admission SET paused_until = clock_timestamp() - interval '1 second'",
    )


def totals(conn: Connection) -> dict[str, int]:
    row = fetch_one(
        conn,
        "SELECT sum(observation_attempts)::int AS attempts,"
        " count(*) FILTER (WHERE recovery_case_id IS NOT NULL)::int AS cases,"
        " count(*) FILTER (WHERE observation_lease_token IS NOT NULL)::int AS leased"
        " FROM media_server_items",
    )
    assert row is not None
    return row


@pytest.fixture
def backlog(conn: Connection) -> int:
    f.provider_key(conn, TMDB_TEST_KEY)
    lib = f.library(conn)
    f.items(conn, lib, ITEMS, seed=3)
    admission.set_rate(conn, 1000)
    return lib


@pytest.mark.parametrize("retry_after", [None, "30"])
def test_a_throttle_storm_is_bounded_by_requests_in_flight(
    conn: Connection, db_url: str, standin: StandIn, backlog: int, retry_after: str | None
) -> None:
    standin.set_fault("throttle", retry_after=retry_after)  # 429 to everything
    with TmdbClient(standin.url, timeout_seconds=2.0) as client:
        summary = service.observe(lambda: connect(db_url), client, POLICY, workers=WORKERS)
    sent = len(standin.state.arrivals)
    assert 1 <= sent <= WORKERS  # not the batch, not the backlog
    # Every request that was answered 429 is one throttled case; every claim that was
    # never sent went back without an attempt, a case or a lease.
    assert summary.by_category.get("throttled") == sent
    assert totals(conn) == {"attempts": sent, "cases": sent, "leased": 0}
    assert service.due_items(conn) == ITEMS - sent
    # The pause is the fleet's: another session is refused admission at once.
    paused = pause_seconds(conn)
    if retry_after is None:
        assert 0 < paused <= admission.DEFAULT_PAUSE_SECONDS
    else:
        assert 25 < paused <= 30
    with connect(db_url) as other, pytest.raises(admission.AdmissionPaused):
        admission.acquire(other)
    # A run during the pause takes nothing and sends nothing.
    with TmdbClient(standin.url, timeout_seconds=2.0) as client:
        again = service.observe(lambda: connect(db_url), client, POLICY, workers=WORKERS)
    assert again.results == () and len(standin.state.arrivals) == sent
    # When the pause is over and the provider answers again, the backlog drains.
    standin.clear_fault()
    end_pause(conn)
    with TmdbClient(standin.url, timeout_seconds=2.0) as client:
        drained = service.observe(lambda: connect(db_url), client, POLICY, workers=WORKERS)
    assert drained.observed == ITEMS - sent and service.due_items(conn) == 0


@pytest.mark.parametrize(("retry_after", "pauses"), [("30", True), (None, False)])
def test_a_503_with_retry_after_pauses_the_fleet_and_one_without_does_not(
    conn: Connection,
    db_url: str,
    standin: StandIn,
    backlog: int,
    retry_after: str | None,
    pauses: bool,
) -> None:
    """A 503 that says how long the service is unavailable is provider-wide evidence, as
    a 429 is: the requests that reach the provider are those in flight, each a
    transient case, and the rest wait unsent. A 503 without Retry-After is that
    request's transient failure alone (the rule: docs/provider-recovery.md#admission-limiter)."""
    standin.set_fault("status", status=503, retry_after=retry_after)
    with TmdbClient(standin.url, timeout_seconds=2.0) as client:
        summary = service.observe(
            lambda: connect(db_url), client, POLICY, workers=WORKERS, max_items=64
        )
    sent = len(standin.state.arrivals)
    assert summary.by_category.get("transient") == sent
    if pauses:
        assert 1 <= sent <= WORKERS and 25 < pause_seconds(conn) <= 30
    else:
        assert sent == 64 and pause_seconds(conn) == 0


PAUSED_WORKER = textwrap.dedent(
    """
    import sys
    from inventory_pipeline.db import connect
    from inventory_pipeline.provider import admission

    with connect(sys.argv[1]) as conn:
        try:
            admission.acquire(conn)
        except admission.AdmissionPaused as exc:
            print(f"paused {exc.seconds:.0f}")
        else:
            print("admitted")
    """
)


def test_another_process_is_refused_while_paused(conn: Connection, db_url: str) -> None:
    admission.pause(conn, retry_after_seconds=120)
    out = subprocess.run(
        [sys.executable, "-c", PAUSED_WORKER, db_url], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("paused") and 110 <= int(out.stdout.split()[1]) <= 120
    end_pause(conn)
    out = subprocess.run(
        [sys.executable, "-c", PAUSED_WORKER, db_url], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "admitted"


def test_default_pause_grows_on_repeated_throttling_and_is_forgotten(conn: Connection) -> None:
    base = admission.DEFAULT_PAUSE_SECONDS
    admission.pause(conn)
    assert base - 2 < pause_seconds(conn) <= base
    # Answers to requests sent before the pause began are not new evidence.
    admission.pause(conn)
    assert pause_seconds(conn) <= base
    end_pause(conn)
    admission.pause(conn)  # throttled again right after the pause: twice as long
    assert 2 * base - 2 < pause_seconds(conn) <= 2 * base
    end_pause(conn)
    admission.pause(conn)
    assert 4 * base - 2 < pause_seconds(conn) <= 4 * base
    # Long after the last pause, a new 429 starts from the default again.
    execute(
        conn,
        "UPDATE provider_admission SET paused_until = clock_timestamp()"
        " - make_interval(secs => %s)",
        (admission.PAUSE_MEMORY_SECONDS + 1,),
    )
    admission.pause(conn)
    assert base - 2 < pause_seconds(conn) <= base
    # A Retry-After decides the length, never shortening a running pause.
    admission.pause(conn, retry_after_seconds=600)
    assert 595 < pause_seconds(conn) <= 600
    admission.pause(conn, retry_after_seconds=5)
    assert pause_seconds(conn) > 595
    # Growth stops at the cap.
    for _ in range(20):
        end_pause(conn)
        admission.pause(conn)
    assert pause_seconds(conn) <= admission.MAX_DEFAULT_PAUSE_SECONDS


def test_probe_throttled_pauses_the_fleet_and_waits_for_it(
    conn: Connection, standin: StandIn
) -> None:
    f.provider_key(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 1)
    standin.set_fault("throttle")
    with credentials.probe_client(standin.url) as client:
        result = credentials.verify(conn, client)
        assert result is not None and result.outcome == "throttled"
        assert pause_seconds(conn) > 0
        # While the fleet is paused nobody probes: no claim, no request, no backoff.
        execute(conn, "UPDATE credential_wakeups SET next_probe_at = NULL")
        standin.clear_fault()
        assert credentials.verify(conn, client) is None
        assert len(standin.state.arrivals) == 1
        end_pause(conn)
        verified = credentials.verify(conn, client)
    assert verified is not None and verified.outcome == "verified"


def test_unsent_claims_go_back_without_an_attempt(
    conn: Connection, standin: StandIn, backlog: int
) -> None:
    claims = service.claim(conn, 3)
    admission.pause(conn)
    with TmdbClient(standin.url, timeout_seconds=2.0) as client:
        settings = service.provider_settings(conn)
        results = [
            service.complete(conn, c, service.fetch(conn, c, client, settings), POLICY)
            for c in claims
        ]
    assert [r.outcome for r in results] == ["deferred"] * 3
    assert standin.state.arrivals == []
    assert totals(conn) == {"attempts": 0, "cases": 0, "leased": 0}
    assert service.due_items(conn) == ITEMS
