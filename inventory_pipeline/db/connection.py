"""Connections, transactions and error translation (the only psycopg user besides db/).

Connections run in autocommit; `transaction()` opens a real transaction, so the caller
owns transaction boundaries (capture, planning and completion each commit on
their own).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn, TypeAlias
from urllib.parse import quote, unquote

import psycopg
from psycopg import conninfo, sql
from psycopg.rows import DictRow, dict_row, tuple_row
from psycopg.types.json import Jsonb

from inventory_pipeline.db.errors import (
    CheckViolation,
    DatabaseError,
    DatabaseUnavailable,
    DeadlockDetected,
    FeatureNotSupported,
    ForeignKeyViolation,
    IdleInTransactionTimeout,
    InvalidDatabaseUrl,
    LockNotAvailable,
    NumericValueOutOfRange,
    ObjectNotInPrerequisiteState,
    QueryCanceled,
    SerializationFailure,
    UniqueViolation,
)

Connection: TypeAlias = psycopg.Connection[DictRow]
Row: TypeAlias = dict[str, Any]
Params: TypeAlias = Mapping[str, Any] | Sequence[Any] | None

# A `password=` parameter, in a URL query or a key=value connection string.
# `password` and `sslpassword` (the client key's passphrase) are the parameters libpq
# treats as secrets.
_PASSWORD_PARAM = re.compile(
    r"((?:^|[?&\s])(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'|[^&\s]*)", re.I
)


def _userinfo_end(rest: str) -> int:
    """Where the user info of `user:password@host/...` ends (its `@`), or -1.

    Conservative on purpose: a password typed without percent-encoding may hold `/`, `?`
    or `@`, so the user info runs to the last `@` before the query that follows the
    first `@`; a message then hides too much rather than part of a password."""
    first = rest.find("@")
    if first < 0:
        return -1
    query = rest.find("?", first)
    return rest.rfind("@", 0, query if query >= 0 else len(rest))


def redact_url(url: str) -> str:
    """Hide the password of a URL (user info or `password=` parameter) for a message."""
    scheme, sep, rest = url.partition("://")
    if sep:
        end = _userinfo_end(rest)
        user, colon, _ = rest[: max(end, 0)].partition(":")
        if end >= 0 and colon:
            rest = f"{user}:***{rest[end:]}"
        url = scheme + sep + rest
    return _PASSWORD_PARAM.sub(r"\1***", url)


def _passwords(url: str) -> set[str]:
    """The password as written in `url` and decoded (to scrub it from driver messages)."""
    found: set[str] = set()
    _, sep, rest = url.partition("://")
    end = _userinfo_end(rest) if sep else -1
    if end >= 0 and ":" in rest[:end]:
        found.add(rest[:end].partition(":")[2])
    found.update(match.group(2) for match in _PASSWORD_PARAM.finditer(url))
    found.update({unquote(value) for value in found})
    return {value for value in found if value}


def scrub(message: str, url: str) -> str:
    """`message` with any form of `url`'s password replaced by ***."""
    for secret in sorted(_passwords(url), key=len, reverse=True):
        message = message.replace(secret, "***")
    return message


def validate_url(url: str) -> None:
    """Refuse anything that is not a PostgreSQL URL, with one clear line."""
    if not url.startswith(("postgresql://", "postgres://")):
        raise InvalidDatabaseUrl(
            f"database URL must start with postgresql://, got {redact_url(url)!r}"
        )
    try:
        conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        reason = scrub(str(exc).strip().splitlines()[0] if str(exc).strip() else "", url)
        raise InvalidDatabaseUrl(f"malformed database URL {redact_url(url)!r}: {reason}") from None


# The pipeline never keeps a transaction open across I/O or computation, so a session
# of ours idle inside a transaction is a frozen or stopped process; the server ends it
# after this long and its locks (a settings share lock, say) stop blocking writers.
IDLE_IN_TRANSACTION_MS = 30_000

