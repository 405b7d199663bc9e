"""The workload reaches the seams: deletion and re-creation, a writer role with table
rights only, malformed identities, throttle storms and a backlog; and the checks that
come with them see what they exist for."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from datetime import date
from functools import partial
from pathlib import Path

import httpx
import pytest

from chaos import invariants, worker
from chaos.config import (
    BACKLOG_LIBRARIES,
    LARGE_EXERCISES,
    SQUEEZE_OPERATIONS,
    SQUEEZED_ATTEMPTS,
    SQUEEZED_COMPUTE_BUDGET_MS,
    STATS_SETTINGS,
    STORM_ITEMS,
)
from chaos.workload import Workload, drop_writer_role
from inventory_pipeline.db import (
    Connection,
    connect,
    execute,
    fetch_all,
    fetch_one,
)
from inventory_pipeline.db.connection import database_name
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.stats import service
from inventory_pipeline.stats import service as stats_service
from inventory_pipeline.stats.models import BATCH_SIZE
from tests import factories as f
from tests import stats_factories as sf


@pytest.fixture
def workload(
    conn: Connection, db_url: str, server_url: str, standin: StandIn
) -> Iterator[Workload]:
    load = Workload(conn, standin, random.Random(5), date(2026, 11, 30), partial(connect, db_url))
    load._create_writer_role()
    try:
        yield load
    finally:
        if load.writer is not None:
            load.writer.close()
        # The role's grants are in this database: revoke them so the role can go now.
        execute(conn, f'DROP OWNED BY "{load.role}"')
        with connect(server_url) as admin:
            drop_writer_role(admin, database_name(db_url))


def test_a_refusal_the_chaos_does_not_explain_is_recorded(workload: Workload) -> None:
    """A lock timeout is chaos; a writer refused for want of a right is a divergence."""
    writer = workload._writer()
    workload.apply("no_right", lambda: execute(writer, "SELECT * FROM provider_settings"))
    workload.apply(
        "lock_timeout",
        lambda: execute(
            workload.conn,
            "DO $$ BEGIN RAISE EXCEPTION 'timed out' USING ERRCODE = 'lock_not_available'; END $$",
        ),
    )
    assert workload.refused == {"no_right": 1, "lock_timeout": 1}
    assert list(workload.unexpected) == [
        "no_right [42501]: permission denied for table provider_settings"
    ]


def test_writer_role_holds_rights_on_the_items_table_only(
    workload: Workload, server_url: str, db_url: str
) -> None:
    writer = workload._writer()
    row = fetch_one(writer, "SELECT current_user AS who")
    assert row is not None and row["who"] == workload.role
    rights = fetch_all(
        workload.conn,
        "SELECT table_name, privilege_type FROM information_schema.role_table_grants"
        " WHERE grantee = %s ORDER BY 1, 2",
        (workload.role,),
    )
    assert {(r["table_name"], r["privilege_type"]) for r in rights} == {
        ("libraries", "SELECT"),
        ("media_servers", "SELECT"),
        *{("media_server_items", p) for p in ("DELETE", "INSERT", "SELECT", "TRUNCATE", "UPDATE")},
    }


def test_malformed_identities_are_judged(conn: Connection) -> None:
    lib = f.library(conn)
    good, superscript, arabic = (f.tmdb_item(conn, lib, n) for n in (7, 8, 9))
    execute(conn, "UPDATE media_server_items SET provider_id = '²' WHERE id = %s", (superscript,))
    execute(conn, "UPDATE media_server_items SET provider_id = '٦٠٣' WHERE id = %s", (arabic,))
    # What a reader that trusts isdigit() does: '٦٠٣' observed as TMDb 603.
    execute(
        conn,
        "INSERT INTO provider_observations (item_id, source_generation, provider_kind,"
        " tmdb_id, title, genres, companies, observed_at)"
        " SELECT id, source_generation, 'movie', 603, 'x', '{}', '{}', now()"
        " FROM media_server_items WHERE id = %s",
        (arabic,),
    )
    assert invariants.malformed_identities(conn) == [
        f"item {arabic}: malformed identity '٦٠٣' observed as TMDb 603",
        f"item {superscript}: malformed identity '²' without an open recovery case",
        f"item {arabic}: malformed identity '٦٠٣' without an open recovery case",
    ]
    assert invariants.outstanding(conn)["items never attempted"] == 3  # good too
    execute(
        conn,
        "UPDATE media_server_items SET recovery_case_id = gen_random_uuid(),"
        " recovery_provider = provider, recovery_provider_kind = provider_kind,"
        " recovery_provider_id = provider_id, recovery_category = 'not_found',"
        " recovery_attempts = 1, recovery_first_failed_at = now(),"
        " recovery_last_failed_at = now() WHERE id = %s",
        (superscript,),
    )
    assert invariants.malformed_identities(conn)[1:] == [
        f"item {arabic}: malformed identity '٦٠٣' without an open recovery case"
    ]
    assert good not in (superscript, arabic)


def test_a_storm_is_a_window_of_429s_with_items_due(
    workload: Workload, standin: StandIn, conn: Connection
) -> None:
    f.library(conn, media_kind="movie")
    workload.throttle_storm()
    with httpx.Client() as client:
        answers = [client.get(f"{standin.url}/3/movie/{n}").status_code for n in range(3)]
    time.sleep(0.01)
    workload.end_storm()
    assert answers == [429, 429, 429]
    [(start, end)] = workload.storms
    assert sum(1 for t in standin.state.arrivals if start <= t <= end) == 3
    row = fetch_one(conn, "SELECT count(*) AS n FROM media_server_items")
    assert row is not None and row["n"] == STORM_ITEMS


def test_the_backlog_turns_its_libraries_dirty_at_once(
    workload: Workload, conn: Connection
) -> None:
    workload.backlog()
    execute(conn, "SELECT fold_inventory_changes()")
    row = fetch_one(
        conn,
        "SELECT count(*) AS n, min(revision) AS lo, max(revision) AS hi,"
        " count(DISTINCT dirty_since) AS moments FROM library_inventory_state",
    )
    assert row is not None
    assert (row["n"], row["lo"], row["hi"], row["moments"]) == (BACKLOG_LIBRARIES, 1, 1, 1)
    assert invariants.outstanding(conn)["dirty libraries"] == BACKLOG_LIBRARIES


def test_deleted_libraries_and_servers_come_back_under_their_names(
    workload: Workload, conn: Connection
) -> None:
    srv = f.server(conn, "home")
    for n in range(2):
        f.items(conn, f.library(conn, srv, name=f"L{n}"), 3)
    before = fetch_all(conn, "SELECT id, name FROM libraries ORDER BY name")
    workload.delete_library()
    workload.delete_server()
    after = fetch_all(conn, "SELECT id, name FROM libraries ORDER BY name")
    assert {r["id"] for r in before}.isdisjoint({r["id"] for r in after})
    servers = fetch_all(conn, "SELECT name FROM media_servers")
    assert [r["name"] for r in servers] == ["home"]


# -- the stats side ----------------------------------------------------------------------


def _drain(conn: Connection) -> None:
    while service.drain(conn, "test").rounds:
        pass


def test_large_accounts_compute_in_batches_and_edits_find_their_runs(
    workload: Workload, conn: Connection
) -> None:
    """An account past one compute batch publishes through the batched path; an edit
    drawn while one of its runs computes is aimed at that account."""
    workload.setup_training(users=1, large_users=2)
    execute(conn, (Path(invariants.__file__).with_name("audit.sql")).read_text())
    first, second = workload.large_users
    candidates = fetch_one(
        conn,
        "SELECT count(DISTINCT exercise_id) AS n FROM training_sets t"
        " JOIN training_sessions s ON s.id = t.session_id WHERE s.user_id = %s",
        (first,),
    )
    assert candidates is not None and candidates["n"] == LARGE_EXERCISES > BATCH_SIZE
    _drain(conn)
    rows = fetch_all(conn, "SELECT user_id, mode FROM chaos_stats_publications")
    assert {(r["user_id"], r["mode"]) for r in rows} >= {(first, "batched"), (second, "batched")}
    execute(conn, "SELECT request_stats_refresh(%s, NULL, '{}', 'test')", (second,))
    claim = stats_service.claim(conn, "test")
    assert claim is not None and claim.user_id == second
    assert stats_service.compute(conn, claim).status == "batch_pending"
    before = sf.versions(conn, second)[0]
    for _ in range(5):
        workload.save_large()
    assert workload.edits_during_compute == 5
    assert sf.versions(conn, second)[0] == before + 5


def test_a_save_the_server_refused_is_not_known_to_the_workload(
    conn: Connection, db_url: str, standin: StandIn
) -> None:
    """A save refused by a restart made no session: the workload must not delete it
    later and read the answer "no such session" as the product's divergence."""
    workload = Workload(
        connect(db_url), standin, random.Random(5), date(2026, 11, 30), partial(connect, db_url)
    )
    workload.setup_training(users=1, large_users=1)
    [user] = workload.large_users
    execute(
        conn,
        "CREATE FUNCTION refuse_saves() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " RAISE EXCEPTION 'the database system is shutting down' USING ERRCODE = '57P01';"
        " END $$",
    )
    execute(
        conn,
        "CREATE TRIGGER refuse_saves BEFORE INSERT ON training_sessions"
        " FOR EACH ROW EXECUTE FUNCTION refuse_saves()",
    )
    for _ in range(20):
        workload.apply("save_large", workload.save_large)
        workload.apply("save_session", lambda: workload.save_session(user))
    execute(conn, "DROP TRIGGER refuse_saves ON training_sessions")
    stored = {
        r["id"]
        for r in fetch_all(conn, "SELECT id FROM training_sessions WHERE user_id = %s", (user,))
    }
    assert set(workload.sessions[user]) <= stored
    workload.apply("delete_all", lambda: workload.delete_all_sessions(user))
    workload.conn.close()
    assert workload.refused["save_large"] > 0 and not workload.unexpected


