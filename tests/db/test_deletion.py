"""Deleting a library, or a server with its libraries, against every pipeline statement
that touches a library's rows, in every order: the deletion at each point of the
pipeline statement, and the pipeline statement at each point of the deletion.

The points are reached with gates: a test-only trigger pauses the one session that opted
in (`test.gate`) at a named point, on an advisory lock the control session holds, so a
test knows where each session stands without sleeping. `pg_blocking_pids` tells a session
waiting for a row lock from one paused at a gate.

Required outcome: no deadlock (40P01) and no error on either side; the pipeline skips
the library being deleted, finishes before the deletion, or loses that one library's
work; every other library gets its ordinary outcome.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from inventory_pipeline.credentials import service as credentials
from inventory_pipeline.db import Connection, connect, execute, fetch_all, fetch_one, transaction
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.profiles import repository as profile_queries
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.profiles.models import RefreshPolicy
from inventory_pipeline.provider.models import Failure, Observation
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.recovery.models import ItemClaim
from inventory_pipeline.recovery.policy import RetryPolicy
from tests import factories as f
from tests.conftest import TMDB_TEST_KEY

POLICY = RefreshPolicy()
GATE_KEY = 7_340_101

# Test-only gates: (name, trigger definition). Deletion points are statement triggers on
# the tables the cascade reaches (fired before the cascade locks any of their rows);
# pipeline points are row triggers (fired once the row is locked) or, for `capture`, an
# AFTER statement trigger named to fire before change capture.
GATES = {
    "libraries": "BEFORE DELETE ON libraries FOR EACH STATEMENT",
    "items": "BEFORE DELETE ON media_server_items FOR EACH STATEMENT",
    "requests": "BEFORE DELETE ON profile_refresh_requests FOR EACH STATEMENT",
    "state": "BEFORE DELETE ON library_inventory_state FOR EACH STATEMENT",
    "request_insert": "BEFORE INSERT ON profile_refresh_requests FOR EACH ROW",
    "request_update": "BEFORE UPDATE ON profile_refresh_requests FOR EACH ROW",
    "profile_write": "BEFORE INSERT OR UPDATE OR DELETE ON library_profiles FOR EACH ROW",
    "item_update": "BEFORE UPDATE ON media_server_items FOR EACH ROW",
    "capture": "AFTER UPDATE ON media_server_items FOR EACH STATEMENT",
    "state_update": "BEFORE UPDATE ON library_inventory_state FOR EACH ROW",
    "change_insert": "BEFORE INSERT ON library_inventory_changes FOR EACH ROW",
}


@pytest.fixture(scope="module")
def shared_url(server_url: str, template_name: str) -> Iterator[str]:
    """One database with the gates for the whole module (a clone per test costs more than
    the test); each test starts from no servers and a fresh credential wakeup row."""
    name = f"inventory_deletion_{uuid.uuid4().hex[:12]}"
    with connect(server_url) as admin:
        create_database(admin, name, template=template_name)
    url = url_with_database(server_url, name)
    with connect(url) as conn:
        install_gates(conn)
    yield url
    with connect(server_url) as admin:
        drop_database(admin, name)


@pytest.fixture
def db_url(shared_url: str) -> Iterator[str]:
    yield shared_url
    with connect(shared_url) as conn, transaction(conn):
        execute(conn, "DELETE FROM media_servers")  # cascades to every library's rows
        execute(conn, "DELETE FROM provider_observations")
        execute(conn, "UPDATE provider_settings SET api_key = NULL, active = false")
        execute(conn, "DELETE FROM credential_wakeups")
        execute(
            conn, "INSERT INTO credential_wakeups (provider) SELECT provider FROM provider_settings"
        )


def install_gates(conn: Connection) -> None:
    execute(
        conn,
        f"""
        CREATE FUNCTION test_gate() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF current_setting('test.gate', true) = TG_ARGV[0] THEN
                PERFORM pg_advisory_xact_lock_shared({GATE_KEY});
            END IF;
            RETURN COALESCE(NEW, OLD);
        END $$
        """,
    )
    for name, definition in GATES.items():
        # "a_" sorts before "media_server_items_capture_update": the gate fires first.
        execute(
            conn,
            f"CREATE TRIGGER a_gate_{name} {definition} EXECUTE FUNCTION test_gate('{name}')",
        )


class Session:
    """One connection driven from its own thread; remembers its result or error."""

    def __init__(self, db_url: str, gate: str | None = None) -> None:
        self.conn = connect(db_url)
        row = fetch_one(self.conn, "SELECT pg_backend_pid() AS pid")
        assert row is not None
        self.pid = int(row["pid"])
        if gate is not None:
            execute(self.conn, "SELECT set_config('test.gate', %s, false)", (gate,))
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, work: Callable[[Connection], Any]) -> None:
        def run() -> None:
            try:
                self.result = work(self.conn)
            except BaseException as exc:  # reported by join()
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    def join(self) -> Any:
        assert self.thread is not None
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "session still running"
        if self.error is not None:
            raise self.error
        return self.result

    def close(self) -> None:
        self.conn.close()


class Control:
    """Shuts and opens the gates, and watches where the sessions stand."""

    def __init__(self, db_url: str) -> None:
        self.conn = connect(db_url)
        row = fetch_one(self.conn, "SELECT pg_backend_pid() AS pid")
        assert row is not None
        self.pid = int(row["pid"])

    def shut(self) -> None:
        execute(self.conn, "SELECT pg_advisory_lock(%s)", (GATE_KEY,))

    def open(self) -> None:
        execute(self.conn, "SELECT pg_advisory_unlock(%s)", (GATE_KEY,))

    def settle(self, session: Session) -> str:
        """Wait until the session has finished ("done"), waits at a gate ("gate") or
        waits for another session's lock ("blocked")."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if session.done():
                return "done"
            row = fetch_one(self.conn, "SELECT pg_blocking_pids(%s) AS b", (session.pid,))
            blockers = set(row["b"]) if row else set()
            if blockers:
                return "gate" if blockers == {self.pid} else "blocked"
            time.sleep(0.005)
        raise AssertionError("the session neither finished nor waited")

    def close(self) -> None:
        self.conn.close()


