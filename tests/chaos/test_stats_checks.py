"""The stats side of the harness sees what it exists for: the independent stats oracle,
owed ranges, generations going back in any table, the publication audit (target, base,
applied, process), the claim holders it kills, and the users whose sessions were all
deleted. Each check is fed a deliberate divergence and must report it."""

from __future__ import annotations

import random
import uuid
from datetime import date, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from chaos import invariants, stats_oracle
from inventory_pipeline.db import Connection, connect, execute, fetch_all, fetch_one, transaction
from inventory_pipeline.stats import service
from inventory_pipeline.stats import service as stats_service
from tests import stats_factories as sf

TODAY = date(2026, 11, 30)


def _audited(conn: Connection) -> None:
    execute(conn, (Path(invariants.__file__).with_name("audit.sql")).read_text())


def _today(conn: Connection) -> None:
    execute(conn, "SELECT set_config('inventory.stats_today', %s, false)", (TODAY.isoformat(),))


def _drain(conn: Connection) -> None:
    for _ in range(20):
        if not service.drain(conn, "test").rounds:
            return
    raise AssertionError("the queue did not drain")


def _random_log(
    conn: Connection, rng: random.Random, users: int, plates: int = 4
) -> list[uuid.UUID]:
    """Random sessions (1/plates-kilogram steps, warm-ups, reps past twelve, sessions
    without sets), an edit (to 101.25 kg x 7 with quarter plates), a delete and a manual
    PR per user, through the write functions."""
    lifts = ["squat", "bench_press", "deadlift"]
    for lift in lifts:
        sf.exercise(conn, lift)
    out = []
    for _ in range(users):
        user = uuid.UUID(int=rng.getrandbits(128))
        out.append(user)
        sessions = []
        for _ in range(rng.randint(3, 8)):
            session_sets = [
                {
                    "exercise_id": rng.choice(lifts),
                    "weight_kg": rng.randint(20 * plates, 200 * plates) / plates,
                    "reps": rng.randint(1, 15),
                    "warmup": rng.random() < 0.2,
                }
                for _ in range(rng.choice((0, 1, 3, 5)))
            ]
            day = TODAY - timedelta(days=rng.randint(0, 400))
            sessions.append(sf.save(conn, user, day, session_sets)["session_id"])
        edited = ("squat", 101.25 if plates == 4 else 101, 7)
        sf.save(conn, user, TODAY - timedelta(days=3), sf.sets(edited), sessions[0])
        sf.delete(conn, user, sessions[-1])
        execute(
            conn,
            "SELECT save_manual_pr(%s, 'deadlift', %s::numeric, %s::integer, %s)",
            (user, rng.randint(40, 225), rng.randint(1, 8), TODAY - timedelta(days=5)),
        )
    return out


# -- the oracle ----------------------------------------------------------------------------


def test_the_estimate_is_exact() -> None:
    assert stats_oracle.estimate(Decimal("101.25"), 7) == Decimal("124.88")
    assert stats_oracle.estimate(Decimal("100"), 1) == Decimal("100")
    assert stats_oracle.estimate(Decimal("100"), 13) is None
    assert stats_oracle.year_before(date(2028, 2, 29)) == date(2027, 2, 28)
    assert stats_oracle.period_start("week", date(2026, 11, 29)) == date(2026, 11, 23)
    assert stats_oracle.period_start("quarter", date(2026, 11, 29)) == date(2026, 10, 1)


def test_the_stats_oracle_agrees_with_the_product_on_random_logs(conn: Connection) -> None:
    """Fails while the product's estimate truncates reps / 30 (101.25 x 7 -> 124.87)."""
    _today(conn)
    _random_log(conn, random.Random(13), users=4)
    _drain(conn)
    assert stats_oracle.check(conn) == []


