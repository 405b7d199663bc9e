"""Dagster must do its share: the judgement of a run's Dagster figures (a share under
its minimum, a run that failed outside every injected fault) without a database, and
the figures themselves read from a real Dagster run storage and the audit trail."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from chaos import invariants
from chaos.config import (
    DAEMON_ENV,
    DAEMON_STOPPED_SENSORS,
    DAGSTER_MIN_SHARE,
)
from chaos.daemon import (
    ACKS,
    PUBLICATIONS,
    REVALIDATIONS,
    SHARE_KINDS,
    Daemon,
    dagster_divergences,
    event_error,
    failed_run_line,
    run_span,
)
from inventory_pipeline.db import Connection, connect, execute
from inventory_pipeline.db.connection import create_database
from inventory_pipeline.deployment import dagster_storage_url
from inventory_pipeline.settings import Settings

ENOUGH = {ACKS: 5, PUBLICATIONS: 2, REVALIDATIONS: 0}
MINIMUMS = {ACKS: 5, PUBLICATIONS: 1}
RESTART = ("restart", 1000.0, 1004.0)


def failed(started: float, ended: float, error: str = "DatabaseUnavailable: lost") -> str:
    return failed_run_line("stats_drain", "0123456789abcdef", started, ended, error)


def test_a_share_at_its_minimum_and_runs_failed_in_a_restart_pass() -> None:
    lines = [failed(999.0, 1001.0), failed(1003.5, 1010.0), failed(990.0, 1020.0)]
    assert dagster_divergences(ENOUGH, lines, [RESTART], MINIMUMS, margin=1.0) == []


def test_a_share_under_its_minimum_fails() -> None:
    assert dagster_divergences({ACKS: 4, PUBLICATIONS: 0}, [], [], MINIMUMS) == [
        "Dagster: 4 profile acknowledgements by Dagster runs (minimum 5)",
        "Dagster: 0 stats publications by Dagster runs (minimum 1)",
    ]
    # Nothing counted (a database that could not be read) is under every minimum.
    assert len(dagster_divergences({}, [], [], MINIMUMS)) == len(MINIMUMS)


def test_the_configured_minimums_pass_the_least_measured_run_and_fail_an_idle_daemon() -> None:
    least = {ACKS: 11, PUBLICATIONS: 8, REVALIDATIONS: 0}  # config.DAGSTER_MIN_SHARE's figures
    assert dagster_divergences(least, [], []) == []
    assert dagster_divergences({ACKS: 7, PUBLICATIONS: 0, REVALIDATIONS: 0}, [], []) == [
        "Dagster: 0 stats publications by Dagster runs (minimum 1)"
    ]


def test_a_run_failed_outside_every_fault_fails() -> None:
    before, after = failed(990.0, 998.9), failed(1005.1, 1006.0)
    assert dagster_divergences(ENOUGH, [before, after], [RESTART], MINIMUMS, margin=1.0) == [
        f"Dagster run failed outside any injected fault: {before}",
        f"Dagster run failed outside any injected fault: {after}",
    ]
    # Without a fault injected, any failed run is one.
    assert len(dagster_divergences(ENOUGH, [failed(1001.0, 1002.0)], [], MINIMUMS)) == 1
    # A line without a span (unreadable run storage) never passes for one in a fault.
    unreadable = "run storage unreadable: DatabaseUnavailable: refused"
    assert dagster_divergences(ENOUGH, [unreadable], [RESTART], MINIMUMS) == [
        f"Dagster run failed outside any injected fault: {unreadable}"
    ]


def test_a_failed_run_line_names_job_run_span_and_error() -> None:
    line = failed_run_line("identity_revalidation", "a1b2c3d4e5f6", 1000.25, 1003.75, "Boom: no")
    assert line.startswith("identity_revalidation run a1b2c3d4 failed ")
    assert line.endswith(" UTC (epoch 1000.2-1003.8): Boom: no")
    assert run_span(line) == (1000.2, 1003.8)
    assert run_span("identity_revalidation run a1b2c3d4: Boom") is None


def test_the_config_names_what_is_counted_and_the_product_reads_it() -> None:
    assert set(DAGSTER_MIN_SHARE) <= set(SHARE_KINDS)
    settings = Settings.from_env(DAEMON_ENV)
    assert settings.policy.lease_seconds == int(DAEMON_ENV["INVENTORY_LEASE_SECONDS"])
    from inventory_pipeline.definitions import defs

    sensors = {s.name for s in defs.sensors or ()}
    assert set(DAEMON_STOPPED_SENSORS) < sensors


@dg.op
def lose_the_database() -> None:
    raise RuntimeError("the connection is lost\nsecond line")


@dg.job
def broken() -> None:
    lose_the_database()


@dg.asset(key=dg.AssetKey("replacement_proposals"))
def proposals() -> dg.MaterializeResult[None]:
    return dg.MaterializeResult(
        metadata={"checked": 9, "proposed": 2, "unproposed": 3, "faults": 1, "due": 4}
    )


REVALIDATION_JOB = dg.Definitions(
    assets=[proposals],
    jobs=[dg.define_asset_job("identity_revalidation", selection=[proposals])],
).resolve_job_def("identity_revalidation")


def test_event_error_is_the_innermost_cause() -> None:
    with dg.instance_for_test() as instance:
        result = broken.execute_in_process(instance=instance, raise_on_error=False)
        events = [
            dg.serialize_value(e)
            for e in instance.all_logs(result.run_id)
            if e.dagster_event is not None and e.dagster_event.is_failure
        ]
    assert events
    assert {event_error(e) for e in events} == {"RuntimeError: the connection is lost"}
    assert event_error("{not json") == "unreadable failure event"
    assert event_error('{"dagster_event": {"message": "run worker died"}}') == "run worker died"


@pytest.fixture
def daemon(server_url: str, db_url: str, tmp_path: Path) -> Iterator[Daemon]:
    """A Daemon on the test database, never started: its run storage is filled by runs
    executed in process on a Postgres-backed instance (the db_url fixture drops it)."""
    daemon = Daemon(server_url, db_url, "http://127.0.0.1:9", tmp_path)
    with connect(server_url) as admin:
        create_database(admin, daemon.database)
    yield daemon


def test_failed_runs_and_share_read_the_storage_and_the_audit(
    daemon: Daemon, conn: Connection, db_url: str
) -> None:
    storage = {"storage": {"postgres": {"postgres_url": dagster_storage_url(daemon.storage_url)}}}
    with dg.instance_for_test(overrides=storage) as instance:
        bad = broken.execute_in_process(instance=instance, raise_on_error=False)
        REVALIDATION_JOB.execute_in_process(instance=instance)
        record = instance.get_run_record_by_id(bad.run_id)
    assert record is not None and record.start_time and record.end_time
    [line] = daemon.failed_runs()
    assert line.startswith(f"broken run {bad.run_id[:8]} failed ")
    assert line.endswith(": RuntimeError: the connection is lost")
    span = run_span(line)
    assert span is not None
    assert span[0] == pytest.approx(record.start_time, abs=0.1)
    assert span[1] == pytest.approx(record.end_time, abs=0.1)

    execute(conn, (Path(invariants.__file__).with_name("audit.sql")).read_text())
    for actor in ("inventory_pipeline.dagster", "chaos.refresher.41", "inventory_pipeline"):
        execute(
            conn,
            "INSERT INTO chaos_profile_acks (request_id, library_id, actor) VALUES (1, 1, %s)",
            (actor,),
        )
    for actor in ("inventory_pipeline.dagster", "chaos.drainer.7", "chaos.stats.8"):
        execute(
            conn,
            "INSERT INTO chaos_stats_publications (run_id, user_id, lease_token, lease_until,"
            " target_version, base_version, actor)"
            " VALUES (1, %s, %s, now(), 2, 1, %s)",
            (uuid.uuid4(), uuid.uuid4(), actor),
        )
    assert daemon.share(db_url) == {ACKS: 2, PUBLICATIONS: 1, REVALIDATIONS: 6}