@dataclass
class World:
    """`library` and `sibling` on one server, `other` on a second server. A library
    deletion deletes `library`; a server deletion deletes `library` and `sibling`."""

    server: int
    library: int
    sibling: int
    other: int
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def libraries(self) -> tuple[int, int, int]:
        return (self.library, self.sibling, self.other)

    def doomed(self, target: str) -> set[int]:
        return {self.library} if target == "library" else {self.library, self.sibling}


def make_world(conn: Connection) -> World:
    server = f.server(conn, "doomed")
    library = f.library(conn, server, "Movies")
    sibling = f.library(conn, server, "More movies")
    other = f.library(conn, f.server(conn, "kept"), "Kept movies")
    return World(server, library, sibling, other)


def delete(conn: Connection, world: World, target: str) -> None:
    if target == "library":
        execute(conn, "DELETE FROM libraries WHERE id = %s", (world.library,))
    else:
        execute(conn, "DELETE FROM media_servers WHERE id = %s", (world.server,))


def assert_gone(conn: Connection, library_ids: set[int]) -> None:
    """A deleted library leaves nothing behind: the cascades removed every row."""
    for table in (
        "library_inventory_state",
        "profile_refresh_requests",
        "media_server_items",
        "library_profiles",
        "library_policies",
    ):
        rows = fetch_all(
            conn,
            f"SELECT library_id FROM {table} WHERE library_id = ANY (%s)",
            (sorted(library_ids),),
        )
        assert rows == [], table