def test_the_stats_oracle_sees_wrong_missing_and_leftover_rows(conn: Connection) -> None:
    _today(conn)
    users = _random_log(conn, random.Random(14), users=3, plates=1)
    gone = users[2]
    for row in fetch_all(conn, "SELECT id FROM training_sessions WHERE user_id = %s", (gone,)):
        sf.delete(conn, gone, row["id"])
    _drain(conn)
    assert stats_oracle.check(conn) == []
    assert sf.exercise_stats(conn, gone) == {}
    execute(
        conn,
        "UPDATE user_exercise_stats SET volume = volume + 1"
        " WHERE user_id = %s AND exercise_id = 'squat'",
        (users[0],),
    )
    execute(
        conn,
        "DELETE FROM user_training_period_stats WHERE user_id = %s AND period = 'year'",
        (users[1],),
    )
    # What a lost range leaves of a user whose sessions were all deleted: its old rows.
    execute(
        conn,
        "INSERT INTO user_exercise_stats (user_id, exercise_id, sessions, working_sets, reps,"
        " volume, heaviest_kg, best_e1rm_kg, first_date, last_date, generation)"
        " SELECT %s, 'bench_press', 1, 1, 5, 500, 100, 116.67, %s, %s, applied_version"
        " FROM user_stats_refresh_state WHERE user_id = %s",
        (gone, TODAY, TODAY, gone),
    )
    found = stats_oracle.check(conn)
    assert len(found) == 3, found
    by_user = {line.split(":")[0]: line for line in found}
    assert "exercise squat: volume expected" in by_user[f"user {users[0]}"]
    assert (
        "period year/" in by_user[f"user {users[1]}"] and "missing" in by_user[f"user {users[1]}"]
    )
    assert "exercise bench_press unexpected" in by_user[f"user {gone}"]


def test_the_stats_oracle_reads_the_pr_overview_through_the_reader(conn: Connection) -> None:
    _today(conn)
    [user] = _random_log(conn, random.Random(15), users=1, plates=1)
    _drain(conn)
    execute(
        conn,
        "UPDATE user_pr_exercise_summary_snapshots SET best_e1rm_30d = 1"
        " WHERE user_id = %s AND exercise_id = 'deadlift' AND as_of_date = %s",
        (user, TODAY),
    )
    [line] = stats_oracle.check(conn)
    assert "PR overview deadlift: best_e1rm_30d expected" in line and "stored 1.00" in line
    execute(
        conn,
        "DELETE FROM user_pr_overview_snapshot_headers WHERE user_id = %s AND as_of_date = %s",
        (user, TODAY),
    )
    [line] = stats_oracle.check(conn)
    assert line.endswith("PR overview unreadable (55000)")


# -- owed ranges -----------------------------------------------------------------------------


def _job(conn: Connection, user: uuid.UUID, status: str, exercises: list[str]) -> int:
    row = fetch_one(
        conn,
        "INSERT INTO user_exercise_stats_refresh_jobs (user_id, event_type, from_date,"
        " exercise_ids, status, requested_version, completed_at)"
        " VALUES (%s, 'session_saved', %s, %s, %s, 1, now()) RETURNING id",
        (user, TODAY, exercises, status),
    )
    assert row is not None
    return int(row["id"])


def test_a_failed_jobs_range_nobody_published_is_owed(conn: Connection) -> None:
    """The lost range: J1 (squat) failed, J2 (bench) published; squat is still owed.
    A later job that published a range covering it settles it."""
    for lift in ("squat", "bench_press"):
        sf.exercise(conn, lift)
    user = uuid.uuid4()
    failed = _job(conn, user, "failed", ["squat"])
    sf.save(conn, user, TODAY, sf.sets(("bench_press", 100, 5)))
    _drain(conn)
    [line] = invariants.owed_ranges(conn)
    assert line.startswith(f"user {user}: range of failed job {failed} (from {TODAY},")
    assert "exercises squat" in line and line.endswith("never published after it failed")
    sf.save(conn, user, TODAY - timedelta(days=1), sf.sets(("squat", 100, 5)))
    _drain(conn)
    assert invariants.owed_ranges(conn) == []


# -- generations -----------------------------------------------------------------------------


def _published_twice(conn: Connection) -> uuid.UUID:
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    for reps in (5, 6):
        sf.save(conn, user, TODAY, sf.sets(("squat", 100, reps)))
        _drain(conn)
    assert sf.versions(conn, user) == (2, 2)
    return user


def test_generations_are_monotonic_in_a_clean_history(conn: Connection) -> None:
    _today(conn)
    _audited(conn)
    _published_twice(conn)
    assert invariants.stats_generations(conn) == []


