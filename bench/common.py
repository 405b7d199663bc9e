"""Scratch databases and timing for the benchmarks.

A benchmark never touches a running installation: it creates its own database on the
server named by INVENTORY_BENCH_DATABASE_URL (or an embedded PostgreSQL), migrates it,
and drops it afterwards.
"""

from __future__ import annotations

import contextlib
import enum
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from inventory_pipeline.db import Connection, connect, execute, fetch_all
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.db.embedded import EmbeddedServer
from inventory_pipeline.db.migrator import migrate

T = TypeVar("T")


class Size(enum.Enum):
    """Which sizes a run uses: smoke proves the benches work (CI), default is the
    published run, scale adds the large sizes (100k libraries, 10M items) that take
    minutes."""

    SMOKE = "smoke"
    DEFAULT = "default"
    SCALE = "scale"


@dataclass(frozen=True)
class Mode:
    """What every bench receives: the size to run at and where its pictures go."""

    size: Size = Size.DEFAULT
    plots: Path = field(default_factory=lambda: Path("bench/plots"))

    @property
    def smoke(self) -> bool:
        return self.size is Size.SMOKE

    @property
    def scale(self) -> bool:
        return self.size is Size.SCALE

    def pick(self, smoke: T, default: T, scale: T | None = None) -> T:
        """The value for this run's size; scale falls back to default when not given."""
        if self.size is Size.SMOKE:
            return smoke
        if self.size is Size.SCALE and scale is not None:
            return scale
        return default


@dataclass(frozen=True)
class Figure:
    """One published figure. A figure over repeated runs carries the median as `value`
    and the spread (min-max over `runs` runs) as `low` / `high`."""

    name: str
    value: float
    unit: str
    goal: str
    met: bool | None = None
    note: str = ""
    low: float | None = None
    high: float | None = None
    runs: int = 1

    def shown(self) -> str:
        """The value with its unit, and its spread when it has one."""
        text = f"{self.value:.2f}{self.unit}"
        if self.low is not None and self.high is not None and self.runs > 1:
            text += f" (min-max {self.low:.2f}-{self.high:.2f}, median of {self.runs})"
        return text

    def line(self) -> str:
        verdict = "" if self.met is None else (" ok" if self.met else " MISSED")
        note = f" - {self.note}" if self.note else ""
        return f"{self.name}: {self.shown()} ({self.goal}){verdict}{note}"


def over_runs(
    name: str,
    values: Sequence[float],
    unit: str,
    goal: str,
    judge: Callable[[float], bool] | None = None,
) -> Figure:
    """A figure for repeated runs: the median judged by `judge` (None: not judged), with
    the min-max spread."""
    if not values:
        raise ValueError(f"{name}: no runs")
    mid = statistics.median(values)
    return Figure(
        name,
        mid,
        unit,
        goal,
        None if judge is None else judge(mid),
        low=min(values),
        high=max(values),
        runs=len(values),
    )


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


# The tables autovacuum would analyze now (changed since their last analysis by more
# than its threshold) and those it would vacuum (dead rows, or rows inserted since the
# last vacuum, past their thresholds): the server's own settings, whose defaults are
# 50 rows + 10 % of the table, 50 + 20 % and 1,000 + 20 %.
AUTOVACUUM_DUE = """
SELECT s.relid::regclass::text AS name,
       s.n_mod_since_analyze > current_setting('autovacuum_analyze_threshold')::float8
           + current_setting('autovacuum_analyze_scale_factor')::float8 * c.tuples
           AS analyze,
       s.n_dead_tup > current_setting('autovacuum_vacuum_threshold')::float8
           + current_setting('autovacuum_vacuum_scale_factor')::float8 * c.tuples
       OR s.n_ins_since_vacuum > current_setting('autovacuum_vacuum_insert_threshold')::float8
           + current_setting('autovacuum_vacuum_insert_scale_factor')::float8 * c.tuples
           AS vacuum
FROM pg_stat_user_tables s
CROSS JOIN LATERAL (SELECT greatest(reltuples, 0) AS tuples FROM pg_class
                    WHERE oid = s.relid) AS c
ORDER BY 1
"""


def as_autovacuum(conn: Connection, vacuum: bool = False) -> list[str]:
    """Analyze the tables autovacuum would analyze after the load `conn` just made, and
    only those (with `vacuum`, also vacuum those it would vacuum); returns the names of
    the tables analyzed.

    A plain ANALYZE also records the tables the load left empty as empty, which
    autovacuum never does: a table never analyzed is planned as at least ten pages,
    one analyzed empty as the page it has when a plan is made. A worker session then
    keeps the plans it made in its first calls (sequential scans of a one-page queue
    table, even for primary-key lookups) until autovacuum analyzes the table, up to a
    minute later: the bench would measure a state an installation is in only for
    that minute."""
    execute(conn, "SELECT pg_stat_force_next_flush()")  # this session's counts, first
    due = fetch_all(conn, AUTOVACUUM_DUE)
    if vacuum and (names := [str(row["name"]) for row in due if row["vacuum"]]):
        execute(conn, "VACUUM " + ", ".join(names))
    names = [str(row["name"]) for row in due if row["analyze"]]
    if names:
        execute(conn, "ANALYZE " + ", ".join(names))
    return names


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values)


def plot(
    path: Path,
    title: str,
    x_label: str,
    y_label: str,
    series: dict[str, Sequence[tuple[float, float]]],
    *,
    log_x: bool = False,
    log_y: bool = False,
) -> Path | None:
    """Draw one line per series (name -> (x, y) points) into the PNG at `path`.

    Creates the parent directory; returns `path`, or None (and says so) when matplotlib,
    which comes with the `bench` extra, is not installed: a missing picture never fails a
    bench.
    """
    try:
        import matplotlib
    except ImportError:
        print(f"no picture {path}: pip install -e '.[bench]' for matplotlib", flush=True)
        return None

    matplotlib.use("Agg")
    from matplotlib import pyplot

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = pyplot.subplots(figsize=(7, 4.2), dpi=100)
    try:
        for name, points in series.items():
            xs = [x for x, _ in points]
            ys = [y for _, y in points]
            ax.plot(xs, ys, marker="o" if len(xs) <= 50 else None, label=name)
        ax.set_title(title)
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        if log_x:
            ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        if len(series) > 1:
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        pyplot.close(fig)
    return path
