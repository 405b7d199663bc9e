"""Stats at scale (BENCHMARKS.md, S6 and S7).

S7: the midnight PR-window rollover of a whole population under the real Dagster daemon
(the rollover sensor and its runs, the drain sensor and its runs, the queue limits of
dagster.yaml) while one user saves a session every second: users rolled per second,
time from midnight until every window has moved, and save -> published during it.
S6: a rebuild of every user through the queue, drained by 2 worker threads.

Sizes: smoke (CI) is tiny; the default run takes 10,000 users; `--scale` adds 100,000.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Protocol, TypeVar

from bench import stats as stats_bench
from bench.common import Figure, as_autovacuum, plot, scratch_database, server_url
from bench.orchestration import daemon
from inventory_pipeline.db import (
    Connection,
    connect,
    execute,
    fetch_all,
    fetch_one,
    jsonb,
    transaction,
)
from inventory_pipeline.stats import repository as stats_repo
from inventory_pipeline.stats import runbook, service

T = TypeVar("T")

# A population's history: sessions over the last SPAN_DAYS days, SETS sets each.
SESSIONS = 12
SPAN_DAYS = 90
SETS = 4
SAVERS = 50  # users among the population who save during the rollover
ROLL_LIMIT_S = 3600.0  # the goal: everyone within the hour after midnight
BASELINE_S = 30.0  # saves before midnight, nothing due


class Sizes(Protocol):
    """The bench mode (bench.common.Mode): which sizes this run takes."""

    @property
    def smoke(self) -> bool: ...

    @property
    def scale(self) -> bool: ...

    @property
    def plots(self) -> Path: ...


POPULATION = """
INSERT INTO exercises (id, name) SELECT 'move_' || g, 'Move ' || g FROM generate_series(1, 8) g;
UPDATE catalog_invalidation_tokens SET processed_token = token, pass_token = NULL, cursor = NULL;
INSERT INTO training_sessions (id, user_id, session_date)
SELECT md5(u || '-' || s)::uuid, md5('user-' || u)::uuid,
       %(today)s::date - (s * %(span)s / %(sessions)s)
FROM generate_series(1, %(users)s) u, generate_series(1, %(sessions)s) s;
INSERT INTO training_sets (session_id, position, exercise_id, weight_kg, reps, warmup)
SELECT t.id, p, 'move_' || (1 + (p + t.h) %% 8), 40 + (t.h + p * 7) %% 120, 1 + (t.h + p) %% 12,
       p = 1
FROM (SELECT id, abs(hashtext(id::text)) AS h FROM training_sessions) t,
     generate_series(1, %(sets)s) p;
INSERT INTO user_stats_refresh_state (user_id, requested_version, applied_version)
SELECT DISTINCT user_id, 1, 1 FROM training_sessions;
INSERT INTO user_exercise_stats (user_id, exercise_id, sessions, working_sets, reps, volume,
    heaviest_kg, best_e1rm_kg, first_date, last_date, generation)
SELECT s.user_id, t.exercise_id, count(DISTINCT s.id), count(*), sum(t.reps),
       sum(t.weight_kg * t.reps), max(t.weight_kg), max(t.weight_kg), min(s.session_date),
       max(s.session_date), 1
FROM training_sessions s JOIN training_sets t ON t.session_id = s.id
GROUP BY s.user_id, t.exercise_id;
INSERT INTO user_training_period_stats (user_id, period, period_start, sessions, working_sets,
    reps, volume, generation)
SELECT s.user_id, 'day', s.session_date, count(DISTINCT s.id), count(*), sum(t.reps),
       sum(t.weight_kg * t.reps), 1
FROM training_sessions s JOIN training_sets t ON t.session_id = s.id
GROUP BY s.user_id, s.session_date;
INSERT INTO user_pr_overview_rollover_state (user_id, due_at, snapshot_generation)
SELECT user_id, now() - interval '1 day', 1 FROM user_stats_refresh_state
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _set_clock(conn: Connection, day: date) -> None:
    execute(conn, "SELECT set_config('inventory.stats_today', %s, false)", (str(day),))


