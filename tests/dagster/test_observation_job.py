"""The observation job and sensor in process, against the loopback stand-in; after a
failure storm the key is nowhere: not in logs, not in the Dagster event log, not in any
database column other than its own setting."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import dagster as dg
import pytest

from inventory_pipeline.db import Connection, connect, execute, fetch_all
from inventory_pipeline.definitions import defs
from inventory_pipeline.defs import observation as obs_defs
from inventory_pipeline.defs.resources import InventoryDatabase, TmdbResource
from inventory_pipeline.provider.standin import StandIn
from tests import factories as f
from tests.conftest import TMDB_TEST_KEY

WRONG_KEY = "wrong-key-7e1d44a0b9"


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


@pytest.fixture
def tmdb_env(standin: StandIn) -> StandIn:
    return standin


def resources(db_url: str, standin: StandIn, **tmdb: int) -> dict[str, object]:
    """The database, and the TMDb resource pointed at the stand-in (no environment)."""
    return {
        "inventory_db": InventoryDatabase(url=db_url),
        "tmdb": TmdbResource(base_url=standin.url, rate=200, **tmdb),
    }


def run_job(
    instance: dg.DagsterInstance, db_url: str, standin: StandIn
) -> dg.ExecuteInProcessResult:
    return defs.resolve_job_def("provider_observation").execute_in_process(
        instance=instance, resources=resources(db_url, standin)
    )


def test_sensor_and_job_report_categories(
    conn: Connection, db_url: str, instance: dg.DagsterInstance, tmdb_env: StandIn
) -> None:
    f.provider_key(conn, TMDB_TEST_KEY)
    lib = f.library(conn)
    for tmdb_id in range(1, 11):
        f.tmdb_item(conn, lib, tmdb_id)
    tmdb_env.set_available("movie", 3, False)
    context = dg.build_sensor_context(
        instance=instance, resources={"inventory_db": InventoryDatabase(url=db_url)}
    )
    request = obs_defs.provider_observation_sensor(context)
    assert isinstance(request, dg.RunRequest) and request.run_key == "observe-1"
    result = run_job(instance, db_url, tmdb_env)
    assert result.success
    [mat] = [
        e.step_materialization_data.materialization
        for e in result.get_asset_materialization_events()
    ]
    assert mat.metadata["observed"].value == 9
    assert mat.metadata["by_category"].value == {"observed": 9, "not_found": 1}
    assert mat.metadata["cases_opened"].value == 1
    # Which item fails, without reading run logs: title, library, TMDb id, category,
    # attempts and next attempt of the oldest open cases.
    [case] = mat.metadata["oldest_open_cases"].value.records  # type: ignore[attr-defined]
    assert {k: case.data[k] for k in ("title", "tmdb_id", "category", "attempts")} == {
        "title": "Item 3",
        "tmdb_id": "movie 3",
        "category": "not_found",
        "attempts": 1,
    }
    assert case.data["library"] and case.data["next_attempt"] != "-"
    assert isinstance(obs_defs.provider_observation_sensor(context), dg.SkipReason)
    passed, _, _ = obs_defs.recovery_check_result(conn)
    assert passed
    # An open case past its deadline with no attempt fails the check.
    conn.execute(
        "UPDATE media_server_items SET observation_due_at = now() - interval '1 hour'"
        " WHERE recovery_case_id IS NOT NULL"
    )
    passed, description, _ = obs_defs.recovery_check_result(conn)
    assert not passed and description is not None


def test_the_recovery_check_counts_what_observation_may_claim(conn: Connection) -> None:
    """Cases of an inactive library wait for its owner, not for a stalled observer: the
    check passes and reports them apart. The count of overdue cases is the whole count,
    not the page the check lists."""
    server = f.server(conn)
    active, inactive = f.library(conn, server), f.library(conn, server, name="Old")
    f.auth_cases(conn, inactive, 1)
    execute(conn, "UPDATE libraries SET active = false WHERE id = %s", (inactive,))
    overdue = "UPDATE media_server_items SET observation_due_at = now() - interval '1 hour'"
    execute(conn, overdue)
    passed, description, metadata = obs_defs.recovery_check_result(conn)
    assert passed and description is None, description
    assert metadata["waiting_in_inactive_libraries"] == 1
    f.auth_cases(conn, active, 25, first_tmdb_id=100)
    execute(conn, overdue)
    passed, description, metadata = obs_defs.recovery_check_result(conn)
    assert not passed and metadata["overdue"] == 25
    assert description is not None and description.startswith("25 open recovery cases")


def test_key_absent_everywhere_after_a_failure_storm(
    conn: Connection,
    db_url: str,
    instance: dg.DagsterInstance,
    tmdb_env: StandIn,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level("DEBUG")
    lib = f.library(conn)
    ids = list(range(100, 140))
    for tmdb_id in ids:
        f.tmdb_item(conn, lib, tmdb_id)
    faults = [
        ("status", {"status": 500}),
        ("throttle", {"retry_after": "5"}),
        ("garbage", {}),
        ("close", {}),
        ("truncate", {}),
        ("status", {"status": 404}),
    ]
    categories: set[str] = set()
    for key in (TMDB_TEST_KEY, WRONG_KEY):
        f.provider_key(conn, key)
        for fault, options in [*faults, ("none", {})]:
            tmdb_env.set_fault(fault, **options)
            # The test clock: retry deadlines and any throttling pause have passed.
            conn.execute("UPDATE media_server_items SET observation_due_at = now()")
            conn.execute("UPDATE provider_admission SET paused_until = NULL")
            assert run_job(instance, db_url, tmdb_env).success
            categories |= {
                r["recovery_category"]
                for r in fetch_all(
                    conn, "SELECT DISTINCT recovery_category FROM media_server_items"
                )
            }
    tmdb_env.clear_fault()
    assert {"transient", "throttled", "invalid_response", "not_found", "auth"} <= categories
    out, err = capfd.readouterr()
    for key in (TMDB_TEST_KEY, WRONG_KEY):
        assert key not in caplog.text
        assert key not in out and key not in err
        for run in instance.get_runs():
            for entry in instance.all_logs(run.run_id):
                assert key not in str(entry)
            assert key not in str(run.run_config)
        assert f.tables_containing(conn, key) == []


def warnings_in(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    return [
        e.user_message
        for e in instance.all_logs(run_id)
        if e.level == logging.WARNING and "recovery case" in e.user_message
    ]


def test_malformed_identity_does_not_fail_the_run(
    conn: Connection, db_url: str, instance: dg.DagsterInstance, tmdb_env: StandIn
) -> None:
    f.provider_key(conn, TMDB_TEST_KEY)
    lib = f.library(conn)
    for tmdb_id in range(1, 6):
        f.tmdb_item(conn, lib, tmdb_id)
    poison = f.tmdb_item(conn, lib, 1)
    conn.execute("UPDATE media_server_items SET provider_id = '²' WHERE id = %s", (poison,))
    result = run_job(instance, db_url, tmdb_env)
    assert result.success
    [materialization] = result.asset_materializations_for_node("provider_observations")
    assert materialization.metadata["observed"].value == 5
    [warning] = warnings_in(instance, result.run_id)
    assert f'item {poison} "Item 1" (tmdb movie "²"):' in warning and "not_found" in warning
    row = f.item(conn, poison)
    assert row["recovery_category"] == "not_found" and row["observation_lease_token"] is None


def test_warnings_are_logged_as_cases_commit_even_if_the_run_dies(
    conn: Connection,
    db_url: str,
    instance: dg.DagsterInstance,
    tmdb_env: StandIn,
) -> None:
    """The run's sessions are ended while its second batch waits on a slow answer: the
    run fails, yet every case it committed was logged as a warning."""
    f.provider_key(conn, TMDB_TEST_KEY)
    lib = f.library(conn)
    for tmdb_id in range(1, 9):
        f.tmdb_item(conn, lib, tmdb_id)
        tmdb_env.set_available("movie", tmdb_id, False)
    tmdb_env.set_fault("slow", delay=3.0, ids=[5])

    def end_sessions_during_the_slow_answer() -> None:
        while len(tmdb_env.state.arrivals) < 5:
            time.sleep(0.01)
        with connect(db_url) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'inventory_pipeline.observer'"
                " AND datname = current_database()"  # not another session's test
            )

    killer = threading.Thread(target=end_sessions_during_the_slow_answer, daemon=True)
    killer.start()
    result = defs.resolve_job_def("provider_observation").execute_in_process(
        instance=instance,
        resources=resources(db_url, tmdb_env, workers=1),  # batches of four
        raise_on_error=False,
    )
    killer.join(timeout=10)
    assert not result.success
    cases = fetch_all(conn, "SELECT id FROM media_server_items WHERE recovery_case_id IS NOT NULL")
    assert len(cases) >= 4
    warned = warnings_in(instance, result.run_id)
    for case in cases:
        assert any(w.startswith(f'item {case["id"]} "') for w in warned)


def test_sensor_waits_while_admission_is_paused(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    f.provider_key(conn, TMDB_TEST_KEY)
    f.tmdb_item(conn, f.library(conn), 1)
    conn.execute(
        "UPDATE provider_admission SET paused_until = clock_timestamp() + interval '1 minute'"
    )
    context = dg.build_sensor_context(
        instance=instance, resources={"inventory_db": InventoryDatabase(url=db_url)}
    )
    skip = obs_defs.provider_observation_sensor(context)
    assert isinstance(skip, dg.SkipReason) and "paused" in str(skip.skip_message)
    conn.execute("UPDATE provider_admission SET paused_until = NULL")
    assert isinstance(obs_defs.provider_observation_sensor(context), dg.RunRequest)
