"""The wakeup sensor and job in process: verify, then release, with run metadata."""

from __future__ import annotations

from collections.abc import Iterator

import dagster as dg
import pytest

from inventory_pipeline.db import Connection, execute
from inventory_pipeline.defs import credentials as wake_defs
from inventory_pipeline.defs.resources import InventoryDatabase
from inventory_pipeline.provider.standin import StandIn
from tests import factories as f
from tests.conftest import TMDB_TEST_KEY


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def test_sensor_launches_verification_then_release(
    conn: Connection,
    db_url: str,
    instance: dg.DagsterInstance,
    standin: StandIn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("INVENTORY_TMDB_BASE_URL", standin.url)
    db = InventoryDatabase(url=db_url)
    context = dg.build_sensor_context(instance=instance, resources={"inventory_db": db})
    assert isinstance(wake_defs.credential_wakeup_sensor(context), dg.SkipReason)
    f.provider_key(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 3)
    request = wake_defs.credential_wakeup_sensor(context)
    assert isinstance(request, dg.RunRequest)
    result = wake_defs.credential_wakeup.execute_in_process(
        instance=instance, resources={"inventory_db": db}
    )
    assert result.success
    metadata = result.output_for_node("wake_authentication_cases")
    assert metadata == 3
    [output] = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    shown = {k: v.value for k, v in output.event_specific_data.metadata.items()}  # type: ignore[union-attr]
    assert shown["verification"] == "verified" and shown["released"] == 3
    assert len(str(shown["generation"])) == 8
    assert TMDB_TEST_KEY not in str(shown)
    # Nothing left to release: the sensor skips; a new key generation is probed again.
    assert isinstance(wake_defs.credential_wakeup_sensor(context), dg.SkipReason)
    execute(conn, "UPDATE provider_settings SET api_key = 'rotated-key'")
    assert isinstance(wake_defs.credential_wakeup_sensor(context), dg.RunRequest)