def _draws_the_floor(seed: int) -> bool:
    rng = random.Random(seed)
    rng.choice(SQUEEZED_ATTEMPTS)
    budgets = (SQUEEZED_COMPUTE_BUDGET_MS, STATS_SETTINGS["compute_budget_ms"])
    return rng.choice(budgets) == SQUEEZED_COMPUTE_BUDGET_MS


def test_a_squeeze_exhausts_attempts_and_is_restored(
    workload: Workload, conn: Connection, db_url: str
) -> None:
    """A squeeze at the budget's floor holds the exercise projection (an operator's
    maintenance) as well: every compute runs out of its budget and is given back, jobs
    exhaust their attempts, and the end of the squeeze lets the table go."""
    workload.setup_training(users=1, large_users=0)
    workload.rng = random.Random(next(n for n in range(100) if _draws_the_floor(n)))
    workload.squeeze_budget()
    row = fetch_one(
        conn, "SELECT max_attempts, compute_budget_ms FROM stats_projection_worker_settings"
    )
    assert row is not None
    assert row["max_attempts"] in SQUEEZED_ATTEMPTS
    assert row["compute_budget_ms"] == SQUEEZED_COMPUTE_BUDGET_MS
    assert workload.squeeze_left == SQUEEZE_OPERATIONS
    for _ in range(3 * (row["max_attempts"] + 1)):
        claim = stats_service.claim(conn, "test")
        if claim is not None:
            assert stats_service.compute(conn, claim).interrupted
        execute(
            conn,
            "UPDATE user_stats_projection_runs SET retry_not_before = now()"
            " WHERE retry_not_before IS NOT NULL AND phase = 'claimed'",
        )
        if fetch_all(
            conn, "SELECT 1 FROM user_exercise_stats_refresh_jobs WHERE status = 'failed'"
        ):
            break
    assert fetch_all(conn, "SELECT 1 FROM user_exercise_stats_refresh_jobs WHERE status = 'failed'")
    for _ in range(SQUEEZE_OPERATIONS):
        workload.tick()
    row = fetch_one(
        conn, "SELECT max_attempts, compute_budget_ms FROM stats_projection_worker_settings"
    )
    assert row is not None and workload.squeeze_left == 0 and workload.squeeze_hold is None
    assert (row["max_attempts"], row["compute_budget_ms"]) == (
        STATS_SETTINGS["max_attempts"],
        STATS_SETTINGS["compute_budget_ms"],
    )


