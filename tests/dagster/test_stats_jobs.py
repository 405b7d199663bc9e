"""The stats sensor, drain and rebuild jobs in process on real PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import date

import dagster as dg
import pytest

from inventory_pipeline.db import Connection
from inventory_pipeline.defs import stats as stats_defs
from inventory_pipeline.defs import stats_maintenance as maintenance_defs
from inventory_pipeline.defs.resources import InventoryDatabase
from tests import stats_factories as sf


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def test_sensor_drain_and_rebuild(
    conn: Connection, db_url: str, instance: dg.DagsterInstance
) -> None:
    db = InventoryDatabase(url=db_url)
    context = dg.build_sensor_context(instance=instance, resources={"inventory_db": db})
    assert isinstance(stats_defs.stats_refresh_sensor(context), dg.SkipReason)
    sf.exercise(conn, "squat")
    users = [uuid.uuid4() for _ in range(3)]
    for u in users:
        sf.save(conn, u, date(2026, 3, 10), sf.sets(("squat", 100, 5)))
    request = stats_defs.stats_refresh_sensor(context)
    assert isinstance(request, dg.RunRequest) and request.run_key == "stats-drain-1"
    result = stats_defs.stats_drain.execute_in_process(
        instance=instance, resources={"inventory_db": db}
    )
    assert result.success
    mats = [
        e.step_materialization_data.materialization
        for e in result.get_asset_materialization_events()
    ]
    assert {m.asset_key.path[0] for m in mats} == {
        "user_exercise_stats",
        "user_training_period_stats",
    }
    assert mats[0].metadata["users"].value == 3 and mats[0].metadata["generations"].value == 3
    assert all(sf.versions(conn, u) == (1, 1) for u in users)
    assert isinstance(stats_defs.stats_refresh_sensor(context), dg.SkipReason)

    rebuild = maintenance_defs.stats_rebuild.execute_in_process(
        instance=instance,
        resources={"inventory_db": db},
        run_config={"ops": {"request_stats_rebuild": {"config": {"user_ids": [str(users[0])]}}}},
    )
    assert rebuild.success
    [job] = [j for j in sf.jobs(conn, users[0]) if j["status"] == "pending"]
    assert (job["event_type"], job["from_date"], job["exercise_ids"]) == (
        "analyst_rebuild",
        None,
        [],
    )
    bad = maintenance_defs.stats_rebuild.execute_in_process(
        instance=instance,
        resources={"inventory_db": db},
        run_config={
            "ops": {"request_stats_rebuild": {"config": {"user_ids": ["'; DROP TABLE x; --"]}}}
        },
        raise_on_error=False,
    )
    assert not bad.success
    everyone = maintenance_defs.stats_rebuild.execute_in_process(
        instance=instance, resources={"inventory_db": db}
    )
    assert everyone.output_for_node("request_stats_rebuild") == 3
