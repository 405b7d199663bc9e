"""Freshness under the real Dagster daemon: commit -> acknowledged for inventory
changes, and save -> published for training sessions, while both keep arriving.

Inventory changes are committed once a second. Saves come at the steady load (one every
two seconds across USERS users) or, in the storm (`freshness_storm`), from STORM_USERS
users each saving every 10-30 s. A poller records when each change's revision is
acknowledged (or each save's generation applied). Percentiles are over all changes: a
change not acknowledged within the window (the writing period plus GRACE seconds) counts
as a failure with an infinite lag, never as a dropped sample, and is reported.
"""

from __future__ import annotations

import heapq
import math
import os
import random
import time
import uuid
from datetime import date
from typing import NamedTuple

from bench.common import Figure, Mode, over_runs, scratch_database
from bench.orchestration import BURST, ITEMS, daemon
from inventory_pipeline.db import Connection, connect, execute, fetch_all, fetch_one, jsonb

LIBRARIES = 50
USERS = 10
STORM_USERS = 1_000
STORM_GAP = (10.0, 30.0)  # seconds between one storm user's saves
GRACE = 120  # seconds after the last write for the last changes to be acknowledged


class RunLags(NamedTuple):
    """One run's lags in seconds (inf: never): each inventory change's, each save's, and
    that of the save before them, the first after idle."""

    inventory: list[float]
    stats: list[float]
    cold: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# Seconds of writes per run (INVENTORY_BENCH_FRESHNESS_SECONDS shortens the window so
# that the 5 runs fit a bench session; the published figures say which was used).
DURATION = int(os.environ.get("INVENTORY_BENCH_FRESHNESS_SECONDS", "90"))
STORM_DURATION = int(os.environ.get("INVENTORY_BENCH_STORM_SECONDS", "300"))
# Runs per figure (INVENTORY_BENCH_FRESHNESS_RUNS: fewer for a quick look).
RUNS = int(os.environ.get("INVENTORY_BENCH_FRESHNESS_RUNS", "5"))
# Goals, p50 and p95 in seconds: inventory is bounded by the sensor loop; a stats save
# is published by the drain the sensor keeps alive, without waiting for a tick.
INVENTORY_GOALS = {0.5: 7.0, 0.95: 20.0}
STATS_GOALS = {0.5: 1.5, 0.95: 3.0}
STORM_GOALS = {0.95: 5.0}


def run(admin_url: str, mode: Mode) -> list[Figure]:
    """The steady load: five runs (one under --smoke), each its own database and
    daemon."""
    duration = 12 if mode.smoke else DURATION
    return figures(admin_url, mode, duration, USERS, None, STATS_GOALS)


def run_storm(admin_url: str, mode: Mode) -> list[Figure]:
    """The storm: STORM_USERS users each saving every 10-30 s."""
    duration = 12 if mode.smoke else STORM_DURATION
    return figures(admin_url, mode, duration, STORM_USERS, STORM_GAP, STORM_GOALS)


def figures(
    admin_url: str,
    mode: Mode,
    duration: int,
    users: int,
    gap: tuple[float, float] | None,
    stats_goals: dict[float, float],
) -> list[Figure]:
    """p50 and p95 of each run, reported as the median with the min-max over the
    runs."""
    reps = mode.pick(smoke=1, default=RUNS)
    runs = [one_run(admin_url, duration, seed, users, gap) for seed in range(11, 11 + reps)]
    scope = f"over {reps} runs of {duration} s"
    out = lag_figures(
        "inventory commit -> acknowledged",
        [r.inventory for r in runs],
        INVENTORY_GOALS,
        scope,
        judged=not mode.smoke,
    ) + lag_figures(
        "stats save -> published",
        [r.stats for r in runs],
        stats_goals,
        scope,
        judged=not mode.smoke,
    )
    out.append(
        over_runs(
            "stats save -> published, the first save after idle (a sensor tick and a run start)",
            [r.cold for r in runs],
            " s",
            "for scale",
        )
    )
    return out


def lag_figures(
    label: str,
    per_run: list[list[float]],
    goals: dict[float, float],
    scope: str,
    judged: bool,
) -> list[Figure]:
    """p50 and p95 of each run's lags (the median over runs, with the min-max) against
    `goals`, and how many changes were never acknowledged: an unacknowledged change is an
    infinite lag in the percentiles and a failure, never a dropped sample."""
    count = sum(len(lags) for lags in per_run)
    failed = sum(1 for lags in per_run for lag in lags if math.isinf(lag))
    detail = f"{count} changes {scope}" if scope else f"{count} changes"
    out = []
    for q in (0.5, 0.95):
        goal = goals.get(q)
        values = [percentile(lags, q) for lags in per_run if lags]
        if not values:
            return [Figure(f"{label}: no changes written", 0, "", "", False)]
        out.append(
            over_runs(
                f"{label} p{round(q * 100)} ({detail})",
                values,
                " s",
                "for scale" if goal is None else f"goal <= {goal:g} s",
                None if goal is None or not judged else lambda v, goal=goal: v <= goal,  # type: ignore[misc]
            )
        )
    out.append(
        Figure(
            f"{label} never acknowledged within {GRACE} s of the last write",
            failed,
            "",
            "goal 0; counted as infinite lag in the percentiles",
            failed == 0,
        )
    )
    return out


