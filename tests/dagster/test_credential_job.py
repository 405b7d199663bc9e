"""The wakeup sensor and job in process: verify, then release, with run metadata."""

from __future__ import annotations

from collections.abc import Iterator

import dagster as dg
import pytest

from inventory_pipeline.credentials import service as credentials
from inventory_pipeline.db import Connection, execute, fetch_one
from inventory_pipeline.definitions import defs
from inventory_pipeline.defs import credentials as wake_defs
from inventory_pipeline.defs.resources import InventoryDatabase, TmdbResource
from inventory_pipeline.provider.standin import StandIn
from tests import factories as f
from tests.conftest import TMDB_TEST_KEY


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def skipped(answer: object) -> bool:
    """A tick that launches nothing: a skip, or the key check recorded with a skip."""
    if isinstance(answer, dg.SensorResult):
        return not answer.run_requests and answer.skip_reason is not None
    return isinstance(answer, dg.SkipReason)


def test_sensor_launches_verification_then_release(
    conn: Connection,
    db_url: str,
    instance: dg.DagsterInstance,
    standin: StandIn,
) -> None:
    db = InventoryDatabase(url=db_url)
    resources = {"inventory_db": db, "tmdb": TmdbResource(base_url=standin.url)}
    context = dg.build_sensor_context(instance=instance, resources={"inventory_db": db})
    assert skipped(wake_defs.credential_wakeup_sensor(context))
    f.provider_key(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 3)
    request = wake_defs.credential_wakeup_sensor(context)
    assert isinstance(request, dg.RunRequest)
    result = defs.resolve_job_def("credential_wakeup").execute_in_process(
        instance=instance, resources=resources
    )
    assert result.success
    [materialization] = result.asset_materializations_for_node("tmdb_credential")
    shown = {k: v.value for k, v in materialization.metadata.items()}
    assert shown["verification"] == "verified" and shown["released"] == 3
    assert len(str(shown["generation"])) == 8
    assert TMDB_TEST_KEY not in str(shown)
    # Nothing left to release: the sensor skips; a new key generation is probed again.
    assert skipped(wake_defs.credential_wakeup_sensor(context))
    execute(conn, "UPDATE provider_settings SET api_key = 'rotated-key'")
    assert isinstance(wake_defs.credential_wakeup_sensor(context), dg.RunRequest)


