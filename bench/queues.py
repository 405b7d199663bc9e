"""Queue mechanics: claim -> acknowledge cycles with no-op work, four concurrent
workers, for the profile outbox and the stats queue, against Procrastinate's
fetch -> finish on the same PostgreSQL server in the same run.

Our cycles keep the stricter token-fenced acknowledgement: a profile cycle is the claim
statement plus the one completion statement (lease token, unexpired lease, GREATEST
acknowledgement); a stats cycle is the three committed stages (claim, compute, publish)
of an account with nothing to compute.

Fairness: every side is loaded in bulk and then the tables its load wrote are analyzed,
as autovacuum would (`bench.common.as_autovacuum`: the tables the load left empty stay
unanalyzed on every side, as autovacuum leaves them).
Procrastinate runs twice: with its defaults (a pool that checks each connection on
checkout and a transaction around every call) and with a pool matched to ours
(autocommit connections, no checkout check). Each repetition runs every side in a
rotated order, and every ratio is paired within its repetition; figures are the median
with the min-max spread.

Two shapes of four workers, every side in both: one process (our workers four threads
under one interpreter lock, Procrastinate's four coroutines of one event loop), and four
processes of one worker each (our refresh runs are one process each; a Procrastinate
deployment may run several worker processes). The second measures the queues with no
two clients sharing an interpreter.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import statistics
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from bench.common import AUTOVACUUM_DUE, Figure, Mode, as_autovacuum, over_runs, scratch_database
from inventory_pipeline.db import Connection, connect, execute, fetch_all
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.profiles import repository as profiles_repo
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.profiles.models import RefreshPolicy
from inventory_pipeline.stats import service as stats

WORKERS = 4
LIBRARIES = """
INSERT INTO media_servers (id, name, kind) VALUES (1, 'bench', 'plex');
INSERT INTO libraries (id, server_id, name, media_kind)
SELECT g, 1, 'library ' || g, 'movie' FROM generate_series(1, %(n)s) g;
UPDATE library_inventory_state SET revision = 1, dirty_since = now(), changed_at = now();
INSERT INTO profile_refresh_requests (library_id, kind, source, reason, inventory_revision)
SELECT id, 'inventory_change', 'inventory_revision', 'inventory_changed', 1 FROM libraries;
"""


def _matched_pool(**kwargs: Any) -> Any:
    """Procrastinate's pool as our workers run: autocommit, no check on checkout."""
    import psycopg_pool

    kwargs.pop("check", None)
    kwargs["kwargs"] = {**(kwargs.get("kwargs") or {}), "autocommit": True}
    return psycopg_pool.AsyncConnectionPool(**kwargs)


@contextlib.contextmanager
def _empty_database(admin_url: str) -> Iterator[str]:
    """A database of its own for Procrastinate's schema, dropped after."""
    name = f"inventory_bench_procrastinate_{uuid.uuid4().hex[:8]}"
    with connect(admin_url) as admin:
        create_database(admin, name)
    try:
        yield url_with_database(admin_url, name)
    finally:
        with connect(admin_url) as admin:
            drop_database(admin, name)


@contextlib.asynccontextmanager
async def _procrastinate_app(url: str, size: int, matched: bool) -> AsyncIterator[Any]:
    """An open Procrastinate app on a pool of `size`: its defaults, or matched to ours."""
    import procrastinate

    extra: dict[str, Any] = {"pool_factory": _matched_pool} if matched else {}
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(
            conninfo=url, min_size=size, max_size=size, **extra
        )
    )
    await app.open_async()
    try:
        yield app
    finally:
        await app.close_async()