def test_a_projection_labelled_older_is_seen(conn: Connection) -> None:
    _today(conn)
    _audited(conn)
    user = _published_twice(conn)
    execute(conn, "UPDATE user_exercise_stats SET generation = 1 WHERE user_id = %s", (user,))
    execute(
        conn,
        "UPDATE user_training_period_stats SET generation = 3"
        " WHERE user_id = %s AND period = 'year'",
        (user,),
    )
    assert invariants.stats_generations(conn) == [
        f"user_exercise_stats: user {user} labelled generation 1 after generation 2",
        f"user_training_period_stats: user {user} holds generation 3 under applied 2",
    ]


def test_pr_headers_of_another_generation_and_a_rollover_going_back_are_seen(
    conn: Connection,
) -> None:
    _today(conn)
    _audited(conn)
    user = _published_twice(conn)
    execute(
        conn,
        "INSERT INTO user_pr_overview_snapshot_headers (user_id, generation, as_of_date,"
        " catalog_epoch, exercise_count) VALUES (%s, 1, %s, 1, 0)",
        (user, TODAY),
    )
    execute(
        conn,
        "UPDATE user_pr_overview_rollover_state SET snapshot_generation = 1 WHERE user_id = %s",
        (user,),
    )
    assert invariants.stats_generations(conn) == [
        f"user_pr_overview_snapshot_headers: user {user} labelled generation 1 after generation 2",
        f"user_pr_overview_rollover_state: user {user} labelled generation 1 after generation 2",
        f"user_pr_overview_snapshot_headers: user {user} holds generation 1 under applied 2",
    ]


def test_a_publication_of_an_older_generation_is_seen(conn: Connection) -> None:
    """The two-live-jobs outcome: a run publishes generation 1 after generation 2 was
    applied (here forced past the product's checks, under the run's own token)."""
    _today(conn)
    _audited(conn)
    user = _published_twice(conn)
    execute(conn, "SELECT request_stats_refresh(%s, NULL, '{}', 'test')", (user,))
    claim = stats_service.claim(conn, "chaos-1")
    assert claim is not None
    with transaction(conn):
        execute(
            conn,
            "SELECT set_config('inventory.stats_lease_token', %s, true)",
            (str(claim.lease_token),),
        )
        execute(
            conn,
            "UPDATE user_stats_projection_runs SET phase = 'published', target_version = 1"
            " WHERE id = %s",
            (claim.run_id,),
        )
    assert invariants.stats_generations(conn) == [
        f"stats run {claim.run_id}: user {user} published generation 1 (base 2) under"
        f" applied 2 (process None, backend {conn.info.backend_pid})"
    ]


# -- the publication audit -----------------------------------------------------------------


def test_every_publication_records_target_base_applied_and_process(db_url: str) -> None:
    """Single and batched publications, each with the worker's process id (from its
    session name) and its server process."""
    with connect(db_url, application_name="chaos.stats.4242") as conn:
        _audited(conn)
        small, large = uuid.uuid4(), uuid.uuid4()
        sf.exercise(conn, "squat")
        lifts = [sf.exercise(conn, f"lift_{n:03d}") for n in range(105)]
        sf.save(conn, small, TODAY, sf.sets(("squat", 100, 5)))
        sf.save(conn, large, TODAY, [sf.sets((lift, 60, 5))[0] for lift in lifts])
        _drain(conn)
        sf.save(conn, small, TODAY, sf.sets(("squat", 100, 6)))
        _drain(conn)
        rows = fetch_all(
            conn,
            "SELECT user_id, target_version, base_version, applied_version, mode, worker_pid,"
            " backend_pid, actor FROM chaos_stats_publications ORDER BY seq",
        )
        pid = conn.info.backend_pid
    expected: list[dict[str, Any]] = [
        {"user_id": small, "target_version": 1, "base_version": 0, "applied_version": 1,
         "mode": "single"},
        {"user_id": large, "target_version": 1, "base_version": 0, "applied_version": 1,
         "mode": "batched"},
        {"user_id": small, "target_version": 2, "base_version": 1, "applied_version": 2,
         "mode": "single"},
    ]  # fmt: skip
    assert (
        sorted(
            ({k: r[k] for k in expected[0]} for r in rows[:2]), key=lambda r: r["mode"] != "single"
        )
        == expected[:2]
    )
    assert {k: rows[2][k] for k in expected[2]} == expected[2]
    assert {(r["worker_pid"], r["backend_pid"], r["actor"]) for r in rows} == {
        (4242, pid, "chaos.stats.4242")
    }


