"""Races stepped through explicitly with two or three connections, each
order asserted: planner against writer, completion after lease loss, settings
save during a probe, enqueue during claim, publication racing a newer generation."""

from __future__ import annotations

import threading
import uuid
from datetime import date

import pytest

from inventory_pipeline.credentials import service as credentials
from inventory_pipeline.db import Connection, DatabaseUnavailable, connect, execute, fetch_all
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.profiles.models import RefreshPolicy
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.stats import service
from tests import factories as f
from tests import stats_factories as sf
from tests.conftest import TMDB_TEST_KEY

POLICY = RefreshPolicy()


def bump(conn: Connection, library: int) -> None:
    execute(
        conn,
        "UPDATE media_server_items SET rating = coalesce(rating, 0) + 0.1 WHERE library_id = %s",
        (library,),
    )


def process_all(conn: Connection) -> list[object]:
    return list(profiles.refresh(conn, POLICY).completions)


def test_writer_then_planner(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    bump(conn, lib)
    [planned] = profiles.plan(conn, POLICY).inventory
    assert planned.inventory_revision == 2


def test_planner_then_writer_keeps_the_newer_revision_pending(conn: Connection) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    [planned] = profiles.plan(conn, POLICY).inventory
    bump(conn, lib)
    profiles.refresh(conn, POLICY, max_claims=1)
    assert f.state(conn, lib)["acknowledged_revision"] == planned.inventory_revision == 1
    process_all(conn)
    assert f.state(conn, lib)["acknowledged_revision"] == 2


def test_open_writer_is_skipped_by_the_planner_then_planned(conn: Connection, db_url: str) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    process_all(conn)
    with connect(db_url) as writer, writer.transaction():
        bump(writer, lib)  # holds the state row until commit
        assert profiles.plan(conn, POLICY).planned == 0  # SKIP LOCKED, no waiting
    [planned] = profiles.plan(conn, POLICY).inventory
    assert planned.inventory_revision == 2


def test_completion_does_not_wait_for_an_open_writer(conn: Connection, db_url: str) -> None:
    """A writer's open transaction holds only its items and its change rows: the worker
    completes beside it, and the writer's change is a revision the worker has not
    acknowledged once it commits."""
    lib = f.library(conn)
    f.items(conn, lib, 6)
    profiles.plan(conn, POLICY)
    [claim] = profiles.claim(conn, POLICY).claims
    outcome: list[object] = []
    with connect(db_url) as writer:
        with writer.transaction():
            bump(writer, lib)

            def complete() -> None:
                with connect(db_url) as worker:
                    outcome.append(profiles.process(worker, claim, POLICY))

            thread = threading.Thread(target=complete)
            thread.start()
            thread.join(timeout=30)
            assert not thread.is_alive()  # done while the writer is still open
    [done] = outcome
    assert done.outcome == "published"  # type: ignore[attr-defined]
    state = f.state(conn, lib)
    assert (state["acknowledged_revision"], state["revision"]) == (1, 2)


def test_enqueue_against_claim_in_every_order(conn: Connection, db_url: str) -> None:
    sf.exercise(conn, "squat")
    # enqueue before the claim: merged into the job the claim takes
    early = uuid.uuid4()
    sf.save(conn, early, date(2026, 3, 1), sf.sets(("squat", 100, 5)))
    sf.save(conn, early, date(2026, 3, 2), sf.sets(("squat", 100, 5)))
    claimed = service.claim(conn, "w", early)
    assert claimed is not None and claimed.target_version == 2
    assert len(sf.jobs(conn, early)) == 1
    # enqueue while a claim holds the pending row (uncommitted): a new pending row
    during = uuid.uuid4()
    sf.save(conn, during, date(2026, 3, 1), sf.sets(("squat", 100, 5)))
    with connect(db_url) as claimer, claimer.transaction():
        execute(
            claimer,
            "SELECT 1 FROM user_exercise_stats_refresh_jobs WHERE user_id = %s FOR UPDATE",
            (during,),
        )
        sf.save(conn, during, date(2026, 3, 2), sf.sets(("squat", 100, 5)))
    assert [j["status"] for j in sf.jobs(conn, during)] == ["pending", "pending"]
    # enqueue after the claim committed: the processing job is never touched
    after = uuid.uuid4()
    sf.save(conn, after, date(2026, 3, 1), sf.sets(("squat", 100, 5)))
    taken = service.claim(conn, "w", after)
    assert taken is not None
    sf.save(conn, after, date(2026, 3, 2), sf.sets(("squat", 100, 5)))
    assert [j["status"] for j in sf.jobs(conn, after)] == ["processing", "pending"]
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 10")
    for claim in (claimed, taken):
        service.compute(conn, claim)
        service.publish(conn, claim)
    service.drain(conn, "w")
    for user in (early, during, after):
        requested, applied = sf.versions(conn, user)
        assert requested == applied == 2


def test_publication_never_goes_back_a_generation(conn: Connection) -> None:
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, date(2026, 3, 1), sf.sets(("squat", 100, 5)))
    first = service.claim(conn, "worker")
    assert first is not None
    sf.save(conn, user, date(2026, 3, 2), sf.sets(("squat", 120, 5)))
    # The scoped processor cannot take the user's newer job while one is processing.
    assert service.process_user(conn, user, "app").outcome == "idle"
    service.compute(conn, first)
    assert service.publish(conn, first).generation == 1
    assert service.process_user(conn, user, "app").outcome == "published"
    assert sf.versions(conn, user) == (2, 2)
    # A replayed publication of the old run changes nothing.
    assert service.publish(conn, first).status == "lost"
    assert sf.versions(conn, user) == (2, 2)


