"""Provider observation and recovery on real PostgreSQL and real loopback HTTP: claims,
guarded completion, recovery cases, source generations, leases, the shared limiter."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from inventory_pipeline.db import Connection, connect, execute, fetch_all, fetch_one
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.profiles.models import RefreshPolicy
from inventory_pipeline.provider.models import Failure
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import repository, service
from inventory_pipeline.recovery.models import ItemClaim, ObservationResult
from inventory_pipeline.recovery.policy import RetryPolicy
from inventory_pipeline.settings import TmdbSettings
from tests import factories as f
from tests.conftest import TMDB_TEST_KEY

POLICY = RetryPolicy()


@pytest.fixture
def client(standin: StandIn) -> Iterator[TmdbClient]:
    with TmdbClient(standin.url, timeout_seconds=2.0) as c:
        yield c


@pytest.fixture
def movies(conn: Connection) -> int:
    f.provider_key(conn, TMDB_TEST_KEY)
    return f.library(conn)


def observe_one(conn: Connection, client: TmdbClient) -> tuple[ItemClaim, object]:
    [claim] = service.claim(conn, 1)
    result = service.observe_claim(conn, claim, client, service.provider_settings(conn), POLICY)
    return claim, result


def make_due(conn: Connection, item_id: int) -> None:
    execute(
        conn, "UPDATE media_server_items SET observation_due_at = now() WHERE id = %s", (item_id,)
    )


def test_observation_flows_into_profile_but_bookkeeping_does_not(
    conn: Connection, movies: int, client: TmdbClient
) -> None:
    item = f.tmdb_item(conn, movies, 603, original_language=None)
    policy = RefreshPolicy()
    profiles.refresh(conn, policy)
    revision = f.revision(conn, movies)
    # Claiming and a failure are bookkeeping only: no revision.
    [claim] = service.claim(conn, 1)
    assert f.revision(conn, movies) == revision
    result = service.observe_claim(conn, claim, client, service.provider_settings(conn), POLICY)
    assert result.outcome == "observed"
    row = f.item(conn, item)
    observed = fetch_all(conn, "SELECT * FROM provider_observations WHERE item_id = %s", (item,))
    assert observed[0]["title"] == "Movie 603"
    assert row["original_language"] == observed[0]["original_language"] is not None
    assert (row["observation_attempts"], row["observation_successes"]) == (1, 1)
    assert row["observation_lease_token"] is None
    assert row["observation_due_at"] > datetime.now(UTC) + timedelta(days=29)
    # The observed language changed the projection: exactly one revision.
    assert f.revision(conn, movies) == revision + 1


def test_not_found_case_repeats_quietly_then_resolves(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    item = f.tmdb_item(conn, movies, 404404)
    standin.set_available("movie", 404404, False)
    revision = f.revision(conn, movies)
    _, opened = observe_one(conn, client)
    assert (opened.outcome, opened.category, opened.transition) == ("failed", "not_found", "opened")
    notice = service.notice(opened)
    assert notice is not None and notice[0] == "warning"
    row = f.item(conn, item)
    assert row["recovery_category"] == "not_found" and row["recovery_attempts"] == 1
    identity = (
        row["recovery_provider"],
        row["recovery_provider_kind"],
        row["recovery_provider_id"],
    )
    assert identity == ("tmdb", "movie", "404404")
    # Never an immediate retry: not due again, at least one day-class floor away.
    assert service.claim(conn, 10) == []
    assert row["observation_due_at"] >= datetime.now(UTC) + timedelta(seconds=299)
    # A periodic recheck of the same failure updates the same case, no warning.
    make_due(conn, item)
    _, repeated = observe_one(conn, client)
    assert repeated.transition == "repeated" and service.notice(repeated) is None
    assert repeated.case_id == opened.case_id and repeated.attempts == 2
    # The cause changes: a warning, same case.
    make_due(conn, item)
    standin.set_fault("status", status=503)
    _, changed = observe_one(conn, client)
    assert changed.transition == "cause_changed" and changed.case_id == opened.case_id
    assert service.notice(changed)[0] == "warning"  # type: ignore[index]
    # The identity becomes available: the next recheck resolves the case (one info).
    standin.clear_fault()
    standin.set_available("movie", 404404, True)
    make_due(conn, item)
    _, resolved = observe_one(conn, client)
    assert resolved.outcome == "observed" and resolved.transition == "resolved"
    assert service.notice(resolved)[0] == "info"  # type: ignore[index]
    row = f.item(conn, item)
    assert row["recovery_case_id"] == opened.case_id and row["recovery_resolved_at"] is not None
    # No recovery bookkeeping dirtied the profile; only the observed language may have.
    assert f.revision(conn, movies) - revision <= 1
    # A later failure opens a new case.
    standin.set_available("movie", 404404, False)
    make_due(conn, item)
    _, again = observe_one(conn, client)
    assert again.transition == "opened" and again.case_id != opened.case_id


def test_no_key_is_a_configuration_case_without_a_request(
    conn: Connection, standin: StandIn, client: TmdbClient
) -> None:
    lib = f.library(conn)
    f.tmdb_item(conn, lib, 11)
    _, result = observe_one(conn, client)
    assert (result.category, result.transition) == ("configuration", "opened")
    assert standin.state.arrivals == []


def test_throttle_retry_after_lengthens_delay(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    item = f.tmdb_item(conn, movies, 7)
    standin.set_fault("throttle", retry_after="864000")  # ten days: capped at seven
    _, result = observe_one(conn, client)
    assert result.category == "throttled"
    due = f.item(conn, item)["observation_due_at"]
    assert due >= datetime.now(UTC) + timedelta(days=7) - timedelta(minutes=1)
    assert due <= datetime.now(UTC) + timedelta(days=7, minutes=1)


def test_source_change_mid_call_loses_even_when_changed_back(
    conn: Connection, db_url: str, movies: int, client: TmdbClient
) -> None:
    item = f.tmdb_item(conn, movies, 5)
    [claim] = service.claim(conn, 1)
    settings = service.provider_settings(conn)
    fetched = service.fetch(conn, claim, client, settings)
    with connect(db_url) as writer:  # the source changes away and back during the call
        execute(writer, "UPDATE media_server_items SET provider_id = '6' WHERE id = %s", (item,))
        execute(writer, "UPDATE media_server_items SET provider_id = '5' WHERE id = %s", (item,))
    late = service.complete(conn, claim, fetched, POLICY)
    assert late.outcome == "lost"
    row = f.item(conn, item)
    assert row["source_generation"] == claim.source_generation + 2
    assert row["observed_at"] is None and row["observation_lease_token"] is None
    assert fetch_all(conn, "SELECT 1 FROM provider_observations") == []
    # The item is due again at once under its new generation.
    [fresh] = service.claim(conn, 1)
    assert fresh.source_generation == claim.source_generation + 2


def test_source_change_clears_open_case(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    item = f.tmdb_item(conn, movies, 77)
    standin.set_available("movie", 77, False)
    observe_one(conn, client)
    execute(conn, "UPDATE media_server_items SET provider_id = '78' WHERE id = %s", (item,))
    row = f.item(conn, item)
    assert row["recovery_case_id"] is None and row["recovery_attempts"] == 0
    _, result = observe_one(conn, client)
    assert result.outcome == "observed" and result.transition is None


def test_killed_worker_lease_expires_and_old_token_is_rejected(
    conn: Connection, movies: int, client: TmdbClient
) -> None:
    item = f.tmdb_item(conn, movies, 9)
    [dead] = service.claim(conn, 1)
    assert service.claim(conn, 1) == []  # leased
    execute(
        conn,
        "UPDATE media_server_items SET observation_lease_expires_at = now() - interval"
        " '1 second' WHERE id = %s",
        (item,),
    )
    [fresh] = service.claim(conn, 1)
    assert fresh.lease_token != dead.lease_token
    settings = service.provider_settings(conn)
    late = service.complete(conn, dead, service.fetch(conn, dead, client, settings), POLICY)
    assert late.outcome == "lost"
    late_failure = service.complete(conn, dead, Failure("transient"), POLICY)
    assert late_failure.outcome == "lost"
    assert f.item(conn, item)["recovery_case_id"] is None
    # Nor can it give back, as never sent, a claim that is no longer its own.
    assert not repository.release_claim(conn, dead)
    assert f.item(conn, item)["observation_lease_token"] == fresh.lease_token
    done = service.complete(conn, fresh, service.fetch(conn, fresh, client, settings), POLICY)
    assert done.outcome == "observed"


def test_concurrent_observers_never_double_claim(db_url: str) -> None:
    with connect(db_url) as setup:
        lib = f.library(setup)
        for i in range(200):
            f.tmdb_item(setup, lib, 1000 + i)
    claimed: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def observer() -> None:
        with connect(db_url) as c:
            barrier.wait(timeout=10)
            while batch := service.claim(c, 7):
                with lock:
                    claimed.extend(x.item_id for x in batch)

    threads = [threading.Thread(target=observer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(claimed) == 200 and len(set(claimed)) == 200


def test_batch_observation_summary(
    db_url: str, conn: Connection, movies: int, standin: StandIn
) -> None:
    rng = random.Random(5)
    ids = rng.sample(range(1, 100_000), 30)
    for tmdb_id in ids:
        f.tmdb_item(conn, movies, tmdb_id)
    for tmdb_id in ids[:5]:
        standin.set_available("movie", tmdb_id, False)
    f.tmdb_item(conn, movies, 0, title="bad id").__int__()
    execute(conn, "UPDATE media_server_items SET provider_id = 'tt0111161' WHERE provider_id = '0'")
    with TmdbClient(standin.url) as client:
        summary = service.observe(lambda: connect(db_url), client, POLICY, workers=4)
    assert summary.observed == 25
    assert summary.by_category == {"observed": 25, "not_found": 6}
    assert summary.opened == 6
    assert service.case_overview(conn) == {"not_found": 6}
    assert service.due_items(conn) == 0


def test_observations_go_with_their_items(
    conn: Connection, movies: int, client: TmdbClient
) -> None:
    first = f.tmdb_item(conn, movies, 21)
    f.tmdb_item(conn, movies, 22)
    for _ in range(2):
        observe_one(conn, client)
    execute(conn, "DELETE FROM media_server_items WHERE id = %s", (first,))
    assert len(fetch_all(conn, "SELECT item_id FROM provider_observations")) == 1
    execute(conn, "TRUNCATE media_server_items")  # other programs may; no CASCADE needed
    assert fetch_all(conn, "SELECT item_id FROM provider_observations") == []


def test_claim_walks_the_due_index_whatever_the_library_estimates(conn: Connection) -> None:
    """The claim reads the due index in its order and stops after its batch, even when
    the small libraries and servers tables were never analyzed (autovacuum leaves
    tables with fewer than 50 changes alone) and few of many items are due: it never
    reads every due item of every library and sorts them."""
    server = f.server(conn)
    libraries = [f.library(conn, server, name=str(n)) for n in range(10)]
    execute(
        conn,
        "INSERT INTO media_server_items (library_id, title, provider, provider_kind,"
        " provider_id, observation_due_at)"
        " SELECT (%(libraries)s::bigint[])[1 + g %% 10], 'Title ' || g, 'tmdb', 'movie',"
        "  g::text, CASE WHEN g %% 50 = 0 THEN now() - interval '1 hour'"
        "                ELSE now() + interval '30 days' END"
        " FROM generate_series(1, 30000) g",
        {"libraries": libraries},
    )
    execute(conn, "ANALYZE media_server_items")
    with conn.transaction(force_rollback=True):
        plan = "\n".join(
            r["QUERY PLAN"]
            for r in fetch_all(
                conn,
                "EXPLAIN " + repository.QUERIES["claim_due"],
                {"limit": 32, "lease_seconds": 300},
            )
        )
    assert "Index Scan using media_server_items_observation_due" in plan, plan
    assert "Sort" not in plan, plan


def test_the_count_and_the_claim_agree_item_by_item(conn: Connection) -> None:
    """The sensor's count and the claim ask one definition of due (`observation_due`):
    whichever of its terms leaves an item out, the item is neither counted nor claimed."""
    server = f.server(conn)
    movies = f.library(conn, server)
    shows = f.library(conn, server, name="Shows", media_kind="tv")
    music = f.library(conn, server, name="Music", media_kind="music")
    idle = f.library(conn, server, name="Idle", active=False)
    elsewhere = f.library(conn, f.server(conn, name="off", active=False), name="Off")

    def item(
        library_id: int,
        provider: str = "tmdb",
        kind: str = "movie",
        due_in: timedelta = timedelta(0),
        lease_for: timedelta | None = None,
    ) -> int:
        row = fetch_one(
            conn,
            "INSERT INTO media_server_items (library_id, title, provider, provider_kind,"
            " provider_id) VALUES (%s, 'Title', %s, %s, '603') RETURNING id",
            (library_id, provider, kind),
        )
        assert row is not None
        execute(  # bookkeeping columns only: no source change resets them
            conn,
            "UPDATE media_server_items SET observation_due_at = now() + %(due_in)s,"
            " observation_lease_token = CASE WHEN %(lease_for)s::interval IS NOT NULL"
            "   THEN gen_random_uuid() END,"
            " observation_lease_expires_at = now() + %(lease_for)s::interval"
            " WHERE id = %(id)s",
            {"id": row["id"], "due_in": due_in, "lease_for": lease_for},
        )
        return int(row["id"])

    due = {
        item(movies),
        item(shows, kind="tv"),
        item(movies, lease_for=timedelta(seconds=-1)),  # an expired lease
    }
    for library_id in (music, idle, elsewhere):
        item(library_id)
    item(movies, provider="imdb")
    item(movies, kind="episode")
    item(movies, due_in=timedelta(hours=1))
    item(movies, lease_for=timedelta(minutes=5))
    assert service.due_items(conn) == len(due)
    with conn.transaction(force_rollback=True):
        assert {c.item_id for c in service.claim(conn, 100)} == due
        assert service.due_items(conn) == 0  # claimed items hold live leases


def test_one_run_sets_the_rate_and_tells_each_notice(
    db_url: str, conn: Connection, movies: int, standin: StandIn
) -> None:
    """The run the CLI and the Dagster job both start: the admission rate it is given
    holds for the fleet, its sessions carry the observer's name, and each new case comes
    back as a (level, message) notice once its completion has committed."""
    for tmdb_id in (601, 603):
        f.tmdb_item(conn, movies, tmdb_id)
    # Inventory text is anyone's: the warning names the item by a bounded, escaped title.
    f.tmdb_item(conn, movies, 602, title="Lost\x1b[31m\nFilm " + "x" * 200)
    standin.set_available("movie", 602, False)
    notices: list[tuple[str, str]] = []
    sessions: set[str] = set()

    def on_notice(level: str, message: str) -> None:
        notices.append((level, message))
        rows = fetch_all(
            conn,
            "SELECT application_name FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        sessions.update(r["application_name"] for r in rows)

    tmdb = TmdbSettings(standin.url, rate=25, workers=2, max_items=10)
    summary = service.observe_due(db_url, tmdb, on_notice)
    assert summary.by_category == {"observed": 2, "not_found": 1}
    rate = fetch_one(conn, "SELECT requests_per_second FROM provider_admission")
    assert rate is not None and rate["requests_per_second"] == 25
    [(level, message)] = notices
    assert level == "warning" and "recovery case" in message and "opened (not_found" in message
    assert message.startswith("item ") and ' "Lost [31m Film xxx' in message
    assert '…" (tmdb movie "602"): recovery case' in message
    assert "\x1b" not in message and "\n" not in message and len(message) < 250
    assert sessions == {service.OBSERVER}
    assert service.due_items(conn) == 0


def test_an_attempt_not_recorded_is_warned_with_the_items_title(
    db_url: str, conn: Connection, movies: int, standin: StandIn
) -> None:
    """The worker's session is lost while the answer is in flight: nothing is recorded,
    and the warning names the item as every case warning does."""
    item = f.tmdb_item(conn, movies, 777, title="Lost Session")

    class Cutting(TmdbClient):
        def fetch(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]
            execute(
                conn,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'cut-me'",
            )
            return super().fetch(*args, **kwargs)  # type: ignore[arg-type]

    told: list[tuple[str, str]] = []

    def on_result(result: ObservationResult) -> None:
        message = service.notice(result)
        if message is not None:
            told.append(message)

    with Cutting(standin.url) as client:
        service.observe(
            lambda: connect(db_url, application_name="cut-me"),
            client,
            POLICY,
            workers=1,
            on_result=on_result,
        )
    assert told == [
        (
            "warning",
            f'item {item} "Lost Session" (tmdb movie "777"): attempt not recorded'
            " (DatabaseUnavailable); retried when its lease expires",
        )
    ]


def test_each_cause_starts_its_own_backoff(
    conn: Connection, movies: int, client: TmdbClient, standin: StandIn
) -> None:
    """The backoff's exponent counts the failures under the case's current cause, so a
    long not_found case that turns transient waits the transient start (6-12 h), not the
    window its not_found failures had grown to; the case keeps counting every attempt."""
    item = f.tmdb_item(conn, movies, 404405)
    standin.set_available("movie", 404405, False)
    for _ in range(10):
        make_due(conn, item)
        observe_one(conn, client)
    row = f.item(conn, item)
    assert (row["recovery_category"], row["recovery_attempts"]) == ("not_found", 10)
    make_due(conn, item)
    standin.set_fault("status", status=502)
    _, changed = observe_one(conn, client)
    assert changed.transition == "cause_changed" and changed.attempts == 11
    due = f.item(conn, item)["observation_due_at"]
    assert due <= datetime.now(UTC) + timedelta(hours=12, minutes=1)
    assert due >= datetime.now(UTC) + timedelta(hours=6) - timedelta(minutes=1)
    # The same cause again doubles from there: 12-24 h.
    make_due(conn, item)
    _, repeated = observe_one(conn, client)
    due = f.item(conn, item)["observation_due_at"]
    assert repeated.transition == "repeated" and repeated.attempts == 12
    assert datetime.now(UTC) + timedelta(hours=12) - timedelta(minutes=1) <= due
    assert due <= datetime.now(UTC) + timedelta(hours=24, minutes=1)
