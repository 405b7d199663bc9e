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
from pathlib import Path

from inventory_pipeline.db.connection import (
    Connection,
    execute,
    execute_script,
    fetch_all,
    transaction,
)
from inventory_pipeline.db.errors import DatabaseError, MigrationError
from inventory_pipeline.db.queries import load_queries

_QUERIES = load_queries("inventory_pipeline.db", "migrator.sql")
_FILENAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
DEFAULT_DIRECTORY = Path(__file__).resolve().parents[2] / "migrations"


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


def discover(directory: Path = DEFAULT_DIRECTORY) -> list[Migration]:
    """Read `NNNN_name.sql` files in version order; versions must be unique."""
    if not directory.is_dir():
        raise MigrationError(f"migrations folder not found: {directory}")
    found: dict[int, Migration] = {}
    for path in sorted(directory.glob("*.sql")):
        match = _FILENAME.match(path.name)
        if match is None:
            raise MigrationError(f"migration file name must be NNNN_name.sql: {path.name}")
        version = int(match.group(1))
        if version in found:
            raise MigrationError(f"two migrations share version {version:04d}")
        found[version] = Migration(version, match.group(2), path.read_text("utf-8"))
    return [found[v] for v in sorted(found)]


def migrate(conn: Connection, directory: Path = DEFAULT_DIRECTORY) -> list[Migration]:
    """Apply the missing migrations; returns those applied by this call."""
    migrations = discover(directory)
    execute(conn, _QUERIES["lock"])
    try:
        execute(conn, _QUERIES["create_ledger"])
        applied = {row["version"]: row for row in fetch_all(conn, _QUERIES["applied"])}
        known = {m.version for m in migrations}
        for version, row in applied.items():
            if version not in known:
                raise MigrationError(
                    f"database has migration {version:04d}_{row['name']}.sql, "
                    "which is not in the migrations folder (is this checkout older?)"
                )
        done: list[Migration] = []
        for migration in migrations:
            record = applied.get(migration.version)
            if record is not None:
                if record["checksum"] != migration.checksum:
                    raise MigrationError(
                        f"migration {migration.filename} was edited after it was applied; "
                        "add a new migration instead"
                    )
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
