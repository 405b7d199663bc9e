"""Settings validation: one clear line for each mistake."""

from __future__ import annotations

import pytest

from inventory_pipeline.db import InvalidDatabaseUrl
from inventory_pipeline.db.connection import redact_url, url_with_database
from inventory_pipeline.deployment import dagster_storage_url
from inventory_pipeline.settings import Settings, SettingsError


def test_defaults() -> None:
    settings = Settings.from_env({})
    assert settings.database_url is None
    assert settings.policy.lease_seconds == 300
    assert settings.policy.circuit_probe_seconds == 7200


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"INVENTORY_LEASE_SECONDS": "soon"}, "must be a whole number"),
        ({"INVENTORY_RUN_CLAIMS": "0"}, "must be positive"),
        ({"INVENTORY_LEASE_SECONDS": "5"}, "at least 10 seconds"),
    ],
)
def test_bad_numbers(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


@pytest.mark.parametrize("url", ["mysql://x/y", "localhost:5432", "postgresql://h/d?sslmode=x=y"])
def test_bad_urls(url: str) -> None:
    with pytest.raises((InvalidDatabaseUrl, SettingsError)):
        Settings.from_env({"INVENTORY_DATABASE_URL": url})


def test_url_helpers_keep_host_and_hide_password() -> None:
    assert redact_url("postgresql://u:secret@h:5/d") == "postgresql://u:***@h:5/d"
    assert url_with_database("postgresql://u:p@h:5/d", "x") == "postgresql://u:p@h:5/x"
    socket = url_with_database("postgresql://postgres:@/postgres?host=/tmp/s", "inv")
    assert socket == "postgresql://postgres@/inv?host=/tmp/s"
    assert dagster_storage_url(socket).startswith("postgresql+psycopg2://")