def one_run(
    admin_url: str,
    duration: int,
    seed: int,
    user_count: int,
    gap: tuple[float, float] | None,
) -> RunLags:
    """One daemon, `duration` seconds of writes: every change's lag (inf: never), and
    the lag of the save before them, the first after idle. With
    `gap`, each user saves every `gap` seconds (uniform); without, one save every two
    seconds by a user drawn at random."""
    rng = random.Random(seed)
    users = [uuid.uuid4() for _ in range(user_count)]
    # (when, user) of each user's next save, for the storm
    due = [(rng.uniform(0, gap[1]), user) for user in users] if gap else []
    heapq.heapify(due)
    inventory: list[tuple[int, int, float]] = []  # library, revision, committed at
    saves: list[tuple[uuid.UUID, int, float]] = []
    inventory_lag: list[float] = []
    stats_lag: list[float] = []
    cold = math.inf
    with scratch_database(admin_url) as url, connect(url) as conn:
        execute(conn, BURST.replace("%(libraries)s", str(LIBRARIES)))
        execute(
            conn,
            ITEMS.replace("generate_series(1, 50) g", "generate_series(1, 20) g"),
            {"libraries": LIBRARIES},
        )
        execute(conn, "INSERT INTO exercises (id, name) VALUES ('squat', 'Squat')")
        with daemon(admin_url, url, {}):
            deadline = time.monotonic() + 120  # the initial load settles first
            while time.monotonic() < deadline:
                execute(conn, "SELECT fold_inventory_changes()")
                row = fetch_one(
                    conn,
                    "SELECT count(*) AS n FROM library_inventory_state"
                    " WHERE acknowledged_revision < revision",
                )
                if row is not None and row["n"] == 0:
                    break
                time.sleep(0.5)
            # The first save after idle waits for the sensor's tick and a run start; the
            # drain it starts stays for the saves that follow. Measured apart.
            user, version, saved_at = save(conn, uuid.uuid4())
            while time.monotonic() < saved_at + GRACE:
                row = fetch_one(
                    conn,
                    "SELECT applied_version FROM user_stats_refresh_state WHERE user_id = %s",
                    (user,),
                )
                if row is not None and row["applied_version"] >= version:
                    cold = time.monotonic() - saved_at
                    break
                time.sleep(0.1)
            started = time.monotonic()
            end = started + duration
            next_write = started
            tick = 0
            while time.monotonic() < end or inventory or saves:
                now = time.monotonic()
                if now < end and now >= next_write:
                    library = rng.randint(1, LIBRARIES)
                    execute(
                        conn,
                        "UPDATE media_server_items SET rating = %s WHERE id ="
                        " (SELECT min(id) FROM media_server_items WHERE library_id = %s)",
                        (round(rng.uniform(0, 10), 1), library),
                    )
                    execute(conn, "SELECT fold_inventory_changes()")  # the write's revision
                    rev = fetch_one(
                        conn,
                        "SELECT revision FROM library_inventory_state WHERE library_id = %s",
                        (library,),
                    )
                    inventory.append((library, int(rev["revision"]), time.monotonic()))  # type: ignore[index]
                    if gap is None and tick % 2 == 0:
                        saves.append(save(conn, rng.choice(users)))
                    tick += 1
                    next_write += 1.0
                while due and now < end and due[0][0] <= now - started:
                    _, user = heapq.heappop(due)
                    saves.append(save(conn, user))
                    heapq.heappush(due, (time.monotonic() - started + rng.uniform(*gap), user))  # type: ignore[misc]
                states = {
                    r["library_id"]: r["acknowledged_revision"]
                    for r in fetch_all(
                        conn,
                        "SELECT library_id, acknowledged_revision FROM library_inventory_state",
                    )
                }
                applied = {
                    r["user_id"]: r["applied_version"]
                    for r in fetch_all(
                        conn, "SELECT user_id, applied_version FROM user_stats_refresh_state"
                    )
                }
                now = time.monotonic()
                inventory_lag += [now - t for lib, rev, t in inventory if states.get(lib, 0) >= rev]
                inventory = [(lib, rev, t) for lib, rev, t in inventory if states.get(lib, 0) < rev]
                stats_lag += [now - t for user, v, t in saves if applied.get(user, 0) >= v]
                saves = [(user, v, t) for user, v, t in saves if applied.get(user, 0) < v]
                if now > end + GRACE:
                    break
                time.sleep(0.1)
    # Whatever is still pending failed: it was never acknowledged within the window.
    inventory_lag += [math.inf] * len(inventory)
    stats_lag += [math.inf] * len(saves)
    return RunLags(inventory_lag, stats_lag, cold)


def save(conn: Connection, user: uuid.UUID) -> tuple[uuid.UUID, int, float]:
    """Save one session for `user`: the generation it requested, and when."""
    payload = {
        "user_id": str(user),
        "session_date": str(date(2026, 3, 1)),
        "sets": [{"exercise_id": "squat", "weight_kg": 100, "reps": 5}],
    }
    saved = fetch_one(conn, "SELECT save_training_session(%s, %s) AS r", (user, jsonb(payload)))
    assert saved is not None
    return user, int(saved["r"]["requested_version"]), time.monotonic()