def expire_request(conn: Connection, request_id: int) -> None:
    execute(
        conn,
        "UPDATE profile_refresh_requests SET lease_expires_at = now() - interval '1 second'"
        " WHERE id = %s",
        (request_id,),
    )


def recover_now(conn: Connection) -> None:
    """The planner puts the expired request back; the test clock skips its backoff."""
    assert profiles.plan(conn, POLICY).expired == 1
    execute(conn, "UPDATE profile_refresh_requests SET available_at = now()")


@pytest.mark.parametrize("order", ["expired only", "old then new", "new then old"])
def test_completion_after_lease_loss_in_every_order(conn: Connection, order: str) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    profiles.plan(conn, POLICY)
    [old] = profiles.claim(conn, POLICY).claims
    expire_request(conn, old.request_id)
    if order == "expired only":  # nobody took over, yet the lease is gone
        assert profiles.process(conn, old, POLICY).outcome == "lost"
        assert f.state(conn, lib)["acknowledged_revision"] == 0
        assert f.profile(conn, lib) is None
        recover_now(conn)
        [new] = profiles.claim(conn, POLICY).claims
        assert profiles.process(conn, new, POLICY).outcome == "published"
    else:
        recover_now(conn)
        [new] = profiles.claim(conn, POLICY).claims
        assert new.request_id == old.request_id and new.lease_token != old.lease_token
        bump(conn, lib)  # the newer claim's observation is of a newer revision
        first, second = (old, new) if order == "old then new" else (new, old)
        outcomes = [profiles.process(conn, c, POLICY).outcome for c in (first, second)]
        assert outcomes == (["lost", "published"] if first is old else ["published", "lost"])
    state = f.state(conn, lib)
    assert state["acknowledged_revision"] == 1  # exactly the claimed revision
    profile = f.profile(conn, lib)
    assert profile is not None
    assert profile["inventory_revision"] == state["revision"]  # the live claim's observation


@pytest.mark.parametrize("order", ["old then new", "new then old"])
def test_stats_completion_after_lease_loss_in_every_order(conn: Connection, order: str) -> None:
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, date(2026, 3, 1), sf.sets(("squat", 100, 5)))
    old = service.claim(conn, "dead")
    assert old is not None
    sf.expire_run(conn, old.run_id, old.lease_token)
    new = service.claim(conn, "live")  # revives the dead worker's job under a new lease
    assert new is not None and new.job_id == old.job_id and new.lease_token != old.lease_token
    if order == "old then new":
        assert service.compute(conn, old).status == "lost"
        assert service.publish(conn, old).status == "lost"
        service.compute(conn, new)
        assert service.publish(conn, new).status == "published"
    else:
        service.compute(conn, new)
        assert service.publish(conn, new).status == "published"
        assert service.compute(conn, old).status == "lost"
        assert service.publish(conn, old).status == "lost"
    assert sf.versions(conn, user) == (1, 1)
    assert sf.exercise_stats(conn, user)["squat"]["sessions"] == 1