def test_a_drain_loops_publication_is_judged_by_the_token_its_publish_declared(
    conn: Connection,
) -> None:
    """A drain loop declares nothing to the harness; its publish stage declared the
    run's token for the fence, and that is what the audit holds it to."""
    _today(conn)
    _audited(conn)
    _published_twice(conn)
    rows = fetch_all(conn, "SELECT lease_token::text, product_token FROM chaos_stats_publications")
    assert rows and all(r["lease_token"] == r["product_token"] for r in rows)
    assert invariants.no_lost_claim_acknowledged(conn) == []
    execute(conn, "UPDATE chaos_stats_publications SET product_token = gen_random_uuid()::text")
    assert all(
        line.endswith("published by a worker that did not hold its lease (process None)")
        for line in invariants.no_lost_claim_acknowledged(conn)
    )


# -- claim holders and the users the comparison covers ----------------------------------------


def test_a_claim_holder_is_found_inside_its_transaction(db_url: str, conn: Connection) -> None:
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    assert fetch_one(conn, invariants.CLAIM_HOLDERS) is None
    with connect(db_url, application_name="chaos.drainer.777") as worker:
        claim = stats_service.claim(worker, "chaos-777")
        assert claim is not None
        assert fetch_one(conn, invariants.CLAIM_HOLDERS) == {
            "worker_pid": 777,
            "in_transaction": False,
        }
        with transaction(worker):
            execute(worker, "SELECT 1")
            assert fetch_one(conn, invariants.CLAIM_HOLDERS) == {
                "worker_pid": 777,
                "in_transaction": True,
            }


def test_the_rebuild_covers_users_whose_sessions_were_all_deleted(conn: Connection) -> None:
    """A rebuild of the users with sessions never looks at an emptied user: what a lost
    range left of it would compare equal before and after. The harness rebuilds every
    user the stats know of."""
    _today(conn)
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    last_year = TODAY - timedelta(days=400)
    session = sf.save(conn, user, last_year, sf.sets(("squat", 100, 5)))["session_id"]
    _drain(conn)
    sf.delete(conn, user, session)
    _drain(conn)
    assert sf.exercise_stats(conn, user) == {}
    # What a lost range leaves behind: the rows of the sessions it never took away.
    execute(
        conn,
        "INSERT INTO user_exercise_stats (user_id, exercise_id, sessions, working_sets, reps,"
        " volume, heaviest_kg, best_e1rm_kg, first_date, last_date, generation)"
        " SELECT %s, 'squat', 1, 1, 5, 500, 100, 116.67, %s, %s, applied_version"
        " FROM user_stats_refresh_state WHERE user_id = %s",
        (user, last_year, last_year, user),
    )
    assert user in invariants.stats_users(conn)
    before = invariants.projections(conn)
    service.request_rebuild(conn, invariants.stats_users(conn))
    _drain(conn)
    assert sf.exercise_stats(conn, user) == {}
    assert invariants.projections_equal(before, invariants.projections(conn)) == [
        "exercise stats: 1 rows differ from a full recomputation"
    ]


# -- the defects, seen through the harness's checks ------------------------------------------


def test_a_failed_jobs_range_is_never_lost_to_the_checks(db_url: str, conn: Connection) -> None:
    """Save D1 with squat, its job fails every attempt (compute budget squeezed while its
    output table is locked), save D2 with bench, drain: the checks must find squat
    published (on a product that drops the failed range they report it owed and the
    oracle a missing squat row)."""
    _today(conn)
    for lift in ("squat", "bench_press"):
        sf.exercise(conn, lift)
    user = uuid.uuid4()
    sf.save(conn, user, TODAY - timedelta(days=2), sf.sets(("squat", 100, 5)))
    claim = stats_service.claim(conn, "chaos-1")
    assert claim is not None
    execute(
        conn,
        "UPDATE stats_projection_worker_settings SET compute_budget_ms = 300,"
        " retry_backoff_seconds = 0",
    )
    with connect(db_url) as blocker, transaction(blocker):
        execute(blocker, "LOCK TABLE training_sets IN ACCESS EXCLUSIVE MODE")
        statuses = [stats_service.compute(conn, claim).status]
        for _ in range(2):  # each retry: the claim takes the run back, its time come
            resumed = stats_service.claim(conn, "chaos-1")
            assert resumed is not None and resumed.run_id == claim.run_id
            statuses.append(stats_service.compute(conn, resumed).status)
    assert statuses == ["retry_pending", "retry_pending", "failed"]
    execute(conn, "UPDATE stats_projection_worker_settings SET compute_budget_ms = 60000")
    sf.save(conn, user, TODAY - timedelta(days=1), sf.sets(("bench_press", 100, 5)))
    _drain(conn)
    assert sf.versions(conn, user) == (2, 2)
    assert invariants.owed_ranges(conn) == []
    assert stats_oracle.check(conn) == []


