"""Forward-only numbered SQL migrations with checksums.

A small runner rather than a library: yoyo and alembic record which files ran but not
their content, and refusing an edited, already-applied file is the rule we need. Each
file runs in its own transaction together with its ledger row; a session advisory lock
serializes concurrent migrators (two `dev` processes, the test template builder).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable

from inventory_pipeline.db.connection import (
    Connection,
    Row,
    execute,
    execute_script,
    fetch_all,
    fetch_one,
    transaction,
)
from inventory_pipeline.db.errors import DatabaseError, MigrationError, SchemaBehind
from inventory_pipeline.db.queries import load_queries

_QUERIES = load_queries("inventory_pipeline.db", "migrator.sql")
_FILENAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
# The repository's migrations/ folder, shipped inside the package (see pyproject.toml).
DEFAULT_DIRECTORY: Traversable = resources.files("inventory_pipeline").joinpath("migrations")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def filename(self) -> str:
        return f"{self.version:04d}_{self.name}.sql"


def discover(directory: Traversable = DEFAULT_DIRECTORY) -> list[Migration]:
    """Read `NNNN_name.sql` files in version order; versions must be unique."""
    if not directory.is_dir():
        raise MigrationError(f"migrations folder not found: {directory}")
    found: dict[int, Migration] = {}
    for path in sorted(
        (entry for entry in directory.iterdir() if entry.name.endswith(".sql")),
        key=lambda entry: entry.name,
    ):
        match = _FILENAME.match(path.name)
        if match is None:
            raise MigrationError(f"migration file name must be NNNN_name.sql: {path.name}")
        version = int(match.group(1))
        if version in found:
            raise MigrationError(f"two migrations share version {version:04d}")
        found[version] = Migration(version, match.group(2), path.read_text("utf-8"))
    return [found[v] for v in sorted(found)]


def pending(conn: Connection, directory: Traversable = DEFAULT_DIRECTORY) -> list[Migration]:
    """The migrations this version has and the database lacks (none applied here).

    Raises when the two disagree in a way migrating cannot fix: the database holds a
    migration this version does not know, or one whose file differs."""
    migrations = discover(directory)
    row = fetch_one(conn, _QUERIES["ledger_exists"])
    if row is None or not row["present"]:
        return migrations
    applied = {row["version"]: row for row in fetch_all(conn, _QUERIES["applied"])}
    _check_applied(migrations, applied)
    return [m for m in migrations if m.version not in applied]


def require_current(conn: Connection, directory: Traversable = DEFAULT_DIRECTORY) -> None:
    """Refuse to work on a schema that is behind: only `dev` and `migrate` migrate."""
    missing = pending(conn, directory)
    if missing:
        raise SchemaBehind(
            f"the database schema is behind ({len(missing)} migrations pending, from "
            f"{missing[0].filename}); run `inventory-pipeline migrate`"
        )


def _check_applied(migrations: list[Migration], applied: dict[int, Row]) -> None:
    known = {m.version: m for m in migrations}
    for version, row in applied.items():
        migration = known.get(version)
        if migration is None:
            raise MigrationError(
                f"database has migration {version:04d}_{row['name']}.sql, "
                "which is not in the migrations folder (is this checkout older?)"
            )
        if row["checksum"] != migration.checksum:
            raise MigrationError(
                f"migration {migration.filename} was edited after it was applied; "
                "add a new migration instead"
            )


def migrate(conn: Connection, directory: Traversable = DEFAULT_DIRECTORY) -> list[Migration]:
    """Apply the missing migrations; returns those applied by this call."""
    migrations = discover(directory)
    execute(conn, _QUERIES["lock"])
    try:
        execute(conn, _QUERIES["create_ledger"])
        applied = {row["version"]: row for row in fetch_all(conn, _QUERIES["applied"])}
        _check_applied(migrations, applied)
        done: list[Migration] = []
        for migration in migrations:
            if migration.version in applied:
                continue
            try:
                with transaction(conn):
                    execute_script(conn, migration.sql)
                    execute(
                        conn,
                        _QUERIES["record"],
                        {
                            "version": migration.version,
                            "name": migration.name,
                            "checksum": migration.checksum,
                        },
                    )
            except DatabaseError as exc:
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise MigrationError(f"migration {migration.filename} failed: {first}") from exc
            done.append(migration)
        return done
    finally:
        execute(conn, _QUERIES["unlock"])