def test_a_stats_worker_past_its_lease_takes_no_step_though_nobody_took_over(
    conn: Connection,
) -> None:
    """A lapsed lease is not revived by its worker's late stage: the compute and the
    publication both answer lost, and the run is the next claim's."""
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, date(2026, 3, 1), sf.sets(("squat", 100, 5)))
    old = service.claim(conn, "stalled")
    assert old is not None
    sf.expire_run(conn, old.run_id, old.lease_token)
    assert service.compute(conn, old).status == "lost"
    assert service.publish(conn, old).status == "lost"
    assert sf.versions(conn, user) == (1, 0)
    new = service.claim(conn, "live")
    assert new is not None and new.job_id == old.job_id
    service.compute(conn, new)
    assert service.publish(conn, new).status == "published"
    assert sf.versions(conn, user) == (1, 1)


def save_settings(conn: Connection, key: str, language: str | None = None) -> None:
    execute(
        conn,
        "UPDATE provider_settings SET api_key = %s, active = true, language = %s",
        (key, language),
    )


def key_edit(conn: Connection) -> None:
    """Away and back: the same key, yet a new generation."""
    save_settings(conn, "another-key")
    save_settings(conn, TMDB_TEST_KEY)


@pytest.mark.parametrize("edit", ["key", "language"])
@pytest.mark.parametrize("when", ["before claim", "during probe", "before release", "after"])
def test_settings_save_against_the_probe_in_every_order(
    conn: Connection, db_url: str, standin: StandIn, when: str, edit: str
) -> None:
    save_settings(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 2)

    def save() -> None:
        with connect(db_url) as writer:
            key_edit(writer) if edit == "key" else save_settings(writer, TMDB_TEST_KEY, "fr-FR")

    invalidates = edit == "key"
    with credentials.probe_client(standin.url) as client:
        if when == "before claim":
            save()
        claim = credentials.claim_probe(conn)
        assert claim is not None
        outcome, retry_after = credentials.probe(conn, claim, client)
        assert outcome == "verified"
        if when == "during probe":
            save()
        result = credentials.complete_probe(conn, claim, outcome, retry_after)
        assert result.accepted == (not (invalidates and when == "during probe"))
        if when == "before release":
            save()
        released = credentials.release(conn)
        if when == "after":
            save()
    stale = invalidates and when in ("during probe", "before release")
    if stale:
        assert released is None  # a verification of another generation releases nothing
    else:
        assert released is not None and released.released == 2
    receipts = fetch_all(
        conn,
        "SELECT recovery_wakeup_generation AS g FROM media_server_items ORDER BY id",
    )
    expected = None if stale else claim.generation
    assert [r["g"] for r in receipts] == [expected, expected]


def test_a_frozen_worker_cannot_block_settings_writers(db_url: str, conn: Connection) -> None:
    """A worker stopped inside the probe's settings share lock (SIGSTOP, a VM pause)
    leaves its session idle in a transaction; the server ends that session, the lock
    goes with it, and the settings writer proceeds."""
    with connect(db_url, idle_in_transaction_ms=300) as frozen:
        frozen.execute("BEGIN")
        frozen.execute("SELECT 1 FROM provider_settings FOR SHARE")
        save_settings(conn, TMDB_TEST_KEY)  # waits until the frozen session is ended
        with pytest.raises(DatabaseUnavailable):
            execute(frozen, "SELECT 1")
    row = fetch_all(conn, "SELECT api_key FROM provider_settings")
    assert row == [{"api_key": TMDB_TEST_KEY}]


def test_sessions_are_ended_when_idle_in_a_transaction(conn: Connection) -> None:
    row = fetch_all(conn, "SHOW idle_in_transaction_session_timeout")
    assert row == [{"idle_in_transaction_session_timeout": "30s"}]
