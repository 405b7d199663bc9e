"""Our stats worker against the same stats built on Procrastinate (bench/peer_tasks.py),
on the same server in the same run: a workout storm and a rebuild of everyone.

Each side works in a scratch database of its own (the peer writes the same table
names), one after the other within each repetition, the order alternating; every ratio is
paired within its repetition. Both sides load the same canonical rows with the same
statements, are analyzed as autovacuum would, and run the same number of workers
(threads looping our drain, or one Procrastinate worker of that concurrency).

Our side is driven only through its public entry points, each behind one adapter below
(`_our_*`), so a change of module or function is a one-line change here.

Times are the server's own: a save is timed from its session's `created_at` (the save's
transaction start, on both sides), a publication at its commit (ours:
`user_stats_projection_runs.finished_at` plus the stage's `publish_ms`, i.e. the end of
the publish stage's function; the peer: `clock_timestamp()` in the task transaction's last
statement), matched after the run, so nothing polls during the storm. CPU is the
server's (/proc, so a local server only): utime + stime of the side's database sessions and
of the server's background processes, which on a quiet server is all of it and on a shared
one leaves out other databases' sessions (CpuWatch); the whole server's and the side's
sessions' alone are shown beside it.
Statements come from pg_stat_statements when the server loads it, transactions from
pg_stat_database.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import math
import os
import random
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any, Protocol

from psycopg import sql

from bench.common import Figure, Mode, as_autovacuum, over_runs, scratch_database
from inventory_pipeline.db import (
    Connection,
    DatabaseError,
    connect,
    execute,
    fetch_all,
    fetch_one,
    jsonb,
)

WORKERS = 2  # the machine has two cores
WRITERS = 8
IDLE_SECONDS = 0.05  # an always-on worker's pause after a drain that published nothing
POLL_SECONDS = 0.25
SAMPLE_SECONDS = 0.5  # the CPU watch's period
SEED = 20261204


# --- Our side: its public entry points, one adapter each ------------------------------


def _our_save(conn: Connection, user_id: uuid.UUID, session: dict[str, Any]) -> int:
    """A save through the write function; its receipt's requested_version."""
    row = fetch_one(
        conn, "SELECT save_training_session(%s, %s) AS receipt", (user_id, jsonb(session))
    )
    assert row is not None
    return int(row["receipt"]["requested_version"])


def _our_drain(conn: Connection, owner: str) -> int:
    """One drain of the worker; the generations it published."""
    from inventory_pipeline.stats import service

    return len(service.drain(conn, owner).published)


def _our_request_rebuild(conn: Connection, user_ids: list[uuid.UUID] | None) -> None:
    """A full-history rebuild of these users (None: everyone), through the queue."""
    from inventory_pipeline.stats import service

    service.request_rebuild(conn, user_ids)


def _our_allow_workers(conn: Connection, workers: int) -> None:
    """As many active leases as workers."""
    execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = %s", (workers,))


def _our_unpublished(conn: Connection) -> int:
    """Users whose requested generation is not yet applied."""
    row = fetch_one(
        conn,
        "SELECT count(*) AS n FROM user_stats_refresh_state"
        " WHERE applied_version < requested_version",
    )
    return int(row["n"]) if row else 0


def _our_status(conn: Connection) -> str:
    """The runbook's status, for a message when work stays outstanding."""
    row = fetch_one(conn, "SELECT stats_projection_worker_status() AS status")
    return str(row["status"]) if row else "?"


def _our_publications(conn: Connection, since: datetime) -> list[tuple[uuid.UUID, Any, datetime]]:
    """(user, generation, committed at) of every publication since `since`."""
    rows = fetch_all(
        conn,
        "SELECT user_id, target_version AS key,"
        " finished_at + coalesce(publish_ms, 0) * interval '1 millisecond' AS at"
        " FROM user_stats_projection_runs WHERE phase = 'published' AND finished_at >= %s",
        (since,),
    )
    return [(r["user_id"], int(r["key"]), r["at"]) for r in rows]


# --- The same canonical rows on both sides --------------------------------------------

EXERCISES = 40
FAVOURITES = 8  # the exercises one user trains
HISTORY = """
INSERT INTO exercises (id, name)
SELECT 'lift_' || g, 'Lift ' || g FROM generate_series(1, 40) g
ON CONFLICT DO NOTHING;
INSERT INTO training_sessions (id, user_id, session_date)
SELECT md5('session-' || u || '-' || s)::uuid, md5('user-' || u)::uuid,
       current_date - s * 7 - u %% 7
FROM generate_series(1, %(users)s) u, generate_series(1, 12) s;
INSERT INTO training_sets (session_id, position, exercise_id, weight_kg, reps, warmup)
SELECT md5('session-' || u || '-' || s)::uuid, p,
       'lift_' || (1 + (u * 7 + (u + s * 3 + p) %% 8) %% 40),
       40 + (u * 13 + s * 7 + p * 11) %% 120, 1 + (u + s + p) %% 12, p = 1
FROM generate_series(1, %(users)s) u, generate_series(1, 12) s, generate_series(1, 4) p
"""
ACCOUNT = """
INSERT INTO exercises (id, name)
SELECT 'big_' || g, 'Big ' || g FROM generate_series(1, %(exercises)s) g;
INSERT INTO training_sessions (id, user_id, session_date)
SELECT md5('largest-' || s)::uuid, %(user)s, current_date - %(sessions)s + s
FROM generate_series(1, %(sessions)s) s;
INSERT INTO training_sets (session_id, position, exercise_id, weight_kg, reps, warmup)
SELECT md5('largest-' || s)::uuid, k * 4 + r + 1,
       'big_' || (1 + (s * 9 / 2 + k) %% %(exercises)s),
       20 + (s * 31 + k * 17 + r * 7) %% 181, 1 + (s + k * 3 + r) %% 15, r = 0
FROM generate_series(1, %(sessions)s) s, generate_series(0, 5) k, generate_series(0, 3) r
WHERE k < 3 + s %% 4
"""
LARGEST = uuid.UUID(hashlib.md5(b"largest").hexdigest())


