"""The peer of bench/peer.py: the same training stats built the way a team without our
design would, on Procrastinate.

A save writes the canonical rows (training_sessions, training_sets) and defers
`recompute_user_stats(user_id)` in the same transaction (Procrastinate's `connection=`
deferral), with `queueing_lock` and `lock` the user id: a save finding the user's job
still waiting (`AlreadyEnqueued`) is covered by it, and no two runs of one user overlap.
Each task run recomputes the user's whole projections and PR window in one transaction
with our worker's own statements (inventory_pipeline/stats/queries.sql: compute_exercises,
compute_periods, drop_older_snapshots, build_pr_snapshot) writing straight into the public
tables, since the peer has no private outputs, leases or generations of ours. It runs in
a scratch database of its own, so it writes the same table names as our side.

Publication is measured by the task itself: its first statement reads the newest session
of the user it sees (READ COMMITTED: every later statement sees at least that), its last
records that bound with `clock_timestamp()` in `peer_stats_publications`, just before
the commit. A user's saves are 10 s or more apart, so a session created at or before the
bound was in the recompute.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast
from uuid import UUID

import procrastinate
import psycopg
from procrastinate import exceptions, jobs
from psycopg.rows import dict_row

from inventory_pipeline.db import Connection

TASK = "recompute_user_stats"

# The peer's own bookkeeping: one row per committed recompute.
SCHEMA = """
CREATE SEQUENCE peer_stats_generation;
CREATE TABLE peer_stats_publications (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id uuid NOT NULL,
    generation bigint NOT NULL,
    covered_through timestamptz,
    published_at timestamptz NOT NULL
);
CREATE INDEX peer_stats_publications_user ON peer_stats_publications (user_id, covered_through);
"""

# One task run, in this order, in one transaction.
RECOMPUTE: tuple[str, ...] = (
    # The newest session this transaction sees, and the generation label of its rows.
    """
    SELECT nextval('peer_stats_generation') AS generation,
           (SELECT max(created_at) FROM training_sessions WHERE user_id = %(user_id)s)
               AS covered
    """,
    "DELETE FROM user_exercise_stats WHERE user_id = %(user_id)s",
    # compute_exercises, every exercise of the user.
    """
    INSERT INTO user_exercise_stats
        (user_id, exercise_id, sessions, working_sets, reps, volume, heaviest_kg,
         best_e1rm_kg, first_date, last_date, generation)
    SELECT %(user_id)s, ts.exercise_id,
           count(DISTINCT s.id),
           count(*) FILTER (WHERE NOT ts.warmup),
           coalesce(sum(ts.reps) FILTER (WHERE NOT ts.warmup), 0),
           coalesce(sum(ts.weight_kg * ts.reps) FILTER (WHERE NOT ts.warmup), 0),
           max(ts.weight_kg) FILTER (WHERE NOT ts.warmup),
           max(estimated_one_rep_max(ts.weight_kg, ts.reps)) FILTER (WHERE NOT ts.warmup),
           min(s.session_date),
           max(s.session_date),
           %(generation)s
    FROM training_sessions s
    JOIN training_sets ts ON ts.session_id = s.id
    WHERE s.user_id = %(user_id)s
    GROUP BY ts.exercise_id
    """,
    "DELETE FROM user_training_period_stats WHERE user_id = %(user_id)s",
    # compute_periods over the whole history.
    """
    INSERT INTO user_training_period_stats
        (user_id, period, period_start, sessions, working_sets, reps, volume, generation)
    SELECT %(user_id)s, p.period, date_trunc(p.period, s.session_date)::date,
           count(DISTINCT s.id),
           count(ts.id) FILTER (WHERE ts.warmup IS FALSE),
           coalesce(sum(ts.reps) FILTER (WHERE ts.warmup IS FALSE), 0),
           coalesce(sum(ts.weight_kg * ts.reps) FILTER (WHERE ts.warmup IS FALSE), 0),
           %(generation)s
    FROM training_sessions s
    LEFT JOIN training_sets ts ON ts.session_id = s.id
    CROSS JOIN (VALUES ('day'), ('week'), ('month'), ('quarter'), ('year')) AS p (period)
    WHERE s.user_id = %(user_id)s
    GROUP BY 2, 3
    """,
    # drop_older_snapshots
    """
    DELETE FROM user_pr_overview_snapshot_headers
    WHERE user_id = %(user_id)s AND generation <= %(generation)s
    """,
    # build_pr_snapshot
    """
    WITH days AS (
        SELECT (stats_clock_date() + d)::date AS as_of FROM generate_series(-1, 1) AS d
    ),
    facts AS (
        SELECT ts.exercise_id, s.session_date AS day, ts.weight_kg,
               estimated_one_rep_max(ts.weight_kg, ts.reps) AS e1rm
        FROM training_sessions s
        JOIN training_sets ts ON ts.session_id = s.id
        WHERE s.user_id = %(user_id)s AND NOT ts.warmup
        UNION ALL
        SELECT exercise_id, recorded_on, weight_kg, estimated_one_rep_max(weight_kg, reps)
        FROM user_manual_pr_records
        WHERE user_id = %(user_id)s
    ),
    headers AS (
        INSERT INTO user_pr_overview_snapshot_headers
            (user_id, generation, as_of_date, catalog_epoch, exercise_count)
        SELECT %(user_id)s, %(generation)s, days.as_of,
               (SELECT catalog_epoch FROM pr_overview_projection_control WHERE id = 1),
               (SELECT count(DISTINCT f.exercise_id) FROM facts f WHERE f.day <= days.as_of)
        FROM days
        RETURNING as_of_date
    )
    INSERT INTO user_pr_exercise_summary_snapshots
        (user_id, generation, as_of_date, exercise_id, best_e1rm_all_time, best_e1rm_30d,
         best_e1rm_30d_prior_year, heaviest_kg)
    SELECT %(user_id)s, %(generation)s, h.as_of_date, f.exercise_id,
           max(f.e1rm),
           max(f.e1rm) FILTER (WHERE f.day > h.as_of_date - 30),
           max(f.e1rm) FILTER (
               WHERE f.day > (h.as_of_date - interval '1 year')::date - 30
                 AND f.day <= (h.as_of_date - interval '1 year')::date),
           max(f.weight_kg)
    FROM headers h
    JOIN facts f ON f.day <= h.as_of_date
    GROUP BY h.as_of_date, f.exercise_id
    """,
    # The publication's record, the transaction's last statement.
    """
    INSERT INTO peer_stats_publications (user_id, generation, covered_through, published_at)
    VALUES (%(user_id)s, %(generation)s, %(covered)s, clock_timestamp())
    """,
)

SAVE_SESSION = """
INSERT INTO training_sessions (id, user_id, session_date) VALUES (%s, %s, %s)
"""
SAVE_SETS = """
INSERT INTO training_sets (session_id, position, exercise_id, weight_kg, reps, warmup)
SELECT %s, s.position, s.exercise_id, s.weight_kg, s.reps, s.warmup
FROM unnest(%s::text[], %s::numeric[], %s::integer[], %s::boolean[])
     WITH ORDINALITY AS s (exercise_id, weight_kg, reps, warmup, position)