@contextlib.asynccontextmanager
async def _procrastinate_queue(url: str, size: int, n: int, matched: bool) -> AsyncIterator[Any]:
    """An open Procrastinate app with `n` jobs deferred and analyzed: its job manager."""
    from procrastinate import jobs

    async with _procrastinate_app(url, size, matched) as app:
        await app.schema_manager.apply_schema_async()
        await app.job_manager.batch_defer_jobs_async(
            [
                jobs.Job(queue="bench", lock=None, queueing_lock=None, task_name="noop")
                for _ in range(n)
            ]
        )
        # The server counts an idle session's changes within a second; then the same
        # tables as autovacuum would analyze.
        await asyncio.sleep(1.5)
        due = await app.connector.execute_query_all_async(AUTOVACUUM_DUE)
        if names := [str(row["name"]) for row in due if row["analyze"]]:
            await app.connector.execute_query_async("ANALYZE " + ", ".join(names))
        yield app.job_manager


def _threads(url: str, work: Callable[[Connection], int]) -> tuple[int, float]:
    counts: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(WORKERS + 1)

    def worker() -> None:
        with connect(url) as conn:
            barrier.wait()
            done = work(conn)
            with lock:
                counts.append(done)

    threads = [threading.Thread(target=worker) for _ in range(WORKERS)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - start


def _processes(work: Callable[[Any], int]) -> tuple[int, float]:
    """`work(barrier)` in WORKERS forked processes of their own; each connects, waits at
    the barrier and returns its count. Timed from the barrier to the last count."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(WORKERS + 1)
    counts = context.Queue()

    def worker() -> None:
        counts.put(work(barrier))

    processes = [context.Process(target=worker) for _ in range(WORKERS)]
    for process in processes:
        process.start()
    barrier.wait()
    start = time.perf_counter()
    done = sum(counts.get() for _ in processes)
    seconds = time.perf_counter() - start
    for process in processes:
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"a worker process exited with {process.exitcode}")
    return done, seconds


def _run(url: str, work: Callable[[Connection], int], processes: bool) -> tuple[int, float]:
    """Four workers running `work` on a connection each: threads, or processes."""
    if not processes:
        return _threads(url, work)

    def one(barrier: Any) -> int:
        with connect(url) as conn:
            barrier.wait()
            return work(conn)

    return _processes(one)


def profile_cycles(admin_url: str, n: int, processes: bool = False) -> tuple[int, float]:
    policy = RefreshPolicy()
    with scratch_database(admin_url) as url:
        with connect(url) as conn:
            for statement in LIBRARIES.replace("%(n)s", str(int(n))).strip().split(";\n"):
                if statement.strip():
                    execute(conn, statement)
            as_autovacuum(conn)  # every side

        def work(conn: Connection) -> int:
            done = 0
            while batch := profiles.claim(conn, policy, limit=1).claims:
                for claim in batch:  # no-op work: complete and acknowledge at once
                    row = profiles_repo.complete_claim(
                        conn, claim, claim.inventory_revision or 0, 0, None
                    )
                    done += row is not None
            return done

        return _run(url, work, processes)


def stats_cycles(admin_url: str, n: int, processes: bool = False) -> tuple[int, float]:
    with scratch_database(admin_url) as url:
        with connect(url) as conn:
            execute(
                conn,
                "UPDATE stats_projection_worker_settings SET active_lease_cap = %s",
                (WORKERS,),
            )
            for _ in range(n):
                execute(
                    conn, "SELECT request_stats_refresh(%s, NULL, '{}', 'bench')", (uuid.uuid4(),)
                )
            as_autovacuum(conn)  # every side

        def work(conn: Connection) -> int:
            # The worker's own loop (the Dagster drain's): claim, compute, publish.
            return len(stats.drain(conn, "bench", max_rounds=n).published)

        return _run(url, work, processes)


def procrastinate_cycles(
    admin_url: str, n: int, matched: bool, processes: bool = False
) -> tuple[int, float]:
    """Procrastinate fetch -> finish: with its default pool, or (`matched`) with
    autocommit connections and no checkout check, as our workers run; four coroutines
    of one event loop, or (`processes`) four processes of one worker each."""
    from procrastinate import jobs

    async def drain(manager: Any) -> int:
        worker_id = await manager.register_worker()
        done = 0
        while (job := await manager.fetch_job(None, worker_id)) is not None:
            await manager.finish_job(job, jobs.Status.SUCCEEDED, delete_job=False)
            done += 1
        return done

    async def run(url: str) -> tuple[int, float]:
        async with _procrastinate_queue(url, WORKERS, n, matched) as manager:
            start = time.perf_counter()
            counts = await asyncio.gather(*(drain(manager) for _ in range(WORKERS)))
            return sum(counts), time.perf_counter() - start

    async def one(url: str, barrier: Any) -> int:
        async with _procrastinate_app(url, 1, matched) as app:
            barrier.wait()  # nothing else runs on this loop yet
            return await drain(app.job_manager)

    with _empty_database(admin_url) as url:
        if not processes:
            return asyncio.run(run(url))

        async def load() -> None:
            async with _procrastinate_queue(url, 1, n, matched):
                pass

        asyncio.run(load())
        return _processes(lambda barrier: asyncio.run(one(url, barrier)))


SIDES: dict[str, Callable[[str, int, bool], tuple[int, float]]] = {
    "procrastinate_default": lambda url, n, p: procrastinate_cycles(url, n, False, p),
    "procrastinate_matched": lambda url, n, p: procrastinate_cycles(url, n, True, p),
    "profile": profile_cycles,
    "stats": stats_cycles,
}
PEERS = {
    "procrastinate_default": "Procrastinate defaults (checked pool, a transaction per call)",
    "procrastinate_matched": "Procrastinate, pool matched to ours (autocommit, no check)",
}
OURS = {
    "profile": "profile outbox claim -> acknowledge",
    "stats": "stats queue claim -> compute -> publish",
}
# The shapes of the four workers: False one process, True four processes.
SHAPES = (False, True)


def rates(admin_url: str, n: int, reps: int) -> dict[tuple[bool, str], list[float]]:
    """Cycles per second of every side in both shapes, keyed (processes, side), `reps`
    times; each repetition runs the sides in a rotated order, shape by shape (the shapes
    alternating which goes first)."""
    names = list(SIDES)
    measured: dict[tuple[bool, str], list[float]] = {
        (shape, name): [] for shape in SHAPES for name in names
    }
    for rep in range(reps):
        shift = rep % len(names)
        for shape in SHAPES if rep % 2 == 0 else SHAPES[::-1]:
            for name in names[shift:] + names[:shift]:
                done, seconds = SIDES[name](admin_url, n, shape)
                if done != n:
                    raise RuntimeError(f"{name}: {done} of {n} cycles completed")
                measured[(shape, name)].append(done / seconds)
    return measured


def run(admin_url: str, mode: Mode) -> list[Figure]:
    n = mode.pick(smoke=100, default=2000)
    reps = mode.pick(smoke=1, default=5)
    try:
        import procrastinate  # noqa: F401
    except ImportError:
        return [
            Figure("queue mechanics", 0, "", "skipped: pip install -e '.[bench]' for Procrastinate")
        ]
    measured = rates(admin_url, n, reps)
    figures: list[Figure] = []
    for shape in SHAPES:
        where = f", {WORKERS} processes" if shape else ""
        figures += [
            over_runs(
                f"{label} ({WORKERS} workers{where}, {n} jobs)",
                measured[(shape, peer)],
                " jobs/s",
                "peer",
            )
            for peer, label in PEERS.items()
        ]
        for ours, label in OURS.items():
            figures.append(
                over_runs(
                    f"{label} ({WORKERS} workers{where}, {n} cycles)",
                    measured[(shape, ours)],
                    " cycles/s",
                    "ours",
                )
            )
            for peer in PEERS:
                short = "defaults" if peer == "procrastinate_default" else "matched pool"
                pairs = zip(measured[(shape, ours)], measured[(shape, peer)], strict=True)
                figures.append(
                    over_runs(
                        f"  {ours} vs Procrastinate {short}{where}",
                        [o / p for o, p in pairs],
                        "x",
                        "goal >= 1.0x (paired within each repetition)",
                        None if mode.smoke else (lambda r: r >= 1.0),
                    )
                )
    return figures


def per_call(admin_url: str, n: int = 1000) -> dict[str, float]:
    """Median milliseconds per call for one worker alone: our claim and completion, and
    Procrastinate's fetch and finish with its defaults and with the matched pool.

    Not part of `run`; it explains the four-worker ratios:
    `python -c "from bench import queues; print(queues.per_call(URL))"`.
    """
    from procrastinate import jobs

    policy = RefreshPolicy()
    result: dict[str, float] = {}
    with scratch_database(admin_url) as url, connect(url) as conn:
        for statement in LIBRARIES.replace("%(n)s", str(int(n))).strip().split(";\n"):
            if statement.strip():
                execute(conn, statement)
        as_autovacuum(conn)
        claims, completions = [], []
        while True:
            start = time.perf_counter()
            batch = profiles.claim(conn, policy, limit=1).claims
            claimed = time.perf_counter()
            if not batch:
                break
            claim = batch[0]
            profiles_repo.complete_claim(conn, claim, claim.inventory_revision or 0, 0, None)
            claims.append(claimed - start)
            completions.append(time.perf_counter() - claimed)
    result["profile claim"] = statistics.median(claims) * 1000
    result["profile complete"] = statistics.median(completions) * 1000

    async def one_worker(url: str, matched: bool) -> tuple[float, float]:
        async with _procrastinate_queue(url, 1, n, matched) as manager:
            worker_id = await manager.register_worker()
            fetches, finishes = [], []
            while True:
                start = time.perf_counter()
                job = await manager.fetch_job(None, worker_id)
                fetched = time.perf_counter()
                if job is None:
                    break
                await manager.finish_job(job, jobs.Status.SUCCEEDED, delete_job=False)
                fetches.append(fetched - start)
                finishes.append(time.perf_counter() - fetched)
            return statistics.median(fetches) * 1000, statistics.median(finishes) * 1000

    for label, matched in (("defaults", False), ("matched", True)):
        with _empty_database(admin_url) as url:
            fetch, finish = asyncio.run(one_worker(url, matched))
        result[f"Procrastinate {label} fetch"] = fetch
        result[f"Procrastinate {label} finish"] = finish
    return result


def stats_per_stage(admin_url: str, n: int = 500) -> dict[str, float]:
    """Median milliseconds per stage for one stats worker alone (no-op accounts), and
    the server's own time in each stage's function (`track_functions`), which the rest
    of a stage's time (commit, round trip, client) comes on top of.

    Not part of `run`; it explains the four-worker ratios:
    `python -c "from bench import queues; print(queues.stats_per_stage(URL))"`.
    """
    result: dict[str, float] = {}
    with scratch_database(admin_url) as url:
        with connect(url) as conn:
            execute(conn, "UPDATE stats_projection_worker_settings SET active_lease_cap = 4")
            for _ in range(n):
                execute(
                    conn, "SELECT request_stats_refresh(%s, NULL, '{}', 'bench')", (uuid.uuid4(),)
                )
            as_autovacuum(conn)
            execute(conn, "SET track_functions = 'pl'")
            times: dict[str, list[float]] = {"claim": [], "compute": [], "publish": []}
            while True:
                start = time.perf_counter()
                claimed = stats.claim(conn, "bench")
                if claimed is None:
                    break
                computing = time.perf_counter()
                stats.compute(conn, claimed)
                publishing = time.perf_counter()
                stats.publish(conn, claimed)
                times["claim"].append(computing - start)
                times["compute"].append(publishing - computing)
                times["publish"].append(time.perf_counter() - publishing)
            execute(conn, "SELECT pg_stat_force_next_flush()")
        for stage, values in times.items():
            result[f"stats {stage}"] = statistics.median(values) * 1000
        time.sleep(1.0)  # the flushed function statistics become visible
        with connect(url) as conn:
            for row in fetch_all(
                conn,
                "SELECT funcname, total_time / calls AS ms FROM pg_stat_user_functions"
                " WHERE funcname LIKE 'stats\\_%%\\_stage'",
            ):
                result[f"server {row['funcname']}"] = float(row["ms"])
    return result
