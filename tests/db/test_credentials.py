"""Verified credential wakeups on real PostgreSQL and the loopback stand-in."""

from __future__ import annotations

import threading
import tracemalloc
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from uuid import uuid4

import pytest

from inventory_pipeline.credentials import repository, service
from inventory_pipeline.credentials.models import ProbeNotSent
from inventory_pipeline.db import (
    Connection,
    LockNotAvailable,
    connect,
    execute,
    fetch_all,
    fetch_one,
)
from inventory_pipeline.provider.standin import StandIn, encoded
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.recovery.policy import RetryPolicy
from tests import factories as f
from tests.conftest import TMDB_TEST_KEY


@pytest.fixture
def client(standin: StandIn) -> Iterator[TmdbClient]:
    with service.probe_client(standin.url) as c:
        yield c


def generation(conn: Connection) -> object:
    row = fetch_one(conn, "SELECT credential_generation AS g FROM provider_settings")
    assert row is not None
    return row["g"]


def wakeup(conn: Connection) -> dict[str, object]:
    row = fetch_one(conn, "SELECT * FROM credential_wakeups")
    assert row is not None
    return row


def save(
    conn: Connection, key: str | None, active: bool = True, language: str | None = None
) -> None:
    execute(
        conn,
        "UPDATE provider_settings SET api_key = %s, active = %s, language = %s",
        (key, active, language),
    )


def verified(conn: Connection, client: TmdbClient) -> None:
    result = service.verify(conn, client)
    assert result is not None and result.outcome == "verified" and result.accepted


def test_generation_changes_only_with_key_or_active(conn: Connection) -> None:
    assert wakeup(conn)["verified_generation"] is None  # unverified after migration
    g0 = generation(conn)
    save(conn, "key-a")
    g1 = generation(conn)
    assert g1 != g0
    save(conn, "key-a", language="fr-FR")  # language only
    save(conn, "key-a", language="fr-FR")  # same values
    assert generation(conn) == g1
    save(conn, "key-a", active=False, language="fr-FR")
    g2 = generation(conn)
    assert g2 not in (g0, g1)
    save(conn, "key-b", language="fr-FR")
    save(conn, "key-a", language="fr-FR")  # away and back
    assert generation(conn) not in (g0, g1, g2)


def test_no_probe_without_auth_cases_or_usable_key(conn: Connection, client: TmdbClient) -> None:
    save(conn, TMDB_TEST_KEY)
    assert service.claim_probe(conn) is None  # no authentication cases
    f.auth_cases(conn, f.library(conn), 1)
    save(conn, TMDB_TEST_KEY, active=False)
    assert service.claim_probe(conn) is None
    save(conn, TMDB_TEST_KEY)
    verified(conn, client)
    assert service.claim_probe(conn) is None  # already verified
    status = service.status(conn)
    assert status is not None and status.verified and status.wants_release


def test_two_workers_race_for_one_probe_lease(db_url: str, conn: Connection) -> None:
    save(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 1)
    claims: list[object] = []
    barrier = threading.Barrier(2)

    def worker() -> None:
        with connect(db_url) as c:
            barrier.wait(timeout=10)
            claims.append(service.claim_probe(c))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(c is not None for c in claims) == 1


def test_settings_saved_during_probe_invalidate_it(
    conn: Connection, db_url: str, client: TmdbClient
) -> None:
    save(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 1)
    claim = service.claim_probe(conn)
    assert claim is not None
    outcome, retry_after = service.probe(conn, claim, client)
    assert outcome == "verified"
    with connect(db_url) as writer:  # the key is edited while the probe is in flight
        save(writer, "another-key")
    result = service.complete_probe(conn, claim, outcome, retry_after)
    assert not result.accepted
    row = wakeup(conn)
    assert row["verified_generation"] is None and row["probe_lease_token"] is None


def test_expired_probe_lease_lets_another_worker_recover(
    conn: Connection, client: TmdbClient
) -> None:
    save(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 1)
    dead = service.claim_probe(conn)
    assert dead is not None and service.claim_probe(conn) is None
    execute(conn, "UPDATE credential_wakeups SET probe_lease_expires_at = now() - interval '1s'")
    live = service.claim_probe(conn)
    assert live is not None and live.lease_token != dead.lease_token
    assert not service.complete_probe(conn, dead, "verified", None).accepted
    assert wakeup(conn)["verified_generation"] is None
    outcome, retry_after = service.probe(conn, live, client)
    assert service.complete_probe(conn, live, outcome, retry_after).accepted