# --- the pipeline statements -------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One pipeline statement (or transaction) over the three libraries.

    `check(conn, world, result, contested)`: every library outside `contested` got its
    ordinary outcome; a contested one (being deleted while the statement ran) got the
    ordinary outcome or none at all. `touched(conn, world, result)`, for a background
    statement that skips what it cannot lock: the libraries it acted on.
    """

    name: str
    setup: Callable[[Connection, World], None]
    run: Callable[[Connection, World], Any]
    check: Callable[[Connection, World, Any, set[int]], None]
    gates: tuple[str, ...]
    touched: Callable[[Connection, World, Any], set[int]] | None = None


def stocked(conn: Connection, world: World) -> None:
    for n, library in enumerate(world.libraries):
        f.items(conn, library, 6, seed=n + 1)
    execute(conn, "SELECT fold_inventory_changes()")  # the revisions the planner reads


def claimed(conn: Connection, world: World) -> None:
    stocked(conn, world)
    profiles.plan(conn, POLICY)
    world.data["claims"] = profiles.claim(conn, POLICY, limit=10).claims
    assert len(world.data["claims"]) == 3


def request_rows(conn: Connection, library: int) -> list[dict[str, Any]]:
    return f.requests(conn, library)


# planner


def run_plan(conn: Connection, world: World) -> set[int]:
    planned = profile_queries.plan_inventory_requests(conn, POLICY, 25).requests
    return {p.library_id for p in planned}


def check_planned(conn: Connection, world: World, planned: Any, contested: set[int]) -> None:
    assert set(world.libraries) - contested <= planned


# native planner


def planned_libraries(conn: Connection, world: World, planned: Any) -> set[int]:
    return set(planned)


def native_setup(conn: Connection, world: World) -> None:
    stocked(conn, world)
    for library in world.libraries:
        execute(
            conn,
            "INSERT INTO library_policies (library_id, enabled, intent)"
            " VALUES (%s, true, 'active')",
            (library,),
        )


def run_native(conn: Connection, world: World) -> set[int]:
    planned = profile_queries.plan_native_requests(conn, POLICY, 25)
    return {p.library_id for p in planned}


# backfill: the analyst's enqueue transaction (lock the states, enqueue or join)


def run_backfill_enqueue(conn: Connection, world: World) -> tuple[set[int], set[int]]:
    with transaction(conn):
        states = profile_queries.lock_states(conn, world.libraries)
        requests = profile_queries.request_backfill(conn, world.libraries)
    return {s["library_id"] for s in states}, {r.library_id for r in requests}


def check_backfill(conn: Connection, world: World, result: Any, contested: set[int]) -> None:
    locked, requested = result
    kept = set(world.libraries) - contested
    assert kept <= locked and kept <= requested
    assert requested <= locked  # never a request for a library it could not hold


# completion


def run_process(conn: Connection, world: World) -> dict[int, str]:
    return {c.library_id: profiles.process(conn, c, POLICY).outcome for c in world.data["claims"]}


def check_outcomes(expected: str, lost: tuple[str, ...] = ("lost",)) -> Any:
    def check(conn: Connection, world: World, outcomes: Any, contested: set[int]) -> None:
        for library in world.libraries:
            allowed = {expected, *lost} if library in contested else {expected}
            found = outcomes[library]
            assert (found if isinstance(found, set) else {found}) <= allowed, (library, outcomes)

    return check


def emptied(conn: Connection, world: World) -> None:
    claimed(conn, world)
    run_process(conn, world)
    execute(
        conn, "DELETE FROM media_server_items WHERE library_id = ANY (%s)", (list(world.libraries),)
    )
    profiles.plan(conn, POLICY)
    world.data["claims"] = profiles.claim(conn, POLICY, limit=10).claims
    assert len(world.data["claims"]) == 3


def boom(frame: Any) -> dict[str, Any]:
    raise RuntimeError("generation failed")


def run_fail(conn: Connection, world: World) -> dict[int, str]:
    return {
        c.library_id: profiles.process(conn, c, POLICY, boom).outcome for c in world.data["claims"]
    }


def expired(conn: Connection, world: World) -> None:
    claimed(conn, world)
    execute(
        conn,
        "UPDATE profile_refresh_requests SET lease_expires_at = now() - interval '1 second'",
    )


def run_expire(conn: Connection, world: World) -> int:
    return profile_queries.expire_leases(conn, POLICY)


def check_expired(conn: Connection, world: World, count: Any, contested: set[int]) -> None:
    for library in set(world.libraries) - contested:
        [request] = request_rows(conn, library)
        assert (request["status"], request["last_error"]) == ("pending", "lease_expired")


# provider observation


def tmdb_stocked(conn: Connection, world: World) -> None:
    world.data["items"] = {
        library: [f.tmdb_item(conn, library, 100 * library + n) for n in range(2)]
        for library in world.libraries
    }


def run_observation_claim(conn: Connection, world: World) -> set[int]:
    return {c.item_id for c in recovery.claim(conn, 100)}


def check_observation_claim(
    conn: Connection, world: World, claimed_items: Any, contested: set[int]
) -> None:
    for library in set(world.libraries) - contested:
        assert set(world.data["items"][library]) <= claimed_items


def claimed_libraries(conn: Connection, world: World, claimed_items: Any) -> set[int]:
    return {lib for lib, items in world.data["items"].items() if set(items) & claimed_items}


def observation_claimed(conn: Connection, world: World) -> None:
    tmdb_stocked(conn, world)
    claims = recovery.claim(conn, 100)
    assert len(claims) == 6
    world.data["claims"] = claims


def observed(claim: ItemClaim) -> Observation:
    return Observation(
        tmdb_id=int(claim.provider_id),
        kind=claim.provider_kind,
        title="Observed",
        genres=("Drama",),
        vote_average=7.5,
        vote_count=10,
        original_language="xx",  # a projection field: change capture advances the revision
        companies=(),
        release_date=None,
        status="Released",
    )


def by_library(world: World, outcomes: dict[int, str]) -> dict[int, set[str]]:
    """The outcomes of each library's items (a deletion can come between two of them)."""
    return {library: {outcomes[i] for i in items} for library, items in world.data["items"].items()}


