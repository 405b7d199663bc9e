"""Scratch databases and timing for the benchmarks.

A benchmark never touches a running installation: it creates its own database on the
server named by INVENTORY_BENCH_DATABASE_URL (or an embedded PostgreSQL), migrates it,
and drops it afterwards.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from inventory_pipeline.db import connect
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.db.embedded import EmbeddedServer
from inventory_pipeline.db.migrator import migrate


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    goal: str
    met: bool | None = None
    note: str = ""

    def line(self) -> str:
        verdict = "" if self.met is None else (" ok" if self.met else " MISSED")
        note = f" - {self.note}" if self.note else ""
        return f"{self.name}: {self.value:.2f}{self.unit} ({self.goal}){verdict}{note}"


@contextlib.contextmanager
def server_url() -> Iterator[str]:
    configured = os.environ.get("INVENTORY_BENCH_DATABASE_URL")
    if configured:
        yield url_with_database(configured, "postgres")
        return
    with tempfile.TemporaryDirectory(prefix="inventory-bench-") as tmp:
        server = EmbeddedServer(Path(tmp) / "pgdata")
        server.start()
        try:
            yield server.url("postgres")
        finally:
            server.stop()


@contextlib.contextmanager
def scratch_database(admin_url: str) -> Iterator[str]:
    name = f"inventory_bench_{uuid.uuid4().hex[:10]}"
    with connect(admin_url) as admin:
        create_database(admin, name)
    url = url_with_database(admin_url, name)
    try:
        with connect(url) as conn:
            migrate(conn)
        yield url
    finally:
        with connect(admin_url) as admin:
            drop_database(admin, name)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values)