# A silent network (a partition, a host lost without closing its sockets) sends no FIN or
# RST, so without these a session would hang on both ends for the kernel's defaults
# (hours). Both ends probe an idle connection after 10 s, every 5 s, and give up after 3
# unanswered probes; data sent and not acknowledged for 25 s ends the connection; a
# server running a statement checks every 5 s that its client is still there. So the
# server ends a cut-off host's sessions (rolling back their transactions, releasing
# their locks) within about 30 s of the cut, and the host's own calls fail as an
# unreachable database instead of waiting (docs/deployment.md#failure-guarantees).
# Each libpq parameter a URL sets itself wins; the server's side follows the values the
# connection uses.
KEEPALIVES = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "25000",
}
CLIENT_CONNECTION_CHECK_MS = 5_000

# libpq parameter -> the server's setting of the same meaning for this session.
SERVER_KEEPALIVES = {
    "keepalives_idle": "tcp_keepalives_idle",
    "keepalives_interval": "tcp_keepalives_interval",
    "keepalives_count": "tcp_keepalives_count",
    "tcp_user_timeout": "tcp_user_timeout",
}

SESSION_SETTINGS = """
SELECT set_config('idle_in_transaction_session_timeout', %(idle_in_transaction)s, false),
       set_config('client_connection_check_interval', %(client_check)s, false),
       set_config('tcp_keepalives_idle', %(keepalives_idle)s, false),
       set_config('tcp_keepalives_interval', %(keepalives_interval)s, false),
       set_config('tcp_keepalives_count', %(keepalives_count)s, false),
       set_config('tcp_user_timeout', %(tcp_user_timeout)s, false)
"""


def network_settings(url: str) -> tuple[dict[str, str], dict[str, str]]:
    """(libpq parameters to add to `url`: the defaults it does not set itself, the
    server's settings for the session: the values the connection ends up with). A URL
    that turns keepalives off (keepalives=0) leaves the server's probes at the system's
    defaults (0 asks for them)."""
    given = {k: str(v) for k, v in conninfo.conninfo_to_dict(url).items() if v is not None}
    added = {key: value for key, value in KEEPALIVES.items() if key not in given}
    used = {**KEEPALIVES, **given}
    server = {key: used[key] for key in SERVER_KEEPALIVES}
    if used["keepalives"] == "0":
        server.update(keepalives_idle="0", keepalives_interval="0", keepalives_count="0")
    return added, server


def with_keepalives(url: str) -> str:
    """`url` with the same bounds for a connection made by another driver (Dagster's
    storage, on psycopg2): the libpq parameters it does not set, and the server's side of
    them as `-c` settings at connect, after the URL's own `options` (a setting those
    name is left to them)."""
    added, server = network_settings(url)
    params = {k: str(v) for k, v in conninfo.conninfo_to_dict(url).items() if v is not None}
    params.update(added)
    options = params.get("options", "")
    ours = [
        f"-c {SERVER_KEEPALIVES[key]}={value}"
        for key, value in server.items()
        if SERVER_KEEPALIVES[key] not in options
    ]
    params["options"] = " ".join([options, *ours]).strip()
    return build_url(params)


def connect(
    url: str,
    *,
    application_name: str = "inventory_pipeline",
    idle_in_transaction_ms: int = IDLE_IN_TRANSACTION_MS,
) -> Connection:
    """Open an autocommit connection with dict rows, whose both ends give up on a silent
    network within a bound (see KEEPALIVES)."""
    validate_url(url)
    added, server = network_settings(url)
    try:
        conn = psycopg.connect(
            conninfo.make_conninfo(url, **added),
            autocommit=True,
            row_factory=dict_row,
            connect_timeout=5,
            application_name=application_name,
        )
    except psycopg.OperationalError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = scrub(reason, url)
        raise DatabaseUnavailable(
            f"cannot connect to {redact_url(url)}: {reason}", exc.sqlstate
        ) from None
    try:
        with translate_errors():
            conn.execute(
                SESSION_SETTINGS,
                {
                    "idle_in_transaction": f"{idle_in_transaction_ms}ms",
                    "client_check": f"{CLIENT_CONNECTION_CHECK_MS}ms",
                    **server,
                },
            )
    except BaseException:
        conn.close()  # a value the server refuses (a negative keepalive) opens nothing
        raise
    return conn


