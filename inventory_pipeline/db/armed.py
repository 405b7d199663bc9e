"""Armed calls: a statement that arms a transaction (its statement budget, the lease
token it acts under, its commit level), then one call whose first row is the answer,
as one transaction; several of them sent in one round trip, each its own transaction.

A statement timeout is armed when a statement starts, so a budget set inside a call
would not bound it: the arming statement is sent first, in the same implicit
transaction. Outside a transaction the calls go through libpq's pipeline mode with a
sync after each one, so each commits (or fails and rolls back alone) before the next
starts, and the round costs one round trip. The statements are prepared once per
connection under names of their own; parameters go as text and the server infers their
types from the statement. Inside the caller's transaction each call runs in a savepoint
and the caller's commit is left as it is.
"""

from __future__ import annotations

import hashlib
import re
import select
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg import abc, adapt, pq

from inventory_pipeline.db.connection import Connection, Row, _translated, translate_errors
from inventory_pipeline.db.errors import DatabaseError

_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")


@dataclass(frozen=True)
class Statement:
    """A named-parameter statement (`%(name)s`) in the server's numbered form."""

    name: bytes
    text: bytes
    params: tuple[str, ...]

    @classmethod
    def of(cls, query: str) -> Statement:
        names: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match.group(0) == "%%":
                return "%"
            if match.group(1) not in names:
                names.append(match.group(1))
            return f"${names.index(match.group(1)) + 1}"

        text = _PLACEHOLDER.sub(number, query)
        digest = hashlib.sha1(text.encode()).hexdigest()[:20]
        return cls(f"inventory_{digest}".encode(), text.encode(), tuple(names))

    def values(self, params: Mapping[str, Any]) -> list[bytes | None]:
        return [_text(params[name]) for name in self.params]


def _encoded(value: Any) -> bytes:
    return str(value).encode()


def _iso(value: date | datetime) -> bytes:
    return value.isoformat().encode()


# A parameter's text input form by its type (the server takes the type from the
# statement); bool before int, since True is an int.
_TEXT: dict[type, Any] = {
    str: str.encode,
    UUID: _encoded,
    int: _encoded,
    float: _encoded,
    bool: lambda value: b"t" if value else b"f",
    date: _iso,
    datetime: _iso,
}


def _text(value: Any) -> bytes | None:
    """A parameter in the server's text input form (its type comes from the statement)."""
    if value is None:
        return None
    encode = _TEXT.get(type(value))
    if encode is None:
        raise TypeError(f"cannot send a {type(value).__name__} to an armed call")
    return encode(value)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class ArmedCall:
    """One transaction: `arm` with `arm_params` (which also receive `async_commit`,
    true only when asked and the call is a transaction of its own), then `query` with
    `params`, whose first row is the answer."""

    arm: str
    arm_params: Mapping[str, Any]
    query: str
    params: Mapping[str, Any] = field(default_factory=dict)
    async_commit: bool = False


class _Session:
    """What armed calls keep per connection: the statements prepared on it and a loader
    of its rows."""

    def __init__(self, conn: Connection) -> None:
        self.prepared: set[bytes] = set()
        self.loader: abc.Transformer = adapt.Transformer(conn)

    def row(self, result: pq.abc.PGresult) -> Row:
        """The first row of `result` as a dict."""
        self.loader.set_pgresult(result)
        values = self.loader.load_row(0, tuple)
        names = [(result.fname(i) or b"").decode() for i in range(result.nfields)]
        return dict(zip(names, values, strict=True))


_sessions: weakref.WeakKeyDictionary[Connection, _Session] = weakref.WeakKeyDictionary()
_sessions_lock = threading.Lock()
_statements: dict[str, Statement] = {}


def _statement(query: str) -> Statement:
    found = _statements.get(query)
    if found is None:
        found = _statements.setdefault(query, Statement.of(query))
    return found


def _session(conn: Connection) -> _Session:
    with _sessions_lock:
        found = _sessions.get(conn)
        if found is None:
            found = _sessions[conn] = _Session(conn)
        return found


def _forget(conn: Connection) -> None:
    with _sessions_lock:
        _sessions.pop(conn, None)


def call_armed(conn: Connection, calls: Sequence[ArmedCall]) -> list[Row | DatabaseError | None]:
    """Each call as a transaction of its own, all in one round trip: its first row (None
    when it returned none) or the error it failed with, which rolled back that call
    only. A session lost on the way raises DatabaseUnavailable and closes the
    connection. Inside the caller's transaction the calls run one by one in savepoints."""
    if conn.pgconn.transaction_status != pq.TransactionStatus.IDLE:
        return [_in_savepoint(conn, call) for call in calls]
    answers = _call_round(conn, calls)
    lost = [i for i, answer in enumerate(answers) if _unprepared(answer)]
    if lost:
        # The statements were deallocated since they were prepared (psycopg sends
        # DEALLOCATE ALL after a rollback on a connection where it prepared its own):
        # a call whose statement was missing did nothing, so it is sent again.
        _session(conn).prepared.clear()
        again = _call_round(conn, [calls[i] for i in lost])
        for i, answer in zip(lost, again, strict=True):
            answers[i] = answer
    return answers


def _unprepared(answer: Row | DatabaseError | None) -> bool:
    return isinstance(answer, DatabaseError) and answer.sqlstate == "26000"


