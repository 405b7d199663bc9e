"""The seeded writer: every kind of change the system of record sees, drawn from one
random stream, so a seed names the same operations in the same order every time.

Writes go through plain SQL and the published write functions, as any application of
the data contract would; the one operator action, a rebuild of every user, goes through
the product's rebuild entry point on a connection of its own, beside the writes. Some
writes go through a separate writer role that holds rights on the items table and
nothing else (INSERT, UPDATE, DELETE, TRUNCATE, upserts, MERGE and COPY), as another
program's sync would.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

from chaos import replacements
from chaos.config import (
    API_KEY,
    AUTH_BACKLOG_CASES,
    BACKLOG_ITEMS,
    BACKLOG_LIBRARIES,
    CANCEL_LOOK_SECONDS,
    EXPECTED_SQLSTATE_CLASSES,
    EXPECTED_SQLSTATES,
    HOLD_ASK_SECONDS,
    HOLD_ATTEMPTS,
    HOLD_PAST_TRIES_SECONDS,
    KEPT_FAULT_MAX_EXTRA,
    KEPT_FAULT_OPERATIONS,
    LARGE_EXERCISES,
    LARGE_IMPORT_SESSIONS,
    LARGE_USERS,
    LIBRARY_HOLD_LEASE_SECONDS,
    LIBRARY_HOLD_SECONDS,
    LOCK_WAIT_CALM_OPERATIONS,
    LOCK_WAIT_LOOK_SECONDS,
    MERGE_VARIANTS,
    SMALL_USERS,
    SQUEEZE_OPERATIONS,
    SQUEEZED_ATTEMPTS,
    SQUEEZED_COMPUTE_BUDGET_MS,
    STATS_SETTINGS,
    STORM_ITEMS,
    STORM_OPERATIONS,
    STORM_RETRY_AFTER,
    WRONG_KEY,
)
from inventory_pipeline.db import (
    Connection,
    DatabaseError,
    DatabaseUnavailable,
    FeatureNotSupported,
    execute,
    fetch_all,
    fetch_one,
    jsonb,
    transaction,
)
from inventory_pipeline.db.connection import translate_errors
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.stats import service
from tests.factories import insert_items, item_values

GLOBAL_EXERCISES = ("squat", "bench_press", "deadlift", "overhead_press", "row", "pull_up")
# The large accounts' catalog: more exercises than one compute batch holds.
LARGE_CATALOG = tuple(f"lift_{n:03d}" for n in range(LARGE_EXERCISES))
# The runs of a user still computing (claimed, not yet computed): where an edit lands
# between a batched compute's transactions.
COMPUTING = (
    "SELECT user_id FROM user_stats_projection_runs WHERE phase = 'claimed'"
    " AND user_id = ANY(%s) ORDER BY id DESC LIMIT 1"
)
# A publication waiting on a lock the given backend (an application's transaction)
# holds: the backend to cancel, or let run out of its budget.
WAITING_PUBLICATION = (
    "SELECT a.pid FROM pg_stat_activity a"
    " WHERE a.datname = current_database() AND a.state = 'active'"
    " AND a.wait_event_type = 'Lock' AND a.query LIKE '%%stats_publish_stage(%%'"
    " AND %s = ANY (pg_blocking_pids(a.pid))"
    " LIMIT 1"
)
# A user's run claimed and at work (computing or about to publish) by a worker (a
# harness worker, `chaos-<pid>`, or a Dagster drain): never the harness's own
# application calls, so that without workers the hold writes nothing.
CLAIMED = (
    "SELECT 1 FROM user_stats_projection_runs WHERE user_id = %s"
    " AND phase IN ('claimed', 'computed') AND retry_not_before IS NULL"
    " AND lock_owner ~ '^(chaos-[0-9]+|dagster:)'"
)
# A stats worker's stage call in flight (its arming statement or the stage itself).
STAGE_IN_FLIGHT = (
    "SELECT a.pid, CASE WHEN a.query LIKE '%stats_claim_stage(%' THEN 'claim'"
    "  WHEN a.query LIKE '%stats_compute_stage(%' THEN 'compute'"
    "  WHEN a.query LIKE '%stats_publish_stage(%' THEN 'publish' ELSE 'arm' END AS stage"
    " FROM pg_stat_activity a"
    " WHERE a.datname = current_database() AND a.state = 'active'"
    " AND a.application_name ~ '^chaos\\.(stats|drainer)\\.'"
    " AND (a.query LIKE '%stats\\_%\\_stage(%'"
    "  OR a.query LIKE '%stats_projection_statement_budget(%')"
    " ORDER BY random() LIMIT 1"
)
# A nested gzip bomb: a few KiB that decode to 256 MiB.
BOMB: dict[str, Any] = {"encoding": ("gzip", "gzip"), "size": 256 << 20}
FAULTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("status", {"status": 500}),
    ("status", {"status": 503}),
    ("throttle", {"retry_after": "1"}),
    ("garbage", {}),
    ("truncate", {}),
    ("close", {}),
    ("slow", {"delay": 1.5}),
    ("missing", {}),
    ("compress", {}),
    ("encoded", BOMB),
)
# A typed item an observer can claim once it is due, with a readable TMDb id the stand-in
# knows (ids divisible by 17 are missing there), in a library no profile claim holds (a
# claim made during the hold waits less than its lease) and with another item: the sync
# program's write holds the library through that other item.
HOLDABLE_ITEM = (
    "i.provider = 'tmdb' AND i.provider_kind IN ('movie', 'tv')"
    " AND mod(tmdb_id_of(i.provider_id), 17) <> 0"
)
HOLDABLE = (
    "SELECT i.library_id, i.id, tmdb_id_of(i.provider_id) AS tmdb_id,"
    " (SELECT o.id FROM media_server_items o WHERE o.library_id = i.library_id"
    "  AND o.id <> i.id ORDER BY o.id LIMIT 1) AS other"
    " FROM media_server_items i JOIN libraries l ON l.id = i.library_id"
    " JOIN media_servers m ON m.id = l.server_id"
    f" WHERE {HOLDABLE_ITEM} AND l.active AND m.active AND l.media_kind IN ('movie', 'tv')"
    " AND i.observation_lease_token IS NULL AND EXISTS (SELECT 1 FROM media_server_items o"
    "             WHERE o.library_id = i.library_id AND o.id <> i.id)"
    " AND NOT EXISTS (SELECT 1 FROM profile_refresh_requests r"
    "                 WHERE r.library_id = i.library_id AND r.status = 'running')"
    " AND i.library_id <> ALL (%(tried)s::bigint[])"
    " AND NOT tmdb_id_of(i.provider_id) = ANY (%(merged)s::bigint[])"
    " ORDER BY md5(i.id::text) LIMIT 1"
)
# The held library's item made due first in line (one an observer can claim).
MAKE_DUE = (
    "UPDATE media_server_items SET observation_due_at = now() - interval '1 hour'"
    " WHERE id = %(id)s AND observation_lease_token IS NULL RETURNING id"
)
# What became of a held library's item whose observation was not interrupted.
HELD_ITEM_END = (
    "SELECT CASE WHEN observation_lease_token IS NOT NULL THEN 'still claimed'"
    " WHEN observed_at >= %(since)s THEN 'observed'"
    " WHEN last_attempt_at >= %(since)s THEN 'failed ' || coalesce(recovery_category, '')"
    " ELSE 'given back' END AS why FROM media_server_items WHERE id = %(id)s"
)
# One look of a library hold: every live claim in the library gets the lease production's
# five minutes would give it (the harness's 3 s lease is shorter than the completion's
# tries, and an observer's batch may hold several items of the library, each waiting in
# turn); whether an observation there was interrupted and given back since the hold
# began.
HOLD_STEP = (
    "WITH lengthened AS ("
    "  UPDATE media_server_items SET observation_lease_expires_at"
    "   = now() + make_interval(secs => %(lease)s)"
    "  WHERE library_id = %(library_id)s AND observation_lease_token IS NOT NULL"
    "  AND id <> %(id)s"  # the held item's lease is lengthened before it is held
    "  RETURNING id)"
    " SELECT EXISTS (SELECT 1 FROM chaos_interruptions x"
    "   JOIN chaos_item_givebacks g ON g.lease_token = x.lease_token"
    "   JOIN media_server_items i ON i.id = g.item_id"
    "   WHERE i.library_id = %(library_id)s AND g.given_back_at >= %(since)s) AS interrupted,"
    " (SELECT count(*) FROM lengthened) AS claimed"
)
HOLD_CLOCKS = {"lease": LIBRARY_HOLD_LEASE_SECONDS}
# Typed TMDb identities no TMDb id can be read from: a superscript digit, Arabic-Indic
# digits (isdigit() accepts both), signs, spaces, letters, empty, and numbers past any
# id. Leading zeros and the int32 edge are odd but readable; they must not crash either.
MALFORMED_IDS = ("²", "٦٠٣", "-5", " 12", "12a", "", "1e3", "99999999999999999999")
ODD_IDS = (*MALFORMED_IDS, "007", "0", "2147483648")
# The statements a writer role issues; MERGE may be refused by a server (feature).
WRITER_COLUMNS = (
    "library_id",
    "title",
    "year",
    "provider",
    "provider_kind",
    "provider_id",
    "rating",
    "genres",
    "primary_studio",
    "original_language",
    "plot",
)


def writer_role(database: str) -> str:
    """The writer role of one scratch database (roles are global to the server)."""
    if not database.replace("_", "").isalnum() or not database.isascii():
        raise ValueError(f"unexpected database name {database!r}")
    return f"{database}_writer"


def drop_writer_role(admin: Connection, database: str) -> None:
    """After the database is gone (its grants went with it), the role can go too."""
    execute(admin, f'DROP ROLE IF EXISTS "{writer_role(database)}"')


def refusal_expected(exc: DatabaseError) -> bool:
    """A write the database may refuse under chaos (a lock or statement timeout, a
    connection lost to a restart or termination); anything else is a divergence."""
    code = exc.sqlstate
    if code is None:
        return isinstance(exc, DatabaseUnavailable)
    return code in EXPECTED_SQLSTATES or code.startswith(EXPECTED_SQLSTATE_CLASSES)


@dataclass
class Workload:
    """Applies operations drawn from `rng` through `conn` (autocommit). `reconnect`,
    when given, replaces a connection the server dropped (a restart)."""

    conn: Connection
    standin: StandIn
    rng: random.Random
    today: date
    reconnect: Callable[[], Connection] | None = None
    writer: Connection | None = None
    role: str = ""  # the writer role, created by setup()
    users: list[uuid.UUID] = field(default_factory=list)
    sessions: dict[uuid.UUID, list[uuid.UUID]] = field(default_factory=dict)
    done: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    # Refusals the chaos does not explain: "operation [SQLSTATE]: message".
    unexpected: Counter[str] = field(default_factory=Counter)
    # Statements the server refuses on this table by design (MERGE, on some versions).
    unsupported: Counter[str] = field(default_factory=Counter)
    storms: list[tuple[float, float]] = field(default_factory=list)  # epoch seconds
    storm_started: float | None = None
    storm_left: int = 0
    # Fixed points' faults a storm or another kept fault held back, in order.
    kept_owed: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    kept_left: int = 0  # operations in which a fixed point's provider fault stays set
    kept_fault: str | None = None  # that fault's name and options
    kept_options: dict[str, Any] = field(default_factory=dict)
    kept_seen: int = 0  # the stand-in's answers with that fault when it was set
    kept_extended: int = 0  # operations it was kept past KEPT_FAULT_OPERATIONS, unmet
    # The stats side: accounts past one compute batch, users emptied for good, budget
    # squeezes, rebuilds beside the writes.
    large_users: list[uuid.UUID] = field(default_factory=list)
    emptied: set[uuid.UUID] = field(default_factory=set)
    squeezes: int = 0
    squeeze_left: int = 0
    edits_during_compute: int = 0
    held_claims: int = 0
    # Stage calls cancelled by the harness, by stage; publications that waited for a
    # state row an application held, by how they ended (cancelled, timed out).
    cancels: Counter[str] = field(default_factory=Counter)
    lock_waits: Counter[str] = field(default_factory=Counter)
    # Libraries a sync program held past an observation's completion, by how the held
    # claim ended (interrupted and given back, or another way).
    library_holds: Counter[str] = field(default_factory=Counter)
    bad_saves_refused: int = 0
    app: Connection | None = None
    squeeze_hold: Connection | None = None  # holds the private output tables in a squeeze
    rebuild: threading.Thread | None = None
    lock_wait_holds: list[threading.Thread] = field(default_factory=list)
    calm_left: int = 0  # operations left in which no drawn squeeze starts
    canceller: threading.Thread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Merges at the stand-in: the records folded so far, and what the operator decided.
    merged: set[tuple[str, int]] = field(default_factory=set)
    merges: Counter[str] = field(default_factory=Counter)
    merges_owed: int = 0
    reviewed: Counter[str] = field(default_factory=Counter)

    def setup(
        self,
        libraries: int = 6,
        items_per_library: int = 15,
        users: int = SMALL_USERS,
        large_users: int = LARGE_USERS,
    ) -> None:
        """The starting system of record: servers, libraries, items, users' logs."""
        self._create_writer_role()
        servers = [self._server(f"server-{n}") for n in range(2)]
        kinds = ("movie", "tv")
        for n in range(libraries):
            row = fetch_one(
                self.conn,
                "INSERT INTO libraries (server_id, name, media_kind) VALUES (%s, %s, %s)"
                " RETURNING id",
                (servers[n % 2], f"Library {n}", kinds[n % 2]),
            )
            assert row is not None
            self._insert_items(int(row["id"]), items_per_library)
        execute(
            self.conn,
            "UPDATE provider_settings SET api_key = %s, active = true WHERE provider = 'tmdb'",
            (API_KEY,),
        )
        self.setup_training(users, large_users)
        self.auth_backlog()

    def setup_training(self, users: int = SMALL_USERS, large_users: int = LARGE_USERS) -> None:
        """The catalog and the users' logs: small accounts of a few lifts, and large
        ones holding more exercises than one compute batch."""
        for exercise in GLOBAL_EXERCISES:
            execute(
                self.conn,
                "INSERT INTO exercises (id, name) VALUES (%s, %s)",
                (exercise, exercise.replace("_", " ").title()),
            )
        for _ in range(users):
            user = uuid.UUID(int=self.rng.getrandbits(128))
            self.users.append(user)
            self.sessions[user] = []
            execute(
                self.conn,
                "INSERT INTO exercises (id, owner_user_id, name) VALUES (%s, %s, 'Own lift')",
                (f"own_{user.hex[:8]}", user),
            )
            for _ in range(4):
                self.save_session(user)
        execute(
            self.conn,
            "INSERT INTO exercises (id, name) SELECT unnest(%s::text[]), 'Bulk lift'",
            (list(LARGE_CATALOG),),
        )
        for _ in range(large_users):
            user = uuid.UUID(int=self.rng.getrandbits(128))
            self.large_users.append(user)
            self.sessions[user] = []
            for _ in range(LARGE_IMPORT_SESSIONS):
                self.save_large(user, everything=True)

    # -- inventory ---------------------------------------------------------------------

    def _server(self, name: str) -> int:
        row = fetch_one(
            self.conn,
            "INSERT INTO media_servers (name, kind) VALUES (%s, 'plex') RETURNING id",
            (name,),
        )
        assert row is not None
        return int(row["id"])

    def _library_ids(self) -> list[int]:
        return [int(r["id"]) for r in fetch_all(self.conn, "SELECT id FROM libraries ORDER BY id")]

    def _item_ids(self, count: int) -> list[int]:
        rows = fetch_all(self.conn, "SELECT id FROM media_server_items ORDER BY id")
        ids = [int(r["id"]) for r in rows]
        return self.rng.sample(ids, min(count, len(ids)))

    def _insert_items(self, library_id: int, count: int) -> None:
        rows = item_values(self.rng, count)
        for row in rows:
            row["provider_id"] = str(self.rng.randint(1, 400))  # small space: shared ids
        insert_items(self.conn, library_id, rows)

    def sync(self) -> None:
        self._insert_items(self.rng.choice(self._library_ids()), self.rng.randint(1, 6))

    def enrich(self) -> None:
        for item_id in self._item_ids(self.rng.randint(1, 5)):
            execute(
                self.conn,
                "UPDATE media_server_items SET rating = %s, genres = %s WHERE id = %s",
                (
                    round(self.rng.uniform(0, 10), 1),
                    self.rng.sample(("Drama", "Comedy", "Action", "Horror"), 2),
                    item_id,
                ),
            )

    def move(self) -> None:
        target = self.rng.choice(self._library_ids())
        ids = self._item_ids(self.rng.randint(1, 3))
        execute(
            self.conn,
            "UPDATE media_server_items SET library_id = %s WHERE id = ANY(%s)",
            (target, ids),
        )

    def delete(self) -> None:
        ids = self._item_ids(self.rng.randint(1, 3))
        execute(self.conn, "DELETE FROM media_server_items WHERE id = ANY(%s)", (ids,))

    def _resync(self, conn: Connection) -> None:
        """After a truncate, a sync refills some libraries."""
        libraries = self._library_ids()
        for library_id in self.rng.sample(libraries, min(8, len(libraries))):
            self._write_rows(conn, library_id, self.rng.randint(0, 8))

    def truncate(self) -> None:
        execute(self.conn, "TRUNCATE media_server_items")
        self._resync(self.conn)

    def correct_identity(self) -> None:
        for item_id in self._item_ids(1):
            execute(
                self.conn,
                "UPDATE media_server_items SET provider = 'tmdb', provider_kind = %s,"
                " provider_id = %s WHERE id = %s",
                (self.rng.choice(("movie", "tv")), str(self.rng.randint(1, 400)), item_id),
            )

    def auth_backlog(self, cases: int = AUTH_BACKLOG_CASES) -> None:
        """More authentication cases than one release batch, cooling down for a day, as
        a rejected key leaves them: only a verified key's wakeup releases them early."""
        server = self._server(f"auth-server-{len(self._library_ids())}")
        row = fetch_one(
            self.conn,
            "INSERT INTO libraries (server_id, name, media_kind) VALUES (%s, 'Auth', 'movie')"
            " RETURNING id",
            (server,),
        )
        assert row is not None
        rows = item_values(self.rng, cases)
        for item in rows:
            item["provider_kind"] = "movie"
            item["provider_id"] = str(self.rng.randint(1, 400))
        ids = insert_items(self.conn, int(row["id"]), rows)
        execute(
            self.conn,
            "UPDATE media_server_items SET recovery_case_id = gen_random_uuid(),"
            " recovery_provider = provider, recovery_provider_kind = provider_kind,"
            " recovery_provider_id = provider_id, recovery_category = 'auth',"
            " recovery_attempts = 2, recovery_first_failed_at = now() - interval '1 hour',"
            " recovery_last_failed_at = now() - interval '1 hour',"
            " observation_due_at = now() + interval '1 day',"
            " last_attempt_at = now() - interval '1 hour' WHERE id = ANY(%s)",
            (ids,),
        )

    def delete_library(self) -> None:
        """A library is deleted and created again under its name (a new id), as an
        operator replacing a library does."""
        row = fetch_one(
            self.conn,
            "SELECT id, server_id, name, media_kind FROM libraries WHERE id = %s",
            (self.rng.choice(self._library_ids()),),
        )
        assert row is not None
        execute(self.conn, "DELETE FROM libraries WHERE id = %s", (row["id"],))
        self._library(int(row["server_id"]), row["name"], row["media_kind"])

    def delete_server(self) -> None:
        """A server and (by cascade) its libraries are deleted, then created again."""
        servers = fetch_all(self.conn, "SELECT id, name FROM media_servers ORDER BY id")
        server = self.rng.choice(servers)
        kinds = [
            r["media_kind"]
            for r in fetch_all(
                self.conn,
                "SELECT media_kind FROM libraries WHERE server_id = %s ORDER BY id LIMIT 3",
                (server["id"],),
            )
        ]
        execute(self.conn, "DELETE FROM media_servers WHERE id = %s", (server["id"],))
        new = self._server(server["name"])
        for n, kind in enumerate(kinds or ["movie"]):
            self._library(new, f"Library {server['name']}-{n}", kind)

    def _library(self, server_id: int, name: str, media_kind: str) -> None:
        row = fetch_one(
            self.conn,
            "INSERT INTO libraries (server_id, name, media_kind) VALUES (%s, %s, %s) RETURNING id",
            (server_id, name, media_kind),
        )
        assert row is not None
        self._insert_items(int(row["id"]), self.rng.randint(1, 10))

    def odd_identity(self) -> None:
        """An item whose typed identity is malformed or odd, inserted or corrected to."""
        provider_id = self.rng.choice(ODD_IDS)
        kind = self.rng.choice(("movie", "tv"))
        if self.rng.random() < 0.5:
            rows = item_values(self.rng, 1)
            rows[0].update(provider_kind=kind, provider_id=provider_id)
            insert_items(self.conn, self.rng.choice(self._library_ids()), rows)
        else:
            execute(
                self.conn,
                "UPDATE media_server_items SET provider = 'tmdb', provider_kind = %s,"
                " provider_id = %s WHERE id = ANY(%s)",
                (kind, provider_id, self._item_ids(1)),
            )

    def odd_values(self) -> None:
        """Values the columns' types accept that a profile must still count right: a
        genres array of two or three dimensions with NULL and blank elements, blank
        studios and languages, a studio or language named like the rest of a
        distribution ("other"), and a long name. Written to several items of one library
        so that a studio called "other" can reach the ten largest."""
        library = self.rng.choice(self._library_ids())
        genres = self.rng.choice(
            (
                "{{Drama,Comedy},{War,NULL}}",
                '{{{Horror}},{{""}}}',
                '{" ",Drama,Drama}',
                "{}",
            )
        )
        studio = self.rng.choice(("other", "", "  ", "Other", "x" * 300, None))
        language = self.rng.choice(("other", "", "en", None))
        execute(
            self.conn,
            "UPDATE media_server_items SET genres = %s::text[], primary_studio = %s,"
            " original_language = %s"
            " WHERE id IN (SELECT id FROM media_server_items WHERE library_id = %s"
            "              ORDER BY id LIMIT %s)",
            (genres, studio, language, library, self.rng.randint(1, 8)),
        )

    def backlog(self) -> None:
        """More dirty libraries at once than the refresh runs can take in one sensor
        tick: a bulk import of a new server, one statement for every library's items
        (no typed identities: the backlog is for profiles, not for TMDb)."""
        server = self._server("backlog-server")
        execute(
            self.conn,
            "INSERT INTO libraries (server_id, name, media_kind)"
            " SELECT %s, 'Backlog ' || n, CASE WHEN n %% 2 = 0 THEN 'movie' ELSE 'tv' END"
            " FROM generate_series(1, %s) AS n",
            (server, BACKLOG_LIBRARIES),
        )
        execute(
            self.conn,
            "INSERT INTO media_server_items (library_id, title, year, rating, genres,"
            " primary_studio, original_language)"
            " SELECT l.id, 'Imported ' || k, 1950 + (l.id * 7 + k) %% 75,"
            " ((l.id * 13 + k * 7) %% 100) / 10.0,"
            " ARRAY[(ARRAY['Drama', 'Comedy', 'Action', 'Horror'])[1 + (l.id + k) %% 4]],"
            " (ARRAY['A24', 'Toho', 'Pixar'])[1 + (l.id * k) %% 3],"
            " (ARRAY['en', 'fr', 'ja'])[1 + k %% 3]"
            " FROM libraries l, generate_series(1, %s) AS k WHERE l.server_id = %s",
            (BACKLOG_ITEMS, server),
        )

    def throttle_storm(self) -> None:
        """The stand-in answers 429 to everything for a while (a Retry-After each
        time) just as a sync brings new items due for observation; the window is
        recorded so the requests that reached the stand-in can be counted."""
        if self.storm_started is not None:
            return
        if self.kept_left and not self._kept_met() and self.kept_fault is not None:
            # The storm replaces a kept fault no answer has carried yet: kept again after.
            self.kept_owed.insert(0, (self.kept_fault, self.kept_options))
            self.kept_left = 0
        self.standin.set_fault("throttle", retry_after=STORM_RETRY_AFTER)
        self.storm_started = time.time()
        self.storm_left = STORM_OPERATIONS
        movies = [
            int(r["id"])
            for r in fetch_all(
                self.conn, "SELECT id FROM libraries WHERE media_kind = 'movie' ORDER BY id"
            )
        ]
        if movies:
            self._insert_items(self.rng.choice(movies), STORM_ITEMS)

    def end_storm(self) -> None:
        if self.storm_started is not None:
            self.standin.clear_fault()
            self.storms.append((self.storm_started, time.time()))
        self.storm_started = None
        self.storm_left = 0

    # -- a writer role with rights on the items table only ---------------------------------

    def _create_writer_role(self) -> None:
        row = fetch_one(self.conn, "SELECT current_database() AS db")
        assert row is not None
        role = writer_role(row["db"])
        self.role = role
        execute(self.conn, f'CREATE ROLE "{role}" NOLOGIN')
        execute(
            self.conn,
            f'GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON media_server_items TO "{role}";'
            f' GRANT SELECT ON libraries, media_servers TO "{role}";'
            f' GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO "{role}"',
        )

    def _writer(self) -> Connection:
        if self.writer is None or self.writer.closed:
            assert self.reconnect is not None, "writer-role operations need reconnect"
            self.writer = self.reconnect()
            execute(self.writer, "SELECT set_config('role', %s, false)", (self.role,))
        return self.writer

    def _write_rows(self, conn: Connection, library_id: int, count: int) -> None:
        rows = item_values(self.rng, count)
        for row in rows:
            row["provider_id"] = str(self.rng.randint(1, 400))
        if rows:
            insert_items(conn, library_id, rows)

    def writer_insert(self) -> None:
        self._write_rows(self._writer(), self.rng.choice(self._library_ids()), 3)

    def writer_update(self) -> None:
        execute(
            self._writer(),
            "UPDATE media_server_items SET rating = %s, primary_studio = %s WHERE id = ANY(%s)",
            (
                round(self.rng.uniform(0, 10), 1),
                self.rng.choice(("A24", "Toho")),
                self._item_ids(3),
            ),
        )

    def writer_delete(self) -> None:
        execute(
            self._writer(),
            "DELETE FROM media_server_items WHERE id = ANY(%s)",
            (self._item_ids(2),),
        )

    def writer_truncate(self) -> None:
        writer = self._writer()
        execute(writer, "TRUNCATE media_server_items")
        self._resync(writer)

    def _observing(self) -> bool:
        """Whether an observer is at work (none in a run without workers): the timed
        operations wait for one only then."""
        return (
            fetch_one(
                self.conn,
                "SELECT 1 FROM media_server_items WHERE observation_lease_token IS NOT NULL"
                " OR last_attempt_at > now() - interval '5 seconds' LIMIT 1",
            )
            is not None
        )

    def writer_batch(self) -> None:
        """A sync program's transaction over several items of one library, one statement
        each, a moment apart, timed to cross an observation's completion: its first
        captured statement holds the library's inventory state to its commit, and its
        last one writes an item an observer has claimed and completes meanwhile. The
        stand-in answers 0.4 s late meanwhile (unless a storm holds it), so an observer's
        batch of claims stays open for a second or more, and the claimed item's language
        is set to one the answer corrects, so its completion needs the state too."""
        previous = self.standin.state.fault
        if not self.storm_left:
            self.standin.set_fault("slow", delay=0.4)
        slowed = self.standin.state.fault
        try:
            deadline = time.monotonic() + (2.0 if self._observing() else 0.0)
            claimed = None
            while claimed is None and time.monotonic() < deadline:
                claimed = fetch_one(
                    self.conn,
                    "SELECT i.id, i.library_id FROM media_server_items i"
                    " WHERE i.observation_lease_token IS NOT NULL"
                    " AND i.observation_lease_expires_at > now() + interval '1 second'"
                    " AND EXISTS (SELECT 1 FROM media_server_items o"
                    "             WHERE o.library_id = i.library_id AND o.id <> i.id)"
                    " ORDER BY i.observation_due_at DESC, i.id DESC LIMIT 1",
                )
                if claimed is None:
                    time.sleep(0.05)
            crossing = claimed is not None
            if claimed is None:  # no observer at work: any item
                items = fetch_all(self.conn, "SELECT id, library_id FROM media_server_items")
                if not items:
                    return
                claimed = self.rng.choice(sorted(items, key=lambda r: int(r["id"])))
            item, library = int(claimed["id"]), int(claimed["library_id"])
            rows = fetch_all(
                self.conn,
                "SELECT id FROM media_server_items WHERE library_id = %s AND id <> %s"
                " ORDER BY id LIMIT 8",
                (library, item),
            )
            others = [int(r["id"]) for r in rows]
            if not others:
                return
            writer = self._writer()
            execute(
                writer,
                "UPDATE media_server_items SET original_language = 'zz' WHERE id = %s",
                (item,),
            )
            ids = [*self.rng.sample(others, self.rng.randint(1, min(3, len(others)))), item]
            with transaction(writer):
                for n, item_id in enumerate(ids):
                    execute(
                        writer,
                        "UPDATE media_server_items SET rating = %s, original_language = %s"
                        " WHERE id = %s",
                        (round(self.rng.uniform(0, 10), 1), self.rng.choice(("xx", "yy")), item_id),
                    )
                    # The state is held from the first statement on; the claimed item's
                    # answer comes meanwhile.
                    time.sleep(self.rng.uniform(0.8, 1.2) if n == 0 and crossing else 0.05)
        finally:
            if self.standin.state.fault is slowed:
                with self.standin.state.lock:
                    self.standin.state.fault = previous

    def writer_repeatable(self) -> None:
        """A sync at REPEATABLE READ: it reads a library, a moment passes (a worker may
        acknowledge the library meanwhile), then it adds items to it. Capture must not
        abort it: a serialization failure here is a divergence. Only new rows are
        written, so no other program's write conflicts with it."""
        writer = self._writer()
        library = self.rng.choice(self._library_ids())
        rows = item_values(self.rng, self.rng.randint(1, 3))
        for row in rows:
            row["provider_id"] = str(self.rng.randint(1, 400))
        execute(writer, "BEGIN ISOLATION LEVEL REPEATABLE READ")
        try:
            execute(
                writer, "SELECT count(*) FROM media_server_items WHERE library_id = %s", (library,)
            )
            time.sleep(self.rng.uniform(0.3, 1.2))
            insert_items(writer, library, rows)
            execute(writer, "COMMIT")
        except BaseException:
            if not writer.closed:
                execute(writer, "ROLLBACK")
            raise

    def writer_rekey(self) -> None:
        """An UPDATE that gives items new ids (a sync re-keying its rows), half the time
        into another library: a delete of the old rows and an insert of new ones."""
        target = self.rng.choice(self._library_ids()) if self.rng.random() < 0.5 else None
        observed = [
            int(r["item_id"])
            for r in fetch_all(self.conn, "SELECT item_id FROM provider_observations ORDER BY 1")
        ]
        count = self.rng.randint(1, 2)
        # Mostly items with records kept by id, which must go with the old id.
        ids = (
            self.rng.sample(observed, min(count, len(observed)))
            if observed and self.rng.random() < 0.8
            else self._item_ids(count)
        )
        execute(
            self._writer(),
            "UPDATE media_server_items"
            " SET id = nextval(pg_get_serial_sequence('media_server_items', 'id')),"
            " library_id = coalesce(%s, library_id) WHERE id = ANY(%s)",
            (target, ids),
        )

    def _incoming(self) -> list[dict[str, Any]]:
        """Rows of a sync: some name existing items by id (updates), some are new."""
        library = self.rng.choice(self._library_ids())
        rows = item_values(self.rng, 4)
        existing = self._item_ids(2)
        for n, row in enumerate(rows):
            row.update(
                id=existing[n] if n < len(existing) else None,
                library_id=library,
                provider_id=str(self.rng.randint(1, 400)),
                gone=n == 0 and self.rng.random() < 0.5,
            )
        return rows

    def writer_upsert(self) -> None:
        """INSERT ... ON CONFLICT (id) DO UPDATE: one statement that inserts new rows and
        updates existing ones."""
        execute(
            self._writer(),
            "INSERT INTO media_server_items AS t (id, library_id, title, provider,"
            " provider_kind, provider_id, rating, genres)"
            " SELECT coalesce(x.id, nextval(pg_get_serial_sequence('media_server_items', 'id'))),"
            " x.library_id, x.title, x.provider, x.provider_kind, x.provider_id, x.rating,"
            " x.genres FROM jsonb_to_recordset(%s) AS x(id bigint, library_id bigint,"
            " title text, provider text, provider_kind text, provider_id text, rating numeric,"
            " genres text[])"
            " ON CONFLICT (id) DO UPDATE SET rating = EXCLUDED.rating, genres = EXCLUDED.genres,"
            " library_id = EXCLUDED.library_id",
            (jsonb(self._incoming()),),
        )

    def writer_merge(self) -> None:
        """MERGE: update matched rows (or delete one), insert the rest, in one statement."""
        try:
            execute(
                self._writer(),
                "MERGE INTO media_server_items AS t"
                " USING jsonb_to_recordset(%s) AS x(id bigint, library_id bigint, title text,"
                " provider text, provider_kind text, provider_id text, rating numeric,"
                " genres text[], gone boolean) ON t.id = x.id"
                " WHEN MATCHED AND x.gone THEN DELETE"
                " WHEN MATCHED THEN UPDATE SET rating = x.rating, genres = x.genres"
                " WHEN NOT MATCHED THEN INSERT (library_id, title, provider, provider_kind,"
                " provider_id, rating, genres) VALUES (x.library_id, x.title, x.provider,"
                " x.provider_kind, x.provider_id, x.rating, x.genres)",
                (jsonb(self._incoming()),),
            )
        except FeatureNotSupported as exc:
            self.unsupported[f"writer_merge: {exc}"] += 1

    def writer_copy(self) -> None:
        """COPY FROM STDIN, the bulk loader's statement."""
        library = self.rng.choice(self._library_ids())
        rows = item_values(self.rng, 3)
        writer = self._writer()
        statement = f"COPY media_server_items ({', '.join(WRITER_COLUMNS)}) FROM STDIN"
        with translate_errors(), writer.cursor() as cursor, cursor.copy(statement) as copy:
            for row in rows:
                row.update(library_id=library, provider_id=str(self.rng.randint(1, 400)))
                copy.write_row([row[c] for c in WRITER_COLUMNS])

    def toggle_library(self) -> None:
        library_id = self.rng.choice(self._library_ids())
        execute(self.conn, "UPDATE libraries SET active = NOT active WHERE id = %s", (library_id,))

    # -- training log ------------------------------------------------------------------

    def _set(self, exercise_id: str) -> dict[str, Any]:
        """Plates of a quarter kilogram (101.25 kg x 7 is where a truncated estimate
        rounds wrong), 1-15 reps (past twelve: no estimate), one warm-up in five."""
        return {
            "exercise_id": exercise_id,
            "weight_kg": self.rng.randint(80, 800) / 4,
            "reps": self.rng.randint(1, 15),
            "warmup": self.rng.random() < 0.2,
        }

    def _sets(self, user: uuid.UUID) -> list[dict[str, Any]]:
        """One to six sets; now and then a session without any."""
        if self.rng.random() < 0.05:
            return []
        lifts = [*GLOBAL_EXERCISES, f"own_{user.hex[:8]}"]
        return [self._set(self.rng.choice(lifts)) for _ in range(self.rng.randint(1, 6))]

    def save_session(self, user: uuid.UUID | None = None, edit: bool = False) -> None:
        writable = [u for u in self.users if u not in self.emptied]
        user = user or self.rng.choice(writable)
        known = self.sessions[user]
        new = not (edit and known)
        session_id = uuid.UUID(int=self.rng.getrandbits(128)) if new else self.rng.choice(known)
        day = self.today - timedelta(days=self.rng.randint(0, 400))
        payload = {
            "id": str(session_id),
            "user_id": str(user),
            "session_date": day.isoformat(),
            "sets": self._sets(user),
        }
        execute(self.conn, "SELECT save_training_session(%s, %s)", (user, jsonb(payload)))
        if new:  # known once saved: a refused save (a lock timeout, a restart) made none
            known.append(session_id)

    def delete_session(self) -> None:
        user = self.rng.choice(self.users)
        if not self.sessions[user]:
            return
        session_id = self.sessions[user].pop(self.rng.randrange(len(self.sessions[user])))
        execute(self.conn, "SELECT delete_training_session(%s, %s)", (user, session_id))

    def delete_all_sessions(self, user: uuid.UUID | None = None) -> None:
        """Every session of one user deleted, one write each."""
        user = user or self.rng.choice(self.users)
        while self.sessions[user]:
            session_id = self.sessions[user].pop()
            execute(self.conn, "SELECT delete_training_session(%s, %s)", (user, session_id))

    def empty_user(self) -> None:
        """The first user loses every session and saves none afterwards."""
        self.emptied.add(self.users[0])
        self.delete_all_sessions(self.users[0])

    def save_large(self, user: uuid.UUID | None = None, everything: bool = False) -> None:
        """A session of a large account: an import-sized one (more exercises than a
        compute batch, so its own range is batched) or a few lifts. Aimed, when one is
        computing, at a large account whose run is between its transactions: the edit
        changes its inputs mid-batches."""
        user = user or self.rng.choice(self.large_users)
        computing = fetch_one(self.conn, COMPUTING, (self.large_users,))
        if computing is not None and not everything:
            user = computing["user_id"]
            self.edits_during_compute += 1
        known = self.sessions[user]
        if everything:
            lifts = list(LARGE_CATALOG)
        elif self.rng.random() < 0.5:
            lifts = self.rng.sample(LARGE_CATALOG, self.rng.randint(101, LARGE_EXERCISES))
        else:
            lifts = self.rng.sample(LARGE_CATALOG, self.rng.randint(1, 5))
        if known and not everything and self.rng.random() < 0.1:
            session_id = known.pop(self.rng.randrange(len(known)))
            execute(self.conn, "SELECT delete_training_session(%s, %s)", (user, session_id))
            return
        new = not (known and not everything and self.rng.random() < 0.7)
        session_id = uuid.UUID(int=self.rng.getrandbits(128)) if new else self.rng.choice(known)
        payload = {
            "id": str(session_id),
            "user_id": str(user),
            "session_date": (self.today - timedelta(days=self.rng.randint(0, 400))).isoformat(),
            "sets": [self._set(lift) for lift in lifts],
        }
        execute(self.conn, "SELECT save_training_session(%s, %s)", (user, jsonb(payload)))
        if new:  # known once saved: a refused save (a lock timeout, a restart) made none
            known.append(session_id)

    # -- the application beside the worker ----------------------------------------------

    def _app(self) -> Connection | None:
        """The application's own connection (a scoped processor's), made on first use."""
        if self.reconnect is None:
            return None
        if self.app is None or self.app.closed:
            self.app = self.reconnect()
        return self.app

    def held_claim(self) -> None:
        """A claim of one user held uncommitted (a scoped processor mid-compute) while the
        user saves and the workers drain beside it, then rolled back (its budget ran
        out): the save lands in a new job, the drains pass the user by, and a later save
        merges into the newer job, never the older."""
        app = self._app()
        if app is None:
            return
        user = self.rng.choice([u for u in self.users if u not in self.emptied])
        execute(app, "BEGIN")
        try:
            service.claim(app, "chaos-app", user)
            self.save_session(user)
            time.sleep(self.rng.uniform(0.05, 1.0))
        finally:
            execute(app, "ROLLBACK")
        self.save_session(user)
        self.held_claims += 1

    def publication_lock_wait(self, cancel: bool | None = None) -> None:
        """A large account imports a session (its range computes in batches, several
        transactions), then an application transaction holds the user's state row: the
        user's publication waits for it and is cancelled by an operator, or runs out of
        its budget (`cancel` None: either). The call ends either way and its run must be
        given back. The hold runs beside the operations, on connections of its own: it
        lasts seconds, and a paused schedule would catch up in a burst of writes."""
        if self.reconnect is None:
            return
        if self.squeeze_left:  # no compute would get to its publication
            self.apply("restore_budget", self.restore_budget)
        self.calm_left = LOCK_WAIT_CALM_OPERATIONS
        user = self.rng.choice(self.large_users)
        self.save_large(user, everything=True)
        cancel = self.rng.random() < 0.5 if cancel is None else cancel
        reconnect = self.reconnect

        def hold() -> None:
            try:
                with reconnect() as watch, reconnect() as app:
                    self._hold_state_row(watch, app, user, cancel)
            except DatabaseError as exc:
                self._refused("publication_lock_wait", exc)

        thread = threading.Thread(target=hold, name="chaos-lock-wait", daemon=True)
        self.lock_wait_holds.append(thread)
        thread.start()

    def _hold_state_row(
        self, watch: Connection, app: Connection, user: uuid.UUID, cancel: bool
    ) -> None:
        """Once the user's job is claimed (a save's enqueue holds the pending job it
        merges into, and a claim passes such a user by), `app` holds the user's state row
        until the publication that waits for it is cancelled from `watch` or has waited
        past its whole budget."""
        deadline = time.monotonic() + LOCK_WAIT_LOOK_SECONDS
        while fetch_one(watch, CLAIMED, (user,)) is None:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)
        execute(app, "BEGIN")
        try:
            execute(app, "SELECT request_stats_refresh(%s, NULL, '{}', 'chaos import')", (user,))
            deadline = time.monotonic() + LOCK_WAIT_LOOK_SECONDS
            while time.monotonic() < deadline:
                waiting = fetch_one(watch, WAITING_PUBLICATION, (app.info.backend_pid,))
                if waiting is not None:
                    if cancel:
                        execute(watch, "SELECT pg_cancel_backend(%s)", (waiting["pid"],))
                    else:  # held past the publication's whole budget
                        time.sleep(STATS_SETTINGS["publish_budget_ms"] / 1000 + 0.3)
                    with self.lock:
                        self.lock_waits["cancelled" if cancel else "timed out"] += 1
                        if cancel:
                            self.cancels["publish"] += 1
                    return
                time.sleep(0.02)
        finally:
            execute(app, "COMMIT")

    def hold_library(self) -> None:
        """A sync program's transaction holds a library's inventory state (a captured
        write to one item) while an observer's answer for another item of it comes: the
        completion waits out its tries and gives the claim back. The item is made due
        first in line and the stand-in holds its answer (a gate) until the sync's write
        is made, so that the hold begins between the request and the answer. It runs
        beside the operations, on connections of its own, until an observation there is
        given back interrupted (at most LIBRARY_HOLD_SECONDS). The operations that write
        the library meanwhile wait for it, as they would for a real sync."""
        if self.reconnect is None:
            return
        reconnect = self.reconnect

        def hold() -> None:
            try:
                with reconnect() as aux, reconnect() as sync:
                    outcome = self._hold_library(aux, sync)
            except DatabaseError as exc:
                self._refused("hold_library", exc)
                outcome = "refused"
            with self.lock:
                self.library_holds[outcome] += 1

        thread = threading.Thread(target=hold, name="chaos-library-hold", daemon=True)
        self.lock_wait_holds.append(thread)
        thread.start()

    def _hold_library(self, aux: Connection, sync: Connection) -> str:
        """Up to HOLD_ATTEMPTS holds, each of another library, until one interrupts an
        observation (an observer may be killed or paused before it asks or completes)."""
        tried: list[int] = []
        outcome = "no library"
        for _ in range(HOLD_ATTEMPTS):
            outcome = self._hold_once(aux, sync, tried)
            if outcome in ("interrupted", "no library"):
                break
        return outcome

    def _hold_once(self, aux: Connection, sync: Connection, tried: list[int]) -> str:
        merged = sorted({tmdb_id for _, tmdb_id in list(self.merged)})
        target = fetch_one(aux, HOLDABLE, {"tried": tried, "merged": merged})
        if target is None:
            return "no library"
        tried.append(int(target["library_id"]))
        tmdb_id = int(target["tmdb_id"])
        # The operator corrects a wrong key first: an answer to it is a 401, whose failure
        # needs no library state (the observers wait for its verification to ask again).
        execute(
            aux,
            "UPDATE provider_settings SET api_key = %s"
            " WHERE provider = 'tmdb' AND api_key IS DISTINCT FROM %s",
            (API_KEY, API_KEY),
        )
        gate = self.standin.gate(tmdb_id)
        try:
            if fetch_one(aux, MAKE_DUE, target) is None:
                return "no item"
            if not gate.arrived.wait(HOLD_ASK_SECONDS):
                return "never asked"
            library = {**target, "since": datetime.now(UTC), **HOLD_CLOCKS}
            execute(
                aux,
                "UPDATE media_server_items"
                " SET observation_lease_expires_at = now() + make_interval(secs => %(lease)s)"
                " WHERE id = %(id)s AND observation_lease_token IS NOT NULL",
                library,
            )
            execute(sync, "BEGIN")
            try:
                execute(  # the sync writes the item being observed and holds it
                    sync,
                    "UPDATE media_server_items"
                    " SET rating = CASE WHEN rating = 1 THEN 2 ELSE 1 END WHERE id = %(id)s",
                    target,
                )
                self.standin.ungate(tmdb_id)
                # Past the completion's tries, the held claims' leases lengthened as
                # production's would cover them.
                deadline = time.monotonic() + HOLD_PAST_TRIES_SECONDS
                while time.monotonic() < deadline:
                    fetch_one(aux, HOLD_STEP, library)
                    time.sleep(0.05)
            finally:
                execute(sync, "COMMIT")
            deadline = time.monotonic() + LIBRARY_HOLD_SECONDS
            while time.monotonic() < deadline:  # the give-back waited for the commit
                row = fetch_one(aux, HOLD_STEP, library)
                if row is not None and row["interrupted"]:
                    return "interrupted"
                time.sleep(0.05)
            end = fetch_one(aux, HELD_ITEM_END, library)
            return f"not interrupted: {end['why'] if end else 'item gone'}"
        finally:
            self.standin.ungate(tmdb_id)

    def cancel_stage(self) -> None:
        """An operator cancels a stats worker's stage call in flight (pg_cancel_backend),
        whichever statement it is in: a claim is made again, a compute or publication is
        given back. A stage lasts milliseconds, so the operator watches for one beside
        the operations, on a connection of its own, for a while (one watch at a time)."""
        if self.reconnect is None or (self.canceller is not None and self.canceller.is_alive()):
            return
        reconnect = self.reconnect

        def watch() -> None:
            try:
                with reconnect() as conn:
                    deadline = time.monotonic() + CANCEL_LOOK_SECONDS
                    while time.monotonic() < deadline:
                        found = fetch_one(conn, STAGE_IN_FLIGHT)
                        if found is not None:
                            execute(conn, "SELECT pg_cancel_backend(%s)", (found["pid"],))
                            with self.lock:
                                self.cancels[found["stage"]] += 1
                            return
                        time.sleep(0.005)
            except DatabaseError as exc:
                self._refused("cancel_stage", exc)

        self.canceller = threading.Thread(target=watch, name="chaos-cancel", daemon=True)
        self.canceller.start()

    def scoped_process(self) -> None:
        """The application publishes one user's stats at once, in its own process."""
        app = self._app()
        if app is None:
            return
        user = self.rng.choice(self.users)
        service.process_user(app, user, "chaos-app")

    def bad_save(self) -> None:
        """A value the worker cannot compute: refused with one line naming the field,
        nothing written. Accepted, it is a divergence (it would poison the user)."""
        user = self.rng.choice([u for u in self.users if u not in self.emptied])
        day, a_set = self.today.isoformat(), self._set(GLOBAL_EXERCISES[0])
        bads: list[tuple[str, dict[str, Any]]] = [
            ("session_date", {"session_date": "300000-01-01"}),
            ("session_date", {"session_date": "0044-03-15 BC"}),
            ("weight_kg", {"sets": [{**a_set, "weight_kg": "NaN"}]}),
            ("weight_kg", {"sets": [{**a_set, "weight_kg": 1e6}]}),
            ("reps", {"sets": [{**a_set, "reps": 2.5}]}),
            ("exercise_id", {"sets": [{**a_set, "exercise_id": "no_such_lift"}]}),
        ]
        field, bad = self.rng.choice(bads)
        payload = {"user_id": str(user), "session_date": day, "sets": [a_set], **bad}
        try:
            execute(self.conn, "SELECT save_training_session(%s, %s)", (user, jsonb(payload)))
        except DatabaseError as exc:
            if exc.sqlstate in ("22008", "22023") and field in str(exc).splitlines()[0]:
                self.bad_saves_refused += 1
                return
            raise
        with self.lock:
            self.unexpected[f"bad_save: a bad {field} was accepted"] += 1

    # -- the stats operator ----------------------------------------------------------------

    def squeeze_budget(self, budget: int | None = None) -> None:
        """The attempt cap drops (and the compute budget to `budget`, or half the time to
        its floor) for a while: jobs exhaust their attempts, and their ranges must stay
        owed. With the floor, an operator's maintenance (a VACUUM FULL, a schema change)
        also holds the exercise projection a compute reads and a publication replaces,
        so every compute and publication runs out of its budget while it lasts, as every
        compute did under the former 1 ms budget; recording the failure needs no lock it
        holds. A drawn squeeze (`budget` None) does not start in the operations that
        follow a held state row: no publication would come to wait for it."""
        if self.squeeze_left or (budget is None and self.calm_left):
            return
        attempts = self.rng.choice(SQUEEZED_ATTEMPTS)
        drawn = self.rng.choice((SQUEEZED_COMPUTE_BUDGET_MS, STATS_SETTINGS["compute_budget_ms"]))
        budget = drawn if budget is None else budget
        execute(
            self.conn,
            "UPDATE stats_projection_worker_settings SET max_attempts = %s, compute_budget_ms = %s",
            (attempts, budget),
        )
        if budget == SQUEEZED_COMPUTE_BUDGET_MS and self.reconnect is not None:
            self.squeeze_hold = self.reconnect()
            execute(self.squeeze_hold, "BEGIN")
            execute(self.squeeze_hold, "LOCK TABLE user_exercise_stats IN ACCESS EXCLUSIVE MODE")
        self.squeezes += 1
        self.squeeze_left = SQUEEZE_OPERATIONS

    def restore_budget(self) -> None:
        if self.squeeze_hold is not None:
            self.squeeze_hold.close()  # its transaction rolls back: the tables are free
            self.squeeze_hold = None
        execute(
            self.conn,
            "UPDATE stats_projection_worker_settings SET max_attempts = %s, compute_budget_ms = %s",
            (STATS_SETTINGS["max_attempts"], STATS_SETTINGS["compute_budget_ms"]),
        )
        self.squeeze_left = 0

    def rebuild_everyone(self) -> None:
        """An operator's rebuild of every user, on a connection of its own so that it
        runs beside the writes that follow (one at a time)."""
        if self.rebuild is not None and self.rebuild.is_alive():
            return
        assert self.reconnect is not None, "a rebuild needs a connection of its own"
        reconnect = self.reconnect

        def rebuild() -> None:
            try:
                with reconnect() as conn:
                    service.request_rebuild(conn, None)
                with self.lock:
                    self.done["rebuild_everyone"] += 1
            except DatabaseError as exc:
                self._refused("rebuild_everyone", exc)

        self.rebuild = threading.Thread(target=rebuild, name="chaos-rebuild", daemon=True)
        self.rebuild.start()

    def save_manual_pr(self) -> None:
        user = self.rng.choice(self.users)
        execute(
            self.conn,
            "SELECT save_manual_pr(%s, %s, %s, %s, %s)",
            (
                user,
                self.rng.choice(GLOBAL_EXERCISES),
                self.rng.randint(40, 250),
                self.rng.randint(1, 10),
                self.today - timedelta(days=self.rng.randint(0, 60)),
            ),
        )

    def delete_manual_pr(self) -> None:
        user = self.rng.choice(self.users)
        rows = fetch_all(
            self.conn,
            "SELECT id FROM user_manual_pr_records WHERE user_id = %s ORDER BY id",
            (user,),
        )
        if rows:
            record = self.rng.choice(rows)["id"]
            execute(self.conn, "SELECT delete_manual_pr(%s, %s)", (user, record))

    def change_catalog(self) -> None:
        if self.rng.random() < 0.5:
            exercise = self.rng.choice(GLOBAL_EXERCISES)
            execute(
                self.conn,
                "UPDATE exercises SET name = %s WHERE id = %s",
                (f"{exercise} v{self.rng.randint(1, 99)}", exercise),
            )
        else:
            user = self.rng.choice(self.users)
            execute(
                self.conn,
                "UPDATE exercises SET name = %s WHERE id = %s",
                (f"Own lift v{self.rng.randint(1, 99)}", f"own_{user.hex[:8]}"),
            )

    # -- provider and settings ---------------------------------------------------------

    def provider_fault(self) -> None:
        if self.storm_left or self.kept_left:
            return  # a storm or a fixed point's fault holds the stand-in
        if self.rng.random() < 0.4:
            self.standin.clear_fault()
            return
        fault, options = self.rng.choice(FAULTS)
        self.standin.set_fault(fault, **options)

    def keep_fault(self, fault: str, options: dict[str, Any]) -> None:
        """A fixed point's provider fault, kept for KEPT_FAULT_OPERATIONS operations
        (drawn faults wait), and past them until an answer has carried it (observers may
        be paused by a throttle or a wrong key meanwhile), at most KEPT_FAULT_MAX_EXTRA
        more. One that comes during a storm, or while another is kept unmet, waits."""
        if self.storm_left or (self.kept_left and not self._kept_met()):
            self.kept_owed.append((fault, options))  # set when the storm or the kept one ends
            return
        self.standin.set_fault(fault, **options)
        self.kept_left = KEPT_FAULT_OPERATIONS
        self.kept_fault, self.kept_options = fault, options
        self.kept_seen = self._answers_with(fault)
        self.kept_extended = 0

    def _answers_with(self, fault: str | None) -> int:
        """The stand-in's answers that carried a kept fault so far."""
        state = self.standin.state
        return {"compress": state.compressed, "encoded": state.encoded}.get(fault or "", 0)

    def _kept_met(self) -> bool:
        return self._answers_with(self.kept_fault) > self.kept_seen

    def _tick_kept(self) -> None:
        if self.kept_left > 1 or self._kept_met() or self.kept_extended >= KEPT_FAULT_MAX_EXTRA:
            self.kept_left -= 1
        else:
            self.kept_extended += 1
        if not self.kept_left and self.kept_owed and not self.storm_left:
            self.keep_fault(*self.kept_owed.pop(0))

    def merge(self, count: int = 1) -> None:
        """TMDb folds observed records into others (chaos/replacements.py)."""
        for _ in range(count):
            variant = replacements.merge(self.conn, self.standin, self.rng, self.merged)
            if variant:
                self.merges[variant] += 1

    def owe_merges(self, count: int) -> None:
        """The schedule asks for merges; they are made once observed records exist
        (the chaos's faults may have kept the provider from observing any yet)."""
        self.merges_owed += count

    def merge_owed(self) -> None:
        """Make the owed merges that observed records allow, each variant once before any
        is drawn, so a run covers every corroboration rule whatever its timing."""
        while self.merges_owed:
            unseen = [v for v, _ in MERGE_VARIANTS if not self.merges[v]]
            variant = replacements.merge(
                self.conn, self.standin, self.rng, self.merged, unseen[0] if unseen else None
            )
            if not variant:
                return  # nothing observed left to merge: try again later
            self.merges[variant] += 1
            self.merges_owed -= 1

    def review(self) -> None:
        """An operator decides the proposals awaiting review."""
        self.reviewed.update(replacements.review(self.conn, self.rng))

    def rotate_key(self) -> None:
        """The operator saves a wrong key and corrects it a second or three later:
        observations sent with the wrong key are still in flight (or stalled) when the
        corrected key is verified, and their 401s arrive after the verification."""
        for key in (WRONG_KEY, API_KEY):
            execute(
                self.conn,
                "UPDATE provider_settings SET api_key = %s WHERE provider = 'tmdb'",
                (key,),
            )
            if key == WRONG_KEY and self._observing():
                time.sleep(self.rng.uniform(1.0, 3.0))  # observers read it meanwhile

    def edit_key(self) -> None:
        key = API_KEY if self.rng.random() < 0.6 else WRONG_KEY
        execute(
            self.conn, "UPDATE provider_settings SET api_key = %s WHERE provider = 'tmdb'", (key,)
        )

    def edit_language(self) -> None:
        execute(
            self.conn,
            "UPDATE provider_settings SET language = %s WHERE provider = 'tmdb'",
            (self.rng.choice(("en-US", "fr-FR", "ja-JP")),),
        )

    def edit_stats_settings(self) -> None:
        execute(
            self.conn,
            "UPDATE stats_projection_worker_settings SET active_lease_cap = %s",
            (self.rng.randint(1, 4),),
        )

    # -- the draw ----------------------------------------------------------------------

    def operations(self) -> list[tuple[str, Callable[[], None], float]]:
        return [
            ("sync", self.sync, 10),
            ("enrich", self.enrich, 10),
            ("move", self.move, 5),
            ("delete", self.delete, 5),
            ("truncate", self.truncate, 0.3),
            ("correct_identity", self.correct_identity, 4),
            ("toggle_library", self.toggle_library, 2),
            ("save_session", self.save_session, 10),
            ("edit_session", lambda: self.save_session(edit=True), 5),
            ("delete_session", self.delete_session, 3),
            ("save_manual_pr", self.save_manual_pr, 2),
            ("delete_manual_pr", self.delete_manual_pr, 1),
            # A global catalog change and a rebuild request every user's whole history:
            # they would cover (and hide) a dropped range within seconds if frequent.
            ("change_catalog", self.change_catalog, 0.6),
            ("provider_fault", self.provider_fault, 3),
            ("edit_key", self.edit_key, 1),
            ("edit_language", self.edit_language, 1),
            ("edit_stats_settings", self.edit_stats_settings, 1),
            ("save_large", self.save_large, 4),
            ("held_claim", self.held_claim, 1),
            ("publication_lock_wait", self.publication_lock_wait, 0.3),
            ("cancel_stage", self.cancel_stage, 1),
            ("scoped_process", self.scoped_process, 2),
            ("bad_save", self.bad_save, 1),
            ("delete_all_sessions", self.delete_all_sessions, 0.3),
            ("squeeze_budget", self.squeeze_budget, 0.2),
            ("rebuild_everyone", self.rebuild_everyone, 0.1),
            ("auth_backlog", self.auth_backlog, 0.1),
            ("delete_library", self.delete_library, 1),
            ("delete_server", self.delete_server, 0.3),
            ("odd_identity", self.odd_identity, 2),
            ("odd_values", self.odd_values, 2),
            ("throttle_storm", self.throttle_storm, 0.2),
            ("writer_insert", self.writer_insert, 3),
            ("writer_update", self.writer_update, 3),
            ("writer_delete", self.writer_delete, 1),
            ("writer_truncate", self.writer_truncate, 0.2),
            ("writer_upsert", self.writer_upsert, 2),
            ("writer_merge", self.writer_merge, 2),
            ("writer_copy", self.writer_copy, 2),
            ("writer_batch", self.writer_batch, 1.5),
            ("writer_repeatable", self.writer_repeatable, 1.5),
            ("writer_rekey", self.writer_rekey, 1),
            ("rotate_key", self.rotate_key, 1),
            ("merge", self.merge, 2),
            ("review", self.review, 2),
        ]

    def step(self) -> str:
        """Draw and apply one operation. A write the database refuses (a lock timeout
        against a worker, say) is counted, never retried differently: the data stays as
        the database left it. A refusal the chaos does not explain is recorded apart."""
        ops = self.operations()
        name, apply, _ = self.rng.choices(ops, weights=[w for *_, w in ops])[0]
        self.apply(name, apply)
        self.tick()
        return name

    def tick(self) -> None:
        """One operation has passed: a storm or a budget squeeze may be over."""
        if self.storm_left:
            self.storm_left -= 1
            if not self.storm_left:
                self.end_storm()
                if self.kept_owed:
                    self.keep_fault(*self.kept_owed.pop(0))
        if self.squeeze_left:
            self.squeeze_left -= 1
            if not self.squeeze_left:
                self.apply("restore_budget", self.restore_budget)
        if self.calm_left:
            self.calm_left -= 1
        if self.kept_left:
            self._tick_kept()

    def apply(self, name: str, apply: Callable[[], None]) -> None:
        if self.conn.closed and self.reconnect is not None:
            try:
                self.conn = self.reconnect()
            except DatabaseUnavailable:
                self.refused[name] += 1
                return
        try:
            apply()
            with self.lock:
                self.done[name] += 1
        except DatabaseError as exc:
            self._refused(name, exc)
            if isinstance(exc, DatabaseUnavailable) and self.reconnect is not None:
                self.conn.close()
                if self.writer is not None:
                    self.writer.close()

    def _refused(self, name: str, exc: DatabaseError) -> None:
        with self.lock:
            self.refused[name] += 1
            if not refusal_expected(exc):
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                self.unexpected[f"{name} [{exc.sqlstate or '-'}]: {first}"] += 1

    def settle(self) -> None:
        """Before quiescence: faults off, the right key and the stats budgets restored
        (the rebuild in flight finishes first), so every case and range can resolve."""
        self.end_storm()
        self.standin.clear_fault()
        if self.rebuild is not None:
            self.rebuild.join()
        for thread in [*self.lock_wait_holds, self.canceller]:
            if thread is not None:
                thread.join()
        if self.writer is not None:
            self.writer.close()
        if self.app is not None:
            self.app.close()
        if self.conn.closed and self.reconnect is not None:
            self.conn = self.reconnect()
        self.restore_budget()
        execute(
            self.conn,
            "UPDATE provider_settings SET api_key = %s, active = true WHERE provider = 'tmdb'",
            (API_KEY,),
        )