def _user(n: int) -> uuid.UUID:
    """The id HISTORY gives user `n` (md5('user-' || n)::uuid)."""
    return uuid.UUID(hashlib.md5(f"user-{n}".encode()).hexdigest())


def _run_script(conn: Connection, script: str, params: dict[str, Any]) -> None:
    for statement in script.split(";\n"):
        if statement.strip():
            execute(conn, statement, params)


# Projections without their generation labels, one digest per table: equal digests on
# both sides mean the same stats were published.
FINGERPRINT = """
SELECT (SELECT md5(coalesce(string_agg(concat_ws(',', user_id, exercise_id, sessions,
            working_sets, reps, volume, heaviest_kg, best_e1rm_kg, first_date, last_date),
            ';' ORDER BY user_id, exercise_id), '')) FROM user_exercise_stats) AS exercises,
       (SELECT md5(coalesce(string_agg(concat_ws(',', user_id, period, period_start, sessions,
            working_sets, reps, volume), ';' ORDER BY user_id, period, period_start), ''))
        FROM user_training_period_stats) AS periods,
       (SELECT md5(coalesce(string_agg(concat_ws(',', user_id, as_of_date, exercise_id,
            best_e1rm_all_time, best_e1rm_30d, best_e1rm_30d_prior_year, heaviest_kg),
            ';' ORDER BY user_id, as_of_date, exercise_id), ''))
        FROM user_pr_exercise_summary_snapshots) AS windows
"""


def _fingerprint(conn: Connection) -> tuple[str, ...]:
    row = fetch_one(conn, FINGERPRINT)
    assert row is not None
    return (str(row["exercises"]), str(row["periods"]), str(row["windows"]))


# --- Server CPU and counters ----------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")
REAPED = 0  # ServerCpu's key for the time of the children the postmaster reaped


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class ServerCpu:
    """The processes of a local server in clock ticks by pid: the postmaster, its live
    children, and under REAPED the children it reaped (they count from the start of the
    server; the difference between two samples is what changed in between)."""

    postmaster: int

    @classmethod
    def locate(cls, conn: Connection) -> ServerCpu | None:
        """The server of `conn` when it runs on this machine (its backend is a local
        postgres process whose parent is too); None otherwise."""
        row = fetch_one(conn, "SELECT pg_backend_pid() AS pid")
        pid = int(row["pid"]) if row else 0
        fields = _proc_stat(pid)
        if fields is None or not _comm(pid).startswith("postgres"):
            return None
        parent = int(fields[1])
        if not _comm(parent).startswith("postgres"):
            return None
        return cls(parent)

    def sample(self) -> dict[int, int]:
        ticks: dict[int, int] = {}
        own = _proc_stat(self.postmaster)
        if own is None:
            raise RuntimeError(f"the server's postmaster {self.postmaster} is gone")
        ticks[self.postmaster] = int(own[11]) + int(own[12])  # utime, stime
        ticks[REAPED] = int(own[13]) + int(own[14])  # cutime, cstime
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            fields = _proc_stat(int(entry))
            if fields is not None and int(fields[1]) == self.postmaster:
                ticks[int(entry)] = int(fields[11]) + int(fields[12])
        return ticks


class CpuWatch:
    """The server's CPU over a window, told apart by database: samples its processes and
    the database each session serves every SAMPLE_SECONDS from its own connection (to the
    maintenance database). Three sums: the whole server; the side's, its database's
    sessions (each to its last sample) plus the processes that serve no database and
    lived through the window (postmaster, checkpointer, WAL writer...: work of the
    side's, and of anything else on the server); and its database's sessions alone. On a
    quiet server the first two differ by the watch's own session; on a shared one the
    second leaves out other databases' sessions, however short."""

    def __init__(self, cpu: ServerCpu, admin_url: str, database: str) -> None:
        self.cpu = cpu
        self.admin_url = admin_url
        self.database = database
        self.first: dict[int, int] = {}  # ticks by pid at the start
        self.now: dict[int, int] = {}  # ticks by pid at the latest sample
        self.last: dict[int, int] = {}  # ticks by pid when last seen
        self.served: dict[int, str] = {}
        self._done = threading.Event()
        self._errors: list[BaseException] = []
        self._thread: threading.Thread | None = None

    def _sample(self, conn: Connection) -> None:
        for row in fetch_all(
            conn, "SELECT pid, datname FROM pg_stat_activity WHERE datname IS NOT NULL"
        ):
            self.served.setdefault(int(row["pid"]), str(row["datname"]))
        self.now = self.cpu.sample()
        self.last.update(self.now)

    def start(self) -> None:
        conn = connect(self.admin_url)
        self._sample(conn)
        self.first = dict(self.now)

        def watch() -> None:
            try:
                with conn:
                    while not self._done.wait(SAMPLE_SECONDS):
                        self._sample(conn)
                    self._sample(conn)
            except BaseException as exc:
                self._errors.append(exc)

        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()

    def stop(self) -> tuple[float, float, float]:
        """Seconds of the whole server, of the side's, and of its database's sessions."""
        self._done.set()
        assert self._thread is not None
        self._thread.join()
        if self._errors:
            raise RuntimeError("sampling the server's CPU failed") from self._errors[0]
        total = sum(self.now.values()) - sum(self.first.values())
        own = sum(
            ticks - self.first.get(pid, 0)
            for pid, ticks in self.last.items()
            if self.served.get(pid) == self.database
        )
        background = sum(
            self.now[pid] - ticks
            for pid, ticks in self.first.items()
            if pid != REAPED and pid in self.now and pid not in self.served
        )
        return total / TICK, (own + background) / TICK, own / TICK