def test_expired_lease_cannot_complete(conn: Connection, client: TmdbClient) -> None:
    save(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 1)
    claim = service.claim_probe(conn)
    assert claim is not None
    execute(conn, "UPDATE credential_wakeups SET probe_lease_expires_at = now() - interval '1s'")
    assert not service.complete_probe(conn, claim, "verified", None).accepted
    assert wakeup(conn)["verified_generation"] is None


def test_rejected_key_backs_off_for_its_generation_only(
    conn: Connection, client: TmdbClient
) -> None:
    save(conn, "wrong-key")
    f.auth_cases(conn, f.library(conn), 1)
    result = service.verify(conn, client)
    assert result is not None and result.outcome == "auth" and result.accepted
    row = wakeup(conn)
    wait = row["next_probe_at"] - datetime.now(UTC)  # type: ignore[operator]
    assert timedelta(minutes=14) < wait <= timedelta(hours=6)
    assert service.claim_probe(conn) is None  # same generation waits
    save(conn, TMDB_TEST_KEY)  # a corrected key is a new generation: probed at once
    verified(conn, client)


def test_a_new_key_starts_its_own_failure_count(conn: Connection, client: TmdbClient) -> None:
    """Five failures of a wrong key; the corrected key's first failure waits the first
    step of the backoff (15-30 min), not the sixth (the wait doubles per failure of one
    generation: docs/credentials.md#backoff)."""
    save(conn, "wrong-key")
    f.auth_cases(conn, f.library(conn), 1)
    for failures in range(5):
        claim = service.claim_probe(conn)
        assert claim is not None and claim.probe_failures == failures
        service.complete_probe(conn, claim, "auth", None)
        execute(conn, "UPDATE credential_wakeups SET next_probe_at = now()")
    save(conn, "second-key")
    claim = service.claim_probe(conn)
    assert claim is not None and claim.probe_failures == 0
    service.complete_probe(conn, claim, "transient", None)
    row = wakeup(conn)
    assert row["probe_failures"] == 1
    wait = row["next_probe_at"] - datetime.now(UTC)  # type: ignore[operator]
    assert timedelta(minutes=14) < wait <= timedelta(minutes=30)


