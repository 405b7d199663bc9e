"""The seeded writer: every kind of change the system of record sees, drawn from one
random stream, so a seed names the same operations in the same order every time.

Writes go through plain SQL and the published write functions, as any application of
the data contract would; nothing here calls the pipeline's own services.
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, timedelta
from typing import Any

from chaos.config import (
    API_KEY,
    AUTH_BACKLOG_CASES,
    EXPECTED_SQLSTATE_CLASSES,
    EXPECTED_SQLSTATES,
    WRONG_KEY,
)
from inventory_pipeline.db import (
    Connection,
    DatabaseError,
    DatabaseUnavailable,
    execute,
    fetch_all,
    fetch_one,
    jsonb,
)
from inventory_pipeline.provider.standin import StandIn
from tests.factories import insert_items, item_values

GLOBAL_EXERCISES = ("squat", "bench_press", "deadlift", "overhead_press", "row", "pull_up")
FAULTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("status", {"status": 500}),
    ("status", {"status": 503}),
    ("throttle", {"retry_after": "1"}),
    ("garbage", {}),
    ("truncate", {}),
    ("close", {}),
    ("slow", {"delay": 1.5}),
    ("missing", {}),
)


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
    users: list[uuid.UUID] = field(default_factory=list)
    sessions: dict[uuid.UUID, list[uuid.UUID]] = field(default_factory=dict)
    done: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    # Refusals the chaos does not explain: "operation [SQLSTATE]: message".
    unexpected: Counter[str] = field(default_factory=Counter)

    def setup(self, libraries: int = 6, items_per_library: int = 15, users: int = 4) -> None:
        """The starting system of record: servers, libraries, items, users' logs."""
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
        self.auth_backlog()

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

    def truncate(self) -> None:
        execute(self.conn, "TRUNCATE media_server_items")
        for library_id in self._library_ids():
            self._insert_items(library_id, self.rng.randint(0, 8))

    def correct_identity(self) -> None:
        for item_id in self._item_ids(1):
            execute(
                self.conn,
                "UPDATE media_server_items SET provider_kind = %s, provider_id = %s WHERE id = %s",
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

    def toggle_library(self) -> None:
        library_id = self.rng.choice(self._library_ids())
        execute(self.conn, "UPDATE libraries SET active = NOT active WHERE id = %s", (library_id,))

    # -- training log ------------------------------------------------------------------

    def _sets(self, user: uuid.UUID) -> list[dict[str, Any]]:
        lifts = [*GLOBAL_EXERCISES, f"own_{user.hex[:8]}"]
        return [
            {
                "exercise_id": self.rng.choice(lifts),
                "weight_kg": self.rng.randint(20, 200),
                "reps": self.rng.randint(1, 15),
                "warmup": self.rng.random() < 0.2,
            }
            for _ in range(self.rng.randint(1, 6))
        ]

    def save_session(self, user: uuid.UUID | None = None, edit: bool = False) -> None:
        user = user or self.rng.choice(self.users)
        known = self.sessions[user]
        if edit and known:
            session_id = self.rng.choice(known)
        else:
            session_id = uuid.UUID(int=self.rng.getrandbits(128))
            known.append(session_id)
        day = self.today - timedelta(days=self.rng.randint(0, 400))
        payload = {
            "id": str(session_id),
            "user_id": str(user),
            "session_date": day.isoformat(),
            "sets": self._sets(user),
        }
        execute(self.conn, "SELECT save_training_session(%s, %s)", (user, jsonb(payload)))

    def delete_session(self) -> None:
        user = self.rng.choice(self.users)
        if not self.sessions[user]:
            return
        session_id = self.sessions[user].pop(self.rng.randrange(len(self.sessions[user])))
        execute(self.conn, "SELECT delete_training_session(%s, %s)", (user, session_id))

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
        if self.rng.random() < 0.4:
            self.standin.clear_fault()
            return
        fault, options = self.rng.choice(FAULTS)
        self.standin.set_fault(fault, **options)

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
            ("change_catalog", self.change_catalog, 2),
            ("provider_fault", self.provider_fault, 3),
            ("edit_key", self.edit_key, 1),
            ("edit_language", self.edit_language, 1),
            ("edit_stats_settings", self.edit_stats_settings, 1),
            ("auth_backlog", self.auth_backlog, 0.1),
        ]

    def step(self) -> str:
        """Draw and apply one operation. A write the database refuses (a lock timeout
        against a worker, say) is counted, never retried differently: the data stays as
        the database left it. A refusal the chaos does not explain is recorded apart."""
        ops = self.operations()
        name, apply, _ = self.rng.choices(ops, weights=[w for *_, w in ops])[0]
        self.apply(name, apply)
        return name

    def apply(self, name: str, apply: Callable[[], None]) -> None:
        if self.conn.closed and self.reconnect is not None:
            try:
                self.conn = self.reconnect()
            except DatabaseUnavailable:
                self.refused[name] += 1
                return
        try:
            apply()
            self.done[name] += 1
        except DatabaseError as exc:
            self.refused[name] += 1
            if not refusal_expected(exc):
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                self.unexpected[f"{name} [{exc.sqlstate or '-'}]: {first}"] += 1
            if isinstance(exc, DatabaseUnavailable) and self.reconnect is not None:
                self.conn.close()

    def settle(self) -> None:
        """Before quiescence: faults off and the right key, so every case can resolve."""
        self.standin.clear_fault()
        if self.conn.closed and self.reconnect is not None:
            self.conn = self.reconnect()
        execute(
            self.conn,
            "UPDATE provider_settings SET api_key = %s, active = true WHERE provider = 'tmdb'",
            (API_KEY,),
        )
