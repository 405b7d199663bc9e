"""Settings as resources: bound to their environment variables, resolved when a run
initializes them, and a bad value fails the run in one line that names the variable."""

from __future__ import annotations

import dagster as dg
import pytest

from inventory_pipeline.defs.resources import (
    InventoryDatabase,
    TmdbResource,
    inventory_database,
    tmdb_resource,
)
from inventory_pipeline.profiles.models import RefreshPolicy
from inventory_pipeline.settings import DEFAULT_TMDB_BASE_URL


def test_unset_variables_keep_the_defaults() -> None:
    tmdb = tmdb_resource({})
    assert (tmdb.base_url, tmdb.rate, tmdb.workers, tmdb.max_items) == (
        DEFAULT_TMDB_BASE_URL,
        40,
        8,
        2000,
    )
    assert inventory_database({}).run_claims == 5000


def test_every_policy_field_is_a_field_of_the_database_resource() -> None:
    """A policy field the resource lacks would fail every tick that reads the policy."""
    resource = InventoryDatabase(url="postgresql://localhost/x")
    assert resource.policy() == RefreshPolicy()


def test_set_variables_are_bound_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """The resource holds the variable's name: the value is read when a run initializes
    it, so it is never part of the code location's snapshot or a run's config."""
    env = {"INVENTORY_TMDB_RATE": "7", "INVENTORY_RUN_CLAIMS": "3"}
    tmdb = tmdb_resource(env)
    db = inventory_database(env)
    # The values at run time are what counts, not those seen when the resources were built.
    monkeypatch.setenv("INVENTORY_TMDB_RATE", "9")
    monkeypatch.setenv("INVENTORY_RUN_CLAIMS", "4")
    monkeypatch.setenv("INVENTORY_DATABASE_URL", "postgresql://u@127.0.0.1:1/x")

    @dg.op
    def read(tmdb: TmdbResource, inventory_db: InventoryDatabase) -> tuple[int, int]:
        return tmdb.settings().rate, inventory_db.policy().run_claims

    @dg.job
    def settings_job() -> None:
        read()

    result = settings_job.execute_in_process(resources={"tmdb": tmdb, "inventory_db": db})
    assert result.output_for_node("read") == (9, 4)


@pytest.mark.parametrize(
    ("resource", "message"),
    [
        (TmdbResource(rate=0), "INVENTORY_TMDB_RATE must be positive, got 0"),
        (TmdbResource(workers=-1), "INVENTORY_OBSERVATION_WORKERS must be positive"),
        (
            TmdbResource(base_url="ftp://user:hunter2@tmdb.example/"),
            "INVENTORY_TMDB_BASE_URL: TMDb base URL must be http(s)",
        ),
    ],
)
def test_bad_tmdb_values_fail_in_one_line(resource: TmdbResource, message: str) -> None:
    with pytest.raises(dg.Failure) as failure:
        resource.settings()
    text = str(failure.value.description)
    assert message in text and "\n" not in text and "hunter2" not in text


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lease_seconds": 5}, "INVENTORY_LEASE_SECONDS must be at least 10 seconds"),
        ({"run_claims": 0}, "INVENTORY_RUN_CLAIMS must be positive, got 0"),
        ({"runs_per_tick": 0}, "INVENTORY_MAX_RUNS_PER_TICK must be positive, got 0"),
    ],
)
def test_bad_policy_values_fail_in_one_line(changes: dict[str, int], message: str) -> None:
    db = InventoryDatabase(url="postgresql://u@127.0.0.1:1/x", **changes)
    with pytest.raises(dg.Failure, match=message):
        db.policy()
        db.max_runs_per_tick()


def test_a_value_that_is_not_a_number_fails_the_run_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Resolved when the run starts: the run fails before any op, naming the variable
    and not echoing its value."""
    monkeypatch.setenv("INVENTORY_TMDB_RATE", "fast-9c1d")

    @dg.op
    def read(tmdb: TmdbResource) -> int:
        return tmdb.settings().rate

    @dg.job
    def settings_job() -> None:
        read()

    defs = dg.Definitions(jobs=[settings_job], resources={"tmdb": tmdb_resource()})
    with pytest.raises(dg.DagsterInvalidConfigError) as error:
        defs.resolve_job_def("settings_job").execute_in_process()
    text = str(error.value)
    assert 'env variable "INVENTORY_TMDB_RATE" cannot be coerced into an int' in text
    assert "fast-9c1d" not in text