def test_a_probe_without_admission_in_time_is_not_sent_and_earns_nothing(
    conn: Connection, client: TmdbClient, standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limiter has no slot within the probe's admission wait: the run does not fail,
    no request goes out, the lease is given back and no outcome or backoff is kept."""
    save(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 1)
    execute(conn, "UPDATE provider_admission SET next_admission_at = now() + interval '1 hour'")
    monkeypatch.setattr(service, "PROBE_ADMISSION_SECONDS", 0.5, raising=False)
    sent = len(standin.state.paths)
    result = service.verify(conn, client)
    assert isinstance(result, ProbeNotSent), result
    assert len(standin.state.paths) == sent
    row = wakeup(conn)
    assert (row["probe_lease_token"], row["last_outcome"], row["probe_failures"]) == (None, None, 0)
    assert row["next_probe_at"] is None


def test_a_probe_the_fleet_pause_refused_is_not_sent_and_earns_nothing(
    conn: Connection, client: TmdbClient, standin: StandIn
) -> None:
    """A 429 elsewhere pauses admission after the probe was claimed: the probe is not
    sent, so nothing was verified: no outcome, no failure, no backoff; it waits for the
    pause alone and then verifies."""
    save(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 1)
    claim = service.claim_probe(conn)
    assert claim is not None
    execute(conn, "UPDATE provider_admission SET paused_until = now() + interval '5 s'")
    sent = len(standin.state.paths)
    probed = service.probe(conn, claim, client)
    assert isinstance(probed, ProbeNotSent), probed
    service.give_back_probe(conn, claim)
    assert len(standin.state.paths) == sent
    row = wakeup(conn)
    assert (row["probe_lease_token"], row["last_outcome"], row["probe_failures"]) == (None, None, 0)
    assert (row["next_probe_at"], row["throttled_until"]) == (None, None)
    assert service.verify(conn, client) is None  # the pause holds: nothing claimed
    execute(conn, "UPDATE provider_admission SET paused_until = now() - interval '1s'")
    verified(conn, client)


def test_a_probe_whose_lease_ran_out_during_admission_is_not_sent(
    conn: Connection, client: TmdbClient, standin: StandIn
) -> None:
    """Admission waits past the probe's lease (one second here): the request is not
    sent after the lease has lapsed."""
    save(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 1)
    claim = service.claim_probe(conn, lease_seconds=1)
    assert claim is not None
    execute(
        conn,
        "UPDATE provider_admission SET next_admission_at = clock_timestamp() + interval '1.5 s'",
    )
    sent = len(standin.state.paths)
    assert isinstance(service.probe(conn, claim, client), ProbeNotSent)
    assert len(standin.state.paths) == sent


def test_throttle_survives_a_key_edit(
    conn: Connection, client: TmdbClient, standin: StandIn
) -> None:
    save(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 1)
    standin.set_fault("throttle", retry_after="3600")
    result = service.verify(conn, client)
    assert (
        result is not None and result.outcome == "throttled" and result.retry_after_seconds == 3600
    )
    standin.clear_fault()
    save(conn, "edited-key")
    save(conn, TMDB_TEST_KEY)
    assert service.claim_probe(conn) is None  # editing settings is not a throttle bypass
    # The test clock: the Retry-After has passed, for the probe and for the fleet's
    # admission, which the same answer paused.
    execute(conn, "UPDATE credential_wakeups SET throttled_until = now() - interval '1s'")
    execute(conn, "UPDATE provider_admission SET paused_until = now() - interval '1s'")
    verified(conn, client)


def test_retry_after_is_capped_at_thirty_days(
    conn: Connection, client: TmdbClient, standin: StandIn
) -> None:
    save(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 1)
    standin.set_fault("throttle", retry_after=str(90 * 24 * 3600))
    result = service.verify(conn, client)
    assert result is not None and result.retry_after_seconds == 30 * 24 * 3600


@pytest.mark.parametrize(
    ("fault", "options"),
    [
        ("oversize", {}),
        ("missing", {}),
        ("garbage", {}),
        ("drip", {"delay": 0.2}),
        ("slow", {"delay": 6.0}),
    ],
)
def test_bad_configuration_answers_do_not_verify(
    conn: Connection, client: TmdbClient, standin: StandIn, fault: str, options: dict[str, object]
) -> None:
    save(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 1)
    standin.set_fault(fault, **options)
    result = service.verify(conn, client)
    assert result is not None and result.outcome in ("invalid_response", "transient")
    assert wakeup(conn)["verified_generation"] is None


def test_a_nested_gzip_bomb_is_a_recorded_invalid_answer(
    conn: Connection, client: TmdbClient, standin: StandIn
) -> None:
    """A configuration answer of a few hundred bytes that decodes to 256 MiB (gzip inside
    gzip): refused within the body limit, recorded as an invalid answer with its backoff,
    and the probe lease given back."""
    save(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 1)
    standin.set_fault("encoded", encoding=("gzip", "gzip"), size=256 * 1024 * 1024)
    encoded(("gzip", "gzip"), 256 * 1024 * 1024, None)  # coded before the measurement
    tracemalloc.start()
    try:
        result = service.verify(conn, client)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024, f"{peak / 2**20:.0f} MiB held"
    assert result is not None and result.outcome == "invalid_response"
    row = wakeup(conn)
    assert (row["verified_generation"], row["probe_lease_token"]) == (None, None)
    assert (row["last_outcome"], row["probe_failures"]) == ("invalid_response", 1)
    assert row["next_probe_at"] is not None


def released(conn: Connection) -> list[int]:
    rows = fetch_all(
        conn,
        "SELECT id FROM media_server_items WHERE recovery_wakeup_generation IS NOT NULL"
        " ORDER BY id",
    )
    return [r["id"] for r in rows]


def allow_next_batch(conn: Connection) -> None:
    execute(conn, "UPDATE credential_wakeups SET last_release_at = now() - interval '61 seconds'")


def test_release_batches_receipts_and_spacing(
    conn: Connection, db_url: str, client: TmdbClient
) -> None:
    save(conn, TMDB_TEST_KEY)
    lib = f.library(conn)
    cases = f.auth_cases(conn, lib, 250)
    before = {r["id"]: r for r in fetch_all(conn, "SELECT * FROM media_server_items")}
    verified(conn, client)
    first = service.release(conn)
    assert first is not None and first.released == 100 and first.cursor == cases[99]
    assert service.release(conn) is None  # at least a minute apart
    allow_next_batch(conn)
    with connect(db_url) as restarted:  # a restart between batches resumes at the cursor
        second = service.release(restarted)
    assert second is not None and second.released == 100
    allow_next_batch(conn)
    third = service.release(conn)
    assert third is not None and third.released == 50 and third.wrapped
    assert released(conn) == cases
    # Replay never releases an item twice for this generation.
    allow_next_batch(conn)
    replay = service.release(conn)
    assert replay is not None and replay.released == 0
    # Released, not recovered: the record is kept; only the clocks moved.
    for row in fetch_all(conn, "SELECT * FROM media_server_items"):
        old = before[row["id"]]
        assert row["recovery_resolved_at"] is None and row["recovery_category"] == "auth"
        assert row["recovery_case_id"] == old["recovery_case_id"]
        assert row["recovery_attempts"] == old["recovery_attempts"]
        assert row["provider_id"] == old["provider_id"] and row["title"] == old["title"]
        assert row["last_attempt_at"] is None
        wait = row["observation_due_at"] - datetime.now(UTC)
        assert timedelta(0) < wait <= timedelta(seconds=61)
    assert wakeup(conn)["released_total"] == 250


def test_only_valid_cases_predating_verification_qualify(
    conn: Connection, client: TmdbClient
) -> None:
    save(conn, TMDB_TEST_KEY)
    srv = f.server(conn)
    movies = f.library(conn, srv, name="movies")
    tv_shelf = f.library(conn, srv, name="tv", media_kind="tv")
    paused = f.library(conn, srv, name="paused", active=False)
    good = f.auth_cases(conn, movies, 1, 1)
    f.auth_cases(conn, tv_shelf, 1, 2)  # a movie identity in a TV library
    f.auth_cases(conn, paused, 1, 3)  # inactive library
    malformed = f.auth_cases(conn, movies, 1, 4)
    execute(
        conn,
        "UPDATE media_server_items SET provider_id = 'tt4', recovery_provider_id = 'tt4'"
        " WHERE id = %s",
        (malformed[0],),
    )
    conflict = f.auth_cases(conn, movies, 1, 5)
    execute(
        conn,
        "UPDATE media_server_items SET recovery_provider_id = '999' WHERE id = %s",
        (conflict[0],),
    )
    leased = f.auth_cases(conn, movies, 1, 6)
    execute(
        conn,
        "UPDATE media_server_items SET observation_lease_token = gen_random_uuid(),"
        " observation_lease_expires_at = now() + interval '5 minutes' WHERE id = %s",
        (leased[0],),
    )
    due_now = f.auth_cases(conn, movies, 1, 7)
    execute(
        conn,
        "UPDATE media_server_items SET observation_due_at = now() - interval '1s' WHERE id = %s",
        (due_now[0],),
    )
    not_auth = f.auth_cases(conn, movies, 1, 8)
    execute(
        conn,
        "UPDATE media_server_items SET recovery_category = 'not_found' WHERE id = %s",
        (not_auth[0],),
    )
    verified(conn, client)
    after = f.auth_cases(conn, movies, 1, 9, failed_ago="0 seconds")  # fails after verification
    execute(
        conn,
        "UPDATE media_server_items SET recovery_last_failed_at = now() + interval '1s'"
        " WHERE id = %s",
        (after[0],),
    )
    result = service.release(conn)
    assert result is not None
    assert released(conn) == good
    assert result.scanned >= 7 and result.wrapped  # advanced past everything else


def test_cursor_wraps_to_locked_rows(conn: Connection, db_url: str, client: TmdbClient) -> None:
    save(conn, TMDB_TEST_KEY)
    cases = f.auth_cases(conn, f.library(conn), 5)
    verified(conn, client)
    with connect(db_url) as holder, holder.transaction():
        execute(
            holder, "SELECT 1 FROM media_server_items WHERE id = ANY(%s) FOR UPDATE", (cases[:2],)
        )
        first = service.release(conn)
        assert first is not None and first.released == 3 and first.wrapped
    allow_next_batch(conn)
    second = service.release(conn)
    assert second is not None and second.released == 2
    assert released(conn) == cases


def test_settings_writer_lock_times_out_after_one_second(
    conn: Connection, db_url: str, client: TmdbClient, standin: StandIn
) -> None:
    save(conn, TMDB_TEST_KEY)
    lib = f.library(conn)
    f.auth_cases(conn, lib, 3)
    verified(conn, client)
    due = f.tmdb_item(conn, lib, 4242)
    with connect(db_url) as writer, writer.transaction():
        execute(writer, "UPDATE provider_settings SET language = 'de-DE'")
        with pytest.raises(LockNotAvailable):
            service.release(conn)
        # The wakeup path failed; ordinary observation still works meanwhile.
        with TmdbClient(standin.url) as observer:
            summary = recovery.observe(lambda: connect(db_url), observer, RetryPolicy())
        assert [r.item_id for r in summary.results] == [due] and summary.observed == 1
    assert released(conn) == []


def test_an_old_keys_late_401_is_released_by_the_new_keys_verification(
    conn: Connection, standin: StandIn, client: TmdbClient
) -> None:
    """A request sent with the old key answers 401 after the new key was verified: its
    case was made with an older generation and is released (docs/credentials.md#release)."""
    save(conn, "old-key")
    lib = f.library(conn)
    item = f.tmdb_item(conn, lib, 777)
    [claim] = recovery.claim(conn, 1)
    settings = recovery.provider_settings(conn)
    with TmdbClient(standin.url) as observer:
        in_flight = recovery.fetch(conn, claim, observer, settings)
    f.auth_cases(conn, lib, 1, first_tmdb_id=1)  # the case that wakes the probe
    save(conn, TMDB_TEST_KEY)
    verified(conn, client)
    late = recovery.complete(conn, claim, in_flight, RetryPolicy(), generation=settings.generation)
    assert late.outcome == "failed" and late.category == "auth"
    service.release(conn)
    assert item in released(conn)


def test_release_then_observation_resolves(
    conn: Connection, db_url: str, standin: StandIn, client: TmdbClient
) -> None:
    lib = f.library(conn)
    for n in range(5):
        f.tmdb_item(conn, lib, 500 + n)
    save(conn, "revoked-key")
    with TmdbClient(standin.url) as observer:
        summary = recovery.observe(lambda: connect(db_url), observer, RetryPolicy())
        assert summary.by_category == {"auth": 5}
        save(conn, TMDB_TEST_KEY)  # the corrected key
        verified(conn, client)
        result = service.release(conn)
        assert result is not None and result.released == 5
        execute(conn, "UPDATE media_server_items SET observation_due_at = now()")  # jitter passed
        summary = recovery.observe(lambda: connect(db_url), observer, RetryPolicy())
    assert summary.resolved == 5
    rows = fetch_all(conn, "SELECT recovery_resolved_at FROM media_server_items")
    assert all(r["recovery_resolved_at"] is not None for r in rows)


def test_the_status_and_the_claims_ask_one_condition(conn: Connection) -> None:
    """The status the sensor reads says a probe may start exactly when the probe claim
    takes the lease, and a release may run exactly when the batch authorization says so:
    each pair asks one definition, whichever clock holds the probe or the release back."""
    save(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 1)
    current = generation(conn)
    lease = {"probe_lease_token": uuid4(), "probe_generation": current}
    probe_states = {
        "nothing pending": {},
        "a live lease": {**lease, "probe_lease_expires_at": "1 minute"},
        "an expired lease": {**lease, "probe_lease_expires_at": "-1 second"},
        "a Retry-After": {"throttled_until": "1 hour"},
        "a Retry-After past": {"throttled_until": "-1 second"},
        "this generation's backoff": {"backoff_generation": current, "next_probe_at": "1 hour"},
        "its backoff past": {"backoff_generation": current, "next_probe_at": "-1 second"},
        "another generation's backoff": {"backoff_generation": uuid4(), "next_probe_at": "1 hour"},
    }
    allowed = set()
    for name, state in probe_states.items():
        set_wakeup(conn, **state)
        status = service.status(conn)
        assert status is not None
        claimed = service.claim_probe(conn) is not None
        assert status.probe_allowed == claimed, name
        if claimed:
            allowed.add(name)
    assert allowed == {
        "nothing pending",
        "an expired lease",
        "a Retry-After past",
        "its backoff past",
        "another generation's backoff",
    }
    for last_release, expected in ((None, True), ("-30 seconds", False), ("-2 minutes", True)):
        set_wakeup(conn, last_release_at=last_release)
        status = service.status(conn, release_spacing_seconds=60)
        assert status is not None and status.release_allowed is expected
        locked = repository.lock_wakeup(conn, 60)
        assert locked is not None and locked["release_allowed"] is expected


def set_wakeup(conn: Connection, **state: object) -> None:
    """Every probe and release clock cleared, then `state` (a clock as an interval from
    now, anything else as its value)."""
    clocks = ("probe_lease_expires_at", "throttled_until", "next_probe_at", "last_release_at")
    tokens = ("probe_lease_token", "probe_generation", "backoff_generation")
    values = {column: None for column in (*clocks, *tokens)}
    values.update(state)
    execute(
        conn,
        "UPDATE credential_wakeups SET"
        + ",".join(f" {c} = %({c})s" for c in tokens)
        + ","
        + ",".join(f" {c} = now() + %({c})s::interval" for c in clocks),
        values,
    )
