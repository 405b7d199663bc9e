"""An independent oracle for training stats: the expected per-exercise stats, period
stats and today's PR overview of every user, computed in plain Python from the raw
canonical rows the workload wrote (sessions, sets, manual PR records), without the
product's queries, its Epley function or its snapshot builder.

It restates the stats contract:
- per user and exercise with any set: sessions holding it (warm-up sets count),
  first and last session date (warm-ups count); over working sets (not warm-ups) their
  number, reps, volume (weight x reps), heaviest weight and best estimated 1RM;
- per user and period (day, ISO week from Monday, month, quarter, year) holding any
  session (a session without sets counts): sessions, and over working sets their
  number, reps and volume;
- the PR overview as of the database date: per exercise with a working set or a manual
  PR record on or before it, the best estimate of all time, of the 30 days ending on
  it, of the same 30 days a year earlier, and the heaviest weight;
- the estimate (Epley): the weight itself for one rep, weight x (30 + reps) / 30 for
  2-12 reps rounded half away from zero to 0.01 kg, none above twelve.
Everything is exact decimal arithmetic, so the comparison is exact.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any
from uuid import UUID

from inventory_pipeline.db import Connection, DatabaseError, fetch_all, fetch_one, snapshot

CENT = Decimal("0.01")
WINDOW_DAYS = 30
PERIODS = ("day", "week", "month", "quarter", "year")

# Raw canonical rows only: no projection, no product function.
RAW_SETS = (
    "SELECT s.user_id, s.id AS session_id, s.session_date, t.exercise_id, t.weight_kg,"
    " t.reps, t.warmup FROM training_sessions s JOIN training_sets t ON t.session_id = s.id"
)
RAW_SESSIONS = "SELECT user_id, id, session_date FROM training_sessions"
RAW_MANUAL = "SELECT user_id, exercise_id, weight_kg, reps, recorded_on FROM user_manual_pr_records"
# Every user the product knows or the workload wrote for: a user whose sessions were all
# deleted must still be compared (nothing may be left of them).
USERS = (
    "SELECT user_id FROM user_stats_refresh_state UNION SELECT user_id FROM training_sessions"
    " UNION SELECT user_id FROM user_exercise_stats"
    " UNION SELECT user_id FROM user_training_period_stats"
)


def estimate(weight: Decimal, reps: int) -> Decimal | None:
    """Epley, exactly: 101.25 kg x 7 is 124.875, so 124.88."""
    if reps == 1:
        return weight
    if 2 <= reps <= 12:
        return (weight * (30 + reps) / 30).quantize(CENT, rounding=ROUND_HALF_UP)
    return None


def year_before(day: date) -> date:
    """`day - interval '1 year'`: 29 February goes to 28 February."""
    try:
        return day.replace(year=day.year - 1)
    except ValueError:
        return day.replace(year=day.year - 1, day=28)


def period_start(period: str, day: date) -> date:
    if period == "day":
        return day
    if period == "week":
        return day - timedelta(days=day.weekday())
    if period == "month":
        return day.replace(day=1)
    if period == "quarter":
        return day.replace(month=3 * ((day.month - 1) // 3) + 1, day=1)
    return day.replace(month=1, day=1)


def _best(values: list[Decimal | None]) -> Decimal | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


@dataclass(frozen=True)
class Expected:
    exercises: dict[tuple[UUID, str], dict[str, Any]]
    periods: dict[tuple[UUID, str, date], dict[str, Any]]
    overview: dict[UUID, dict[str, dict[str, Any]]]  # user -> exercise -> values


def expected(
    sets: list[dict[str, Any]],
    sessions: list[dict[str, Any]],
    manual: list[dict[str, Any]],
    today: date,
) -> Expected:
    """The contract applied to raw rows."""
    by_exercise: dict[tuple[UUID, str], list[dict[str, Any]]] = defaultdict(list)
    for row in sets:
        by_exercise[(row["user_id"], row["exercise_id"])].append(row)
    exercises = {}
    for key, rows in by_exercise.items():
        working = [r for r in rows if not r["warmup"]]
        exercises[key] = {
            "sessions": len({r["session_id"] for r in rows}),
            "working_sets": len(working),
            "reps": sum(r["reps"] for r in working),
            "volume": sum((Decimal(r["weight_kg"]) * r["reps"] for r in working), Decimal(0)),
            "heaviest_kg": _best([Decimal(r["weight_kg"]) for r in working]),
            "best_e1rm_kg": _best([estimate(Decimal(r["weight_kg"]), r["reps"]) for r in working]),
            "first_date": min(r["session_date"] for r in rows),
            "last_date": max(r["session_date"] for r in rows),
        }
    sets_of: dict[UUID, list[dict[str, Any]]] = defaultdict(list)
    for row in sets:
        sets_of[row["session_id"]].append(row)
    periods: dict[tuple[UUID, str, date], dict[str, Any]] = {}
    for session in sessions:
        working = [r for r in sets_of.get(session["id"], []) if not r["warmup"]]
        for period in PERIODS:
            start = period_start(period, session["session_date"])
            totals = periods.setdefault(
                (session["user_id"], period, start),
                {"sessions": 0, "working_sets": 0, "reps": 0, "volume": Decimal(0)},
            )
            totals["sessions"] += 1
            totals["working_sets"] += len(working)
            totals["reps"] += sum(r["reps"] for r in working)
            totals["volume"] += sum(
                (Decimal(r["weight_kg"]) * r["reps"] for r in working), Decimal(0)
            )
    facts: dict[UUID, list[tuple[str, date, Decimal, int]]] = defaultdict(list)
    for row in sets:
        if not row["warmup"]:
            facts[row["user_id"]].append(
                (row["exercise_id"], row["session_date"], Decimal(row["weight_kg"]), row["reps"])
            )
    for row in manual:
        facts[row["user_id"]].append(
            (row["exercise_id"], row["recorded_on"], Decimal(row["weight_kg"]), row["reps"])
        )
    prior = year_before(today)
    overview: dict[UUID, dict[str, dict[str, Any]]] = {}
    for user, lifted_by_user in facts.items():
        lifts: dict[str, list[tuple[date, Decimal, Decimal | None]]] = defaultdict(list)
        for exercise_id, day, weight, reps in lifted_by_user:
            if day <= today:
                lifts[exercise_id].append((day, weight, estimate(weight, reps)))
        overview[user] = {
            exercise_id: {
                "best_e1rm_all_time": _best([e for _, _, e in lifted]),
                "best_e1rm_30d": _best(
                    [e for d, _, e in lifted if d > today - timedelta(days=WINDOW_DAYS)]
                ),
                "best_e1rm_30d_prior_year": _best(
                    [e for d, _, e in lifted if prior - timedelta(days=WINDOW_DAYS) < d <= prior]
                ),
                "heaviest_kg": max(w for _, w, _ in lifted),
            }
            for exercise_id, lifted in lifts.items()
        }
    return Expected(exercises, periods, overview)


def _differences(
    what: str, expected: dict[Any, dict[str, Any]], stored: dict[Any, dict[str, Any]]
) -> list[str]:
    out = []
    for key in sorted(set(expected) | set(stored), key=str):
        name = "/".join(str(k) for k in (key if isinstance(key, tuple) else (key,)))
        if key not in stored:
            out.append(f"{what} {name} missing")
        elif key not in expected:
            out.append(f"{what} {name} unexpected")
        else:
            out += [
                f"{what} {name}: {field} expected {value}, stored {stored[key][field]}"
                for field, value in expected[key].items()
                if stored[key][field] != value
            ]
    return out


def check(conn: Connection) -> list[str]:
    """Every user's stored projections and today's PR overview (read through the
    fail-closed reader) against the oracle, one line per user that differs."""
    today_row = fetch_one(conn, "SELECT stats_clock_date() AS today")
    assert today_row is not None
    want = expected(
        fetch_all(conn, RAW_SETS),
        fetch_all(conn, RAW_SESSIONS),
        fetch_all(conn, RAW_MANUAL),
        today_row["today"],
    )
    users = sorted(r["user_id"] for r in fetch_all(conn, USERS))
    stored_exercises = {
        (r["user_id"], r["exercise_id"]): r
        for r in fetch_all(conn, "SELECT * FROM user_exercise_stats")
    }
    stored_periods = {
        (r["user_id"], r["period"], r["period_start"]): r
        for r in fetch_all(conn, "SELECT * FROM user_training_period_stats")
    }
    out: list[str] = []
    for user in users:
        found = _differences(
            "exercise",
            {k[1]: v for k, v in want.exercises.items() if k[0] == user},
            {k[1]: v for k, v in stored_exercises.items() if k[0] == user},
        )
        found += _differences(
            "period",
            {k[1:]: v for k, v in want.periods.items() if k[0] == user},
            {k[1:]: v for k, v in stored_periods.items() if k[0] == user},
        )
        if fetch_one(
            conn, "SELECT 1 AS known FROM user_stats_refresh_state WHERE user_id = %s", (user,)
        ):
            try:
                rows = fetch_all(
                    conn,
                    "SELECT * FROM get_pr_overview(%s, %s)",
                    (user, today_row["today"]),
                )
            except DatabaseError as exc:
                found.append(f"PR overview unreadable ({exc.sqlstate})")
            else:
                found += _differences(
                    "PR overview",
                    want.overview.get(user, {}),
                    {r["exercise_id"]: r for r in rows},
                )
        if found:
            shown = "; ".join(found[:3]) + (f"; +{len(found) - 3} more" if len(found) > 3 else "")
            out.append(f"user {user}: stats oracle: {shown}")
    return out


def check_current(conn: Connection, rng: random.Random, sample: int = 3) -> list[str]:
    """Users the product calls current (not stale: their applied generation is the one
    requested and no range is owed) read what their facts say: a few of them, drawn at
    random, in one snapshot, their projections and today's PR overview against the
    oracle. A save left out of a published generation while the user reads as current
    (a later save merged into an older job) shows here."""
    out: list[str] = []
    with snapshot(conn):
        today = fetch_one(conn, "SELECT stats_clock_date() AS today")
        assert today is not None
        current = [
            r["user_id"]
            for r in fetch_all(
                conn,
                "SELECT user_id FROM user_stats_refresh_state"
                " WHERE applied_version > 0 AND NOT stats_user_is_stale(user_id)"
                " ORDER BY user_id",
            )
        ]
        for user in rng.sample(current, min(sample, len(current))):
            mine = {"u": user}
            want = expected(
                fetch_all(conn, RAW_SETS + " WHERE s.user_id = %(u)s", mine),
                fetch_all(conn, RAW_SESSIONS + " WHERE user_id = %(u)s", mine),
                fetch_all(conn, RAW_MANUAL + " WHERE user_id = %(u)s", mine),
                today["today"],
            )
            found = _differences(
                "exercise",
                {k[1]: v for k, v in want.exercises.items()},
                {
                    r["exercise_id"]: r
                    for r in fetch_all(
                        conn, "SELECT * FROM user_exercise_stats WHERE user_id = %(u)s", mine
                    )
                },
            )
            found += _differences(
                "period",
                {k[1:]: v for k, v in want.periods.items()},
                {
                    (r["period"], r["period_start"]): r
                    for r in fetch_all(
                        conn,
                        "SELECT * FROM user_training_period_stats WHERE user_id = %(u)s",
                        mine,
                    )
                },
            )
            if found:
                shown = "; ".join(found[:3]) + (
                    f"; +{len(found) - 3} more" if len(found) > 3 else ""
                )
                out.append(
                    f"user {user}: read as current, its published stats not its facts: {shown}"
                )
    return out
