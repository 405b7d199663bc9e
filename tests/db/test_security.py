"""Security: the application role's reach, hostile strings as data through
every write path, and hostile provider records that must not become failed writes."""

from __future__ import annotations

import json
import uuid
from datetime import date

import pytest

from inventory_pipeline.db import Connection, DatabaseError, execute, fetch_all, fetch_one
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.provider.standin import StandIn, record
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.recovery.policy import RetryPolicy
from inventory_pipeline.stats import service
from tests import factories as f
from tests import stats_factories as sf
from tests.conftest import TMDB_TEST_KEY
from tests.db.test_interleavings import process_all
from tests.roles import acting_as, writer_role

HOSTILE = (
    "Robert'); DROP TABLE media_server_items; --",
    '"; DELETE FROM libraries WHERE ""="',
    "$$ || pg_sleep(10) || $$",
    "%(library_id)s %s {0} \\x27",
    "' OR 1=1 --",
)
APPLICATION_FUNCTIONS = {
    "delete_manual_pr(uuid,bigint)",
    "delete_training_session(uuid,uuid)",
    "get_pr_overview(uuid,date)",
    "get_pr_overview_status(uuid,date)",
    "request_stats_refresh(uuid,date,text[],text)",
    "save_manual_pr(uuid,text,numeric,integer,date)",
    "save_training_session(uuid,jsonb)",
    "stats_clock_date()",
    "stats_current_user_id()",  # the row-level policies call it as the querying role
}
APPLICATION_TABLES = {"exercises", "user_exercise_stats", "user_training_period_stats"}


def test_application_role_reaches_only_its_surface(conn: Connection) -> None:
    executable = {
        r["f"]
        for r in fetch_all(
            conn,
            "SELECT p.oid::regprocedure::text AS f FROM pg_proc p"
            " JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = 'public'"
            " AND has_function_privilege('inventory_app', p.oid, 'EXECUTE')",
        )
    }
    assert executable == APPLICATION_FUNCTIONS
    reachable = {
        r["t"]: r["p"]
        for r in fetch_all(
            conn,
            "SELECT c.relname AS t, array_agg(p.privilege ORDER BY p.privilege) AS p"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " CROSS JOIN unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE',"
            "   'REFERENCES', 'TRIGGER']) AS p(privilege)"
            " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'v', 'm', 'p')"
            " AND has_table_privilege('inventory_app', c.oid, p.privilege)"
            " GROUP BY c.relname",
        )
    }
    assert reachable == {table: ["SELECT"] for table in APPLICATION_TABLES}


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT * FROM profile_refresh_requests",  # the profile queue
        "SELECT * FROM library_inventory_state",
        "SELECT * FROM user_exercise_stats_refresh_jobs",  # the stats queue
        "SELECT * FROM user_stats_projection_runs",  # runs
        "SELECT api_key FROM provider_settings",  # settings (the key)
        "SELECT * FROM stats_projection_worker_settings",
        "SELECT * FROM credential_wakeups",
        "SELECT recovery_case_id FROM media_server_items",  # recovery internals
        "SELECT * FROM provider_observations",
        "UPDATE provider_admission SET next_admission_at = now()",
        "SELECT advance_inventory_revisions(ARRAY[1::bigint])",  # worker functions
        "SELECT estimated_one_rep_max(100, 5)",
        "SELECT inventory_observation_of(i) FROM media_server_items i",
    ],
)
def test_application_role_is_refused(conn: Connection, statement: str) -> None:
    with pytest.raises(DatabaseError, match="permission denied"), conn.transaction():
        execute(conn, "SET LOCAL ROLE inventory_app")
        execute(conn, statement)


def test_application_writes_still_fire_capture(conn: Connection, db_url: str) -> None:
    """Revoking EXECUTE on the internal functions does not stop the triggers: the
    application's writes and those of a writer role granted only its table rights are
    both captured."""
    sf.exercise(conn, "squat")
    user = uuid.uuid4()
    with conn.transaction():
        execute(conn, "SET LOCAL ROLE inventory_app")
        execute(conn, "SELECT set_config('inventory.current_user_id', %s, true)", (str(user),))
        sf.save(conn, user, date(2026, 3, 1), sf.sets(("squat", 100, 5)))
    assert sf.versions(conn, user) == (1, 0)
    lib = f.library(conn)
    with writer_role(db_url) as writer, acting_as(conn, writer):
        assert fetch_one(conn, "SELECT current_user AS u") == {"u": writer}
        f.items(conn, lib, 3)
    assert f.revision(conn, lib) == 1