# The one table from SQLSTATE to the project's error class: the states callers branch on.
# Anything else is a plain DatabaseError (or DatabaseUnavailable when the session is
# gone), still carrying its SQLSTATE.
ERROR_CLASSES: dict[str, type[DatabaseError]] = {
    "0A000": FeatureNotSupported,
    "22003": NumericValueOutOfRange,
    "23503": ForeignKeyViolation,
    "23505": UniqueViolation,
    "23514": CheckViolation,
    "25P03": IdleInTransactionTimeout,
    "40001": SerializationFailure,
    "40P01": DeadlockDetected,
    "55000": ObjectNotInPrerequisiteState,
    "55P03": LockNotAvailable,
    "57014": QueryCanceled,
}

# The server ended the session: administrator shutdown, crash shutdown, cannot connect
# now (a restart); class 08 is a connection failure.
_SESSION_GONE = frozenset({"57P01", "57P02", "57P03"})


def _session_gone(exc: psycopg.Error) -> bool:
    """Is this session lost (retry elsewhere later), rather than one statement failed?
    A deadlock (40P01), a statement timeout (57014) or an exhausted lock table (53200)
    arrive as OperationalError too, but the session survives them: they are the
    statement's error, not an unreachable database."""
    if exc.sqlstate is None:
        return isinstance(exc, psycopg.OperationalError)  # detected by the client
    return exc.sqlstate.startswith("08") or exc.sqlstate in _SESSION_GONE


def _translated(exc: psycopg.Error, elapsed_ms: float | None = None) -> DatabaseError:
    """The project's error for a driver error, keeping the server's message and SQLSTATE;
    a canceled statement also records how long the call had run."""
    message = str(exc).strip()
    cls = ERROR_CLASSES.get(exc.sqlstate or "")
    if cls is None:
        cls = DatabaseUnavailable if _session_gone(exc) else DatabaseError
    error = cls(message, exc.sqlstate)
    error.constraint = exc.diag.constraint_name
    if isinstance(error, QueryCanceled):
        error.elapsed_ms = elapsed_ms
    return error


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Turn driver errors into the project's own (see `_translated`)."""
    started = time.perf_counter()
    try:
        yield
    except psycopg.Error as exc:
        raise _translated(exc, (time.perf_counter() - started) * 1000) from exc


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
    """Column names and plain tuples: the cheap path for bulk reads (profiles count them)."""
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


def in_transaction(conn: Connection) -> bool:
    """Whether a statement sent now would join a transaction the caller has open."""
    return conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE


CALLER_TIMEOUT = "SELECT current_setting('statement_timeout') AS timeout"
RESTORE_TIMEOUT = "SELECT set_config('statement_timeout', %(timeout)s, true)"


def fetch_one_armed(
    conn: Connection, arm: str, arm_params: Mapping[str, Any], query: str, params: Params = None
) -> Row | None:
    """`query`'s first row, with `arm` (a statement that sets transaction-local settings,
    such as a statement budget) run first in the same transaction: two ordinary
    statements. Outside a transaction they go as one message of the simple query
    protocol, which PostgreSQL runs as one implicit transaction, committed at its end (a
    cron command arming a budget before its call is the same message); psycopg binds the
    values on the client, the one way to send two statements with values in one
    message. Inside the caller's transaction they run in a savepoint and commit with the
    caller. An error rolls both back and leaves the session usable. The two statements'
    parameters must not share a name."""
    with translate_errors():
        if in_transaction(conn):
            # The arm's settings are transaction-local: a released savepoint keeps them,
            # so the caller's later statements would run under this call's budget. The
            # caller's timeout is put back.
            caller = conn.execute(CALLER_TIMEOUT).fetchone()
            with conn.transaction():
                conn.execute(arm, arm_params)
                row = conn.execute(query, params).fetchone()
                conn.execute(RESTORE_TIMEOUT, caller)
            return row
        values = {**arm_params, **(dict(params) if isinstance(params, Mapping) else {})}
        with psycopg.ClientCursor(conn) as cursor:
            cursor.execute(f"{arm.rstrip().rstrip(';')};\n{query}", values)
            cursor.nextset()
            return cursor.fetchone()