STATEMENTS = """
SELECT coalesce(sum(calls) FILTER (WHERE toplevel), 0)::bigint AS top,
       coalesce(sum(calls), 0)::bigint AS every,
       (SELECT dealloc FROM pg_stat_statements_info) AS dealloc
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


def _count_statements(conn: Connection) -> str | None:
    """Make pg_stat_statements count every statement of this database's new sessions;
    None when it does, else why not (the figure is then n/a)."""
    row = fetch_one(conn, "SELECT current_setting('shared_preload_libraries') AS libraries")
    if row is None or "pg_stat_statements" not in str(row["libraries"]):
        return "n/a: the server does not load pg_stat_statements (shared_preload_libraries)"
    try:
        execute(conn, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        name = fetch_one(conn, "SELECT current_database() AS name")
        assert name is not None
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET pg_stat_statements.track = 'all'").format(
                sql.Identifier(str(name["name"]))
            )
        )
    except DatabaseError as exc:
        return f"n/a: pg_stat_statements unusable here ({str(exc).splitlines()[0]})"
    return None


@dataclass
class Window:
    """One side's measured window on its database: server CPU from `start` to `stop`,
    transactions and statements to `count` (read after the side's sessions closed, so
    that their statistics are flushed). The probe's own statements are left out."""

    conn: Connection
    watch: CpuWatch | None
    statements: bool
    probes: int = 0
    started_at: datetime | None = None
    cpu_seconds: float | None = None  # the side's sessions and the server's background
    total_cpu_seconds: float | None = None  # the server's
    own_cpu_seconds: float | None = None  # this database's sessions alone
    transactions: int = 0
    top_statements: int | None = None
    all_statements: int | None = None
    evicted: bool = False
    _counts: tuple[int, int, int, int] = (0, 0, 0, 0)
    _probes_at_start: int = 0

    def query(self, statement: str, params: Any = None) -> dict[str, Any]:
        self.probes += 1
        row = fetch_one(self.conn, statement, params)
        assert row is not None
        return row

    def _read_counts(self) -> tuple[int, int, int, int]:
        row = self.query(
            "SELECT xact_commit + xact_rollback AS n FROM pg_stat_database"
            " WHERE datname = current_database()"
        )
        if not self.statements:
            return int(row["n"]), 0, 0, 0
        counted = self.query(STATEMENTS)
        return int(row["n"]), int(counted["top"]), int(counted["every"]), int(counted["dealloc"])

    def start(self) -> None:
        if self.statements:  # room in its table: entries of dropped databases go
            fetch_all(
                self.conn,
                "SELECT pg_stat_statements_reset(0, d.dbid, 0) FROM (SELECT DISTINCT dbid"
                " FROM pg_stat_statements WHERE dbid NOT IN (SELECT oid FROM pg_database)) d",
            )
        self._counts = self._read_counts()
        self._probes_at_start = self.probes
        self.started_at = self.query("SELECT clock_timestamp() AS at")["at"]
        if self.watch is not None:
            self.watch.start()

    def stop(self) -> None:
        """The CPU since start (see CpuWatch)."""
        if self.watch is not None:
            self.total_cpu_seconds, self.cpu_seconds, self.own_cpu_seconds = self.watch.stop()

    def count(self) -> None:
        """After the side's sessions closed: the transactions and statements since start."""
        time.sleep(1.0)  # a closed session's statistics reach the server as it exits
        with contextlib.suppress(DatabaseError):
            self.query("SELECT pg_stat_force_next_flush()")  # the probe's own
        probes = self.probes - self._probes_at_start
        xacts, top, every, dealloc = self._read_counts()
        self.transactions = xacts - self._counts[0] - probes
        if self.statements:
            self.top_statements = top - self._counts[1] - probes
            self.all_statements = every - self._counts[2] - probes
            self.evicted = dealloc != self._counts[3]


def _watch(admin_url: str, conn: Connection) -> CpuWatch | None:
    """A CPU watch of the server of `conn` (None: not a local server)."""
    cpu = ServerCpu.locate(conn)
    database = fetch_one(conn, "SELECT current_database() AS name")
    assert database is not None
    return None if cpu is None else CpuWatch(cpu, admin_url, str(database["name"]))


def _checkpoint(conn: Connection) -> None:
    """Each window starts after a checkpoint (skipped where not allowed)."""
    with contextlib.suppress(DatabaseError):
        execute(conn, "CHECKPOINT")


# --- The two sides ----------------------------------------------------------------


@dataclass(frozen=True)
class Save:
    due: float  # seconds after the storm starts
    user: uuid.UUID
    session: uuid.UUID
    sets: tuple[tuple[str, float, int, bool], ...]


