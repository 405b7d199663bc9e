"""Races of the seeds stepped through explicitly with two connections, each order
asserted (issue 8's interleaving tests, first part)."""

from __future__ import annotations

import threading
import uuid
from datetime import date

from inventory_pipeline.db import Connection, connect, execute
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.profiles.models import RefreshPolicy
from inventory_pipeline.stats import processors, service
from tests import factories as f
from tests import stats_factories as sf

POLICY = RefreshPolicy()


def bump(conn: Connection, library: int) -> None:
    execute(
        conn,
        "UPDATE media_server_items SET rating = coalesce(rating, 0) + 0.1 WHERE library_id = %s",
        (library,),
    )


def process_all(conn: Connection) -> list[object]:
    profiles.plan(conn, POLICY)
    return profiles.process_batch(conn, profiles.claim(conn, POLICY).lease_token, POLICY)


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
    profiles.process_batch(conn, profiles.claim(conn, POLICY).lease_token, POLICY)
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


def test_completion_waits_for_an_open_writer_without_deadlock(
    conn: Connection, db_url: str
) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 6)
    profiles.plan(conn, POLICY)
    [claim] = profiles.claim(conn, POLICY).claims
    outcome: list[object] = []
    with connect(db_url) as writer:
        with writer.transaction():
            bump(writer, lib)  # state row locked: completion must wait (state -> request)

            def complete() -> None:
                with connect(db_url) as worker:
                    outcome.append(profiles.process(worker, claim, POLICY))

            thread = threading.Thread(target=complete)
            thread.start()
            thread.join(timeout=1)
            assert thread.is_alive()  # waiting on the writer, holding nothing it needs
        thread.join(timeout=10)
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
    processors.drain(conn, "w")
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
    assert processors.process_user(conn, user, "app").outcome == "idle"
    service.compute(conn, first)
    assert service.publish(conn, first).generation == 1
    assert processors.process_user(conn, user, "app").outcome == "published"
    assert sf.versions(conn, user) == (2, 2)
    # A replayed publication of the old run changes nothing.
    assert service.publish(conn, first).status == "lease_lost"
    assert sf.versions(conn, user) == (2, 2)
