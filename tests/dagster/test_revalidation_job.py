"""The revalidation job, its sensor and the decision job in process, against the
loopback stand-in: what they record, how they refuse bad input, and the key nowhere
after a storm of faults (logs, event log, run config, tables)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest

from inventory_pipeline.db import Connection, execute
from inventory_pipeline.definitions import defs as definitions
from inventory_pipeline.defs import revalidation as defs
from inventory_pipeline.defs.resources import InventoryDatabase, TmdbResource
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from tests import factories as f
from tests import revalidation_cases as rc
from tests.conftest import TMDB_TEST_KEY
from tests.db.test_bad_input import fingerprint

WRONG_KEY = "wrong-key-3c8d1e7f02"


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def resources(db_url: str, standin: StandIn, per_hour: int = 60) -> dict[str, Any]:
    return {
        "inventory_db": InventoryDatabase(url=db_url),
        "tmdb": TmdbResource(base_url=standin.url, rate=200, revalidations_per_hour=per_hour),
    }


def sensor(instance: dg.DagsterInstance, db_url: str, standin: StandIn, per_hour: int = 60) -> Any:
    context = dg.build_sensor_context(
        instance=instance, resources=resources(db_url, standin, per_hour)
    )
    return defs.identity_revalidation_sensor(context)


def materialization(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    [event] = result.get_asset_materialization_events()
    mat = event.step_materialization_data.materialization
    assert mat.asset_key == defs.PROPOSALS
    return {k: v.value for k, v in mat.metadata.items()}


def decide(
    instance: dg.DagsterInstance, db_url: str, config: dict[str, Any]
) -> dg.ExecuteInProcessResult:
    return defs.replacement_decision.execute_in_process(
        run_config={"ops": {"decide_replacement_proposals": {"config": config}}},
        instance=instance,
        resources={"inventory_db": InventoryDatabase(url=db_url)},
        raise_on_error=False,
    )


def failure(result: dg.ExecuteInProcessResult) -> str:
    [event] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert event.step_failure_data.error is not None
    return event.step_failure_data.error.message


@pytest.fixture
def movies(conn: Connection) -> int:
    f.provider_key(conn, TMDB_TEST_KEY)
    return f.library(conn)


def test_sensor_job_and_decision(
    conn: Connection,
    db_url: str,
    instance: dg.DagsterInstance,
    standin: StandIn,
    client: TmdbClient,
    movies: int,
) -> None:
    assert "no cases due" in str(sensor(instance, db_url, standin).skip_message)
    merged = rc.merged(conn, client, standin, movies, 603, 9603, title="Heat", year=1995)
    odd = rc.merged(conn, client, standin, movies, 604, 9604, survivor={"year": 2001})
    request = sensor(instance, db_url, standin)
    assert isinstance(request, dg.RunRequest) and request.run_key == "revalidate-1"
    run = definitions.resolve_job_def("identity_revalidation").execute_in_process(
        instance=instance, resources=resources(db_url, standin)
    )
    assert run.success
    metadata = materialization(run)
    assert (metadata["checked"], metadata["proposed"], metadata["unproposed"]) == (2, 1, 1)
    assert metadata["awaiting_decision"] == 1 and metadata["no_proposal_by_reason"] == {"year": 1}
    [row] = [r.data for r in metadata["proposals"].records]
    assert (row["item"], row["state"], row["old_id"], row["candidate"]) == (
        merged,
        "proposed",
        603,
        9603,
    )
    assert (row["title"], row["year"], row["library"]) == (
        '"Heat" = "Heat"',
        "1995 ~ 1995",
        "Movies",
    )
    assert row["evidence"] == "imdb_id tt0000603" and row["age_hours"] == 0
    [why] = [r.data for r in metadata["no_proposal"].records]
    assert (why["item"], why["reason"], why["passed"]) == (
        odd,
        "year",
        "single candidate, round trip, title",
    )
    columns = [c.name for c in metadata["proposals"].schema.columns]
    assert columns[:7] == ["proposal", "state", "item", "library", "kind", "old_id", "candidate"]
    infos = [e.user_message for e in instance.all_logs(run.run_id) if e.level == logging.INFO]
    assert any(f"item {merged}: replacement proposed" in m for m in infos)
    assert any(f"item {odd}: no replacement proposed for TMDb 604 (year;" in m for m in infos)
    assert "no cases due" in str(sensor(instance, db_url, standin).skip_message)

    proposal = row["proposal"]
    approved = decide(instance, db_url, {"approve": [proposal], "operator": "alice"})
    assert approved.success
    after = materialization(approved)
    [row] = [r.data for r in after["proposals"].records]
    assert (row["state"], after["approved_now"], after["awaiting_decision"]) == ("approved", 1, 0)
    messages = [e.user_message for e in instance.all_logs(approved.run_id)]
    assert any(
        f"proposal {proposal} approved: item {merged} observed under TMDb 9603" in m
        for m in messages
    )


def test_a_spent_budget_or_a_pause_holds_the_sensor(
    conn: Connection,
    db_url: str,
    instance: dg.DagsterInstance,
    standin: StandIn,
    client: TmdbClient,
    movies: int,
) -> None:
    rc.merged(conn, client, standin, movies, 603, 9603)
    rc.merged(conn, client, standin, movies, 604, 9604)
    run = definitions.resolve_job_def("identity_revalidation").execute_in_process(
        instance=instance, resources=resources(db_url, standin, per_hour=1)
    )
    assert run.success and materialization(run)["checked"] == 1
    skip = sensor(instance, db_url, standin, per_hour=1)
    assert "1 cases due; the hourly budget of 1 is spent" in str(skip.skip_message)
    assert isinstance(sensor(instance, db_url, standin, per_hour=2), dg.RunRequest)
    execute(
        conn, "UPDATE provider_admission SET paused_until = clock_timestamp() + interval '1 minute'"
    )
    assert "admission paused" in str(sensor(instance, db_url, standin, per_hour=2).skip_message)


def test_a_bad_budget_setting_fails_the_tick_in_one_line(
    db_url: str, instance: dg.DagsterInstance, standin: StandIn
) -> None:
    with pytest.raises(Exception) as failed:
        sensor(instance, db_url, standin, per_hour=0)
    assert "INVENTORY_REVALIDATIONS_PER_HOUR must be from 1 to 3600, got 0" in str(failed.value)


def test_a_refused_decision_fails_in_one_line_and_changes_nothing(
    conn: Connection,
    db_url: str,
    instance: dg.DagsterInstance,
    standin: StandIn,
    client: TmdbClient,
    movies: int,
) -> None:
    rc.merged(conn, client, standin, movies, 603, 9603)
    [proposed] = rc.revalidate(conn, client).results
    one = proposed.proposal_id
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"approve": [424242], "operator": "alice"}, "proposal 424242 does not exist"),
        ({"operator": "alice"}, "name at least one proposal"),
        (
            {"approve": [one], "reject": [one], "operator": "alice"},
            f"proposal {one} is named twice",
        ),
        ({"approve": [one], "operator": ""}, "the operator's name must be 1 to 64"),
        ({"approve": [-3], "operator": "alice"}, "proposal ids are positive whole numbers"),
    ]
    before = fingerprint(conn)
    for config, message in refusals:
        result = decide(instance, db_url, config)
        assert not result.success
        text = failure(result)
        assert message in text and "\n" not in text.strip(), text
        assert fingerprint(conn) == before


@pytest.mark.parametrize(
    "config",
    [
        {"approve": ["7"], "operator": "alice"},
        {"approve": [7]},
        {"approve": [7], "operator": "a", "x": 1},
    ],
    ids=["not-an-id", "no-operator", "unknown-field"],
)
def test_run_config_is_typed(
    db_url: str, instance: dg.DagsterInstance, config: dict[str, Any]
) -> None:
    with pytest.raises(dg.DagsterInvalidConfigError):
        decide(instance, db_url, config)


def test_key_absent_everywhere_after_a_revalidation_storm(
    conn: Connection,
    db_url: str,
    instance: dg.DagsterInstance,
    standin: StandIn,
    client: TmdbClient,
    movies: int,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level("DEBUG")
    for n in range(6):
        rc.merged(conn, client, standin, movies, 600 + n, 9600 + n)
    faults = [
        ("status", {"status": 500}),
        ("throttle", {"retry_after": "5"}),
        ("garbage", {}),
        ("close", {}),
        ("truncate", {}),
        ("status", {"status": 401}),
    ]
    for key in (TMDB_TEST_KEY, WRONG_KEY):
        f.provider_key(conn, key)
        for fault, options in [*faults, ("none", {})]:
            standin.set_fault(fault, **options)
            execute(conn, "UPDATE identity_revalidations SET due_at = now() WHERE outcome IS NULL")
            execute(conn, "UPDATE provider_admission SET paused_until = NULL")
            execute(conn, "UPDATE revalidation_budget SET recent_claims = '{}'")
            run = definitions.resolve_job_def("identity_revalidation").execute_in_process(
                instance=instance, resources=resources(db_url, standin)
            )
            assert run.success
    standin.clear_fault()
    out, err = capfd.readouterr()
    for key in (TMDB_TEST_KEY, WRONG_KEY):
        assert key not in caplog.text and key not in out and key not in err
        for r in instance.get_runs():
            for entry in instance.all_logs(r.run_id):
                assert key not in str(entry)
            assert key not in str(r.run_config)
        assert f.tables_containing(conn, key) == []
    assert rc.proposals(conn)  # the storm ended with the right key: checks concluded
