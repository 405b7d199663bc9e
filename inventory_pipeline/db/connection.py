"""Connections, transactions and error translation (the only psycopg user besides db/).

Connections run in autocommit; `transaction()` opens a real transaction, so the caller
owns transaction boundaries (seed 000: capture, planning and completion each commit on
their own).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn, TypeAlias

import psycopg
from psycopg import conninfo, errors, sql
from psycopg.rows import DictRow, dict_row, tuple_row
from psycopg.types.json import Jsonb

from inventory_pipeline.db.errors import (
    DatabaseError,
    DatabaseUnavailable,
    InvalidDatabaseUrl,
    LockNotAvailable,
)

Connection: TypeAlias = psycopg.Connection[DictRow]
Row: TypeAlias = dict[str, Any]
Params: TypeAlias = Mapping[str, Any] | Sequence[Any] | None

_PASSWORD = re.compile(r"(://[^:/@]*:)[^@]*@")


def redact_url(url: str) -> str:
    """Hide the password of a URL so it can appear in a message."""
    return _PASSWORD.sub(r"\1***@", url)


def validate_url(url: str) -> None:
    """Refuse anything that is not a PostgreSQL URL, with one clear line."""
    if not url.startswith(("postgresql://", "postgres://")):
        raise InvalidDatabaseUrl(
            f"database URL must start with postgresql://, got {redact_url(url)!r}"
        )
    try:
        conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise InvalidDatabaseUrl(f"malformed database URL {redact_url(url)!r}: {exc}") from None


# The pipeline never keeps a transaction open across I/O or computation, so a session
# of ours idle inside a transaction is a frozen or stopped process; the server ends it
# after this long and its locks (a settings share lock, say) stop blocking writers.
IDLE_IN_TRANSACTION_MS = 30_000


def connect(
    url: str,
    *,
    application_name: str = "inventory_pipeline",
    idle_in_transaction_ms: int = IDLE_IN_TRANSACTION_MS,
) -> Connection:
    """Open an autocommit connection with dict rows."""
    validate_url(url)
    try:
        conn = psycopg.connect(
            url,
            autocommit=True,
            row_factory=dict_row,
            connect_timeout=5,
            application_name=application_name,
        )
    except psycopg.OperationalError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatabaseUnavailable(
            f"cannot connect to {redact_url(url)}: {reason}", exc.sqlstate
        ) from None
    with translate_errors():
        conn.execute(
            "SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
            (f"{idle_in_transaction_ms}ms",),
        )
    return conn


# The server ended the session (admin shutdown, crash, restart) or an idle-in-transaction
# session (25P03); class 08 is a connection failure.
_SESSION_GONE = frozenset({"57P01", "57P02", "57P03", "25P03"})


def _session_gone(exc: psycopg.Error) -> bool:
    """Is this session lost (retry elsewhere later), rather than one statement failed?
    A deadlock (40P01), a statement timeout (57014) or an exhausted lock table (53200)
    arrive as OperationalError too, but the session survives them: they are the
    statement's error, not an unreachable database."""
    if exc.sqlstate is None:
        return isinstance(exc, psycopg.OperationalError)  # detected by the client
    return exc.sqlstate.startswith("08") or exc.sqlstate in _SESSION_GONE


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Turn driver errors into the project's own, keeping the server's message."""
    try:
        yield
    except errors.LockNotAvailable as exc:
        raise LockNotAvailable(str(exc).strip(), exc.sqlstate) from exc
    except psycopg.Error as exc:
        if _session_gone(exc):
            raise DatabaseUnavailable(str(exc).strip(), exc.sqlstate) from exc
        raise DatabaseError(str(exc).strip(), exc.sqlstate) from exc


@contextlib.contextmanager
def transaction(conn: Connection) -> Iterator[Connection]:
    """A real transaction on an autocommit connection; commits on success."""
    with translate_errors(), conn.transaction():
        yield conn


def fetch_all(conn: Connection, query: str, params: Params = None) -> list[Row]:
    with translate_errors():
        return conn.execute(query, params).fetchall()


def fetch_one(conn: Connection, query: str, params: Params = None) -> Row | None:
    with translate_errors():
        return conn.execute(query, params).fetchone()


def fetch_tuples(
    conn: Connection, query: str, params: Params = None
) -> tuple[tuple[str, ...], list[tuple[Any, ...]]]:
    """Column names and plain tuples: the cheap path for bulk reads into pandas."""
    with translate_errors(), conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(query, params)
        columns = tuple(col.name for col in cur.description or ())
        return columns, cur.fetchall()


class Savepoint:
    """A savepoint of the caller's transaction (see `savepoint`)."""

    def __init__(self, tx: psycopg.Transaction) -> None:
        self._tx = tx

    def rollback(self) -> NoReturn:
        """Undo what the block did, release the locks it took, and leave the block."""
        raise psycopg.Rollback(self._tx)


