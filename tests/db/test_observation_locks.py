"""An observation's completion against other programs' inventory writes, and what a
database error does to an attempt (docs/provider-recovery.md#completion-fence).

A sync program writes several items of one library in one transaction under a role with
only its table rights: its first statement's change capture locks the library's
inventory state, its next statement an item row. A completion that saves an observed
original language needs both. Neither program may lose its write to the other, and a
database error is never recorded as a provider outcome.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from inventory_pipeline.db import Connection, DatabaseError, connect, execute, fetch_one
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import repository, service
from inventory_pipeline.recovery.models import ObservationResult
from inventory_pipeline.recovery.policy import RetryPolicy
from tests import factories as f
from tests.conftest import TMDB_TEST_KEY
from tests.roles import acting_as, writer_role

POLICY = RetryPolicy()


@pytest.fixture
def writer(db_url: str) -> Iterator[str]:
    with writer_role(db_url) as role:
        yield role


@pytest.fixture
def library(conn: Connection) -> int:
    f.provider_key(conn, TMDB_TEST_KEY)
    return f.library(conn)


def waiting_for_lock(conn: Connection, pid: int) -> bool:
    row = fetch_one(
        conn,
        "SELECT wait_event_type = 'Lock' AS waiting FROM pg_stat_activity WHERE pid = %s",
        (pid,),
    )
    return bool(row and row["waiting"])


def backend_pid(conn: Connection) -> int:
    row = fetch_one(conn, "SELECT pg_backend_pid() AS pid")
    assert row is not None
    return int(row["pid"])


def in_thread(target: object) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(target())  # type: ignore[operator]
        except Exception as exc:  # the test reads it
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def attempts_and_case(conn: Connection, item: int) -> tuple[int, object]:
    row = f.item(conn, item)
    return int(row["observation_attempts"]), row["recovery_case_id"]


def test_a_sync_transaction_and_a_completion_both_keep_their_writes(
    conn: Connection, db_url: str, writer: str, library: int, client: TmdbClient
) -> None:
    """The crossing order: the writer holds the library's state (its first statement)
    and then writes the item the completion is saving."""
    first = f.tmdb_item(conn, library, 601, original_language=None)
    second = f.tmdb_item(conn, library, 602, original_language=None)
    execute(
        conn,
        "UPDATE media_server_items SET observation_due_at = now() + interval '1 year'"
        " WHERE id = %s",
        (first,),
    )
    [claim] = service.claim(conn, 1)
    assert claim.item_id == second
    observation = service.fetch(conn, claim, client, service.provider_settings(conn))
    with connect(db_url) as sync, connect(db_url) as observer:
        observer_pid = backend_pid(observer)
        with acting_as(sync, writer):
            execute(sync, "UPDATE media_server_items SET rating = 7.5 WHERE id = %s", (first,))
            thread, out = in_thread(lambda: service.complete(observer, claim, observation, POLICY))
            deadline = time.monotonic() + 10
            while not waiting_for_lock(conn, observer_pid) and thread.is_alive():
                assert time.monotonic() < deadline
                time.sleep(0.01)
            execute(sync, "UPDATE media_server_items SET rating = 8.5 WHERE id = %s", (second,))
        thread.join(timeout=30)
    [result] = out
    assert isinstance(result, ObservationResult) and result.outcome == "observed", result
    assert [f.item(conn, i)["rating"] for i in (first, second)] == [7.5, 8.5]
    row = f.item(conn, second)
    assert row["original_language"] is not None and row["recovery_case_id"] is None
    assert (
        fetch_one(conn, "SELECT 1 AS one FROM provider_observations WHERE item_id = %s", (second,))
        is not None
    )


def test_a_completion_that_cannot_get_its_item_leaves_the_claim_without_an_attempt(
    conn: Connection, db_url: str, writer: str, library: int, client: TmdbClient
) -> None:
    """A writer holds the item through the completion's tries: the claim goes back
    unrecorded once the writer lets go (no attempt, no case), and is not sent again at
    once: it is due a minute later."""
    item = f.tmdb_item(conn, library, 603, original_language=None)
    [claim] = service.claim(conn, 1)
    before = attempts_and_case(conn, item)
    settings = service.provider_settings(conn)
    with connect(db_url) as sync, connect(db_url) as observer:
        observer_pid = backend_pid(observer)
        with acting_as(sync, writer):
            execute(sync, "SELECT 1 FROM media_server_items WHERE id = %s FOR UPDATE", (item,))
            thread, out = in_thread(
                lambda: service.observe_claim(observer, claim, client, settings, POLICY)
            )
            deadline = time.monotonic() + 20
            while not waiting_for_lock(conn, observer_pid) and thread.is_alive():
                assert time.monotonic() < deadline
                time.sleep(0.01)
        thread.join(timeout=30)
    [result] = out
    assert isinstance(result, ObservationResult), result
    assert result.outcome == "interrupted" and result.error == "LockNotAvailable", result
    assert attempts_and_case(conn, item) == before
    assert f.item(conn, item)["observation_lease_token"] is None
    assert service.claim(conn, 1) == []  # no immediate retry
    due = fetch_one(
        conn,
        "SELECT observation_due_at - now() AS wait FROM media_server_items WHERE id = %s",
        (item,),
    )
    assert due is not None
    assert due["wait"].total_seconds() > RetryPolicy().interrupted_seconds - 5
    execute(conn, "UPDATE media_server_items SET observation_due_at = now() WHERE id = %s", (item,))
    [again] = service.claim(conn, 1)  # the test clock: the minute has passed
    assert again.item_id == item
    done = service.observe_claim(conn, again, client, settings, POLICY)
    assert done.outcome == "observed"


def test_a_give_back_that_waited_for_its_item_counts_the_delay_from_when_it_wrote(
    conn: Connection, db_url: str, writer: str, library: int
) -> None:
    """The give-back itself may wait for the item behind a sync program's write: the item
    is due the delay after the give-back wrote, not after it began (a wait longer than
    the delay would otherwise leave it due at once)."""
    item = f.tmdb_item(conn, library, 604, original_language=None)
    [claim] = service.claim(conn, 1)
    with connect(db_url) as sync, connect(db_url) as observer:
        observer_pid = backend_pid(observer)
        with acting_as(sync, writer):
            execute(sync, "BEGIN")
            execute(sync, "SELECT 1 FROM media_server_items WHERE id = %s FOR UPDATE", (item,))
            thread, out = in_thread(lambda: repository.give_back_interrupted(observer, claim, 1))
            deadline = time.monotonic() + 20
            while not waiting_for_lock(conn, observer_pid):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(1.5)  # longer than the delay
            released = fetch_one(sync, "SELECT clock_timestamp() AS at")
            execute(sync, "COMMIT")
        thread.join(timeout=30)
    [due] = out
    assert released is not None and due is not None
    assert due > released["at"]  # type: ignore[operator]
    assert f.item(conn, item)["observation_lease_token"] is None


def test_any_other_database_error_fails_the_run_and_opens_no_case(
    conn: Connection, db_url: str, library: int, client: TmdbClient
) -> None:
    """An item whose completion the database refuses (here a check the test adds): the
    run fails naming the item and the SQLSTATE, after the rest of its batch is observed
    and reported; the item gets no case and no attempt, and waits out its lease."""
    items = [f.tmdb_item(conn, library, tmdb_id) for tmdb_id in (21, 22, 23, 24)]
    execute(
        conn,
        "ALTER TABLE provider_observations ADD CONSTRAINT test_refuses_22 CHECK (tmdb_id <> 22)",
    )
    reported: list[ObservationResult] = []
    with pytest.raises(DatabaseError, match=rf"item {items[1]}: CheckViolation \(SQLSTATE 23514\)"):
        service.observe(
            lambda: connect(db_url), client, POLICY, workers=2, on_result=reported.append
        )
    assert sorted(r.item_id for r in reported) == [items[0], items[2], items[3]]
    assert {r.outcome for r in reported} == {"observed"}
    assert attempts_and_case(conn, items[1]) == (0, None)
    assert f.item(conn, items[1])["observation_lease_token"] is not None
    assert fetch_one(conn, "SELECT count(*) AS n FROM provider_observations") == {"n": 3}


def test_a_library_a_restore_created_without_its_state_is_observed(
    conn: Connection, client: TmdbClient
) -> None:
    """A library and its item written with triggers off (a restore, a logical
    replication apply) have no inventory state row: the observation's completion creates
    it, saves the answer (not `lost`, which would send the item again after every lease)
    and the library's profile is marked to refresh."""
    f.provider_key(conn, TMDB_TEST_KEY)
    execute(conn, "SET session_replication_role = replica")
    try:
        library = f.library(conn, name="Restored")
        item = f.tmdb_item(conn, library, 604, original_language=None)
    finally:
        execute(conn, "RESET session_replication_role")
    assert (
        fetch_one(conn, "SELECT 1 FROM library_inventory_state WHERE library_id = %s", (library,))
        is None
    )
    [claim] = service.claim(conn, 1)
    settings = service.provider_settings(conn)
    result = service.observe_claim(conn, claim, client, settings, POLICY)
    assert result.outcome == "observed", result
    assert f.item(conn, item)["original_language"] is not None
    state = f.state(conn, library)
    assert state["revision"] > state["acknowledged_revision"]