def _build_windows(url: str, today: date, threads: int = 2) -> None:
    """Generation 1 of every user gets its window for `today`, as its publication
    builds it (a few threads, each over its share of the users)."""
    with connect(url) as conn:
        users = [
            r["user_id"] for r in fetch_all(conn, "SELECT user_id FROM user_stats_refresh_state")
        ]
    errors: list[BaseException] = []

    def work(share: list[uuid.UUID]) -> None:
        try:
            with connect(url) as conn:
                _set_clock(conn, today)
                for user in share:
                    with transaction(conn):
                        stats_repo.publish_pr_window(conn, user, 1)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(users[n::threads],)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def load_population(url: str, users: int) -> date:
    """`users` users with their history, generation 1 published (projections in place,
    so the backfill scanner finds nothing stale; the catalog predates them, so no
    catalog pass is owed) and a window built for the server's date; returns that
    date."""
    with connect(url) as conn:
        row = fetch_one(conn, "SELECT current_date AS today")
        assert row is not None
        today: date = row["today"]
        params = {
            "users": users,
            "sessions": SESSIONS,
            "span": SPAN_DAYS,
            "sets": SETS,
            "today": str(today),
        }
        for statement in POPULATION.split(";\n"):
            execute(conn, statement, params)
        as_autovacuum(conn)
    _build_windows(url, today)
    with connect(url) as conn:
        as_autovacuum(conn, vacuum=True)
        row = fetch_one(
            conn,
            "SELECT count(*) AS n FROM user_pr_overview_rollover_state WHERE window_end = %s",
            (today + timedelta(days=1),),
        )
    assert row is not None and row["n"] == users, (row, users)
    return today


def _not_rolled(conn: Connection, day: date) -> int:
    row = fetch_one(
        conn,
        "SELECT count(*) AS n FROM user_pr_overview_rollover_state WHERE window_end < %s",
        (day + timedelta(days=1),),
    )
    assert row is not None
    return int(row["n"])


def rollover_under_daemon(admin_url: str, users: int, baseline_s: float = BASELINE_S) -> Rollover:
    """Midnight for `users` users under the daemon while a session is saved every
    second, after `baseline_s` seconds of the same saves with nothing due."""
    rng = random.Random(7)
    with scratch_database(admin_url) as url:
        today = load_population(url, users)
        midnight = today + timedelta(days=1)
        with connect(url) as conn:
            database = fetch_one(conn, "SELECT current_database() AS name")
            assert database is not None
            savers = [
                uuid.UUID(r["user_id"])
                for r in conn.execute(
                    "SELECT user_id::text FROM user_stats_refresh_state ORDER BY user_id LIMIT %s",
                    (SAVERS,),
                ).fetchall()
            ]
            with daemon(admin_url, url, {}) as storage:
                time.sleep(10)  # the daemon and its code server come up
                # Before midnight: the same saves with no rollover due, for comparison.
                idle_lags, idle_lost, _ = _save_while(
                    conn, rng, savers, today, lambda elapsed: elapsed >= baseline_s
                )
                # Midnight: every connection the daemon opens from now on sees the new
                # date, and every window is due. The drain the sensor keeps alive holds a
                # connection opened before (a real midnight moves current_date in every
                # session; this clock is a session setting): a pause ends it and the
                # resume, once it has ended, lets the sensor start one on a new connection.
                execute(
                    conn,
                    f'ALTER DATABASE "{database["name"]}" SET inventory.stats_today = '
                    f"'{midnight.isoformat()}'",
                )
                runbook.pause(conn)
                _wait_for_no_drain(storage)
                runbook.resume(conn)
                _set_clock(conn, midnight)
                execute(conn, "UPDATE user_pr_overview_rollover_state SET due_at = now()")
                lags, lost, rolled_at = _save_while(
                    conn, rng, savers, midnight, lambda _: _not_rolled(conn, midnight) == 0
                )
    return Rollover(rolled_at, lags, lost, idle_lags, idle_lost)


DRAINS_IN_FLIGHT = """
SELECT count(*) AS n FROM runs
WHERE pipeline_name = 'stats_drain'
  AND status IN ('QUEUED', 'NOT_STARTED', 'STARTING', 'STARTED')
"""


def _wait_for_no_drain(storage_url: str, timeout: float = 120.0) -> None:
    """Until Dagster's run storage shows no stats drain queued or running."""
    deadline = time.monotonic() + timeout
    with connect(storage_url) as storage:
        while (row := fetch_one(storage, DRAINS_IN_FLIGHT)) is not None and row["n"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"a stats drain still runs {timeout:.0f} s after the pause")
            time.sleep(0.5)