class Side(Protocol):
    name: str

    def install(self, url: str, conn: Connection) -> None: ...

    def workers(self, url: str) -> contextlib.AbstractContextManager[Callable[[], None]]: ...

    def everyone(self, url: str, conn: Connection, users: list[uuid.UUID]) -> None: ...

    def outstanding(self, conn: Connection) -> int: ...

    def status(self, conn: Connection) -> str: ...

    def saver(self, url: str) -> Callable[[Connection, Save, date], tuple[int | None, bool]]: ...

    def publications(
        self, conn: Connection, since: datetime
    ) -> list[tuple[uuid.UUID, Any, datetime]]: ...

    def recompute_seconds(self, url: str, conn: Connection, user: uuid.UUID) -> float: ...


@contextlib.contextmanager
def _threads(
    targets: Sequence[Callable[[threading.Event], None]],
) -> Iterator[Callable[[], None]]:
    """Run each target in a thread until the block ends (they watch the event); yields a
    check that raises the first error a thread died of."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def guarded(target: Callable[[threading.Event], None]) -> None:
        try:
            target(stop)
        except BaseException as exc:
            errors.append(exc)

    def check() -> None:
        if errors:
            raise RuntimeError("a worker failed") from errors[0]

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for t in threads:
        t.start()
    try:
        yield check
    finally:
        stop.set()
        for t in threads:
            t.join()
    check()


class Ours:
    name = "ours"

    def install(self, url: str, conn: Connection) -> None:
        _our_allow_workers(conn, WORKERS)

    def workers(self, url: str) -> contextlib.AbstractContextManager[Callable[[], None]]:
        def worker(n: int) -> Callable[[threading.Event], None]:
            def loop(stop: threading.Event) -> None:
                with connect(url) as conn:
                    while not stop.is_set():
                        if _our_drain(conn, f"peer-bench-{n}") == 0:
                            stop.wait(IDLE_SECONDS)

            return loop

        return _threads([worker(n) for n in range(WORKERS)])

    def everyone(self, url: str, conn: Connection, users: list[uuid.UUID]) -> None:
        _our_request_rebuild(conn, None)

    def outstanding(self, conn: Connection) -> int:
        return _our_unpublished(conn)

    def status(self, conn: Connection) -> str:
        return _our_status(conn)

    def saver(self, url: str) -> Callable[[Connection, Save, date], tuple[int | None, bool]]:
        def save(conn: Connection, s: Save, day: date) -> tuple[int | None, bool]:
            session = {
                "id": str(s.session),
                "user_id": str(s.user),
                "session_date": str(day),
                "sets": [
                    {"exercise_id": e, "weight_kg": w, "reps": r, "warmup": wu}
                    for e, w, r, wu in s.sets
                ],
            }
            return _our_save(conn, s.user, session), True

        return save

    def publications(
        self, conn: Connection, since: datetime
    ) -> list[tuple[uuid.UUID, Any, datetime]]:
        return _our_publications(conn, since)

    def recompute_seconds(self, url: str, conn: Connection, user: uuid.UUID) -> float:
        _our_request_rebuild(conn, [user])
        start = time.perf_counter()
        published = _our_drain(conn, "peer-bench-largest")
        seconds = time.perf_counter() - start
        if published != 1:
            raise RuntimeError(f"the largest account: {published} publications, not 1")
        return seconds


class Peer:
    name = "peer"

    def install(self, url: str, conn: Connection) -> None:
        from bench import peer_tasks

        peer_tasks.install(url, conn)

    def workers(self, url: str) -> contextlib.AbstractContextManager[Callable[[], None]]:
        from bench import peer_tasks

        def run(stop: threading.Event) -> None:
            async def main() -> None:
                app = peer_tasks.app(url)
                async with app.open_async():
                    worker = asyncio.create_task(
                        app.run_worker_async(
                            concurrency=WORKERS, name="peer-bench", install_signal_handlers=False
                        )
                    )
                    while not stop.is_set() and not worker.done():
                        await asyncio.sleep(0.05)
                    if worker.done():
                        worker.result()  # its error
                        raise RuntimeError("the Procrastinate worker stopped")
                    worker.cancel()  # Procrastinate stops gracefully on cancellation
                    with contextlib.suppress(asyncio.CancelledError):
                        await worker

            asyncio.run(main())

        return _threads([run])

    def everyone(self, url: str, conn: Connection, users: list[uuid.UUID]) -> None:
        from bench import peer_tasks

        peer_tasks.defer_everyone(conn, peer_tasks.app(url), users)

    def outstanding(self, conn: Connection) -> int:
        row = fetch_one(
            conn,
            "SELECT count(*) FILTER (WHERE status IN ('todo', 'doing')) AS open,"
            " count(*) FILTER (WHERE status NOT IN ('todo', 'doing', 'succeeded')) AS bad"
            " FROM procrastinate_jobs",
        )
        assert row is not None
        if row["bad"]:
            raise RuntimeError(f"{row['bad']} Procrastinate jobs did not succeed")
        return int(row["open"])

    def status(self, conn: Connection) -> str:
        rows = fetch_all(
            conn, "SELECT status, count(*) AS n FROM procrastinate_jobs GROUP BY 1 ORDER BY 1"
        )
        return ", ".join(f"{r['status']} {r['n']}" for r in rows)

    def saver(self, url: str) -> Callable[[Connection, Save, date], tuple[int | None, bool]]:
        from bench import peer_tasks

        app = peer_tasks.app(url)
        app.connector.get_sync_connector()  # made once, before the writer threads share it

        def save(conn: Connection, s: Save, day: date) -> tuple[int | None, bool]:
            return None, peer_tasks.save(conn, app, s.user, s.session, day, s.sets)

        return save

    def publications(
        self, conn: Connection, since: datetime
    ) -> list[tuple[uuid.UUID, Any, datetime]]:
        rows = fetch_all(
            conn,
            "SELECT user_id, covered_through AS key, published_at AS at"
            " FROM peer_stats_publications WHERE published_at >= %s",
            (since,),
        )
        return [(r["user_id"], r["key"], r["at"]) for r in rows]

    def recompute_seconds(self, url: str, conn: Connection, user: uuid.UUID) -> float:
        import psycopg

        from bench import peer_tasks

        async def timed() -> float:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as aconn:
                start = time.perf_counter()
                await peer_tasks.recompute(aconn, user)
                return time.perf_counter() - start

        return asyncio.run(timed())


SIDES: dict[str, Side] = {"ours": Ours(), "peer": Peer()}
CLOCK = "server clock, the save's transaction start to the publication's commit"
LABELS = {"ours": "ours", "peer": "Procrastinate peer"}


@contextlib.contextmanager
def _side_database(admin_url: str, side: Side, users: int) -> Iterator[tuple[str, str | None]]:
    """A scratch database for `side` with `users` users' history loaded and analyzed;
    yields its URL and why statements are not counted (None: they are)."""
    with scratch_database(admin_url) as url:
        with connect(url) as conn:
            uncounted = _count_statements(conn)
            side.install(url, conn)
            _run_script(conn, HISTORY, {"users": users})
            as_autovacuum(conn)
        yield url, uncounted


def _wait_published(side: Side, window: Window, check: Callable[[], None], timeout: float) -> bool:
    """Poll until nothing is outstanding (True) or `timeout` seconds passed (False)."""
    deadline = time.perf_counter() + timeout
    while True:
        check()
        window.probes += 1
        if side.outstanding(window.conn) == 0:
            return True
        if time.perf_counter() > deadline:
            return False
        time.sleep(POLL_SECONDS)


# --- Workload 1: the workout storm ----------------------------------------------------


def schedule(users: int, seconds: float, interval: tuple[float, float]) -> list[Save]:
    """Every user saves a session of one to three sets of their exercises every
    `interval` seconds (uniform), the first within the first interval; seeded, so both
    sides get the same saves at the same offsets."""
    rng = random.Random(SEED)
    saves: list[Save] = []
    for n in range(1, users + 1):
        at = rng.uniform(0, rng.uniform(*interval))
        while at < seconds:
            sets = tuple(
                (
                    f"lift_{1 + (n * 7 + rng.randrange(FAVOURITES)) % EXERCISES}",
                    float(rng.randint(20, 200)),
                    rng.randint(1, 12),
                    False,
                )
                for _ in range(rng.randint(1, 3))
            )
            saves.append(Save(at, _user(n), uuid.UUID(int=rng.getrandbits(128), version=4), sets))
            at += rng.uniform(*interval)
    saves.sort(key=lambda s: s.due)
    return saves


@dataclass
class StormResult:
    saves: int
    p50: float
    p95: float
    never: int
    cpu_ms: float | None  # the side's sessions and the server's background, per save
    total_cpu_ms: float | None  # the whole server's
    own_cpu_ms: float | None  # this database's sessions alone
    statements: float | None
    all_statements: float | None
    transactions: float
    publications: float  # per save
    coalesced: int  # saves covered by a waiting job (peer)
    lag_p95: float  # writers behind schedule
    fingerprint: tuple[str, ...]
    evicted: bool


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank; an unpublished save is +inf."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _latencies(
    saves: Sequence[tuple[uuid.UUID, Any, datetime]],
    publications: Sequence[tuple[uuid.UUID, Any, datetime]],
) -> list[float]:
    """Seconds from each save (user, key, saved at) to the first publication of its user
    whose key covers the save's key; +inf when none did."""
    by_user: dict[uuid.UUID, list[tuple[Any, datetime]]] = defaultdict(list)
    for user, key, at in publications:
        if key is not None:
            by_user[user].append((key, at))
    earliest: dict[uuid.UUID, tuple[list[Any], list[datetime]]] = {}
    for user, pubs in by_user.items():
        pubs.sort(key=lambda p: p[0])
        keys = [k for k, _ in pubs]
        first = [at for _, at in pubs]
        for i in range(len(first) - 2, -1, -1):  # the earliest at or after each key
            first[i] = min(first[i], first[i + 1])
        earliest[user] = (keys, first)
    result: list[float] = []
    for user, key, saved_at in saves:
        keys, first = earliest.get(user, ([], []))
        i = bisect.bisect_left(keys, key)
        result.append((first[i] - saved_at).total_seconds() if i < len(keys) else math.inf)
    return result


