"""The migration runner: order, checksums, locking, and seeding an existing system."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from inventory_pipeline.db import (
    Connection,
    MigrationError,
    connect,
    fetch_all,
    fetch_one,
    jsonb,
)
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.db.migrator import discover, migrate


@pytest.fixture
def empty_db(server_url: str):
    name = "inventory_empty_" + str(threading.get_ident())
    with connect(server_url) as admin:
        drop_database(admin, name)
        create_database(admin, name)
    yield url_with_database(server_url, name)
    with connect(server_url) as admin:
        drop_database(admin, name)


def copy_migrations(tmp_path: Path, upto: int | None = None) -> Path:
    folder = tmp_path / "migrations"
    folder.mkdir()
    for m in discover():
        if upto is None or m.version <= upto:
            (folder / m.filename).write_text(m.sql)
    return folder


def test_applies_each_file_once_with_checksum(empty_db: str) -> None:
    with connect(empty_db) as conn:
        applied = migrate(conn)
        assert [m.version for m in applied] == [m.version for m in discover()]
        assert migrate(conn) == []
        rows = fetch_all(conn, "SELECT version, checksum FROM schema_migrations ORDER BY 1")
        assert [r["checksum"] for r in rows] == [m.checksum for m in discover()]


def test_edited_applied_file_is_refused(empty_db: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    with connect(empty_db) as conn:
        migrate(conn, folder)
        first = sorted(folder.glob("*.sql"))[0]
        first.write_text(first.read_text() + "\n-- edited\n")
        with pytest.raises(MigrationError, match="was edited after it was applied"):
            migrate(conn, folder)


def test_failed_file_rolls_back_alone(empty_db: str, tmp_path: Path) -> None:
    folder = copy_migrations(tmp_path)
    (folder / "0999_broken.sql").write_text("CREATE TABLE half_done (id int);\nSELECT 1/0;\n")
    with connect(empty_db) as conn:
        with pytest.raises(MigrationError, match=r"0999_broken\.sql failed"):
            migrate(conn, folder)
        assert fetch_one(conn, "SELECT to_regclass('half_done') AS t")["t"] is None  # type: ignore[index]
        versions = [r["version"] for r in fetch_all(conn, "SELECT version FROM schema_migrations")]
        assert 999 not in versions and 1 in versions


def test_concurrent_migrators_serialize(empty_db: str) -> None:
    results: list[object] = []

    def run() -> None:
        with connect(empty_db) as conn:
            try:
                results.append(len(migrate(conn)))
            except Exception as exc:  # pragma: no cover - reported below
                results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 0, len(discover())]  # type: ignore[type-var]


def test_revision_migration_seeds_existing_libraries_dirty(empty_db: str, tmp_path: Path) -> None:
    """Existing nonempty libraries and libraries with stored profiles start
    dirty; empty libraries without a profile start clean. A stored profile's library
    advances once more when the profile format changes (rest_share), so it is generated
    again."""
    folder = copy_migrations(tmp_path, upto=1)
    with connect(empty_db) as conn:
        migrate(conn, folder)
        conn.execute("INSERT INTO media_servers (id, name, kind) VALUES (1, 's', 'plex')")
        conn.execute(
            "INSERT INTO libraries (id, server_id, name, media_kind) VALUES"
            " (1, 1, 'stocked', 'movie'), (2, 1, 'profiled', 'movie'), (3, 1, 'empty', 'tv')"
        )
        conn.execute("INSERT INTO media_server_items (library_id, title) VALUES (1, 'x')")
        conn.execute(
            "INSERT INTO library_profiles (library_id, item_count, profile) VALUES (2, 3, '{}')"
        )
        for m in discover():
            if m.version > 1:
                (folder / m.filename).write_text(m.sql)
        migrate(conn, folder)
        rows = fetch_all(
            conn,
            "SELECT library_id, revision, acknowledged_revision FROM library_inventory_state"
            " ORDER BY 1",
        )
        assert [(r["library_id"], r["revision"], r["acknowledged_revision"]) for r in rows] == [
            (1, 1, 0),
            (2, 2, 0),
            (3, 0, 0),
        ]


def test_owed_ranges_migration_keeps_what_an_existing_database_holds(
    empty_db: str, tmp_path: Path
) -> None:
    """An existing database upgrades: a job that failed earlier is owed again, and where
    two jobs of one user are live the older fails and owes its range instead of
    blocking the one-live-job index."""
    folder = copy_migrations(tmp_path, upto=11)
    user = "00000000-0000-0000-0000-0000000000a1"
    with connect(empty_db) as conn:
        migrate(conn, folder)
        for from_date, exercises, status in (
            ("2026-01-05", ["squat"], "failed"),
            ("2026-02-01", ["bench"], "processing"),
            ("2026-03-01", ["row"], "processing"),
        ):
            conn.execute(
                "INSERT INTO user_exercise_stats_refresh_jobs"
                " (user_id, event_type, from_date, exercise_ids, status, locked_at, lock_owner)"
                " VALUES (%s, 'session_saved', %s, %s, %s, now(), 'old worker')",
                (user, from_date, exercises, status),
            )
        for m in discover():
            if m.version > 11:
                (folder / m.filename).write_text(m.sql)
        migrate(conn, folder)
        live = fetch_all(
            conn,
            "SELECT exercise_ids FROM user_exercise_stats_refresh_jobs WHERE status = 'processing'",
        )
        assert [r["exercise_ids"] for r in live] == [["row"]]
        owed = fetch_one(conn, "SELECT * FROM user_stats_owed_ranges")
        assert owed is not None
        assert str(owed["from_date"]) == "2026-01-05"
        assert owed["exercise_ids"] == ["bench", "squat"]
        assert len(owed["failed_job_ids"]) == 2


def test_require_current_reads_and_never_writes(empty_db: str, tmp_path: Path) -> None:
    from inventory_pipeline.db import SchemaBehind
    from inventory_pipeline.db.migrator import pending, require_current

    with connect(empty_db) as conn:
        with pytest.raises(SchemaBehind, match=r"run `inventory-pipeline migrate`"):
            require_current(conn)
        assert fetch_one(conn, "SELECT to_regclass('schema_migrations') AS t")["t"] is None  # type: ignore[index]
        older = copy_migrations(tmp_path, upto=2)
        migrate(conn, older)
        assert [m.version for m in pending(conn)] == [m.version for m in discover()][2:]
        migrate(conn)
        require_current(conn)
        # A database ahead of this version, or with an edited file, is refused outright.
        with pytest.raises(MigrationError, match="not in the migrations folder"):
            pending(conn, older)
        (tmp_path / "all").mkdir()
        edited = copy_migrations(tmp_path / "all")
        first = sorted(edited.glob("*.sql"))[0]
        first.write_text(first.read_text() + "\n-- edited\n")
        with pytest.raises(MigrationError, match="was edited after it was applied"):
            require_current(conn, edited)


def test_shared_conditions_are_inlined_where_they_are_asked(conn: Connection) -> None:
    """Each condition migration 0017 defines once is asked by two statements. The planner
    inlines it, so every statement keeps the plan it had with the condition written out
    in place: no call to any of them is left, and the planners still step backwards
    through each library's terminal requests."""
    import uuid
    from datetime import UTC, datetime

    from inventory_pipeline.credentials import repository as credentials
    from inventory_pipeline.profiles import repository as profiles
    from inventory_pipeline.recovery import repository as recovery

    functions = (
        "observation_due",
        "recent_refresh_failure",
        "credential_probe_allowed",
        "credential_release_allowed",
    )
    circuit = {"circuit_probe_seconds": 7200, "limit": 25, "source": "test", "reason": "test"}
    asked = {
        recovery.QUERIES["due_items"]: {},
        recovery.QUERIES["claim_due"]: {"limit": 32, "lease_seconds": 300},
        profiles.QUERIES["plan_inventory_requests"]: {
            **circuit,
            "after_since": datetime(1970, 1, 1, tzinfo=UTC),
            "after_id": 0,
        },
        profiles.QUERIES["plan_native_requests"]: {**circuit, "native_max_age_seconds": 86400},
        credentials.QUERIES["status"]: {"release_spacing_seconds": 60},
        credentials.QUERIES["lock_wakeup"]: {"release_spacing_seconds": 60},
        credentials.QUERIES["claim_probe"]: {
            "lease_token": uuid.uuid4(),
            "generation": uuid.uuid4(),
            "lease_seconds": 60,
        },
    }
    for statement, params in asked.items():
        plan = "\n".join(
            r["QUERY PLAN"] for r in fetch_all(conn, "EXPLAIN VERBOSE " + statement, params)
        )
        assert not [f for f in functions if f + "(" in plan], plan
        if "circuit_probe_seconds" in params:
            assert "Index Scan Backward using profile_refresh_requests_library_terminal" in plan


