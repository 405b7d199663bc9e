"""Bad run config and partition keys: the run fails with one clear message
and the database is exactly as it was."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest

from inventory_pipeline.db import Connection
from inventory_pipeline.definitions import defs
from inventory_pipeline.defs import profile_ranges as ranges
from inventory_pipeline.defs import profiles as profile_defs
from inventory_pipeline.defs import stats_maintenance as maintenance_defs
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.models import RefreshPolicy
from tests import factories as f
from tests.db.test_bad_input import fingerprint

HOSTILE_KEY = "1; DROP TABLE libraries; --"


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def failure_message(result: dg.ExecuteInProcessResult) -> str:
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    error = failure.step_failure_data.error
    assert error is not None
    return error.message


@pytest.mark.parametrize(
    ("job", "run_config", "message"),
    [
        (
            profile_defs.library_profile_refresh,
            {"ops": {"refresh_claimed_profiles": {"config": {"max_claims": 0}}}},
            "max_claims must be positive",
        ),
        (
            maintenance_defs.stats_rebuild,
            {"ops": {"request_stats_rebuild": {"config": {"user_ids": [HOSTILE_KEY]}}}},
            "user_ids must be UUIDs",
        ),
        (
            defs.resolve_job_def("stats_drain"),
            {"ops": {"drain_stats": {"config": {"max_rounds": 0}}}},
            "max_rounds must be at least 1",
        ),
        (
            defs.resolve_job_def("stats_drain"),
            {"ops": {"drain_stats": {"config": {"idle_seconds": -1}}}},
            "idle_seconds must be 0 to 3600 and lifetime_seconds above 0 and at most 3600",
        ),
        (
            defs.resolve_job_def("stats_drain"),
            {"ops": {"drain_stats": {"config": {"lifetime_seconds": 0}}}},
            "idle_seconds must be 0 to 3600 and lifetime_seconds above 0 and at most 3600",
        ),
        (
            defs.resolve_job_def("stats_drain"),
            {"ops": {"drain_stats": {"config": {"lifetime_seconds": float("inf")}}}},
            "idle_seconds must be 0 to 3600 and lifetime_seconds above 0 and at most 3600",
        ),
        (
            defs.resolve_job_def("stats_drain"),
            {"ops": {"drain_stats": {"config": {"idle_seconds": float("nan")}}}},
            "idle_seconds must be 0 to 3600 and lifetime_seconds above 0 and at most 3600",
        ),
        (
            maintenance_defs.stats_retention,
            {"ops": {"prune_stats_history": {"config": {"run_batch": 0}}}},
            "run_batch and days must be at least 1",
        ),
    ],
    ids=[
        "refresh-claims",
        "rebuild-users",
        "drain-rounds",
        "drain-idle",
        "drain-lifetime",
        "drain-lifetime-infinite",
        "drain-idle-nan",
        "retention-batch",
    ],
)
def test_bad_run_config_fails_in_one_line_and_changes_nothing(
    conn: Connection,
    db_url: str,
    instance: dg.DagsterInstance,
    job: dg.JobDefinition,
    run_config: dict[str, Any],
    message: str,
) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 5)
    service.plan(conn, RefreshPolicy())
    before = fingerprint(conn)
    result = job.execute_in_process(
        run_config=run_config,
        instance=instance,
        resources={"inventory_db": InventoryDatabase(url=db_url)},
        raise_on_error=False,
    )
    assert not result.success
    text = failure_message(result)
    assert message in text.splitlines()[0]
    assert fingerprint(conn) == before


def test_hostile_partition_key_is_refused(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    lib = f.library(conn)
    f.items(conn, lib, 5)
    before = fingerprint(conn)
    instance.add_dynamic_partitions(ranges.library_partitions.name, [HOSTILE_KEY])
    result = dg.materialize(
        [profile_defs.library_profile],
        partition_key=HOSTILE_KEY,
        instance=instance,
        resources={"inventory_db": InventoryDatabase(url=db_url)},
        raise_on_error=False,
    )
    assert not result.success
    assert "partition keys must be library id ranges" in failure_message(result)
    assert fingerprint(conn) == before