def storm_side(
    admin_url: str, side: Side, users: int, saves: list[Save], tail: float
) -> StormResult:
    with _side_database(admin_url, side, users) as (url, uncounted):
        with connect(url) as conn:
            day = fetch_one(conn, "SELECT current_date AS day")
            assert day is not None
            window = Window(conn, _watch(admin_url, conn), uncounted is None)
            with side.workers(url) as check:
                # The history published before the clock starts, as autovacuum would
                # find it afterwards.
                side.everyone(url, conn, [_user(n) for n in range(1, users + 1)])
                if not _wait_published(side, window, check, 600):
                    raise RuntimeError(
                        f"{side.name}: the history was not published in 600 s: {side.status(conn)}"
                    )
                as_autovacuum(conn)
                _checkpoint(conn)
                records, lags, published = _write(url, side, saves, day["day"], window, check)
                done = _wait_published(side, window, check, tail)
                window.stop()
                if not done:
                    print(f"{side.name}: work outstanding at the end: {side.status(conn)}")
            window.count()
            assert window.started_at is not None
            created = {
                r["id"]: (r["user_id"], r["created_at"])
                for r in fetch_all(
                    conn,
                    "SELECT id, user_id, created_at FROM training_sessions WHERE id = ANY(%s)",
                    ([s for s, _, _ in records],),
                )
            }
            keyed = [
                (created[s][0], key if key is not None else created[s][1], created[s][1])
                for s, key, _ in records
            ]
            pubs = side.publications(conn, window.started_at)
            fingerprint = _fingerprint(conn)
    seconds = _latencies(keyed, pubs)
    never = sum(1 for s in seconds if math.isinf(s))
    if not done and never == 0:
        raise RuntimeError(f"{side.name}: work outstanding after every save was published")
    ok = len(seconds) - never or 1

    def per_save(value: float | None, scale: float = 1.0) -> float | None:
        return None if value is None else value * scale / ok

    return StormResult(
        saves=len(records),
        p50=_percentile(seconds, 0.50),
        p95=_percentile(seconds, 0.95),
        never=never,
        cpu_ms=per_save(window.cpu_seconds, 1000),
        total_cpu_ms=per_save(window.total_cpu_seconds, 1000),
        own_cpu_ms=per_save(window.own_cpu_seconds, 1000),
        statements=per_save(window.top_statements),
        all_statements=per_save(window.all_statements),
        transactions=window.transactions / ok,
        publications=len(pubs) / max(len(records), 1),
        coalesced=sum(1 for d in published if not d),
        lag_p95=_percentile(lags, 0.95),
        fingerprint=fingerprint,
        evicted=window.evicted,
    )


