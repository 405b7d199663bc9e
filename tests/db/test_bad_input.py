"""Bad input to the write surface and the settings: a clear error, and the
data exactly as it was (every table's content compared before and after)."""

from __future__ import annotations

import json
import uuid
from datetime import date
from typing import Any

import pytest

from inventory_pipeline.db import Connection, DatabaseError, execute, fetch_one
from tests import factories as f
from tests import stats_factories as sf

WATCHED = (
    "training_sessions",
    "training_sets",
    "stats_mutation_receipts",
    "user_exercise_stats_refresh_jobs",
    "user_stats_refresh_state",
    "user_manual_pr_records",
    "provider_settings",
    "credential_wakeups",
    "stats_projection_worker_settings",
    "libraries",
    "media_server_items",
    "library_inventory_state",
)


def fingerprint(conn: Connection) -> dict[str, str]:
    """A digest of every watched table's rows."""
    out = {}
    for table in WATCHED:
        # Table names come from the fixed tuple above, never from input.
        digest = "md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), ''))"
        row = fetch_one(conn, f"SELECT {digest} AS d FROM {table} t")
        assert row is not None
        out[table] = row["d"]
    return out


USER = uuid.UUID("00000000-0000-4000-8000-000000000001")
OTHER = uuid.UUID("00000000-0000-4000-8000-000000000002")


def session(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "user_id": str(USER),
        "session_date": "2026-03-01",
        "sets": sf.sets(("squat", 100, 5)),
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


@pytest.fixture
def seeded(conn: Connection) -> Connection:
    sf.exercise(conn, "squat")
    sf.exercise(conn, "own_lift", owner=OTHER)
    sf.save(conn, USER, date(2026, 2, 1), sf.sets(("squat", 80, 5)))
    lib = f.library(conn)
    f.items(conn, lib, 3)
    return conn


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (session(session_date=None), "session_date is required"),
        (session(session_date="2026-02-30"), "session_date must be a date"),
        (session(session_date="someday"), "session_date must be a date"),
        (session(session_date="infinity"), "session_date must be between"),
        (session(id="not-a-uuid"), "must be UUIDs"),
        (session(user_id=str(OTHER)), "owner"),
        (session(sets={"exercise_id": "squat"}), "sets must be an array"),
        (
            session(sets=[{"exercise_id": "squat", "weight_kg": -1, "reps": 5}]),
            "weight_kg must be a number from 0",
        ),
        (
            session(sets=[{"exercise_id": "squat", "weight_kg": 10, "reps": 5000}]),
            "reps must be a whole number",
        ),
        (
            session(sets=[{"exercise_id": "squat", "weight_kg": "heavy", "reps": 5}]),
            "weight_kg must be a number",
        ),
        (
            session(sets=[{"exercise_id": "nope", "weight_kg": 10, "reps": 5}]),
            "exercise_id must name a known",
        ),
        (session(sets=[{"weight_kg": 10, "reps": 5}]), "exercise_id must name a known"),
        (session(sets=[{"exercise_id": "own_lift", "weight_kg": 1, "reps": 1}]), "another user"),
    ],
    ids=[
        "no-date",
        "impossible-date",
        "word-date",
        "infinite-date",
        "bad-id",
        "other-owner",
        "sets-object",
        "negative-weight",
        "too-many-reps",
        "text-weight",
        "unknown-exercise",
        "no-exercise",
        "foreign-personal-exercise",
    ],
)
def test_bad_session_writes_change_nothing(
    seeded: Connection, payload: dict[str, Any], message: str
) -> None:
    before = fingerprint(seeded)
    with pytest.raises(DatabaseError, match=message):
        execute(seeded, "SELECT save_training_session(%s, %s)", (USER, json.dumps(payload)))
    assert fingerprint(seeded) == before


@pytest.mark.parametrize(
    ("statement", "params", "message"),
    [
        ("SELECT save_manual_pr(%s, 'squat', 0, 5, '2026-03-01')", (USER,), "weight_kg must be"),
        ("SELECT save_manual_pr(%s, 'squat', 100, 0, '2026-03-01')", (USER,), "reps must be"),
        ("SELECT save_manual_pr(%s, 'nope', 100, 5, '2026-03-01')", (USER,), "exercise_id must"),
        ("SELECT save_manual_pr(%s, 'squat', 100, 5, 'infinity')", (USER,), "recorded_on must"),
        ("SELECT save_manual_pr(NULL, 'squat', 100, 5, '2026-03-01')", (), "owner"),
        ("SELECT delete_manual_pr(%s, 999999)", (USER,), "no such manual PR"),
        ("SELECT delete_training_session(%s, gen_random_uuid())", (USER,), "session"),
        ("SELECT request_stats_refresh(NULL, NULL, '{}', 'x')", (), "owner"),
        (
            "UPDATE provider_settings SET active = true, api_key = NULL",
            (),
            "provider_settings_active_needs_key",
        ),
        (
            "UPDATE stats_projection_worker_settings SET lease_seconds = 1",
            (),
            "lease_covers_work",
        ),
        ("UPDATE stats_projection_worker_settings SET max_attempts = 0", (), "check constraint"),
        ("UPDATE libraries SET media_kind = 'vinyl'", (), "check constraint"),
        ("UPDATE libraries SET server_id = 999999", (), "foreign key"),
    ],
    ids=[
        "pr-zero-weight",
        "pr-zero-reps",
        "pr-unknown-exercise",
        "pr-infinite-date",
        "pr-no-owner",
        "pr-missing",
        "session-missing",
        "refresh-no-owner",
        "active-without-key",
        "lease-below-budgets",
        "no-attempts",
        "unknown-media-kind",
        "unknown-server",
    ],
)
def test_bad_writes_and_settings_change_nothing(
    seeded: Connection, statement: str, params: tuple[Any, ...], message: str
) -> None:
    before = fingerprint(seeded)
    with pytest.raises(DatabaseError, match=message):
        execute(seeded, statement, params)
    assert fingerprint(seeded) == before