def test_the_value_rules_migration_names_what_to_repair_first(
    empty_db: str, tmp_path: Path
) -> None:
    """A database upgraded to the write surface's value rules: a session it holds dated
    in the year 300000 (its sets weighing NaN) stops the migration with one line saying
    what to repair; once the session is deleted through the write functions, the
    migration applies, and the delete's dirty range, which reached that date, becomes the
    full history the worker can compute."""
    folder = copy_migrations(tmp_path, upto=25)
    user = "00000000-0000-0000-0000-0000000000b2"
    session = {
        "id": "00000000-0000-0000-0000-0000000000c3",
        "user_id": user,
        "session_date": "300000-01-01",
        "sets": [{"exercise_id": "squat", "weight_kg": "NaN", "reps": 5}],
    }
    with connect(empty_db) as conn:
        migrate(conn, folder)
        conn.execute("INSERT INTO exercises (id, name) VALUES ('squat', 'Squat')")
        conn.execute("SELECT save_training_session(%s, %s)", (user, jsonb(session)))
        for m in discover():
            if m.version > 25:
                (folder / m.filename).write_text(m.sql)
        with pytest.raises(MigrationError) as refused:
            migrate(conn, folder)
        assert (
            "1 sessions dated outside 0001-01-01..9999-12-31, 1 sets weighing NaN"
            in str(refused.value).splitlines()[0]
        )
        conn.execute("UPDATE user_exercise_stats_refresh_jobs SET status = 'completed'")
        conn.execute("SELECT delete_training_session(%s, %s)", (user, session["id"]))
        migrate(conn, folder)
        pending = fetch_all(
            conn,
            "SELECT from_date FROM user_exercise_stats_refresh_jobs WHERE status = 'pending'",
        )
        assert pending == [{"from_date": None}]
