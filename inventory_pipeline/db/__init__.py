"""The only package that imports psycopg: connections, transactions, migrations."""

from __future__ import annotations

from inventory_pipeline.db.connection import (
    Connection,
    Row,
    connect,
    execute,
    fetch_all,
    fetch_one,
    fetch_one_armed,
    fetch_tuples,
    jsonb,
    savepoint,
    snapshot,
    transaction,
)
from inventory_pipeline.db.errors import (
    DatabaseError,
    DatabaseUnavailable,
    InvalidDatabaseUrl,
    LockNotAvailable,
    MigrationError,
    SchemaBehind,
)

__all__ = [
    "Connection",
    "DatabaseError",
    "DatabaseUnavailable",
    "InvalidDatabaseUrl",
    "LockNotAvailable",
    "MigrationError",
    "Row",
    "SchemaBehind",
    "connect",
    "execute",
    "fetch_all",
    "fetch_one",
    "fetch_one_armed",
    "fetch_tuples",
    "jsonb",
    "savepoint",
    "snapshot",
    "transaction",
]