def run_observation_complete(conn: Connection, world: World) -> dict[int, str]:
    outcomes = {
        c.item_id: recovery.complete(conn, c, observed(c), RetryPolicy()).outcome
        for c in world.data["claims"]
    }
    return by_library(world, outcomes)


def run_observation_failed(conn: Connection, world: World) -> dict[int, str]:
    outcomes = {
        c.item_id: recovery.complete(conn, c, Failure("transient"), RetryPolicy()).outcome
        for c in world.data["claims"]
    }
    return by_library(world, outcomes)


# credential wakeup release


def auth_cases_verified(conn: Connection, world: World) -> None:
    f.provider_key(conn, TMDB_TEST_KEY)
    world.data["items"] = {
        library: f.auth_cases(conn, library, 2, first_tmdb_id=100 * library)
        for library in world.libraries
    }
    execute(
        conn,
        "UPDATE credential_wakeups w SET verified_generation = s.credential_generation,"
        " verified_at = now() FROM provider_settings s WHERE s.provider = w.provider",
    )


def run_release(conn: Connection, world: World) -> set[int]:
    """The libraries whose cases the batch released, read before a deletion held back
    by the test can remove them."""
    result = credentials.release(conn)
    assert result is not None
    rows = fetch_all(
        conn,
        "SELECT DISTINCT library_id FROM media_server_items WHERE recovery_wakeup_generation = %s",
        (result.generation,),
    )
    return {r["library_id"] for r in rows}


def check_released(conn: Connection, world: World, released: Any, contested: set[int]) -> None:
    assert set(world.libraries) - contested <= released
    for library in set(world.libraries) - contested:
        rows = fetch_all(
            conn,
            "SELECT recovery_wakeup_generation AS g FROM media_server_items WHERE library_id = %s",
            (library,),
        )
        assert len(rows) == 2 and all(r["g"] is not None for r in rows)


def released_libraries(conn: Connection, world: World, released: Any) -> set[int]:
    return set(released)


SCENARIOS = [
    Scenario("plan", stocked, run_plan, check_planned, ("request_insert",), planned_libraries),
    Scenario(
        "plan_native",
        native_setup,
        run_native,
        check_planned,
        ("request_insert",),
        planned_libraries,
    ),
    Scenario("backfill", stocked, run_backfill_enqueue, check_backfill, ("request_insert",)),
    Scenario(
        "complete",
        claimed,
        run_process,
        check_outcomes("published"),
        ("request_update", "profile_write"),
    ),
    Scenario(
        "complete_empty",
        emptied,
        run_process,
        check_outcomes("removed"),
        ("request_update", "profile_write"),
    ),
    Scenario("fail", claimed, run_fail, check_outcomes("failed"), ("request_update",)),
    Scenario("expire", expired, run_expire, check_expired, ("request_update",)),
    Scenario(
        "observation_claim",
        tmdb_stocked,
        run_observation_claim,
        check_observation_claim,
        ("item_update",),
        claimed_libraries,
    ),
    Scenario(
        "observation_complete",
        observation_claimed,
        run_observation_complete,
        check_outcomes("observed"),
        ("item_update", "capture", "change_insert"),
    ),
    Scenario(
        "observation_failed",
        observation_claimed,
        run_observation_failed,
        check_outcomes("failed"),
        ("item_update",),
    ),
    Scenario(
        "release",
        auth_cases_verified,
        run_release,
        check_released,
        ("item_update",),
        released_libraries,
    ),
]


@pytest.fixture
def control(db_url: str) -> Iterator[Control]:
    c = Control(db_url)
    yield c
    c.close()