def _write(
    url: str,
    side: Side,
    saves: list[Save],
    day: date,
    window: Window,
    check: Callable[[], None],
) -> tuple[list[tuple[uuid.UUID, int | None, float]], list[float], list[bool]]:
    """The storm: WRITERS threads, each on its own connection, take the next due save and
    make it when it is due. Starts the window when every writer is connected. Returns
    (session, receipt version, lag) per save, the lags, and whether each save deferred a
    job of its own."""
    save = side.saver(url)
    lock = threading.Lock()
    position = [0]
    records: list[tuple[uuid.UUID, int | None, float]] = []
    deferred: list[bool] = []
    ready = threading.Barrier(WRITERS + 1, timeout=60)
    go = threading.Event()
    start = [0.0]

    def writer(stop: threading.Event) -> None:
        with connect(url) as conn:
            ready.wait()
            go.wait()
            while not stop.is_set():
                with lock:
                    if position[0] >= len(saves):
                        return
                    s = saves[position[0]]
                    position[0] += 1
                delay = start[0] + s.due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                lag = max(0.0, time.perf_counter() - start[0] - s.due)
                key, own_job = save(conn, s, day)
                with lock:
                    records.append((s.session, key, lag))
                    deferred.append(own_job)

    with _threads([writer] * WRITERS) as writers_check:
        ready.wait()
        window.start()
        start[0] = time.perf_counter()
        go.set()
        while True:
            with lock:
                finished = len(records) == len(saves)
            if finished:
                break
            writers_check()
            check()
            time.sleep(POLL_SECONDS)
    return records, [lag for _, _, lag in records], deferred