"""


async def recompute(conn: psycopg.AsyncConnection[Any], user_id: UUID) -> None:
    """One user's projections and PR window, whole, in one transaction."""
    async with conn.transaction():
        cursor = conn.cursor(row_factory=dict_row)
        await cursor.execute(RECOMPUTE[0], {"user_id": user_id})
        row = await cursor.fetchone()
        assert row is not None
        params = {"user_id": user_id, "generation": row["generation"], "covered": row["covered"]}
        for statement in RECOMPUTE[1:]:
            await cursor.execute(statement, params)


async def _recompute_user_stats(context: procrastinate.JobContext, user_id: str) -> None:
    """The task: a connection from the app's pool for the recompute's transaction."""
    connector = cast(procrastinate.PsycopgConnector, context.app.connector)
    async with connector.pool.connection() as conn:
        await recompute(conn, UUID(user_id))


def app(url: str) -> procrastinate.App:
    """A Procrastinate app on `url` with the task registered (each worker and each group
    of writers makes its own)."""
    made = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))
    made.task(name=TASK, pass_context=True)(_recompute_user_stats)
    return made


def install(url: str, conn: Connection) -> None:
    """Procrastinate's schema, applied by its own schema manager, and the peer's table."""
    made = app(url)
    with made.open():
        made.schema_manager.apply_schema()
    for statement in SCHEMA.split(";\n"):
        if statement.strip():
            conn.execute(statement)


def save(
    conn: Connection,
    made: procrastinate.App,
    user_id: UUID,
    session_id: UUID,
    day: Any,
    sets: Sequence[tuple[str, float, int, bool]],
) -> bool:
    """One session saved and its recompute deferred in the same transaction; False when
    the user's job was still waiting (`AlreadyEnqueued`: the save is covered by it). The
    deferral runs in a savepoint, since its unique violation would abort the save."""
    task = made.tasks[TASK]
    with conn.transaction():
        conn.execute(SAVE_SESSION, (session_id, user_id, day))
        conn.execute(
            SAVE_SETS,
            (
                session_id,
                [s[0] for s in sets],
                [s[1] for s in sets],
                [s[2] for s in sets],
                [s[3] for s in sets],
            ),
        )
        try:
            with conn.transaction():
                task.configure(
                    lock=str(user_id), queueing_lock=str(user_id), connection=conn
                ).defer(user_id=str(user_id))
        except exceptions.AlreadyEnqueued:
            return False
    return True


def defer_everyone(
    conn: Connection, made: procrastinate.App, users: Iterable[UUID], chunk: int = 1000
) -> int:
    """A rebuild: one job per user, `chunk` jobs a statement; returns the jobs deferred."""
    pending = [
        jobs.Job(
            queue="default",
            lock=str(u),
            queueing_lock=str(u),
            task_name=TASK,
            task_kwargs={"user_id": str(u)},
        )
        for u in users
    ]
    for start in range(0, len(pending), chunk):
        made.job_manager.batch_defer_jobs(pending[start : start + chunk], connection=conn)
    return len(pending)
