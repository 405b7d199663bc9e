"""Stats test data, written through the SQL write surface like any application."""

from __future__ import annotations

import random
import uuid
from datetime import date, timedelta
from typing import Any

from inventory_pipeline.db import Connection, execute, fetch_all, fetch_one, jsonb


def exercise(conn: Connection, exercise_id: str, owner: uuid.UUID | None = None) -> str:
    execute(
        conn,
        "INSERT INTO exercises (id, owner_user_id, name) VALUES (%s, %s, %s)"
        " ON CONFLICT DO NOTHING",
        (exercise_id, owner, exercise_id.replace("_", " ").title()),
    )
    return exercise_id


def sets(*spec: tuple[str, float, int] | tuple[str, float, int, bool]) -> list[dict[str, Any]]:
    out = []
    for s in spec:
        out.append(
            {
                "exercise_id": s[0],
                "weight_kg": s[1],
                "reps": s[2],
                "warmup": s[3] if len(s) > 3 else False,
            }  # type: ignore[misc]
        )
    return out


def save(
    conn: Connection,
    user: uuid.UUID,
    day: date,
    session_sets: list[dict[str, Any]],
    session_id: uuid.UUID | None = None,
    expected: uuid.UUID | str | None = "same",
) -> dict[str, Any]:
    owner = user if expected == "same" else expected
    payload = {"user_id": str(user), "session_date": day.isoformat(), "sets": session_sets}
    if session_id is not None:
        payload["id"] = str(session_id)
    row = fetch_one(conn, "SELECT save_training_session(%s, %s) AS r", (owner, jsonb(payload)))
    assert row is not None
    return dict(row["r"])


def delete(conn: Connection, user: uuid.UUID, session_id: uuid.UUID | str) -> dict[str, Any]:
    row = fetch_one(conn, "SELECT delete_training_session(%s, %s) AS r", (user, session_id))
    assert row is not None
    return dict(row["r"])


def jobs(conn: Connection, user: uuid.UUID) -> list[dict[str, Any]]:
    return fetch_all(
        conn,
        "SELECT * FROM user_exercise_stats_refresh_jobs WHERE user_id = %s ORDER BY id",
        (user,),
    )


def versions(conn: Connection, user: uuid.UUID) -> tuple[int, int]:
    row = fetch_one(
        conn,
        "SELECT requested_version, applied_version FROM user_stats_refresh_state"
        " WHERE user_id = %s",
        (user,),
    )
    return (0, 0) if row is None else (row["requested_version"], row["applied_version"])


def exercise_stats(conn: Connection, user: uuid.UUID) -> dict[str, dict[str, Any]]:
    rows = fetch_all(conn, "SELECT * FROM user_exercise_stats WHERE user_id = %s", (user,))
    return {r["exercise_id"]: r for r in rows}


def history(
    conn: Connection,
    user: uuid.UUID,
    sessions: int,
    exercises: int,
    seed: int = 1,
    start: date = date(2024, 1, 1),
) -> list[str]:
    """A training history: `sessions` sessions spread over `exercises` exercises."""
    rng = random.Random(seed)
    ids = [exercise(conn, f"ex_{seed}_{n:03d}") for n in range(exercises)]
    cursor = 0
    for n in range(sessions):
        count = rng.randint(3, 6)
        chosen = [ids[(cursor + k) % exercises] for k in range(count)]
        cursor += count
        save(
            conn,
            user,
            start + timedelta(days=n),
            [
                {
                    "exercise_id": e,
                    "weight_kg": rng.randint(20, 200),
                    "reps": rng.randint(1, 15),
                    "warmup": k == 0,
                }
                for e in chosen
                for k in range(3)
            ],
        )
    return ids


def expire_run(conn: Connection, run_id: int, lease_token: uuid.UUID) -> None:
    """The lease runs out (a dead worker): only its own token may move lease_until."""
    set_run(conn, run_id, lease_token, "lease_until = now() - interval '1s'")


def set_run(conn: Connection, run_id: int, lease_token: uuid.UUID, assignments: str) -> None:
    """Update a leased run as its lease holder (the lease fence refuses anyone else)."""
    with conn.transaction():
        execute(
            conn,
            "SELECT set_config('inventory.stats_lease_token', %s, true)",
            (str(lease_token),),
        )
        execute(
            conn, f"UPDATE user_stats_projection_runs SET {assignments} WHERE id = %s", (run_id,)
        )


def hold_lease_slots(conn: Connection) -> None:
    """In the caller's transaction, lock every lease slot's row as a claim filling it
    would: a claim made meanwhile finds no slot it can take."""
    execute(conn, "SELECT slot FROM stats_lease_slots FOR UPDATE")