def _save_while(
    conn: Connection,
    rng: random.Random,
    savers: list[uuid.UUID],
    day: date,
    done: Callable[[float], bool],
) -> tuple[list[float], int, float]:
    """Save a session every second until `done(elapsed)`; then wait for the saves to
    publish (two minutes at most): (save -> published lags, saves never published,
    seconds until done)."""
    start = time.monotonic()
    saves: list[tuple[uuid.UUID, int, float]] = []
    lags: list[float] = []
    finished: float | None = None
    next_save = start
    while True:
        now = time.monotonic()
        if finished is None and now >= next_save:
            user = rng.choice(savers)
            payload = {
                "user_id": str(user),
                "session_date": str(day),
                "sets": [{"exercise_id": "move_1", "weight_kg": 100, "reps": 5}],
            }
            saved = fetch_one(
                conn, "SELECT save_training_session(%s, %s) AS r", (user, jsonb(payload))
            )
            assert saved is not None
            saves.append((user, int(saved["r"]["requested_version"]), time.monotonic()))
            next_save += 1.0
        if saves:
            rows = conn.execute(
                "SELECT user_id, applied_version FROM user_stats_refresh_state"
                " WHERE user_id = ANY(%s)",
                (list({s[0] for s in saves}),),
            ).fetchall()
            applied = {r["user_id"]: r["applied_version"] for r in rows}
            now = time.monotonic()
            lags += [now - t for u, v, t in saves if applied.get(u, 0) >= v]
            saves = [(u, v, t) for u, v, t in saves if applied.get(u, 0) < v]
        if finished is None and done(now - start):
            finished = now - start
        if finished is not None and (not saves or now > start + finished + 120):
            return lags, len(saves), finished
        if now > start + ROLL_LIMIT_S:
            raise RuntimeError("not done within the hour")
        time.sleep(0.2)


@dataclass(frozen=True)
class Rollover:
    """A midnight under the daemon: seconds until every window moved, save -> published
    lags during it (and saves never published), and the same before midnight."""

    seconds: float
    lags: list[float]
    lost: int
    idle_lags: list[float]
    idle_lost: int


@dataclass(frozen=True)
class Rebuild:
    """A rebuild of every user drained by worker threads: the rate, the worker's own
    compute and publish times (median per user), and the CPU seconds per user of the
    worker threads (Python) and of their server backends (PostgreSQL)."""

    users_per_s: float
    compute_ms: float
    publish_ms: float
    client_cpu_ms: float
    server_cpu_ms: float


def _cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of a local process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rebuild(admin_url: str, users: int, workers: int = 2) -> Rebuild:
    """A rebuild of every one of `users` users (6 sessions, 30 sets each) through the
    queue, drained by `workers` threads on a server on this machine."""
    with scratch_database(admin_url) as url:
        with connect(url) as conn:
            stats_bench.request_rebuild_of(conn, users, workers)
            as_autovacuum(conn, vacuum=True)
        done: list[int] = []
        server_cpu: list[float] = []
        lock = threading.Lock()
        barrier = threading.Barrier(workers + 1)

        def worker(n: int) -> None:
            with connect(url) as c:
                row = fetch_one(c, "SELECT pg_backend_pid() AS pid")
                assert row is not None
                before = _cpu_seconds(int(row["pid"]))
                barrier.wait()
                summary = service.drain(c, f"bench-{n}", max_rounds=10**7)
                used = _cpu_seconds(int(row["pid"])) - before
                with lock:
                    done.append(len(summary.published))
                    server_cpu.append(used)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(workers)]
        for t in threads:
            t.start()
        barrier.wait()
        cpu = time.process_time()
        start = time.perf_counter()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        client = time.process_time() - cpu
        with connect(url) as conn:
            row = fetch_one(
                conn,
                "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY compute_ms) AS compute_ms,"
                " percentile_cont(0.5) WITHIN GROUP (ORDER BY publish_ms) AS publish_ms"
                " FROM user_stats_projection_runs WHERE phase = 'published'",
            )
    assert sum(done) == users, (sum(done), users)
    assert row is not None
    return Rebuild(
        users / elapsed,
        float(row["compute_ms"]),
        float(row["publish_ms"]),
        client / users * 1000,
        sum(server_cpu) / users * 1000,
    )