def strings(value: object) -> set[str]:
    """Every key and string value in a JSON document."""
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        return set(value) | {s for v in value.values() for s in strings(v)}
    if isinstance(value, list):
        return {s for v in value for s in strings(v)}
    return set()


def test_hostile_strings_are_data_on_every_write_path(conn: Connection) -> None:
    server = f.server(conn, name=HOSTILE[1])
    lib = f.library(conn, server, name=HOSTILE[0])
    f.items(
        conn,
        lib,
        5,
        title=HOSTILE[2],
        genres=list(HOSTILE),
        primary_studio=HOSTILE[3],
        original_language=HOSTILE[4],
    )
    [done] = process_all(conn)
    assert done.outcome == "published"  # type: ignore[attr-defined]
    stored = f.profile(conn, lib)
    assert stored is not None
    assert set(HOSTILE) <= strings(stored["profile"])  # genres, studio, language: verbatim
    assert fetch_one(conn, "SELECT name FROM libraries WHERE id = %s", (lib,)) == {
        "name": HOSTILE[0]
    }
    # The training log: a hostile exercise id, session notes and a rebuild reason.
    exercise = sf.exercise(conn, HOSTILE[0])
    user = uuid.uuid4()
    execute(
        conn,
        "SELECT save_training_session(%s, %s)",
        (
            user,
            json.dumps(
                {
                    "user_id": str(user),
                    "session_date": "2026-03-01",
                    "notes": HOSTILE[1],
                    "sets": sf.sets((exercise, 100, 5)),
                }
            ),
        ),
    )
    execute(conn, "SELECT request_stats_refresh(%s, NULL, %s, %s)", (user, [exercise], HOSTILE[2]))
    service.drain(conn, "worker")
    assert list(sf.exercise_stats(conn, user)) == [HOSTILE[0]]
    assert fetch_one(conn, "SELECT notes FROM training_sessions WHERE user_id = %s", (user,)) == {
        "notes": HOSTILE[1]
    }
    tables = fetch_one(
        conn,
        "SELECT count(*) AS n FROM pg_tables WHERE tablename IN"
        " ('media_server_items', 'libraries', 'training_sessions')",
    )
    assert tables == {"n": 3}


def _body(**changes: object) -> str:
    return json.dumps({**record("movie", 11), **changes})


@pytest.mark.parametrize(
    ("body", "outcome", "category"),
    [
        (_body(title=HOSTILE[0], genres=[{"id": 1, "name": HOSTILE[1]}]), "observed", None),
        (_body(original_language=HOSTILE[4]), "observed", None),
        (_body(title="nul \u0000 inside"), "failed", "invalid_response"),
        (_body(genres=[{"id": 1, "name": "bad \u0000"}]), "failed", "invalid_response"),
        (_body().replace('"Movie 11"', '"lone \\ud800 surrogate"'), "failed", "invalid_response"),
        (_body(vote_count=2**40), "failed", "invalid_response"),
        (_body(vote_average=float("nan")), "failed", "invalid_response"),
        (_body(id=12), "failed", "invalid_response"),
        (_body(release_date="2026-02-30"), "failed", "invalid_response"),
        ("[]", "failed", "invalid_response"),
        ('{"id": 11, "title": ' + "[" * 5000 + "]" * 5000 + "}", "failed", "invalid_response"),
    ],
    ids=[
        "sql-metacharacters",
        "hostile-language",
        "nul-in-title",
        "nul-in-genre",
        "lone-surrogate",
        "vote-count-overflow",
        "nan",
        "other-id",
        "impossible-date",
        "not-an-object",
        "deep-nesting",
    ],
)
def test_hostile_provider_records(
    conn: Connection,
    standin: StandIn,
    client: TmdbClient,
    body: str,
    outcome: str,
    category: str | None,
) -> None:
    f.provider_key(conn, TMDB_TEST_KEY)
    item = f.tmdb_item(conn, f.library(conn), 11)
    standin.set_fault("body", body=body)
    [claim] = recovery.claim(conn, 10)
    result = recovery.observe_claim(
        conn, claim, client, recovery.provider_settings(conn), RetryPolicy()
    )
    assert (result.outcome, result.category) == (outcome, category)
    row = f.item(conn, item)
    assert row["observation_lease_token"] is None  # recorded, not a crashed write
    if outcome == "observed":
        observed = fetch_one(
            conn, "SELECT title, genres FROM provider_observations WHERE item_id = %s", (item,)
        )
        assert observed is not None
        assert json.loads(body)["title"] == observed["title"]
        process_all(conn)  # and the observed language flows into a profile as data
        assert profiles.profile_status(conn, [row["library_id"]])[0].items == 1
