"""The hourly revalidation budget as a setting: a named default, bound like the other
TMDb settings, and every bad value refused in one line that names the variable."""

from __future__ import annotations

import dagster as dg
import pytest

from inventory_pipeline.defs.resources import TmdbResource, tmdb_resource
from inventory_pipeline.settings import (
    DEFAULT_REVALIDATIONS_PER_HOUR,
    MAX_REVALIDATIONS_PER_HOUR,
    Settings,
    SettingsError,
    checked_tmdb,
)


def test_the_default_is_named_and_shared() -> None:
    assert Settings.from_env({}).revalidations_per_hour == DEFAULT_REVALIDATIONS_PER_HOUR == 60
    assert tmdb_resource({}).revalidations_per_hour == DEFAULT_REVALIDATIONS_PER_HOUR
    assert TmdbResource().settings().revalidations_per_hour == DEFAULT_REVALIDATIONS_PER_HOUR
    env = {"INVENTORY_REVALIDATIONS_PER_HOUR": "12"}
    assert Settings.from_env(env).revalidations_per_hour == 12


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "must be positive"),
        ("-4", "must be positive"),
        ("ten", "must be a whole number"),
        (str(MAX_REVALIDATIONS_PER_HOUR + 1), "must be from 1 to 3600, got 3601"),
    ],
)
def test_bad_budgets_are_one_line(value: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message) as refused:
        Settings.from_env({"INVENTORY_REVALIDATIONS_PER_HOUR": value})
    assert "INVENTORY_REVALIDATIONS_PER_HOUR" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_bad_budget_fails_a_run_in_one_line() -> None:
    with pytest.raises(SettingsError, match="from 1 to 3600"):
        checked_tmdb("https://api.themoviedb.org", 40, 8, 2000, 0)
    with pytest.raises(dg.Failure, match="INVENTORY_REVALIDATIONS_PER_HOUR must be from 1"):
        TmdbResource(revalidations_per_hour=99999).settings()
