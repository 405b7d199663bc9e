"""The convergence harness in CI: one bounded seeded run with SIGKILLed, paused and
terminated workers, a server restart and the real Dagster daemon, on a private server
of the version under test; and proof that its checks see a divergence when there is one
(more in test_checks.py).

INVENTORY_CHAOS_SECONDS lengthens the run (the long run is `python -m chaos --runs N`);
INVENTORY_CHAOS_SEED picks another seed; INVENTORY_CHAOS_DAEMON=1/0 takes the Dagster
daemon in or leaves it out (default: in on a configured server, out on the embedded one).
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Iterator
from datetime import date
from functools import partial
from pathlib import Path

import pytest

from chaos import invariants
from chaos.run import run
from chaos.servers import Server, private_like
from chaos.worker import declare
from chaos.workload import Workload, drop_writer_role
from inventory_pipeline.db import Connection, connect, execute, fetch_all, fetch_one
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.provider.standin import StandIn
from tests import factories as f
from tests.db.test_interleavings import POLICY, expire_request, process_all, recover_now

CI_SEED = 20261130
CI_SECONDS = 40.0


@pytest.fixture
def chaos_server(server_url: str) -> Iterator[Server]:
    """A server the harness may restart: a private one of the same major version (a
    restart of the shared server would break whatever else uses it)."""
    server = private_like(server_url) or Server(server_url, restartable=False)
    try:
        yield server
    finally:
        server.stop()


def test_bounded_chaos_run_converges(chaos_server: Server) -> None:
    seed = int(os.environ.get("INVENTORY_CHAOS_SEED", CI_SEED))
    seconds = float(os.environ.get("INVENTORY_CHAOS_SECONDS", CI_SECONDS))
    # The daemon costs a warm-up of half a minute: on by default for the run on a
    # configured server (PostgreSQL 15 in CI), off for the embedded one.
    default = "1" if os.environ.get("INVENTORY_TEST_DATABASE_URL") else "0"
    daemon = os.environ.get("INVENTORY_CHAOS_DAEMON", default) != "0"
    report = run(chaos_server, seed, seconds, log=lambda _: None, daemon=daemon)
    print("\n".join(report.lines()))
    assert sum(report.kills.values()) > 0 and report.runs > len(report.kills)
    assert sum(report.terminations.values()) > 0
    assert report.restarts == (1 if chaos_server.restartable else 0)
    assert report.audit["profile_acks"] > 0 and report.audit["stats_publications"] > 0
    assert report.audit["stats_batched_publications"] > 0 and report.squeezes >= 1
    assert report.operations["save_large"] > 0 and report.operations["rebuild_everyone"] > 0
    assert report.audit["wakeup_batches"] >= 2 and report.audit["verifications"] > 0
    assert report.merges["corroborated"] > 0  # checked by chaos.replacements.checks
    if daemon:
        assert report.audit["profile_acks_by_dagster"] > 0
    assert not report.divergences, "\n".join(report.lines())


def _audited(conn: Connection) -> None:
    execute(conn, (Path(invariants.__file__).with_name("audit.sql")).read_text())


def test_checks_see_a_stale_profile_and_a_lagging_library(conn: Connection) -> None:
    _audited(conn)
    lib = f.library(conn)
    f.items(conn, lib, 8)
    process_all(conn)
    assert invariants.profiles_converged(conn) == []
    execute(
        conn,
        "UPDATE library_profiles SET profile = profile || '{\"x\": 1}' WHERE library_id = %s",
        (lib,),
    )
    assert invariants.profiles_converged(conn) == [
        f"library {lib}: profile differs from a recomputation"
    ]
    process_all(conn)  # nothing to do: the library is acknowledged
    f.items(conn, lib, 1, seed=9)
    assert f"library {lib}: acknowledged 1 != revision 2" in invariants.profiles_converged(conn)
    assert invariants.outstanding(conn)["dirty libraries"] == 1


def _acknowledge_unguarded(conn: Connection, request_id: int) -> None:
    """What a broken fence would let through: success whatever the claim's state."""
    execute(
        conn,
        "UPDATE profile_refresh_requests SET status = 'succeeded', finished_at = now(),"
        " lease_token = NULL, lease_expires_at = NULL WHERE id = %s AND status = 'running'",
        (request_id,),
    )