@pytest.fixture
def sessions(db_url: str) -> Iterator[Callable[[str | None], Session]]:
    opened: list[Session] = []

    def make(gate: str | None = None) -> Session:
        s = Session(db_url, gate)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


DELETION_POINTS = ["libraries", "items", "requests", "state", "uncommitted", "rolled back"]


class RolledBack(Exception):
    """The deleter changed its mind."""


@pytest.mark.parametrize("target", ["library", "server"])
@pytest.mark.parametrize("point", [*DELETION_POINTS, "committed"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_pipeline_at_every_point_of_a_deletion(
    conn: Connection,
    control: Control,
    sessions: Callable[[str | None], Session],
    scenario: Scenario,
    point: str,
    target: str,
) -> None:
    if point == "libraries" and target == "library":
        pytest.skip("a library deletion does not cascade from libraries")
    pipeline_during_deletion(conn, control, sessions, scenario, point, target)


def pipeline_during_deletion(
    conn: Connection,
    control: Control,
    sessions: Callable[[str | None], Session],
    scenario: Scenario,
    point: str,
    target: str,
) -> None:
    """Pause the deletion at `point`, run the pipeline statement until it finishes or
    waits, let the deletion go on; both must succeed."""
    world = make_world(conn)
    scenario.setup(conn, world)
    doomed = world.doomed(target)
    pipeline = sessions(None)
    if point == "committed":
        delete(conn, world, target)
        pipeline.start(lambda c: scenario.run(c, world))
        result = pipeline.join()
    else:
        deleter = sessions(point if point in GATES else None)
        deleted = threading.Event()
        finish = threading.Event()

        def deletion(c: Connection) -> None:
            with transaction(c):
                delete(c, world, target)
                deleted.set()
                finish.wait(timeout=60)
                if point == "rolled back":
                    raise RolledBack

        control.shut()
        deleter.start(deletion)
        if point in GATES:
            assert control.settle(deleter) == "gate"
        else:
            assert deleted.wait(timeout=30)
        pipeline.start(lambda c: scenario.run(c, world))
        assert control.settle(pipeline) in ("done", "blocked")
        control.open()
        finish.set()
        result = pipeline.join()
        try:
            deleter.join()
        except RolledBack:
            assert point == "rolled back"
            doomed = set()
    scenario.check(conn, world, result, world.doomed(target))
    if scenario.touched is not None and point not in ("libraries", "committed"):
        # The deletion held the libraries before the statement began: skipped.
        assert not scenario.touched(conn, world, result) & world.doomed(target)
    assert_gone(conn, doomed)
    for library in doomed:
        assert fetch_one(conn, "SELECT 1 FROM libraries WHERE id = %s", (library,)) is None


@pytest.mark.parametrize("target", ["library", "server"])
@pytest.mark.parametrize(
    "scenario, point",
    [(s, g) for s in SCENARIOS for g in (*s.gates, "committed")],
    ids=lambda v: v.name if isinstance(v, Scenario) else v,
)
def test_deletion_at_every_point_of_the_pipeline(
    conn: Connection,
    control: Control,
    sessions: Callable[[str | None], Session],
    scenario: Scenario,
    point: str,
    target: str,
) -> None:
    deletion_during_pipeline(conn, control, sessions, scenario, point, target)


def deletion_during_pipeline(
    conn: Connection,
    control: Control,
    sessions: Callable[[str | None], Session],
    scenario: Scenario,
    point: str,
    target: str,
) -> None:
    """Pause the pipeline statement at `point`, run the deletion until it finishes or
    waits, let the pipeline go on; both must succeed."""
    world = make_world(conn)
    scenario.setup(conn, world)
    deleter = sessions(None)
    if point == "committed":
        pipeline = sessions(None)
        pipeline.start(lambda c: scenario.run(c, world))
        result = pipeline.join()
        delete(deleter.conn, world, target)
    else:
        pipeline = sessions(point)
        control.shut()
        pipeline.start(lambda c: scenario.run(c, world))
        assert control.settle(pipeline) == "gate"
        deleter.start(lambda c: delete(c, world, target))
        assert control.settle(deleter) in ("done", "blocked")
        control.open()
        result = pipeline.join()
        deleter.join()
    scenario.check(conn, world, result, world.doomed(target))
    assert_gone(conn, world.doomed(target))


# --- the rules the statements rely on, and the waits they must not make -------------


@pytest.mark.parametrize(
    "tables",
    ["library_inventory_state s JOIN libraries l", "libraries l JOIN library_inventory_state s"],
)
@pytest.mark.parametrize("library_first", [True, False])
def test_locking_clauses_lock_each_row_in_the_order_they_are_written(
    conn: Connection,
    control: Control,
    sessions: Callable[[str | None], Session],
    library_first: bool,
    tables: str,
) -> None:
    """Per joined row, PostgreSQL locks the tables in the order of the locking clauses
    (not the order of the FROM list): `FOR KEY SHARE OF l FOR UPDATE OF s` holds the
    library while it waits for the state row."""
    world = make_world(conn)
    clauses = ["FOR KEY SHARE OF l", "FOR UPDATE OF s"]
    if not library_first:
        clauses.reverse()
    holder, locker, probe = sessions(None), sessions(None), sessions(None)
    with transaction(holder.conn):
        execute(
            holder.conn,
            "SELECT 1 FROM library_inventory_state WHERE library_id = %s FOR UPDATE",
            (world.library,),
        )

        def lock(c: Connection) -> None:
            with transaction(c):
                execute(
                    c,
                    f"SELECT 1 FROM {tables} ON l.id = s.library_id"
                    f" WHERE s.library_id = %s {' '.join(clauses)}",
                    (world.library,),
                )

        locker.start(lock)
        assert control.settle(locker) == "blocked"  # on the state row
        held = fetch_all(
            probe.conn,
            "SELECT id FROM libraries WHERE id = %s FOR UPDATE SKIP LOCKED",
            (world.library,),
        )
        assert (held == []) == library_first
    locker.join()


def test_a_backfill_never_waits_while_holding_a_library(
    conn: Connection, control: Control, sessions: Callable[[str | None], Session]
) -> None:
    """A deletion of several libraries in one statement locks them in heap order, not id
    order; an analyst's backfill of the same libraries must not wait for one while it
    holds another."""
    world = make_world(conn)
    stocked(conn, world)
    # Move the lower id's row version behind the higher one: a sequential scan then
    # deletes `sibling` before `library`.
    execute(conn, "UPDATE libraries SET name = name || '.' WHERE id = %s", (world.library,))
    heap = fetch_all(
        conn, "SELECT id FROM libraries WHERE server_id = %s ORDER BY ctid", (world.server,)
    )
    assert [r["id"] for r in heap] == [world.sibling, world.library]
    writer, backfiller, deleter = sessions(None), sessions(None), sessions(None)
    execute(deleter.conn, "SET enable_indexscan = off")
    execute(deleter.conn, "SET enable_bitmapscan = off")
    with transaction(writer.conn):
        execute(
            writer.conn,  # another transaction (a completion) holds the library's state
            "SELECT 1 FROM library_inventory_state WHERE library_id = %s FOR UPDATE",
            (world.library,),
        )
        backfiller.start(lambda c: run_backfill_enqueue(c, world))
        assert control.settle(backfiller) == "blocked"
        deleter.start(
            lambda c: execute(
                c,
                "DELETE FROM libraries WHERE id IN (%s, %s)",
                (world.library, world.sibling),
            )
        )
        assert control.settle(deleter) == "blocked"
    locked, requested = backfiller.join()
    deleter.join()
    assert locked == requested == {world.other}
    assert_gone(conn, {world.library, world.sibling})


@pytest.mark.parametrize("deletion", ["commits", "rolls back"])
def test_a_backfill_waits_for_a_deletion_in_flight(
    conn: Connection,
    control: Control,
    sessions: Callable[[str | None], Session],
    deletion: str,
) -> None:
    """The analyst asked for the library: the backfill waits for the deletion, then
    reports the library gone (or refreshes it), and refreshes the others either way."""
    world = make_world(conn)
    stocked(conn, world)
    deleter, backfiller = sessions(None), sessions(None)
    deleter.conn.execute("BEGIN")
    delete(deleter.conn, world, "library")
    backfiller.start(
        lambda c: profiles.backfill(c, [world.library, world.other], POLICY, wait_seconds=30)
    )
    assert control.settle(backfiller) == "blocked"
    deleter.conn.execute("COMMIT" if deletion == "commits" else "ROLLBACK")
    results = {r.library_id: r for r in backfiller.join()}
    assert results[world.other].status == "refreshed"
    if deletion == "commits":
        assert results[world.library].status == "failed"
        assert_gone(conn, {world.library})
    else:
        assert results[world.library].status == "refreshed"