def storm(admin_url: str, mode: Mode) -> list[Figure]:
    users = mode.pick(smoke=20, default=1000)
    seconds = mode.pick(
        smoke=5.0, default=float(os.environ.get("INVENTORY_BENCH_PEER_SECONDS", "300"))
    )
    interval = mode.pick(smoke=(1.0, 3.0), default=(10.0, 30.0))
    reps = mode.pick(smoke=1, default=2)
    tail = mode.pick(smoke=30.0, default=120.0)
    saves = schedule(users, seconds, interval)
    results: dict[str, list[StormResult]] = {"ours": [], "peer": []}
    equal = 0
    for rep in range(reps):
        order = ("ours", "peer") if rep % 2 == 0 else ("peer", "ours")
        for name in order:
            print(f"storm repetition {rep + 1}/{reps}: {name}", flush=True)
            results[name].append(storm_side(admin_url, SIDES[name], users, saves, tail))
        equal += results["ours"][-1].fingerprint == results["peer"][-1].fingerprint
    judged = not mode.smoke
    lo, hi = interval
    figures = [
        over_runs(
            f"storm: {users} users, a save every {lo:g}-{hi:g} s for {seconds:g} s,"
            f" {WORKERS} workers a side: saves per side",
            [float(r.saves) for r in results["ours"]],
            "",
            f"same seeded schedule on both sides; {reps} repetition(s), order alternating",
        )
    ]
    for name in ("ours", "peer"):
        runs = results[name]
        figures += [
            over_runs(
                f"  {LABELS[name]} save -> published p50", [r.p50 for r in runs], " s", CLOCK
            ),
            over_runs(
                f"  {LABELS[name]} save -> published p95", [r.p95 for r in runs], " s", CLOCK
            ),
        ]
    figures.append(
        over_runs(
            "  ours p95 vs peer p95",
            [o.p95 / p.p95 for o, p in zip(results["ours"], results["peer"], strict=True)],
            "x",
            "goal <= 1.0x (paired within each repetition)",
            (lambda r: r <= 1.0) if judged else None,
        )
    )
    figures += _cpu_figures(
        {n: [(r.cpu_ms, r.total_cpu_ms, r.own_cpu_ms) for r in rs] for n, rs in results.items()},
        "published save",
        "goal <= 0.5x (paired within each repetition)",
        (lambda r: r <= 0.5) if judged else None,
    )
    figures += _count_figures(
        {n: [r.statements for r in rs] for n, rs in results.items()},
        {n: [r.all_statements for r in rs] for n, rs in results.items()},
        {n: [r.transactions for r in rs] for n, rs in results.items()},
        "published save",
        any(r.evicted for rs in results.values() for r in rs),
    )
    for name, what in (("ours", "generations published"), ("peer", "task runs")):
        figures.append(
            over_runs(
                f"  {LABELS[name]} {what} per save",
                [r.publications for r in results[name]],
                "",
                "coalescing"
                + (
                    f"; saves covered by a waiting job (AlreadyEnqueued): "
                    f"{', '.join(str(r.coalesced) for r in results[name])}"
                    if name == "peer"
                    else ""
                ),
            )
        )
    for name in ("ours", "peer"):
        figures.append(
            over_runs(
                f"  {LABELS[name]} saves never published within {tail:g} s of the last",
                [float(r.never) for r in results[name]],
                "",
                "goal 0 (counted as infinite in the percentiles)",
                (lambda n: n == 0) if judged else None,
            )
        )
        figures.append(
            over_runs(
                f"  {LABELS[name]} writers behind schedule, p95",
                [r.lag_p95 for r in results[name]],
                " s",
                f"{WRITERS} writer threads; a check on the load generator",
            )
        )
    figures.append(_equal_figure(equal, reps))
    return figures


def _equal_figure(equal: int, reps: int) -> Figure:
    return Figure(
        "  both sides published the same projections and PR windows",
        float(equal),
        f" of {reps}",
        "repetitions with equal digests of every projection row (generations aside)",
        equal == reps,
    )


@dataclass(frozen=True)
class NotMeasured(Figure):
    """A figure this run could not measure: shown as n/a, with the reason as its goal."""

    def shown(self) -> str:
        return "n/a"


def _cpu_figures(
    measured: dict[str, list[tuple[float | None, float | None, float | None]]],
    per: str,
    goal: str,
    judge: Callable[[float], bool] | None,
) -> list[Figure]:
    """Per side: the CPU of its sessions and the server's background (judged), with the
    whole server's and its sessions' alone in the note; and the paired ratio."""
    cpu: dict[str, list[float]] = {}
    for name, runs in measured.items():
        if any(v is None for run in runs for v in run):
            return [
                NotMeasured(
                    f"  database CPU per {per}",
                    math.nan,
                    "",
                    "n/a: the server is not a local process (CPU is read from /proc)",
                )
            ]
        cpu[name] = [float(run[0] or 0) for run in runs]
    figures: list[Figure] = []
    for name in ("ours", "peer"):
        total = [float(run[1] or 0) for run in measured[name]]
        own = [float(run[2] or 0) for run in measured[name]]
        figures.append(
            over_runs(
                f"  {LABELS[name]} database CPU per {per}",
                cpu[name],
                " ms",
                "utime+stime (/proc) of the side's sessions and the server's background"
                f" processes; whole server {min(total):.2f}-{max(total):.2f} ms,"
                f" the side's sessions alone {min(own):.2f}-{max(own):.2f} ms",
            )
        )
    ratios = [o / p for o, p in zip(cpu["ours"], cpu["peer"], strict=True) if p]
    figures.append(over_runs(f"  ours CPU per {per} vs peer", ratios, "x", goal, judge))
    return figures


def _count_figures(
    top: dict[str, list[float | None]],
    every: dict[str, list[float | None]],
    transactions: dict[str, list[float]],
    per: str,
    evicted: bool,
) -> list[Figure]:
    figures: list[Figure] = []
    for name in ("ours", "peer"):
        counted = [v for v in top[name] if v is not None]
        nested = [v for v in every[name] if v is not None]
        if len(counted) != len(top[name]):
            figures.append(
                NotMeasured(
                    f"  {LABELS[name]} statements per {per}",
                    math.nan,
                    "",
                    "n/a: the server does not load pg_stat_statements (shared_preload_libraries)",
                )
            )
        else:
            note = "pg_stat_statements, top level" + (
                f"; with nested {min(nested):.1f}-{max(nested):.1f}" if nested else ""
            )
            if evicted:
                note += "; entries were evicted meanwhile, an undercount"
            figures.append(over_runs(f"  {LABELS[name]} statements per {per}", counted, "", note))
        figures.append(
            over_runs(
                f"  {LABELS[name]} transactions per {per}",
                transactions[name],
                "",
                "pg_stat_database of the side's database",
            )
        )
    return figures


# --- Workload 2: a rebuild of everyone, and the largest account -----------------------