def test_audit_tells_the_live_claim_from_a_lost_one(conn: Connection) -> None:
    _audited(conn)
    lib = f.library(conn)
    f.items(conn, lib, 4)
    profiles.plan(conn, POLICY)
    [live] = profiles.claim(conn, POLICY).claims
    declare(conn, live.lease_token)
    assert profiles.process(conn, live, POLICY).outcome == "published"
    assert invariants.no_lost_claim_acknowledged(conn) == []
    # The lease ran out, yet its worker acknowledges.
    f.items(conn, lib, 1, seed=3)
    profiles.plan(conn, POLICY)
    [late] = profiles.claim(conn, POLICY).claims
    expire_request(conn, late.request_id)
    declare(conn, late.lease_token)
    _acknowledge_unguarded(conn, late.request_id)
    assert invariants.no_lost_claim_acknowledged(conn) == [
        f"request {late.request_id}: acknowledged by token {late.lease_token} (lease expired)"
    ]
    # A stale worker acknowledges a request another worker has claimed since.
    f.items(conn, lib, 1, seed=4)
    profiles.plan(conn, POLICY)
    [old] = profiles.claim(conn, POLICY).claims
    expire_request(conn, old.request_id)
    recover_now(conn)
    [new] = profiles.claim(conn, POLICY).claims
    declare(conn, old.lease_token)
    _acknowledge_unguarded(conn, new.request_id)
    assert invariants.no_lost_claim_acknowledged(conn)[1:] == [
        f"request {old.request_id}: acknowledged by token {old.lease_token} (not the live claim)"
    ]


def test_audit_sees_versions_going_back(conn: Connection) -> None:
    _audited(conn)
    user = uuid.uuid4()
    execute(
        conn,
        "INSERT INTO user_stats_refresh_state (user_id, requested_version, applied_version)"
        " VALUES (%s, 3, 3)",
        (user,),
    )
    execute(
        conn, "UPDATE user_stats_refresh_state SET applied_version = 2 WHERE user_id = %s", (user,)
    )
    [line] = invariants.no_lost_claim_acknowledged(conn)
    assert line.startswith("stats version went back") and "applied 3 -> 2" in line
    assert invariants.stats_versions(conn) == [f"user {user}: applied 2 != requested 3"]
    row = fetch_one(conn, "SELECT count(*) AS n FROM chaos_regressions")
    assert row is not None and row["n"] == 1


# The system of record's contents, without clocks or random generations.
CONTENTS = (
    "SELECT id, server_id, name, media_kind, active FROM libraries",
    "SELECT id, library_id, title, year, provider, provider_kind, provider_id, rating, genres,"
    " primary_studio, original_language, source_generation FROM media_server_items",
    "SELECT library_id, revision FROM library_inventory_state",
    "SELECT id, user_id, session_date, notes FROM training_sessions",
    "SELECT session_id, position, exercise_id, weight_kg, reps, warmup FROM training_sets",
    "SELECT id, user_id, exercise_id, weight_kg, reps, recorded_on FROM user_manual_pr_records",
    "SELECT user_id, requested_version FROM user_stats_refresh_state",
    "SELECT id, owner_user_id, name FROM exercises",
    "SELECT api_key, language, active FROM provider_settings",
    "SELECT active_lease_cap FROM stats_projection_worker_settings",
)


def contents(conn: Connection) -> list[str]:
    return [
        str(sorted(map(str, fetch_all(conn, f"SELECT * FROM ({query}) AS q"))))
        for query in CONTENTS
    ]


def test_a_seed_replays_the_same_operations(
    server_url: str, template_name: str, standin: StandIn
) -> None:
    """Without workers the database is a pure function of the operations: two runs of
    one seed on two fresh databases end with identical contents."""
    outcomes = []
    for _ in range(2):
        name = f"inventory_replay_{uuid.uuid4().hex[:10]}"
        with connect(server_url) as admin:
            create_database(admin, name, template=template_name)
        url = url_with_database(server_url, name)
        try:
            with connect(url) as conn:
                workload = Workload(
                    conn, standin, random.Random(7), date(2026, 11, 30), partial(connect, url)
                )
                workload.setup()
                for _ in range(150):
                    workload.step()
                workload.settle()
                outcomes.append((dict(workload.done), dict(workload.refused), contents(conn)))
        finally:
            with connect(server_url) as admin:
                drop_database(admin, name)
                drop_writer_role(admin, name)
    assert outcomes[0] == outcomes[1]
    assert len(outcomes[0][0]) + len(outcomes[0][1]) >= 20  # most kinds were drawn
