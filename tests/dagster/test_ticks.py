"""A sensor's answer is in its tick's log, which the UI's tick history shows."""

from __future__ import annotations

import uuid
from datetime import date

import dagster as dg
import pytest

from inventory_pipeline.db import Connection
from inventory_pipeline.defs import stats as stats_defs
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.defs.ticks import answer_of
from tests import stats_factories as sf


def test_a_skip_and_a_launch_are_logged_in_the_tick(
    conn: Connection, db_url: str, capfd: pytest.CaptureFixture[str]
) -> None:
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(
            instance=instance, resources={"inventory_db": InventoryDatabase(url=db_url)}
        )
        assert isinstance(stats_defs.stats_refresh_sensor(context), dg.SkipReason)
        assert "INFO - skipped: no stats work waiting" in capfd.readouterr().err
        sf.exercise(conn, "squat")
        sf.save(conn, uuid.uuid4(), date(2026, 3, 10), sf.sets(("squat", 100, 5)))
        assert isinstance(stats_defs.stats_refresh_sensor(context), dg.RunRequest)
        assert "INFO - launching 1 run" in capfd.readouterr().err


def test_answers_read_as_one_line() -> None:
    assert answer_of(dg.SkipReason("nothing due")) == "skipped: nothing due"
    assert answer_of(dg.SensorResult(run_requests=[dg.RunRequest(), dg.RunRequest()])) == (
        "launching 2 runs"
    )
    assert answer_of(dg.SensorResult(skip_reason="busy")) == "skipped: busy"
    assert answer_of(None) is None