def s7(admin_url: str, users: int, baseline_s: float = BASELINE_S) -> list[Figure]:
    result = rollover_under_daemon(admin_url, users, baseline_s)
    size = f"{users:,} users"

    def p(lags: list[float], q: float) -> float:
        return percentile(lags, q) if lags else float("inf")

    return [
        Figure(
            f"S7 rollover of {size} under the daemon: every window moved",
            result.seconds,
            " s",
            f"goal <= 3600 s at 100,000 users; {users / result.seconds:.0f} users/s",
            None if users < 100_000 else result.seconds <= ROLL_LIMIT_S,
        ),
        Figure(
            f"S7 save -> published p95 during the rollover of {size}"
            f" ({len(result.lags)} saves, {result.lost} not published)",
            p(result.lags, 0.95),
            " s",
            f"goal <= 20 s; p50 {p(result.lags, 0.5):.1f} s",
            None if users < 10_000 else (p(result.lags, 0.95) <= 20 and result.lost == 0),
        ),
        Figure(
            f"S7 save -> published p95 before midnight, nothing due, {size}"
            f" ({len(result.idle_lags)} saves, {result.idle_lost} not published)",
            p(result.idle_lags, 0.95),
            " s",
            f"the same machine and daemon without the rollover; p50"
            f" {p(result.idle_lags, 0.5):.1f} s",
        ),
    ]


S6_GOAL = 300.0  # users/s at 100,000 users


def plot_s6(path: Path, rates: dict[int, float]) -> None:
    """The S6 curve: users/s over the population, against the goal."""
    if len(rates) < 2:
        return
    sizes = sorted(rates)
    plot(
        path,
        "S6: rebuild of every user through the queue, 2 workers",
        "users",
        "users per second",
        {
            "rebuild": [(float(n), rates[n]) for n in sizes],
            "goal at 100,000 users": [(float(sizes[0]), S6_GOAL), (float(sizes[-1]), S6_GOAL)],
        },
        log_x=True,
    )


def s6(admin_url: str, users: int) -> Figure:
    result = rebuild(admin_url, users)
    return Figure(
        f"S6 rebuild of {users:,} users through the queue, 2 workers",
        result.users_per_s,
        " users/s",
        "goal >= 300 users/s at 100,000 users",
        None if users < 100_000 else result.users_per_s >= 300,
        note=(
            f"per user: compute {result.compute_ms:.1f} ms, publish {result.publish_ms:.1f} ms"
            f" (median, the worker's own); CPU {result.client_cpu_ms:.1f} ms in the worker"
            f" threads + {result.server_cpu_ms:.1f} ms in their server backends"
        ),
    )


def pick(mode: Sizes, smoke: T, default: T, scale: T) -> T:
    if mode.smoke:
        return smoke
    return scale if mode.scale else default


def run(admin_url: str, mode: Sizes) -> list[Figure]:
    """S7 and S6 at the sizes `mode` selects."""
    figures: list[Figure] = []
    for users in pick(mode, [20], [10_000], [10_000, 100_000]):
        figures += s7(admin_url, users, pick(mode, 5.0, BASELINE_S, BASELINE_S))
    rates: dict[int, float] = {}
    for users in pick(mode, [50], [1_000, 10_000], [1_000, 10_000, 100_000]):
        figure = s6(admin_url, users)
        rates[users] = figure.value
        figures.append(figure)
    plot_s6(mode.plots / "s6-rebuild.png", rates)
    return figures


def main(argv: list[str]) -> None:
    """`python -m bench.scale_stats s7:10000 s6:1000 ...`: chosen figures at chosen
    sizes, on the bench's server (INVENTORY_BENCH_DATABASE_URL or an embedded one);
    two or more S6 sizes also draw bench/plots/s6-rebuild.png."""
    rates: dict[int, float] = {}
    with server_url() as admin:
        for spec in argv:
            what, users = spec.split(":")
            started = time.monotonic()
            figures = s7(admin, int(users)) if what == "s7" else [s6(admin, int(users))]
            if what == "s6":
                rates[int(users)] = figures[0].value
            for figure in figures:
                print(figure.line(), f"[{time.monotonic() - started:.0f} s]", flush=True)
    plot_s6(Path("bench/plots/s6-rebuild.png"), rates)


if __name__ == "__main__":
    main(sys.argv[1:])