@dataclass
class RebuildResult:
    rate: float  # users/s
    cpu_ms: float | None
    total_cpu_ms: float | None
    own_cpu_ms: float | None
    statements: float | None
    all_statements: float | None
    transactions: float
    fingerprint: tuple[str, ...]
    evicted: bool
    largest: list[float] = field(default_factory=list)  # seconds per full recompute


def rebuild_side(
    admin_url: str,
    side: Side,
    users: int,
    timeout: float,
    account: tuple[int, int],
    timings: int,
) -> RebuildResult:
    ids = [_user(n) for n in range(1, users + 1)]
    with _side_database(admin_url, side, users) as (url, uncounted):
        with connect(url) as conn:
            window = Window(conn, _watch(admin_url, conn), uncounted is None)
            _checkpoint(conn)
            with side.workers(url) as check:
                time.sleep(0.5)  # the workers connected and idle
                window.start()
                side.everyone(url, conn, ids)
                if not _wait_published(side, window, check, timeout):
                    raise RuntimeError(
                        f"{side.name}: the rebuild took over {timeout:g} s: {side.status(conn)}"
                    )
                window.stop()
            window.count()
            assert window.started_at is not None
            pubs = side.publications(conn, window.started_at)
            if len({u for u, _, _ in pubs}) != users:
                raise RuntimeError(f"{side.name}: {len(pubs)} publications for {users} users")
            seconds = (max(at for _, _, at in pubs) - window.started_at).total_seconds()
            fingerprint = _fingerprint(conn)
            sessions, exercises = account
            _run_script(
                conn, ACCOUNT, {"user": LARGEST, "sessions": sessions, "exercises": exercises}
            )
            as_autovacuum(conn)
            largest = [side.recompute_seconds(url, conn, LARGEST) for _ in range(timings)]

    def per_user(value: float | None, scale: float = 1.0) -> float | None:
        return None if value is None else value * scale / users

    return RebuildResult(
        rate=users / seconds,
        cpu_ms=per_user(window.cpu_seconds, 1000),
        total_cpu_ms=per_user(window.total_cpu_seconds, 1000),
        own_cpu_ms=per_user(window.own_cpu_seconds, 1000),
        statements=per_user(window.top_statements),
        all_statements=per_user(window.all_statements),
        transactions=window.transactions / users,
        fingerprint=fingerprint,
        evicted=window.evicted,
        largest=largest,
    )


def rebuild(admin_url: str, mode: Mode) -> list[Figure]:
    users = mode.pick(smoke=50, default=10_000)
    reps = mode.pick(smoke=1, default=2)
    timings = mode.pick(smoke=1, default=2)
    account = mode.pick(smoke=(60, 120), default=(658, 296))
    timeout = mode.pick(smoke=60.0, default=1800.0)
    results: dict[str, list[RebuildResult]] = {"ours": [], "peer": []}
    equal = 0
    for rep in range(reps):
        order = ("ours", "peer") if rep % 2 == 0 else ("peer", "ours")
        for name in order:
            print(f"rebuild repetition {rep + 1}/{reps}: {name}", flush=True)
            results[name].append(
                rebuild_side(admin_url, SIDES[name], users, timeout, account, timings)
            )
        equal += results["ours"][-1].fingerprint == results["peer"][-1].fingerprint
    figures = [
        over_runs(
            f"rebuild of all {users} users (12 sessions, 48 sets each), {WORKERS} workers a"
            " side: ours, request to everyone published",
            [r.rate for r in results["ours"]],
            " users/s",
            "request_rebuild(None), one user per transaction, drained meanwhile",
        ),
        over_runs(
            "  Procrastinate peer, first defer to everyone published",
            [r.rate for r in results["peer"]],
            " users/s",
            "one job per user, deferred 1,000 a statement",
        ),
        over_runs(
            "  ours vs peer (users/s)",
            [o.rate / p.rate for o, p in zip(results["ours"], results["peer"], strict=True)],
            "x",
            "paired within each repetition",
        ),
    ]
    figures += _cpu_figures(
        {n: [(r.cpu_ms, r.total_cpu_ms, r.own_cpu_ms) for r in rs] for n, rs in results.items()},
        "user",
        "paired within each repetition",
        None,
    )
    figures += _count_figures(
        {n: [r.statements for r in rs] for n, rs in results.items()},
        {n: [r.all_statements for r in rs] for n, rs in results.items()},
        {n: [r.transactions for r in rs] for n, rs in results.items()},
        "user",
        any(r.evicted for rs in results.values() for r in rs),
    )
    figures.append(_equal_figure(equal, reps))
    sessions, exercises = account
    ours_ms = [s * 1000 for r in results["ours"] for s in r.largest]
    peer_ms = [s * 1000 for r in results["peer"] for s in r.largest]
    figures += [
        over_runs(
            f"largest account ({sessions} sessions, {exercises} exercises), one full"
            " recompute: ours",
            ours_ms,
            " ms",
            "one drain: claim, compute in batches of <= 100 exercises, publish",
        ),
        over_runs("  Procrastinate peer", peer_ms, " ms", "the task's body: one transaction"),
        over_runs(
            "  ours vs peer",
            [o / p for o, p in zip(ours_ms, peer_ms, strict=True)],
            "x",
            "paired by repetition and timing",
        ),
    ]
    return figures


def run(admin_url: str, mode: Mode) -> list[Figure]:
    try:
        import procrastinate  # noqa: F401
    except ImportError:
        return [Figure("stats vs Procrastinate", 0, "", "skipped: pip install -e '.[bench]'")]
    return storm(admin_url, mode) + rebuild(admin_url, mode)