def _call_round(conn: Connection, calls: Sequence[ArmedCall]) -> list[Row | DatabaseError | None]:
    messages = [_messages(call) for call in calls]
    session = _session(conn)
    started = time.perf_counter()
    with conn.lock:
        try:
            results = _round(conn.pgconn, session, messages)
        except BaseException as exc:
            # A pipeline left half read (a lost session, or an interruption such as a
            # run's termination) cannot be used again.
            _forget(conn)
            conn.close()
            if isinstance(exc, psycopg.Error):
                raise _translated(exc, (time.perf_counter() - started) * 1000) from exc
            raise
    elapsed_ms = (time.perf_counter() - started) * 1000
    return [_answer(conn, session, result, elapsed_ms) for result in results]


def fetch_one_armed(
    conn: Connection,
    arm: str,
    arm_params: Mapping[str, Any],
    query: str,
    params: Mapping[str, Any] | None = None,
    *,
    async_commit: bool = False,
) -> Row | None:
    """One armed call (see `call_armed`): its first row, or its error raised."""
    [answer] = call_armed(conn, [ArmedCall(arm, arm_params, query, params or {}, async_commit)])
    if isinstance(answer, DatabaseError):
        raise answer
    return answer


def _in_savepoint(conn: Connection, call: ArmedCall) -> Row | DatabaseError | None:
    try:
        with translate_errors(), conn.transaction():
            conn.execute(call.arm, {**call.arm_params, "async_commit": False})
            row: Row | None = conn.execute(call.query, call.params).fetchone()
            return row
    except DatabaseError as exc:
        return exc


# A call's two statements with their parameters in text form.
_Messages = tuple[tuple[Statement, list[bytes | None]], ...]


def _messages(call: ArmedCall) -> _Messages:
    arm_params = {**call.arm_params, "async_commit": call.async_commit}
    arm, query = _statement(call.arm), _statement(call.query)
    return ((arm, arm.values(arm_params)), (query, query.values(call.params)))


def _answer(
    conn: Connection, session: _Session, results: list[pq.abc.PGresult], elapsed_ms: float
) -> Row | DatabaseError | None:
    """The first row of a call's last statement, or the first error among its results."""
    for result in results:
        if result.status == pq.ExecStatus.FATAL_ERROR:
            error = psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
            return _translated(error, elapsed_ms)
    last = results[-1]
    return session.row(last) if last.ntuples else None


def _round(
    pg: pq.abc.PGconn, session: _Session, calls: Sequence[_Messages]
) -> list[list[pq.abc.PGresult]]:
    """Send every call (preparing what this connection has not prepared yet), then read
    each call's results up to its sync. A statement whose preparation failed is
    prepared again next time."""
    prepared = session.prepared
    pg.enter_pipeline_mode()
    preparing: list[list[bytes | None]] = []
    for messages in calls:
        names: list[bytes | None] = []  # per result: the name it prepares, or None
        for statement, values in messages:
            if statement.name not in prepared:
                pg.send_prepare(statement.name, statement.text)
                prepared.add(statement.name)
                names.append(statement.name)
            pg.send_query_prepared(statement.name, values)
            names.append(None)
        pg.pipeline_sync()
        preparing.append(names)
    _flush(pg)
    answers = []
    for names in preparing:
        results, commit_error = _read_until_sync(pg, len(names))
        for name, result in zip(names, results, strict=True):
            if name is not None and result.status != pq.ExecStatus.COMMAND_OK:
                prepared.discard(name)
        # A failed commit is the call's error (its statements' results came first).
        answers.append(results if commit_error is None else [commit_error, *results])
    pg.exit_pipeline_mode()
    return answers


def _flush(pg: pq.abc.PGconn) -> None:
    while pg.flush():
        readable, _ = _wait(pg, write=True)
        if readable:
            pg.consume_input()


def _next_result(pg: pq.abc.PGconn) -> pq.abc.PGresult | None:
    while pg.is_busy():
        _wait(pg, write=False)
        pg.consume_input()
    return pg.get_result()


def _read_until_sync(
    pg: pq.abc.PGconn, count: int
) -> tuple[list[pq.abc.PGresult], pq.abc.PGresult | None]:
    """The results of `count` messages (an aborted one's stands for it), each ended by
    an empty result, then the sync that ends their transaction; and the error of a
    commit that failed at the sync (a deferred constraint), which comes before it."""
    results: list[pq.abc.PGresult] = []
    for _ in range(count):
        result = _next_result(pg)
        if result is None or _next_result(pg) is not None:
            raise psycopg.OperationalError("the pipeline's results are out of step")
        results.append(result)
    sync = _next_result(pg)
    commit_error = None
    if sync is not None and sync.status == pq.ExecStatus.FATAL_ERROR:
        commit_error = sync
        sync = _next_result(pg)
        if sync is None:
            sync = _next_result(pg)
    if sync is None or sync.status != pq.ExecStatus.PIPELINE_SYNC:
        raise psycopg.OperationalError("the pipeline lost its sync")
    return results, commit_error


def _wait(pg: pq.abc.PGconn, *, write: bool) -> tuple[bool, bool]:
    """Block until the socket is readable (or writable, when asked)."""
    poller = select.poll()
    poller.register(pg.socket, select.POLLIN | (select.POLLOUT if write else 0))
    ready = 0
    for _, flags in poller.poll():
        ready |= flags
    if ready & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
        return True, False  # consume_input reports what happened
    return bool(ready & select.POLLIN), bool(ready & select.POLLOUT)
