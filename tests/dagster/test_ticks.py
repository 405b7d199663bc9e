"""A sensor's answer is in its tick's log, which the UI's tick history shows (tested
through the webserver's GraphQL in test_ui_profiles); here: what reaches the console."""

from __future__ import annotations

import uuid
from datetime import date

import dagster as dg
import pytest

from inventory_pipeline.db import Connection
from inventory_pipeline.defs import stats as stats_defs
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.defs.ticks import answer_of, cursor_state
from tests import stats_factories as sf


def test_a_launch_reaches_the_console_and_a_skip_does_not(
    conn: Connection, db_url: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """A skip is logged at DEBUG, which the tick history shows and `dev`'s terminal
    (INFO and up) does not; a launch at INFO."""
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(
            instance=instance, resources={"inventory_db": InventoryDatabase(url=db_url)}
        )
        assert isinstance(stats_defs.stats_refresh_sensor(context), dg.SkipReason)
        assert "skipped" not in capfd.readouterr().err
        sf.exercise(conn, "squat")
        sf.save(conn, uuid.uuid4(), date(2026, 3, 10), sf.sets(("squat", 100, 5)))
        assert isinstance(stats_defs.stats_refresh_sensor(context), dg.RunRequest)
        assert "INFO - launching 1 run" in capfd.readouterr().err


def test_answers_read_as_one_line() -> None:
    assert answer_of(dg.SkipReason("nothing due")) == (False, "skipped: nothing due")
    assert answer_of(dg.SensorResult(run_requests=[dg.RunRequest(), dg.RunRequest()])) == (
        True,
        "launching 2 runs",
    )
    assert answer_of(dg.SensorResult(skip_reason="busy")) == (False, "skipped: busy")
    assert answer_of(None) is None


def test_a_cursor_of_an_older_release_or_unreadable_keeps_or_restarts_its_count() -> None:
    assert cursor_state(None, "runs") == {"runs": 0}
    assert cursor_state("7", "runs") == {"runs": 7}  # the older bare count
    assert cursor_state('{"runs": 3, "width": 10}', "runs") == {"runs": 3, "width": 10}
    for unreadable in ("{", "[]", '{"runs": "3"}', '{"launches": 2}'):
        assert cursor_state(unreadable, "runs") == {"runs": 0}, unreadable
