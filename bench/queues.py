"""Queue mechanics: claim -> acknowledge cycles with no-op work, four concurrent
workers, for the profile outbox and the stats queue, against Procrastinate's
fetch -> finish on the same PostgreSQL server in the same run.

Our cycles keep the stricter token-fenced acknowledgement: a profile cycle is the claim
statement plus the one completion statement (lease token, unexpired lease, GREATEST
acknowledgement); a stats cycle is the three committed stages (claim, compute, publish)
of an account with nothing to compute.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable

from bench.common import Figure, Mode, scratch_database
from inventory_pipeline.db import Connection, connect, execute
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


def profile_cycles(admin_url: str, n: int) -> tuple[int, float]:
    policy = RefreshPolicy()
    with scratch_database(admin_url) as url:
        with connect(url) as conn:
            for statement in LIBRARIES.replace("%(n)s", str(int(n))).strip().split(";\n"):
                if statement.strip():
                    execute(conn, statement)
            execute(conn, "ANALYZE")  # as autovacuum would after a bulk load (both sides)

        def work(conn: Connection) -> int:
            done = 0
            while batch := profiles.claim(conn, policy, limit=1).claims:
                for claim in batch:  # no-op work: complete and acknowledge at once
                    row = profiles_repo.complete_claim(
                        conn, claim, claim.inventory_revision or 0, 0, None
                    )
                    done += row is not None
            return done

        return _threads(url, work)


def stats_cycles(admin_url: str, n: int) -> tuple[int, float]:
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

        def work(conn: Connection) -> int:
            done = 0
            while (claimed := stats.claim(conn, "bench")) is not None:
                stats.compute(conn, claimed)
                done += stats.publish(conn, claimed).status == "published"
            return done

        return _threads(url, work)


def procrastinate_cycles(admin_url: str, n: int) -> tuple[int, float]:
    import procrastinate
    from procrastinate import jobs

    name = f"inventory_bench_procrastinate_{uuid.uuid4().hex[:8]}"
    with connect(admin_url) as admin:
        create_database(admin, name)
    url = url_with_database(admin_url, name)

    async def run() -> tuple[int, float]:
        app = procrastinate.App(
            connector=procrastinate.PsycopgConnector(
                conninfo=url, min_size=WORKERS, max_size=WORKERS
            )
        )
        await app.open_async()
        try:
            await app.schema_manager.apply_schema_async()
            manager = app.job_manager
            await manager.batch_defer_jobs_async(
                [
                    jobs.Job(queue="bench", lock=None, queueing_lock=None, task_name="noop")
                    for _ in range(n)
                ]
            )

            async def worker() -> int:
                worker_id = await manager.register_worker()
                done = 0
                while (job := await manager.fetch_job(None, worker_id)) is not None:
                    await manager.finish_job(job, jobs.Status.SUCCEEDED, delete_job=False)
                    done += 1
                return done

            start = time.perf_counter()
            counts = await asyncio.gather(*(worker() for _ in range(WORKERS)))
            return sum(counts), time.perf_counter() - start
        finally:
            await app.close_async()

    try:
        return asyncio.run(run())
    finally:
        with connect(admin_url) as admin:
            drop_database(admin, name)


def run(admin_url: str, mode: Mode) -> list[Figure]:
    smoke = mode.smoke
    n = 100 if smoke else 2000
    try:
        peer_done, peer_seconds = procrastinate_cycles(admin_url, n)
    except ImportError:
        return [
            Figure("queue mechanics", 0, "", "skipped: pip install -e '.[bench]' for Procrastinate")
        ]
    peer = peer_done / peer_seconds
    figures = [
        Figure(
            f"Procrastinate fetch -> finish ({WORKERS} workers, {n} jobs)", peer, " jobs/s", "peer"
        )
    ]
    for label, measure in (
        ("profile outbox claim -> acknowledge", profile_cycles),
        ("stats queue claim -> compute -> publish", stats_cycles),
    ):
        done, seconds = measure(admin_url, n)
        rate = done / seconds
        figures.append(
            Figure(
                f"{label} ({WORKERS} workers, {done} cycles)",
                rate / peer,
                "x",
                f"goal >= 1.0x Procrastinate; {rate:.0f} cycles/s",
                None if smoke else rate >= peer,
            )
        )
    return figures