def test_an_emptied_user_keeps_no_session_and_the_rebuild_runs_beside_the_writes(
    workload: Workload, conn: Connection
) -> None:
    workload.setup_training(users=3, large_users=0)
    emptied = workload.users[0]
    workload.empty_user()
    workload.rebuild_everyone()
    for _ in range(40):
        workload.save_session()
    workload.settle()
    assert workload.done["rebuild_everyone"] == 1
    row = fetch_one(
        conn, "SELECT count(*) AS n FROM training_sessions WHERE user_id = %s", (emptied,)
    )
    assert row is not None and row["n"] == 0
    assert emptied in invariants.stats_users(conn)
    jobs = fetch_all(
        conn,
        "SELECT DISTINCT user_id FROM user_exercise_stats_refresh_jobs"
        " WHERE reason LIKE '%%analyst rebuild%%'",
    )
    assert {r["user_id"] for r in jobs} >= set(workload.users) - {emptied}


def test_the_refresher_acknowledges_through_the_run_with_its_token_declared(
    conn: Connection, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refresher worker takes one claim through the run's own call, declaring the
    claim's token before the completion; planning stays with the planner role."""
    execute(conn, (Path(invariants.__file__).with_name("audit.sql")).read_text())
    monkeypatch.setattr(worker.random, "random", lambda: 0.5)  # no stall past the lease
    lib = f.library(conn)
    f.items(conn, lib, 4)
    with connect(db_url, application_name=worker.application_name("refresher", 1)) as session:
        assert worker.refresher(session) is False  # nothing queued, and it plans nothing
        assert f.requests(conn, lib) == []
        worker.planner(session)
        assert worker.refresher(session) is True
    [ack] = fetch_all(
        conn, "SELECT lease_token::text AS token, completing_token FROM chaos_profile_acks"
    )
    assert ack["completing_token"] == ack["token"]
    assert invariants.no_lost_claim_acknowledged(conn) == []
    assert f.state(conn, lib)["acknowledged_revision"] == 1
    assert profiles.stored_profile(conn, lib) is not None