def execute(conn: Connection, query: str, params: Params = None) -> int:
    """Run a statement; returns the affected row count."""
    with translate_errors():
        return conn.execute(query, params).rowcount


def listen(conn: Connection, channel: str) -> None:
    """Subscribe the session to `channel` (a fixed identifier). The connection must stay
    out of transactions between statements: notifications arrive only there."""
    with translate_errors():
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))


def wait_for_notify(conn: Connection, timeout: float) -> bool:
    """Wait up to `timeout` seconds for a notification on a channel the session listens
    on; True when one came. Notifications that arrived while the session ran other
    statements count (the driver keeps them), and every one waiting is consumed, so one
    wakeup answers for all of them."""
    woke = False
    with translate_errors():
        for _ in conn.notifies(timeout=max(0.0, timeout), stop_after=1):
            woke = True
        if woke:
            for _ in conn.notifies(timeout=0):
                pass
    return woke


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
    """The same server, credentials and options, another database."""
    params = conninfo.conninfo_to_dict(url)
    params["dbname"] = database
    return build_url({key: str(value) for key, value in params.items() if value is not None})


def _host_in_netloc(host: str) -> str | None:
    """`host` as written between `@` and `/`, or None when it must go in the query
    (a socket folder, several hosts, anything with a reserved character)."""
    if ":" in host and all(c in "0123456789abcdefABCDEF:." for c in host):
        return f"[{host}]"  # an IPv6 address
    if host and all(c.isalnum() or c in "-._" for c in host):
        return host
    return None


def build_url(params: Mapping[str, str]) -> str:
    """A postgresql:// URL for libpq connection parameters, every part percent-encoded
    so that libpq and SQLAlchemy (Dagster's storage) read back the same parameters."""
    rest = dict(params)
    database = rest.pop("dbname", "")
    user = rest.pop("user", "")
    password = rest.pop("password", "")
    host = rest.pop("host", "")
    port = rest.pop("port", "")
    auth = ""
    if user:
        auth = quote(user, safe="") + (":" + quote(password, safe="") if password else "") + "@"
    elif password:
        rest["password"] = password
    netloc = _host_in_netloc(host) if host else ""
    if netloc is None:
        netloc = ""
        rest = {"host": host, **rest}
    if port and netloc and port.isdigit():
        netloc += f":{port}"
    elif port:
        rest["port"] = port
    query = "&".join(
        f"{quote(key, safe='')}={quote(value, safe='/')}" for key, value in rest.items()
    )
    return f"postgresql://{auth}{netloc}/{quote(database, safe='')}" + (
        f"?{query}" if query else ""
    )


def database_name(url: str) -> str:
    return str(conninfo.conninfo_to_dict(url).get("dbname") or "postgres")


__all__ = [
    "Connection",
    "DatabaseError",
    "Row",
    "build_url",
    "connect",
    "create_database",
    "database_exists",
    "database_name",
    "drop_database",
    "execute",
    "execute_script",
    "fetch_all",
    "fetch_one",
    "fetch_one_armed",
    "fetch_tuples",
    "in_transaction",
    "jsonb",
    "redact_url",
    "savepoint",
    "scrub",
    "snapshot",
    "transaction",
    "url_with_database",
    "validate_url",
    "with_keepalives",
]