def test_sensor_launches_no_probe_while_admission_is_paused(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    """A probe could not be sent during the fleet's pause: the tick says why instead of
    launching a run that would report `not needed`; once the pause ends, it launches."""
    db = InventoryDatabase(url=db_url)
    context = dg.build_sensor_context(instance=instance, resources={"inventory_db": db})
    f.provider_key(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 3)
    execute(conn, "UPDATE provider_admission SET paused_until = now() + interval '1 hour'")
    answer = wake_defs.credential_wakeup_sensor(context)
    assert skipped(answer)
    reason = answer.skip_reason if isinstance(answer, dg.SensorResult) else answer
    assert "admission paused for" in str(reason)
    execute(conn, "UPDATE provider_admission SET paused_until = now() - interval '1 s'")
    assert isinstance(wake_defs.credential_wakeup_sensor(context), dg.RunRequest)


WRONG_KEY = "wrong-key-3c0ffee1d2"


def test_key_absent_everywhere_after_a_probe_storm(
    conn: Connection,
    db_url: str,
    instance: dg.DagsterInstance,
    standin: StandIn,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Every probe outcome, with the right key and a rejected one: the keys appear in no
    log line, event, run config or column other than their own setting."""
    caplog.set_level("DEBUG")
    db = InventoryDatabase(url=db_url)
    resources = {"inventory_db": db, "tmdb": TmdbResource(base_url=standin.url)}
    f.auth_cases(conn, f.library(conn), 3)
    faults = [
        ("status", {"status": 500}),
        ("status", {"status": 401}),
        ("throttle", {"retry_after": "30"}),
        ("garbage", {}),
        ("close", {}),
        ("truncate", {}),
        ("none", {}),
    ]
    outcomes = set()
    for key in (TMDB_TEST_KEY, WRONG_KEY):
        f.provider_key(conn, key)
        for fault, options in faults:
            standin.set_fault(fault, **options)
            # The test clock: whatever backoff or pause the last probe earned has passed.
            execute(
                conn, "UPDATE credential_wakeups SET next_probe_at = NULL, throttled_until = NULL"
            )
            execute(conn, "UPDATE provider_admission SET paused_until = NULL")
            result = defs.resolve_job_def("credential_wakeup").execute_in_process(
                instance=instance, resources=resources
            )
            assert result.success
            row = fetch_one(conn, "SELECT last_outcome FROM credential_wakeups")
            assert row is not None
            outcomes.add(row["last_outcome"])
    standin.clear_fault()
    assert {"verified", "auth", "throttled", "transient", "invalid_response"} <= outcomes
    out, err = capfd.readouterr()
    for key in (TMDB_TEST_KEY, WRONG_KEY):
        assert key not in caplog.text and key not in out and key not in err
        for run in instance.get_runs():
            assert key not in str(run.run_config) and key not in str(run.tags)
            for entry in instance.all_logs(run.run_id):
                assert key not in str(entry)
        assert f.tables_containing(conn, key) == []


def test_sensor_never_stacks_runs_behind_one_in_flight(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    f.provider_key(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 3)
    context = dg.build_sensor_context(
        instance=instance, resources={"inventory_db": InventoryDatabase(url=db_url)}
    )
    assert isinstance(wake_defs.credential_wakeup_sensor(context), dg.RunRequest)
    stuck = instance.create_run_for_job(
        defs.resolve_job_def("credential_wakeup"), status=dg.DagsterRunStatus.STARTED
    )
    skip = wake_defs.credential_wakeup_sensor(context)
    assert skipped(skip) and "already" in str(skip)
    instance.report_run_failed(stuck)
    assert isinstance(wake_defs.credential_wakeup_sensor(context), dg.RunRequest)


def test_a_key_nobody_needed_to_probe_says_why_it_is_unverified(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    """The demo's key, or any key saved while no authentication case waits: nothing
    probes it, and the check says so instead of showing no status (0/1) while `status`
    printed a bare "unverified". Recorded once per change, not every tick."""
    context = dg.build_sensor_context(
        instance=instance, resources={"inventory_db": InventoryDatabase(url=db_url)}
    )
    missing = wake_defs.credential_wakeup_sensor(context)
    assert isinstance(missing, dg.SensorResult)
    [absent] = missing.asset_events
    assert isinstance(absent, dg.AssetCheckEvaluation) and not absent.passed
    assert absent.description == "no active TMDb key is saved (inventory-pipeline tmdb-key)"
    f.provider_key(conn, TMDB_TEST_KEY)
    saved = wake_defs.credential_wakeup_sensor(context)
    assert isinstance(saved, dg.SensorResult)
    [evaluation] = saved.asset_events
    assert isinstance(evaluation, dg.AssetCheckEvaluation)
    assert evaluation.passed and evaluation.check_name == wake_defs.KEY_CHECK
    assert evaluation.description is not None
    assert evaluation.description.endswith(
        "is unverified, which is expected: a key is probed only when authentication cases "
        "wait for it, and none does"
    )
    assert TMDB_TEST_KEY not in str(evaluation)
    assert isinstance(wake_defs.credential_wakeup_sensor(context), dg.SkipReason)


def test_a_rejected_key_stays_red_until_a_new_key_is_saved(
    conn: Connection, db_url: str, instance: dg.DagsterInstance, standin: StandIn
) -> None:
    """The key check reads the current generation's last probe from the database: a
    later run with nothing to probe (the rejected key waits out its backoff) does not
    turn the rejection into a warning, and a newly saved key does not inherit it."""
    f.provider_key(conn, WRONG_KEY)
    f.auth_cases(conn, f.library(conn), 2)
    resources = {
        "inventory_db": InventoryDatabase(url=db_url),
        "tmdb": TmdbResource(base_url=standin.url),
    }
    job = defs.resolve_job_def("credential_wakeup")

    def evaluation(result: dg.ExecuteInProcessResult) -> tuple[bool, str]:
        [check] = result.get_asset_check_evaluations()
        return check.passed, str(check.description)

    rejected = job.execute_in_process(instance=instance, resources=resources)
    [materialization] = rejected.asset_materializations_for_node("tmdb_credential")
    assert materialization.metadata["verification"].value == "auth"
    passed, description = evaluation(rejected)
    assert not passed and "TMDb rejected key generation" in description
    later = job.execute_in_process(instance=instance, resources=resources)
    [materialization] = later.asset_materializations_for_node("tmdb_credential")
    assert materialization.metadata["verification"].value == "not needed"
    assert evaluation(later) == (passed, description)
    f.provider_key(conn, TMDB_TEST_KEY)
    context = dg.build_sensor_context(
        instance=instance, resources={"inventory_db": resources["inventory_db"]}
    )
    assert isinstance(wake_defs.credential_wakeup_sensor(context), dg.RunRequest)
    passed, _, description, _ = wake_defs.key_check(credentials.status(conn))
    assert not passed and "not verified; 2 authentication cases wait" in description
