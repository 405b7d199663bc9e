"""The seed's incident account through the stats worker: 658 sessions, 296 exercises.

Compute and publish times are the worker's own (user_stats_projection_runs), measured
against the seed's production figures for the same account (compute 43,853 ms, publish
1,985 ms) and the issue's goals (compute <= 2 s, publish <= 0.5 s on this machine).
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from datetime import date, timedelta

from bench.common import Figure, scratch_database
from inventory_pipeline.db import connect, execute, fetch_one, jsonb
from inventory_pipeline.stats import processors

SEED_COMPUTE_MS = 43_853.488
SEED_PUBLISH_MS = 1_984.670


def load_account(url: str, user: uuid.UUID, sessions: int, exercises: int) -> None:
    rng = random.Random(658)
    with connect(url) as conn:
        ids = [f"ex_{n:03d}" for n in range(exercises)]
        execute(
            conn,
            "INSERT INTO exercises (id, name) SELECT x, x FROM unnest(%s::text[]) AS x",
            (ids,),
        )
        cursor = 0
        for n in range(sessions):
            count = rng.randint(3, 6)
            chosen = [ids[(cursor + k) % exercises] for k in range(count)]
            cursor += count
            sets = [
                {
                    "exercise_id": e,
                    "weight_kg": rng.randint(20, 200),
                    "reps": rng.randint(1, 15),
                    "warmup": k == 0,
                }
                for e in chosen
                for k in range(4)
            ]
            payload = {
                "user_id": str(user),
                "session_date": str(date(2024, 1, 1) + timedelta(days=n)),
                "sets": sets,
            }
            execute(conn, "SELECT save_training_session(%s, %s)", (user, jsonb(payload)))


REBUILD_USERS = """
INSERT INTO exercises (id, name) SELECT 'lift_' || g, 'Lift ' || g FROM generate_series(1, 8) g;
INSERT INTO training_sessions (id, user_id, session_date)
SELECT md5(u::text || '-' || s)::uuid, md5(u::text)::uuid, date '2025-01-01' + s * 3
FROM generate_series(1, %(users)s) u, generate_series(1, 6) s;
INSERT INTO training_sets (session_id, position, exercise_id, weight_kg, reps, warmup)
SELECT t.id, p, 'lift_' || (1 + (p + s_hash) %% 8), 40 + p * 5, 3 + p, p = 1
FROM (SELECT id, abs(hashtext(id::text)) AS s_hash FROM training_sessions) t,
     generate_series(1, 5) p;
"""


def rebuild(admin_url: str, users: int, workers: int) -> float:
    """Users per second through request_rebuild -> the worker with `workers` threads."""
    with scratch_database(admin_url) as url:
        with connect(url) as conn:
            for statement in REBUILD_USERS.replace("%(users)s", str(int(users))).split(";\n"):
                if statement.strip():
                    execute(conn, statement.replace("%%", "%"))
            execute(
                conn,
                "UPDATE stats_projection_worker_settings SET active_lease_cap = %s",
                (workers,),
            )
            processors.request_rebuild(conn, None)
            execute(conn, "ANALYZE")
        done: list[int] = []
        lock = threading.Lock()

        def worker(n: int) -> None:
            with connect(url) as c:
                summary = processors.drain(c, f"bench-{n}", max_rounds=10**6)
                with lock:
                    done.append(len(summary.published))

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(workers)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
    assert sum(done) == users, (sum(done), users)
    return users / elapsed


def run(admin_url: str, smoke: bool) -> list[Figure]:
    figures = incident(admin_url, smoke)
    users = 50 if smoke else 1000
    one = rebuild(admin_url, users, 1)
    two = rebuild(admin_url, users, 2)
    figures.append(
        Figure(
            f"stats rebuild of {users} users (6 sessions, 30 sets each), 2 workers",
            two,
            " users/s",
            f"{two / one:.2f}x one worker ({one:.0f} users/s) on 2 cores",
        )
    )
    return figures


def incident(admin_url: str, smoke: bool) -> list[Figure]:
    sessions, exercises = (60, 120) if smoke else (658, 296)
    user = uuid.uuid4()
    with scratch_database(admin_url) as url:
        load_account(url, user, sessions, exercises)
        with connect(url) as conn:
            summary = processors.drain(conn, "bench")
            row = fetch_one(
                conn,
                "SELECT compute_ms, publish_ms FROM user_stats_projection_runs"
                " WHERE phase = 'published' ORDER BY id DESC LIMIT 1",
            )
    assert row is not None and summary.published
    compute_ms, publish_ms = float(row["compute_ms"]), float(row["publish_ms"])
    batches = summary.published[0][2]
    label = f"{sessions} sessions, {exercises} exercises, {batches} compute calls"
    return [
        Figure(
            f"stats incident account compute ({label})",
            compute_ms,
            " ms",
            f"goal <= 2000 ms; {SEED_COMPUTE_MS / compute_ms:.0f}x faster than the seed's"
            " 43,853 ms",
            None if smoke else compute_ms <= 2000,
        ),
        Figure(
            "stats incident account publish",
            publish_ms,
            " ms",
            f"goal <= 500 ms; {SEED_PUBLISH_MS / publish_ms:.0f}x faster than the seed's 1,985 ms",
            None if smoke else publish_ms <= 500,
        ),
    ]