@contextlib.contextmanager
def savepoint(conn: Connection) -> Iterator[Savepoint]:
    """A savepoint inside the caller's transaction (a transaction of its own when
    there is none); released when the block ends unless rolled back."""
    with translate_errors(), conn.transaction() as tx:
        yield Savepoint(tx)


@contextlib.contextmanager
def snapshot(conn: Connection) -> Iterator[Connection]:
    """A read-only REPEATABLE READ transaction: several reads see one snapshot."""
    with translate_errors(), conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield conn


def jsonb(value: Any) -> Jsonb:
    """Bind a Python value as a jsonb parameter."""
    return Jsonb(value)


def execute(conn: Connection, query: str, params: Params = None) -> int:
    """Run a statement; returns the affected row count."""
    with translate_errors():
        return conn.execute(query, params).rowcount


def execute_script(conn: Connection, script: str) -> None:
    """Run a multi-statement script (migrations): simple protocol, no parameters."""
    with translate_errors():
        conn.execute(script.encode())


def create_database(conn: Connection, name: str, template: str | None = None) -> None:
    """CREATE DATABASE with a quoted identifier (names are fixed by the caller)."""
    stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        stmt = sql.SQL("{} TEMPLATE {}").format(stmt, sql.Identifier(template))
    with translate_errors():
        conn.execute(stmt)


def drop_database(conn: Connection, name: str) -> None:
    stmt = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    with translate_errors():
        conn.execute(stmt)


def database_exists(conn: Connection, name: str) -> bool:
    row = fetch_one(conn, "SELECT 1 AS present FROM pg_database WHERE datname = %s", (name,))
    return row is not None


def url_with_database(url: str, database: str) -> str:
    """The same server and credentials, another database."""
    params = conninfo.conninfo_to_dict(url)
    params["dbname"] = database
    host = params.pop("host", None)
    port = params.pop("port", None)
    user = params.pop("user", None)
    password = params.pop("password", None)
    auth = ""
    if user:
        auth = str(user) + (f":{password}" if password else "") + "@"
    netloc = ""
    query: list[str] = []
    if host and str(host).startswith("/"):
        query.append(f"host={host}")
    elif host:
        netloc = str(host)
    if port:
        if netloc:
            netloc += f":{port}"
        else:
            query.append(f"port={port}")
    for key, value in params.items():
        if key != "dbname" and value is not None:
            query.append(f"{key}={value}")
    suffix = ("?" + "&".join(query)) if query else ""
    return f"postgresql://{auth}{netloc}/{database}{suffix}"


def database_name(url: str) -> str:
    return str(conninfo.conninfo_to_dict(url).get("dbname") or "postgres")


def is_error(exc: BaseException, sqlstate: str) -> bool:
    cause = exc.__cause__
    return isinstance(cause, psycopg.Error) and cause.sqlstate == sqlstate


__all__ = [
    "Connection",
    "DatabaseError",
    "Row",
    "connect",
    "create_database",
    "database_exists",
    "database_name",
    "drop_database",
    "execute",
    "execute_script",
    "fetch_all",
    "fetch_one",
    "fetch_tuples",
    "is_error",
    "jsonb",
    "redact_url",
    "savepoint",
    "snapshot",
    "transaction",
    "url_with_database",
    "validate_url",
]
