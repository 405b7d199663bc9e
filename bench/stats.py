"""The seed's incident account through the stats worker: 658 sessions, 296 exercises.

Compute and publish times are the worker's own (user_stats_projection_runs), measured
against the seed's production figures for the same account (compute 43,853 ms, publish
1,985 ms) and the issue's goals (compute <= 2 s, publish <= 0.5 s on this machine).
"""

from __future__ import annotations

import random
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


def run(admin_url: str, smoke: bool) -> list[Figure]:
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