def test_a_newer_job_waits_for_the_older_one_a_claim_holds(db_url: str, conn: Connection) -> None:
    """A claim holds the older pending job while a save enqueues a newer one beside it
    (the enqueue skips the locked row): another worker's claim passes the user by
    rather than publish the newer generation first; once the holder rolls back, both
    publish in order (the checks see every table)."""
    _today(conn)
    _audited(conn)
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    sf.save(conn, user, TODAY - timedelta(days=2), sf.sets(("squat", 100, 5)))
    [older] = sf.jobs(conn, user)
    with connect(db_url) as holder:
        with transaction(holder):
            execute(
                holder,
                "SELECT id FROM user_exercise_stats_refresh_jobs WHERE id = %s FOR UPDATE",
                (older["id"],),
            )
            sf.save(conn, user, TODAY - timedelta(days=1), sf.sets(("squat", 110, 5)))
            assert stats_service.claim(conn, "chaos-2") is None
        # The holder's transaction ends without claiming: a claim that rolled back.
    _drain(conn)
    assert invariants.stats_generations(conn) == []
    assert sf.versions(conn, user) == (2, 2)
    assert stats_oracle.check(conn) == []


def test_a_batch_run_resumed_by_another_process_is_counted(db_url: str) -> None:
    """Two processes can share a resumed token: the steps audit says who stepped a run,
    and the publication which process published it."""
    with (
        connect(db_url, application_name="chaos.stats.1") as first,
        connect(db_url, application_name="chaos.drainer.2") as second,
    ):
        _audited(first)
        user = uuid.uuid4()
        lifts = [sf.exercise(first, f"lift_{n:03d}") for n in range(105)]
        sf.save(first, user, TODAY, [sf.sets((lift, 60, 5))[0] for lift in lifts])
        claim = stats_service.claim(first, "chaos-1")
        assert claim is not None
        assert stats_service.compute(first, claim).status == "batch_pending"
        sf.expire_run(first, claim.run_id, claim.lease_token)  # the first process died
        resumed = stats_service.claim(second, "chaos-2")
        assert resumed is not None and resumed.lease_token == claim.lease_token
        service.process(second, resumed)
        row = fetch_one(
            second,
            "SELECT (SELECT count(*) FROM (SELECT run_id FROM chaos_stats_steps"
            "   GROUP BY run_id HAVING count(DISTINCT backend_pid) > 1) r) AS several,"
            " (SELECT array_agg(DISTINCT worker_pid) FROM chaos_stats_steps) AS workers,"
            " (SELECT worker_pid FROM chaos_stats_publications) AS publisher",
        )
    assert row == {"several": 1, "workers": [1, 2], "publisher": 2}


def test_a_user_read_as_current_without_its_last_save_is_caught(conn: Connection) -> None:
    """The sampled check that current means correct: a user whose applied generation
    claims to cover a save its published stats lack (what merging a later save into an
    older job produced) is reported; a truly current user is not."""
    _today(conn)
    for lift in ("squat", "bench_press"):
        sf.exercise(conn, lift)
    user = uuid.uuid4()
    sf.save(conn, user, TODAY - timedelta(days=2), sf.sets(("squat", 100, 5)))
    _drain(conn)
    assert stats_oracle.check_current(conn, random.Random(0)) == []
    sf.save(conn, user, TODAY - timedelta(days=1), sf.sets(("bench_press", 80, 5)))
    assert stats_oracle.check_current(conn, random.Random(0)) == []  # stale: not sampled
    execute(conn, "UPDATE user_stats_refresh_state SET applied_version = requested_version")
    [found] = stats_oracle.check_current(conn, random.Random(0))
    assert str(user) in found and "bench_press missing" in found
    # Service the queue, the user is current again and reads true.
    execute(conn, "UPDATE user_stats_refresh_state SET applied_version = applied_version - 1")
    _drain(conn)
    assert stats_oracle.check_current(conn, random.Random(0)) == []
